"""Running one attempt of a Python task beside the worker loop: a function in a thread, or a coroutine on
the worker's event loop. Each attempt reports exactly one ``Outcome`` to the loop. (Commands:
``onward.command_handler``, which imports none of this, so that ``onward run`` never loads asyncio.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import traceback
from collections.abc import Callable
from typing import Any

from . import crashpoints, results
from . import steps as durable
from .attempt import Attempt, Cancelled, Loop, Outcome, Parked, error_tail
from .config import RunConfig
from .context import AsyncTaskContext, ContextBase, TaskContext
from .errors import StepDrift, UsageError
from .spawn import spawn_forked
from .store.base import Claim
from .threads import EventLoopThread, ThreadPool, off_loop

# Per thread of the pool: while its attempt's outcome is being settled on it (Loop.settle_here), ``free`` is
# true and the first attempt the worker starts meanwhile is left in ``next`` for this thread to run, instead
# of going to another thread.
_lane = threading.local()

# An attempt's error when its traceback could not be formatted for want of memory (made ahead: there may be
# none left to make it then).
NO_MEMORY_FOR_TRACEBACK = "out of memory: no memory was left to format the error's traceback"

# The fork path of commands under its old name here (tests start a command through it into a cgroup that
# is gone).
_spawn = spawn_forked


# --- Python functions ---------------------------------------------------------------------------------
class PythonAttempt(Attempt):
    def __init__(self, claim: Claim, fn: Callable[..., Any], loop: Loop, replay: str = "strict",
                 park_sleeps_over: float = RunConfig.park_sleeps_over) -> None:
        super().__init__(claim)
        self.stop_requested = False
        self.replay = replay
        self.park_sleeps_over = park_sleeps_over
        self.stop_event = threading.Event()  # set on stop, cancel or abandon: wakes durable sleeps
        self._worker = loop
        self._reported = False
        self._report_lock = threading.Lock()
        self._fn = fn
        self._aio_loop: asyncio.AbstractEventLoop | None = None
        self._future: concurrent.futures.Future[None] | None = None
        self._astop: asyncio.Event | None = None
        self.ctx: ContextBase = TaskContext(self, loop)

    # -- a function in a thread --
    def run(self) -> None:
        """Run this attempt on the calling thread (one of the pool's); then, each time its outcome was
        settled here and the worker handed this thread the next attempt, that one: one task after another
        with no hand-over between threads."""
        attempt: PythonAttempt | None = self
        while attempt is not None:
            try:
                attempt = attempt._run_here()
            except BaseException as e:  # noqa: BLE001 - see below
                # Not even its outcome could be made or handed over (no memory left for it). An attempt that
                # never reports holds its task for good, its lease renewed by a loop that looks healthy to
                # any watchdog: the worker stops instead, as after an error of its own, and the task is
                # reclaimed from it.
                self._worker.abort(e)  # (every attempt this thread runs has the same worker)
                return

    def _run_here(self) -> PythonAttempt | None:
        token = durable.CURRENT.set(self.ctx)
        try:
            try:
                outcome = self._done(self._fn(self.claim.name, self.ctx))
            except BaseException as e:  # the task's own failure, whatever it raised
                outcome = self._failed(e)
                if outcome.kind == "failed" and self.ctx.used_step_log is not None:
                    self.ctx.used_step_log.end_failed(e)
            if self.ctx.used_step_log is not None:
                self.ctx.used_step_log.finish()
        finally:
            durable.CURRENT.reset(token)
        with self._report_lock:
            if self._reported:
                return None  # abandoned meanwhile: reported released already
            self._reported = True
        _lane.free, _lane.next = True, None
        try:
            self._worker.settle_here(self, outcome)
        finally:
            _lane.free = False
            following, _lane.next = _lane.next, None
        return following

    # -- a coroutine on the worker's event loop --
    def start_async(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ctx = AsyncTaskContext(self, self._worker)
        self._aio_loop = loop
        self._future = asyncio.run_coroutine_threadsafe(self._run_async_or_abort(), loop)

    async def _run_async(self) -> None:
        durable.CURRENT.set(self.ctx)  # this asyncio task's own copy of the context
        self._astop = asyncio.Event()
        if self.stop_event.is_set():
            self._astop.set()
        try:
            outcome = self._done(await self._fn(self.claim.name, self.ctx))
        except asyncio.CancelledError:
            outcome = self._failed(Cancelled(self.cancel_reason or "cancelled"))
        except BaseException as e:
            outcome = self._failed(e)
            if outcome.kind == "failed" and self.ctx.used_step_log is not None:
                await off_loop(self.ctx.used_step_log.end_failed, e)
        if self.ctx.used_step_log is not None:
            await off_loop(self.ctx.used_step_log.finish)
        self._report(outcome)

    async def _run_async_or_abort(self) -> None:
        """``_run_async``; if not even its outcome could be made or reported, the worker stops (see ``run``)."""
        try:
            await self._run_async()
        except BaseException as e:  # noqa: BLE001
            self._worker.abort(e)

    async def wait_stop_async(self, timeout: float) -> None:
        """Wait until told to stop, at most ``timeout`` seconds (an asyncio task's ``stop_event.wait``)."""
        assert self._astop is not None
        try:
            await asyncio.wait_for(self._astop.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- outcomes --
    def _done(self, value: Any) -> Outcome:
        log = self.ctx.used_step_log
        if log is not None and isinstance(log.failure, StepDrift):
            # The task caught the drift error and returned anyway: its result cannot be trusted.
            return self._failed(log.failure)
        data, kind = results.encode(value)
        return Outcome.done(data, kind)

    def _failed(self, e: BaseException) -> Outcome:
        if isinstance(e, Parked) and self.cancel_reason is None:
            return Outcome.parked(e.key, e.until)
        if isinstance(e, Cancelled):
            if self.cancel_reason is not None:
                return Outcome.failure(self.cancel_reason)
            return Outcome.released(f"stopped: {e}")
        log = self.ctx.used_step_log
        if log is not None and self.cancel_reason is None and log.ended_by_store_fault(e):
            # A store fault is the machine's, not the task's: given back uncounted, as on a graceful stop. The
            # task runs again once the store answers, replaying what was recorded (the step whose record
            # failed runs again).
            return Outcome.released(f"the store could not record a step: {log.store_fault}", store_fault=True)
        if isinstance(e, MemoryError):
            # What the task allocated is still held by its frames, which the traceback keeps alive: let it
            # go before the traceback is formatted, which takes memory too (a thread that died of a second
            # MemoryError here left its attempt running for good).
            traceback.clear_frames(e.__traceback__)
        try:
            tail = error_tail("".join(traceback.format_exception(type(e), e, e.__traceback__)), False,
                              self._worker.secrets)
        except MemoryError:
            tail = NO_MEMORY_FOR_TRACEBACK
        if isinstance(e, StepDrift):
            tail = f"StepDrift: {e}"  # the one line that says it all; the traceback points into onward
        if self.cancel_reason is not None:
            return Outcome.failure(f"{self.cancel_reason}\n{tail}".strip())
        return Outcome.failure(tail)

    def _report(self, outcome: Outcome) -> None:
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        self._worker.post(self, outcome)

    # -- told from the worker loop --
    def _wake(self) -> None:
        self.stop_event.set()
        loop, astop = self._aio_loop, self._astop
        if loop is not None and astop is not None:
            try:
                loop.call_soon_threadsafe(astop.set)
            except RuntimeError:
                pass  # the event loop is closed

    def request_stop(self) -> None:
        self.stop_requested = True
        self._wake()

    def cancel(self, reason: str) -> None:
        super().cancel(reason)
        self._wake()
        if self._future is not None:
            # An asyncio task can really be stopped: CancelledError at its current await.
            self._future.cancel()

    def abandon(self, reason: str) -> None:
        # A thread cannot be killed: report the attempt released now; the thread's later outcome is
        # ignored, and anything it tries to record is refused by the fence.
        self._report(Outcome.released(reason))
        self._wake()
        if self._future is not None:
            self._future.cancel()

    def unresponsive(self, now: float, grace: float) -> bool:
        return self.cancelled_at is not None and not self._reported and now - self.cancelled_at > grace


class PythonHandler:
    """Runs a Python task function: a plain function in a thread of its own, an ``async def`` on the
    worker's event loop thread."""

    def __init__(self, fn: Callable[..., Any], replay: str = "strict",
                 park_sleeps_over: float = RunConfig.park_sleeps_over) -> None:
        if replay not in durable.REPLAY_POLICIES:
            raise UsageError(f"replay must be one of {', '.join(durable.REPLAY_POLICIES)} (got {replay!r})")
        self.fn = fn
        self.replay = replay
        self.park_sleeps_over = park_sleeps_over
        self.is_async = inspect.iscoroutinefunction(fn)
        self._pool = ThreadPool()
        self._event_loop: EventLoopThread | None = None

    def start(self, claim: Claim, loop: Loop) -> Attempt:
        attempt = PythonAttempt(claim, self.fn, loop, self.replay, self.park_sleeps_over)
        if self.is_async:
            if self._event_loop is None:
                self._event_loop = EventLoopThread()
            attempt.start_async(self._event_loop.loop)
        elif getattr(_lane, "free", False):
            _lane.free, _lane.next = False, attempt  # this thread runs it once the turn is over
        else:
            self._pool.submit(attempt.run)
        if crashpoints.ARMED:  # the task's function is running (claim committed, nothing of it yet)
            crashpoints.hit("attempt_started")
        return attempt

    def spare_children(self, limit: int) -> list[tuple[int, int]]:
        return []  # a Python task runs in a thread

    def discard_spares(self) -> None:
        pass

    def close(self) -> None:
        if self._event_loop is not None:
            self._event_loop.close()
            self._event_loop = None
