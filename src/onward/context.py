"""The task contexts: what a Python task function receives as ``ctx`` (``TaskContext``, or
``AsyncTaskContext`` for an ``async def`` task). A context speaks for its attempt (progress, stop and
cancel requests, pauses) and offers the durable-step API (``step``, ``checkpoint``, ``restore``, ``sleep``)
on top of ``onward.steps``, whose journal it creates on first use.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from . import steps as durable
from . import waits
from .attempt import Cancelled, Loop, Parked
from .errors import WaitTimeout
from .step_records import WAIT
from .store.base import Claim

T = TypeVar("T")


class TaskAttempt(Protocol):
    """What a context needs of the attempt it belongs to (``attempts.PythonAttempt``)."""

    claim: Claim
    replay: str  # the replay policy of the task's steps
    park_sleeps_over: float  # a durable sleep with more seconds left than this parks the task
    stop_requested: bool
    stop_event: threading.Event  # set on stop, cancel or abandon: wakes pauses
    cancel_reason: str | None

    @property
    def cancelled(self) -> bool: ...

    def beat(self, note: str | None = None) -> None: ...

    async def wait_stop_async(self, timeout: float) -> None: ...


class ContextBase:
    """What every Python task's ``ctx`` offers, sync or async."""

    def __init__(self, attempt: TaskAttempt, loop: Loop) -> None:
        self._attempt = attempt
        self._loop = loop
        self.task: str = attempt.claim.name
        self.attempt: int = attempt.claim.attempt
        self._steps: durable.StepLog | None = None

    def beat(self, note: str | None = None) -> None:
        """Report progress: resets the stall timer and shows ``note`` in ``onward status``."""
        self._attempt.beat(note)

    @property
    def stopping(self) -> bool:
        """True once the worker was asked to stop (SIGTERM/SIGINT): finish or call ``check()`` soon."""
        return self._attempt.stop_requested or self._attempt.cancelled

    @property
    def cancelled(self) -> bool:
        """True when this attempt was cancelled (timeout, stall, lease lost)."""
        return self._attempt.cancelled

    def check(self) -> None:
        """Raise ``Cancelled`` if the task should stop now; a convenient point to call between steps."""
        if self._attempt.cancelled:
            raise Cancelled(self._attempt.cancel_reason or "cancelled")
        if self._attempt.stop_requested:
            raise Cancelled("worker stopping")

    @property
    def idempotency_key(self) -> str:
        """While a step's body runs: a key stable across re-runs of that step (same task, step name and call
        index) and different for every other step. Raises ``UsageError`` outside a step body."""
        return durable.current_step_key()

    @property
    def step_log(self) -> durable.StepLog:
        """This attempt's recorded steps (created on first use: tasks without steps pay nothing)."""
        if self._steps is None:
            attempt = self._attempt
            self._steps = durable.StepLog(attempt.claim, self._loop.worker_id, attempt.replay,
                                          self._loop.store_call, attempt.beat)
        return self._steps

    @property
    def used_step_log(self) -> durable.StepLog | None:
        """The step journal if the task used one (None: it called no step, and pays nothing at its end)."""
        return self._steps

    def pause(self, seconds: float, note: str | None = None) -> None:
        """Wait ``seconds`` (a thread's wait), beating meanwhile; raise ``Cancelled`` if told to stop."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._attempt.beat(note)  # a deliberate wait is not a stall
            self._attempt.stop_event.wait(min(left, 1.0))

    async def apause(self, seconds: float, note: str | None = None) -> None:
        """``pause`` for an asyncio task: only this task waits."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._attempt.beat(note)
            await self._attempt.wait_stop_async(min(left, 1.0))


    def _sleep_left(self, deadline: float) -> float:
        """The seconds a durable sleep still sleeps in this attempt, holding its worker slot. More than
        ``park_sleeps_over`` left: the task parks like a wait on the reserved key ``SLEEP_KEY`` whose
        deadline is the wake-up time (state ``waiting``: no slot, no lease, and a sandbox whose tasks all
        wait may sleep too). This attempt ends; the task is claimed again once the deadline passes and
        replays up to this sleep, whose recorded deadline then leaves nothing (or a moment) to sleep."""
        left = deadline - self.step_log.store_now()
        if left > self._attempt.park_sleeps_over:
            raise Parked(waits.SLEEP_KEY, deadline)
        return left

    def _wait_begin(self, key: str, timeout: float | None) -> tuple[int, Any]:
        durable.not_in_step("ctx.wait")
        waits.check_key(key)
        waits.check_timeout(timeout)
        return self.step_log.begin(key, WAIT)

    def _wait_end(self, index: int, key: str, payload: bytes | None, until: float | None) -> Any:
        if payload is None:
            raise Parked(key, until)  # the attempt ends here; the task runs again once the value comes
        return self._wait_outcome(index, key, payload)

    def _wait_outcome(self, index: int, key: str, payload: bytes) -> Any:
        """The value a wait's record at ``index`` holds, or its ``WaitTimeout`` raised, noted as the error
        recorded there: an attempt that fails with it drops the record (``StepLog.end_failed``), as for a
        step's error, and the next attempt waits again, with a deadline of its own. Kept, a timeout ended
        every later attempt at once, and a value sent after an ``onward retry`` was never taken."""
        try:
            return waits.outcome(key, payload)
        except WaitTimeout as e:
            self.step_log.note_error(index, e)
            raise


class TaskContext(ContextBase):
    """What a Python task function receives as ``ctx``."""

    def step(self, name: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` as the durable step ``name`` (what ``@step`` does, without a
        decorator): recorded when it returns, replayed when the task runs again."""
        if durable.in_step():  # nested in a step's body: the outer step is what is recorded
            return fn(*args, **kwargs)
        return cast(T, durable.run_step(self, durable.StepSpec(name), fn, args, kwargs))

    def restore(self, default: Any = None) -> Any:
        """The value of the latest ``checkpoint`` (from this or an earlier attempt), or ``default``. Steps
        recorded before that checkpoint are then skipped: replay goes on from the call after it, so call
        ``restore`` where the task resumes from its state (at the top of its loop)."""
        if not self.step_log.loaded:
            self.step_log.load()
        return durable.restore(self.step_log, default)

    def checkpoint(self, value: Any) -> None:
        """Commit ``value`` (JSON) as the task's state: ``restore`` returns it on resume."""
        durable.not_in_step("ctx.checkpoint")
        if not self.step_log.loaded:
            self.step_log.load()
        commit = durable.checkpoint(self.step_log, value)
        if commit is not None:
            commit()

    def sleep(self, seconds: float) -> None:
        """A durable sleep: the wake-up time is recorded first, so after a crash only what is left is slept.
        Up to ``park_sleeps_over`` seconds (``Job``/``RunConfig``, default 60) it sleeps in the worker,
        holding the task's slot, and raises ``Cancelled`` if the worker stops meanwhile (the next run sleeps
        the rest). A longer sleep parks the task in state ``waiting`` until the wake-up time, as ``wait``
        does: no slot, no lease; it runs again then, replaying its steps up to here. Inside a step's body it
        is a plain wait. ``seconds``: a finite number, 0 or more and at most ``waits.MAX_WAIT_SECONDS`` (366
        days); anything else raises ``UsageError`` before anything is recorded, failing the attempt as a
        bad ``wait`` does."""
        seconds = waits.check_sleep(seconds)
        if durable.in_step():
            return self.pause(seconds, "sleeping")
        if not self.step_log.loaded:
            self.step_log.load()
        deadline = durable.sleep_deadline(self.step_log, seconds)
        if callable(deadline):
            deadline = deadline()
        self.pause(self._sleep_left(deadline), "sleeping")


    def wait(self, key: str, timeout: float | None = None) -> Any:
        """A durable wait: the JSON value sent for ``key`` from outside (``onward send TASK KEY JSON``,
        ``Job.send``). A value sent earlier is returned at once. Otherwise the task is parked (state
        ``waiting``: it holds no worker slot and no lease, and this attempt ends) and runs again once the
        value arrives, replaying its recorded steps up to here. ``timeout`` (seconds): raise ``WaitTimeout``
        when no value came by then. Either outcome is recorded: a resumed task gets it again here without
        waiting."""
        if not self.step_log.loaded:
            self.step_log.load()
        index, record = self._wait_begin(key, timeout)
        if record is not None:
            return self._wait_outcome(index, key, self.step_log.replayed_one(record).payload)
        self.check()
        payload, until = self.step_log.receive(index, key, timeout)
        return self._wait_end(index, key, payload, until)


class AsyncTaskContext(ContextBase):
    """``ctx`` of an ``async def`` task: ``step``, ``checkpoint`` and ``sleep`` are awaited; commits wait in
    a thread, so the other tasks on the event loop run on meanwhile."""

    async def step(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (awaited if it returns an awaitable) as the durable step ``name``."""
        if durable.in_step():
            value = fn(*args, **kwargs)
            return await value if inspect.isawaitable(value) else value
        return await durable.run_step_async(self, durable.StepSpec(name), fn, args, kwargs)

    async def load(self) -> None:
        await durable.load_journal(self.step_log)

    async def restore(self, default: Any = None) -> Any:
        """The value of the latest ``checkpoint``, or ``default`` (see ``TaskContext.restore``)."""
        await self.load()
        return durable.restore(self.step_log, default)

    async def checkpoint(self, value: Any) -> None:
        """Commit ``value`` (JSON) as the task's state: ``restore`` returns it on resume."""
        durable.not_in_step("ctx.checkpoint")
        await self.load()
        commit = durable.checkpoint(self.step_log, value)
        if commit is not None:
            await asyncio.to_thread(commit)

    async def sleep(self, seconds: float) -> None:
        """A durable sleep (see ``TaskContext.sleep``)."""
        seconds = waits.check_sleep(seconds)
        if durable.in_step():
            return await self.apause(seconds, "sleeping")
        await self.load()
        deadline = durable.sleep_deadline(self.step_log, seconds)
        if callable(deadline):
            deadline = await asyncio.to_thread(deadline)
        await self.apause(self._sleep_left(deadline), "sleeping")

    async def wait(self, key: str, timeout: float | None = None) -> Any:
        """A durable wait (see ``TaskContext.wait``)."""
        await self.load()
        index, record = self._wait_begin(key, timeout)
        if record is not None:
            return self._wait_outcome(index, key, self.step_log.replayed_one(record).payload)
        self.check()
        payload, until = await asyncio.to_thread(self.step_log.receive, index, key, timeout)
        return self._wait_end(index, key, payload, until)
