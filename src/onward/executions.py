"""Running one attempt of a task beside the worker loop: a Python function in a thread, or a command in
its own process group. Each execution reports exactly one ``Outcome`` to the runner.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import inspect
import os
import queue
import selectors
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from . import results
from . import steps as durable
from .cgroups import AttemptCgroup, WorkerCgroups
from .config import DEFAULT_MAX_RESULT_BYTES
from .errors import OnwardError, StepDrift, UsageError
from .log import one_line
from .proc import die_with_parent_preexec, kill_group, pid_exists, pid_start_time, prepare_die_with_parent
from .secrets import scrub
from .store.base import Claim

if TYPE_CHECKING:
    from .runner import Runner

T = TypeVar("T")
ERROR_TAIL_BYTES = 4096


@dataclass(frozen=True)
class Outcome:
    kind: str  # "done", "failed" or "released" (given back uncounted on a graceful stop)
    result: bytes = b""
    result_kind: str = "bytes"
    error: str = ""

    @classmethod
    def done(cls, data: bytes, kind: str) -> Outcome:
        return cls("done", data, kind)

    @classmethod
    def failure(cls, error: str) -> Outcome:
        return cls("failed", error=error)

    @classmethod
    def released(cls, reason: str) -> Outcome:
        return cls("released", error=reason)

    @property
    def error_line(self) -> str:
        """The error squeezed onto one line for a log."""
        return one_line(self.error) or "(no message)"


def error_tail(text: str, cut: bool, secrets: Sequence[str]) -> str:
    """The end of a task's error output (its stderr, a traceback), as kept in the store and shown: the last
    ERROR_TAIL_BYTES of ``text`` (``cut``: ``text`` is such an end already), without the store's password.
    A cut can fall inside the password and leave its second half at the start, which no longer matches it:
    that part goes too."""
    if len(text) > ERROR_TAIL_BYTES:
        text, cut = text[-ERROR_TAIL_BYTES:], True
    if cut:
        text = text.lstrip("\ufffd")  # a character cut in two by a byte cut
        for secret in secrets:  # longest first
            part = next((k for k in range(len(secret) - 1, 0, -1) if text.startswith(secret[-k:])), 0)
            if part:
                text = text[part:]
                break
    return scrub(text, secrets)


class Cancelled(OnwardError):
    """Raised by ``ctx.check()`` in a task that was asked to stop (timeout, stall, lease lost, SIGTERM)."""


class Execution:
    """One attempt of one task. Subclasses run it; the base is also the record of an attempt that could
    not start."""

    child_pid: int | None = None
    child_start: int | None = None

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.started = time.monotonic()
        self._progress = self.started
        self.note: str | None = None
        self.cancel_reason: str | None = None
        self.cancelled_at: float | None = None
        self.fenced = False  # the lease was lost: whatever happens, commit nothing

    @property
    def cancelled(self) -> bool:
        return self.cancel_reason is not None

    def last_progress(self) -> float:
        return self._progress

    def beat(self, note: str | None = None) -> None:
        self._progress = time.monotonic()
        if note is not None:
            self.note = note[:200]

    def request_stop(self) -> None:
        """The worker is stopping gracefully: finish soon if you can."""

    def cancel(self, reason: str) -> None:
        """Stop this attempt now; it counts as failed with ``reason``."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self.cancelled_at = time.monotonic()

    def abandon(self, reason: str) -> None:
        """The worker is leaving: end the attempt at once and report it released."""

    def unresponsive(self, now: float, grace: float) -> bool:
        """True when the attempt was cancelled more than ``grace`` seconds ago and still runs."""
        return False


class Handler(Protocol):
    def start(self, claim: Claim, runner: Runner) -> Execution:
        """Start one attempt; it must report its outcome with ``runner.post`` exactly once."""


# --- Python functions ---------------------------------------------------------------------------------
class _ContextBase:
    """What every Python task's ``ctx`` offers, sync or async."""

    def __init__(self, execution: PythonExecution, runner: Runner) -> None:
        self._execution = execution
        self._runner = runner
        self.task: str = execution.claim.name
        self.attempt: int = execution.claim.attempt
        self._steps: durable.StepLog | None = None

    def beat(self, note: str | None = None) -> None:
        """Report progress: resets the stall timer and shows ``note`` in ``onward status``."""
        self._execution.beat(note)

    @property
    def stopping(self) -> bool:
        """True once the worker was asked to stop (SIGTERM/SIGINT): finish or call ``check()`` soon."""
        return self._execution.stop_requested or self._execution.cancelled

    @property
    def cancelled(self) -> bool:
        """True when this attempt was cancelled (timeout, stall, lease lost)."""
        return self._execution.cancelled

    def check(self) -> None:
        """Raise ``Cancelled`` if the task should stop now; a convenient point to call between steps."""
        if self._execution.cancelled:
            raise Cancelled(self._execution.cancel_reason or "cancelled")
        if self._execution.stop_requested:
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
            self._steps = durable.StepLog(self._execution, self._runner, self._execution.replay)
        return self._steps

    def pause(self, seconds: float, note: str | None = None) -> None:
        """Wait ``seconds`` (a thread's wait), beating meanwhile; raise ``Cancelled`` if told to stop."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._execution.beat(note)  # a deliberate wait is not a stall
            self._execution.stop_event.wait(min(left, 1.0))

    async def apause(self, seconds: float, note: str | None = None) -> None:
        """``pause`` for an asyncio task: only this task waits."""
        deadline = time.monotonic() + seconds
        while True:
            self.check()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._execution.beat(note)
            await self._execution.wait_stop_async(min(left, 1.0))


class TaskContext(_ContextBase):
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
        return durable.restore(self, default)

    def checkpoint(self, value: Any) -> None:
        """Commit ``value`` (JSON) as the task's state: ``restore`` returns it on resume."""
        durable.not_in_step("ctx.checkpoint")
        if not self.step_log.loaded:
            self.step_log.load()
        commit = durable.checkpoint(self, value)
        if commit is not None:
            commit()

    def sleep(self, seconds: float) -> None:
        """A durable sleep: the wake-up time is recorded first, so after a crash only what is left is slept.
        Raises ``Cancelled`` if the worker stops meanwhile (the next run sleeps the rest). Inside a step's
        body it is a plain wait."""
        if durable.in_step():
            return self.pause(seconds, "sleeping")
        if not self.step_log.loaded:
            self.step_log.load()
        deadline = durable.sleep_deadline(self, seconds)
        if callable(deadline):
            deadline = deadline()
        self.pause(deadline - self.step_log.store_now(), "sleeping")


class AsyncTaskContext(_ContextBase):
    """``ctx`` of an ``async def`` task: ``step``, ``checkpoint`` and ``sleep`` are awaited; commits wait in
    a thread, so the other tasks on the event loop run on meanwhile."""

    async def step(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` (awaited if it returns an awaitable) as the durable step ``name``."""
        if durable.in_step():
            value = fn(*args, **kwargs)
            return await value if inspect.isawaitable(value) else value
        return await durable.run_step_async(self, durable.StepSpec(name), fn, args, kwargs)

    async def load(self) -> None:
        if not self.step_log.loaded:
            await asyncio.to_thread(self.step_log.load)

    async def restore(self, default: Any = None) -> Any:
        """The value of the latest ``checkpoint``, or ``default`` (see ``TaskContext.restore``)."""
        await self.load()
        return durable.restore(self, default)

    async def checkpoint(self, value: Any) -> None:
        """Commit ``value`` (JSON) as the task's state: ``restore`` returns it on resume."""
        durable.not_in_step("ctx.checkpoint")
        await self.load()
        commit = durable.checkpoint(self, value)
        if commit is not None:
            await asyncio.to_thread(commit)

    async def sleep(self, seconds: float) -> None:
        """A durable sleep (see ``TaskContext.sleep``)."""
        if durable.in_step():
            return await self.apause(seconds, "sleeping")
        await self.load()
        deadline = durable.sleep_deadline(self, seconds)
        if callable(deadline):
            deadline = await asyncio.to_thread(deadline)
        await self.apause(deadline - self.step_log.store_now(), "sleeping")


def _start_thread(thread: threading.Thread) -> None:
    """Start ``thread``; when none can be started (out of memory or processes), raise ``OSError`` EAGAIN as
    a failed fork does: a shortage of the worker, not a task's fault (the runner gives the attempt back)."""
    try:
        thread.start()
    except RuntimeError as e:  # "can't start new thread": pthread_create failed
        raise OSError(errno.EAGAIN, f"cannot start a thread: {e}") from None


class _ThreadPool:
    """Daemon threads that run task functions: a worker that exits must not wait for a stuck task."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in an idle thread, or a new one (see ``_start_thread`` for when none can start)."""
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if not spawn:
            self._jobs.put(job)
            return
        _start_thread(threading.Thread(target=self._work, args=(job,), name="onward-task", daemon=True))

    def _work(self, job: Callable[[], None]) -> None:
        while True:
            job()
            with self._lock:
                self._idle += 1
            job = self._jobs.get()


class _EventLoopThread:
    """One asyncio event loop in a daemon thread, running every ``async def`` task of a worker. The worker
    loop (leases, heartbeats, signals) stays on its own thread, so a busy event loop cannot starve it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="onward-async", daemon=True)
        try:
            _start_thread(self._thread)
        except OSError:
            self.loop.close()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def close(self) -> None:
        def stop() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()  # what is left was abandoned (reported released): let it unwind
            self.loop.call_later(0.1, self.loop.stop)
        self.loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=2.0)
        if not self._thread.is_alive():
            self.loop.close()


class PythonExecution(Execution):
    def __init__(self, claim: Claim, fn: Callable[..., Any], runner: Runner, replay: str = "strict") -> None:
        super().__init__(claim)
        self.stop_requested = False
        self.replay = replay
        self.stop_event = threading.Event()  # set on stop, cancel or abandon: wakes durable sleeps
        self._runner = runner
        self._reported = False
        self._report_lock = threading.Lock()
        self._fn = fn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future: concurrent.futures.Future[None] | None = None
        self._astop: asyncio.Event | None = None
        self.ctx: _ContextBase = TaskContext(self, runner)

    # -- a function in a thread --
    def run(self) -> None:
        token = durable.CURRENT.set(self.ctx)
        try:
            try:
                outcome = self._done(self._fn(self.claim.name, self.ctx))
            except BaseException as e:  # the task's own failure, whatever it raised
                outcome = self._failed(e)
            if self.ctx._steps is not None:
                self.ctx._steps.finish()
        finally:
            durable.CURRENT.reset(token)
        self._report(outcome)

    # -- a coroutine on the worker's event loop --
    def start_async(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ctx = AsyncTaskContext(self, self._runner)
        self._loop = loop
        self._future = asyncio.run_coroutine_threadsafe(self._run_async(), loop)

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
        if self.ctx._steps is not None:
            await asyncio.to_thread(self.ctx._steps.finish)
        self._report(outcome)

    async def wait_stop_async(self, timeout: float) -> None:
        """Wait until told to stop, at most ``timeout`` seconds (an asyncio task's ``stop_event.wait``)."""
        assert self._astop is not None
        try:
            await asyncio.wait_for(self._astop.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # -- outcomes --
    def _done(self, value: Any) -> Outcome:
        log = self.ctx._steps
        if log is not None and isinstance(log.failure, StepDrift):
            # The task caught the drift error and returned anyway: its result cannot be trusted.
            return self._failed(log.failure)
        data, kind = results.encode(value)
        return Outcome.done(data, kind)

    def _failed(self, e: BaseException) -> Outcome:
        if isinstance(e, Cancelled):
            if self.cancel_reason is not None:
                return Outcome.failure(self.cancel_reason)
            return Outcome.released(f"stopped: {e}")
        tail = error_tail("".join(traceback.format_exception(type(e), e, e.__traceback__)), False,
                          self._runner.secrets)
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
        self._runner.post(self, outcome)

    # -- told from the worker loop --
    def _wake(self) -> None:
        self.stop_event.set()
        loop, astop = self._loop, self._astop
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

    def __init__(self, fn: Callable[..., Any], replay: str = "strict") -> None:
        if replay not in durable.REPLAY_POLICIES:
            raise UsageError(f"replay must be one of {', '.join(durable.REPLAY_POLICIES)} (got {replay!r})")
        self.fn = fn
        self.replay = replay
        self.is_async = inspect.iscoroutinefunction(fn)
        self._pool = _ThreadPool()
        self._event_loop: _EventLoopThread | None = None

    def start(self, claim: Claim, runner: Runner) -> Execution:
        execution = PythonExecution(claim, self.fn, runner, self.replay)
        if self.is_async:
            if self._event_loop is None:
                self._event_loop = _EventLoopThread()
            execution.start_async(self._event_loop.loop)
        else:
            self._pool.submit(execution.run)
        return execution

    def close(self) -> None:
        if self._event_loop is not None:
            self._event_loop.close()
            self._event_loop = None


# --- commands -----------------------------------------------------------------------------------------
class CommandExecution(Execution):
    """A child process in its own process group (and session), killed with its parent (PDEATHSIG), and in
    a cgroup of its own where ``cgroups`` is given (everything it starts ends with the attempt)."""

    def __init__(self, claim: Claim, argv: list[str], env: dict[str, str], heartbeat_file: str | None,
                 runner: Runner, max_result_bytes: int, cgroups: WorkerCgroups | None = None) -> None:
        super().__init__(claim)
        self._runner = runner
        self._selector: selectors.BaseSelector = runner.selector
        self._max_result = max_result_bytes
        self._stdout = bytearray()
        self._overflow = False
        self._stderr = bytearray()
        self._stderr_cut = False  # its beginning was dropped
        self._heartbeat_file = heartbeat_file
        self._heartbeat_mtime = self._mtime()
        self._reported = False
        self._killed = False
        self._proc_exited = False
        self._cgroups = cgroups
        self._cgroup = cgroups.attempt() if cgroups is not None else None
        try:
            self._proc = _spawn(argv, env, self._cgroup)
        except BaseException:
            if cgroups is not None and self._cgroup is not None:
                cgroups.finished(self._cgroup, reusable=False)
            raise
        self.child_pid = self._proc.pid
        self._open: dict[int, tuple[Any, Callable[[bytes], None]]] = {}  # fd -> (pipe, where its bytes go)
        pidfd = -1
        try:
            self.child_start = pid_start_time(self._proc.pid)
            pidfd = os.pidfd_open(self._proc.pid)
            assert self._proc.stdout is not None and self._proc.stderr is not None
            for stream, sink in ((self._proc.stdout, self._on_stdout), (self._proc.stderr, self._on_stderr)):
                fd = stream.fileno()
                os.set_blocking(fd, False)
                self._selector.register(fd, selectors.EVENT_READ, _bind(self._read, fd))
                self._open[fd] = (stream, sink)
            self._selector.register(pidfd, selectors.EVENT_READ, self._on_exit)
        except BaseException:
            # Out of descriptors or memory after the command was spawned: it must not run on unwatched (the
            # attempt is given back, and the task would run twice at once).
            self._discard(pidfd)
            raise
        self._pidfd = pidfd

    def _discard(self, pidfd: int) -> None:
        """Undo a start that failed after the spawn: kill and reap the command, close what was opened."""
        kill_group(self._proc.pid)
        self._proc.wait()
        if self._cgroups is not None and self._cgroup is not None:
            self._cgroups.finished(self._cgroup)  # kills what the command started outside its group
        for fd in list(self._open):
            self._close_fd(fd)
        for stream in (self._proc.stdout, self._proc.stderr):
            if stream is not None:
                stream.close()
        if pidfd >= 0:
            os.close(pidfd)

    def _mtime(self) -> int | None:
        if self._heartbeat_file is None:
            return None
        try:
            return os.stat(self._heartbeat_file).st_mtime_ns
        except OSError:
            return None

    def last_progress(self) -> float:
        mtime = self._mtime()
        if mtime != self._heartbeat_mtime:  # the command touched $ONWARD_HEARTBEAT_FILE
            self._heartbeat_mtime = mtime
            self._progress = time.monotonic()
        return self._progress

    def _on_stdout(self, data: bytes) -> None:
        if len(self._stdout) + len(data) > self._max_result:
            self._overflow = True  # keep draining so the child never blocks on a full pipe
        else:
            self._stdout += data

    def _on_stderr(self, data: bytes) -> None:
        self._stderr += data
        if len(self._stderr) > 2 * ERROR_TAIL_BYTES:
            del self._stderr[:-ERROR_TAIL_BYTES]
            self._stderr_cut = True

    def _read(self, fd: int) -> bool:
        """Read what the pipe has; False once it reached end of file (and was closed)."""
        if fd not in self._open:
            return False  # closed by an earlier event of the same select() round
        sink = self._open[fd][1]
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError:
                data = b""
            if not data:
                self._close_fd(fd)
                return False
            self._progress = time.monotonic()
            sink(data)

    def _close_fd(self, fd: int) -> None:
        pipe = self._open.pop(fd, None)
        if pipe is not None:
            self._selector.unregister(fd)
            pipe[0].close()

    def _on_exit(self) -> None:
        if self._proc_exited:
            return
        self._proc_exited = True
        self._selector.unregister(self._pidfd)
        os.close(self._pidfd)
        # The step is over once its main process is: whatever it left running in its group goes too
        # (the exited leader, not yet reaped, keeps the group id from being reused meanwhile), and so
        # does whatever left the group but not the attempt's cgroup.
        kill_group(self._proc.pid)
        self._drain()
        status = self._proc.wait()
        if self._cgroups is not None and self._cgroup is not None:
            self._cgroups.finished(self._cgroup)
        if self._heartbeat_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._heartbeat_file)
        self._report(self._outcome(status))

    def _drain(self) -> None:
        for fd in list(self._open):
            self._read(fd)
            self._close_fd(fd)

    def _outcome(self, status: int) -> Outcome:
        cut = self._stderr_cut or len(self._stderr) > ERROR_TAIL_BYTES
        tail = error_tail(bytes(self._stderr[-ERROR_TAIL_BYTES:]).decode("utf-8", "replace"), cut,
                          self._runner.secrets).strip()
        if status == 0 and not self._killed:
            if self._overflow:
                return Outcome.failure(f"result exceeds the limit of {self._max_result} bytes of stdout")
            return Outcome.done(bytes(self._stdout), "bytes")
        if self.abandon_reason is not None:
            return Outcome.released(self.abandon_reason)
        if self.cancel_reason is not None:
            what = self.cancel_reason
        elif status < 0:
            what = f"killed by signal {signal.Signals(-status).name}"
        else:
            what = f"exit status {status}"
        return Outcome.failure(f"{what}\n{tail}".strip())

    abandon_reason: str | None = None

    def _report(self, outcome: Outcome) -> None:
        if not self._reported:
            self._reported = True
            self._runner.post(self, outcome)

    def cancel(self, reason: str) -> None:
        super().cancel(reason)
        self._kill()

    def _kill(self) -> None:
        if not self._proc_exited:
            self._killed = True
            kill_group(self._proc.pid)
            if self._cgroup is not None:
                self._cgroup.kill()

    def abandon(self, reason: str) -> None:
        if self._reported:
            return
        self.abandon_reason = reason
        self._kill()
        self._on_exit()  # SIGKILL cannot be caught: reaping now takes no time


def check_command(argv: list[str]) -> None:
    """Refuse a command that cannot run before anything is written: its first word must name an executable
    file, as a path (with a ``/``) or on the PATH the command gets (the worker's own: ``CommandHandler``
    passes the environment on with PATH unchanged). A first word made of the task text (``{task}``) is
    only known per attempt; a program that vanishes later fails its attempts with its name."""
    program = argv[0]
    if "{task}" in program:
        return
    if "/" not in program:
        if shutil.which(program, path=os.pathsep.join(os.get_exec_path())) is None:
            raise UsageError(f"command not found: {program} (no executable file of that name on PATH)")
    elif not os.path.exists(program):
        raise UsageError(f"command not found: {program}")
    elif os.path.isdir(program):
        raise UsageError(f"command is a directory: {program}")
    elif not os.access(program, os.X_OK):
        raise UsageError(f"command is not executable: {program}")


class CommandHandler:
    """Runs ``argv`` with every ``{task}`` replaced by the task text, never through a shell."""

    def __init__(self, argv: list[str], db_url: str, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        self.argv = argv
        self.max_result_bytes = max_result_bytes
        _remove_stale_beat_dirs()
        # The heartbeat files live in a private folder of this worker (mkdtemp makes it 0700).
        self._beat_dir = tempfile.mkdtemp(prefix=f"{BEAT_DIR_PREFIX}{os.getpid()}-")
        env = dict(os.environ, ONWARD_DB=db_url)
        # Variables meant for the worker itself must not leak to the task: a task speaking sd_notify
        # would otherwise pose as the worker to systemd.
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(name, None)
        self._env = env
        prepare_die_with_parent()
        self._cgroups = WorkerCgroups.create()

    def start(self, claim: Claim, runner: Runner) -> Execution:
        argv = [arg.replace("{task}", claim.name) for arg in self.argv]
        # Not created here (a file per task would cost a create and a delete each): the command creates
        # or touches it to show progress, and the runner removes it when the attempt ends.
        beat_file = os.path.join(self._beat_dir, f"task-{claim.task_id}-{claim.fence}")
        env = dict(self._env, ONWARD_TASK=claim.name, ONWARD_ATTEMPT=str(claim.attempt),
                   ONWARD_HEARTBEAT_FILE=beat_file)
        return CommandExecution(claim, argv, env, beat_file, runner, self.max_result_bytes, self._cgroups)

    def close(self) -> None:
        shutil.rmtree(self._beat_dir, ignore_errors=True)
        if self._cgroups is not None:
            self._cgroups.close()


BEAT_DIR_PREFIX = "onward-beat-"


def _remove_stale_beat_dirs() -> None:
    """Heartbeat folders of workers that died without cleaning up (kill -9) are removed by the next one."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        if not name.startswith(BEAT_DIR_PREFIX):
            continue
        pid = name[len(BEAT_DIR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) > 0 and not pid_exists(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)




def _spawn(argv: list[str], env: dict[str, str], cgroup: AttemptCgroup | None):
    import subprocess

    try:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            close_fds=True, start_new_session=True, preexec_fn=_in_child(cgroup),
        )
    except subprocess.SubprocessError as e:  # only the preexec function raises it: the cgroup step
        raise OSError(f"cannot move the command into its cgroup {cgroup.path if cgroup else ''}") from e


def _in_child(cgroup: AttemptCgroup | None) -> Callable[[], None]:
    """What the child does between fork and exec: enter the attempt's cgroup first, before it can fork
    anything that would be born outside, then arrange to die with its parent."""
    if cgroup is None:
        return die_with_parent_preexec

    def setup() -> None:
        cgroup.enter()
        die_with_parent_preexec()
    return setup


def _bind(read: Callable[[int], bool], fd: int) -> Callable[[], None]:
    def on_ready() -> None:
        read(fd)
    return on_ready
