"""Running one attempt of a task beside the worker loop: a Python function in a thread, or a command in
its own process group. Each execution reports exactly one ``Outcome`` to the runner.
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from . import results
from .errors import OnwardError
from .log import one_line
from .proc import die_with_parent_preexec, kill_group, pid_start_time, prepare_die_with_parent
from .store.base import Claim

if TYPE_CHECKING:
    from .runner import Runner

DEFAULT_MAX_RESULT_BYTES = 16 * 1024 * 1024
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
class TaskContext:
    """What a Python task function receives as ``ctx``."""

    def __init__(self, execution: PythonExecution, runner: Runner) -> None:
        self._execution = execution
        self._runner = runner
        self.task: str = execution.claim.name
        self.attempt: int = execution.claim.attempt

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


class _ThreadPool:
    """Daemon threads that run task functions: a worker that exits must not wait for a stuck task."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, name="onward-task", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            job()
            with self._lock:
                self._idle += 1


class PythonExecution(Execution):
    def __init__(self, claim: Claim, fn: Callable[[str, TaskContext], Any], runner: Runner) -> None:
        super().__init__(claim)
        self.stop_requested = False
        self._runner = runner
        self._reported = False
        self._report_lock = threading.Lock()
        self.ctx = TaskContext(self, runner)
        self._fn = fn

    def run(self) -> None:
        try:
            value = self._fn(self.claim.name, self.ctx)
            data, kind = results.encode(value)
            outcome = Outcome.done(data, kind)
        except Cancelled as e:
            if self.cancel_reason is not None:
                outcome = Outcome.failure(self.cancel_reason)
            else:
                outcome = Outcome.released(f"stopped: {e}")
        except BaseException as e:  # the task's own failure, whatever it raised
            tail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-ERROR_TAIL_BYTES:]
            outcome = Outcome.failure(tail)
        if self.cancel_reason is not None and outcome.kind == "failed":
            outcome = Outcome.failure(f"{self.cancel_reason}\n{outcome.error}".strip())
        self._report(outcome)

    def _report(self, outcome: Outcome) -> None:
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        self._runner.post(self, outcome)

    def request_stop(self) -> None:
        self.stop_requested = True

    def abandon(self, reason: str) -> None:
        # A thread cannot be killed: report the attempt released now; the thread's later outcome is
        # ignored, and anything it tries to record is refused by the fence.
        self._report(Outcome.released(reason))

    def unresponsive(self, now: float, grace: float) -> bool:
        return self.cancelled_at is not None and not self._reported and now - self.cancelled_at > grace


class PythonHandler:
    def __init__(self, fn: Callable[[str, TaskContext], Any]) -> None:
        self.fn = fn
        self._pool = _ThreadPool()

    def start(self, claim: Claim, runner: Runner) -> Execution:
        execution = PythonExecution(claim, self.fn, runner)
        self._pool.submit(execution.run)
        return execution


# --- commands -----------------------------------------------------------------------------------------
class CommandExecution(Execution):
    """A child process in its own process group (and session), killed with its parent (PDEATHSIG)."""

    def __init__(self, claim: Claim, argv: list[str], env: dict[str, str], heartbeat_file: str | None,
                 runner: Runner, max_result_bytes: int) -> None:
        super().__init__(claim)
        self._runner = runner
        self._selector: selectors.BaseSelector = runner.selector
        self._max_result = max_result_bytes
        self._stdout = bytearray()
        self._overflow = False
        self._stderr = bytearray()
        self._heartbeat_file = heartbeat_file
        self._heartbeat_mtime = self._mtime()
        self._reported = False
        self._killed = False
        self._proc_exited = False
        self._proc = _spawn(argv, env)
        self.child_pid = self._proc.pid
        self.child_start = pid_start_time(self._proc.pid)
        self._pidfd = os.pidfd_open(self._proc.pid)
        self._open: dict[int, tuple[Any, Callable[[bytes], None]]] = {}  # fd -> (pipe, where its bytes go)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        for stream, sink in ((self._proc.stdout, self._on_stdout), (self._proc.stderr, self._on_stderr)):
            fd = stream.fileno()
            os.set_blocking(fd, False)
            self._open[fd] = (stream, sink)
            self._selector.register(fd, selectors.EVENT_READ, _bind(self._read, fd))
        self._selector.register(self._pidfd, selectors.EVENT_READ, self._on_exit)

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
        # (the exited leader, not yet reaped, keeps the group id from being reused meanwhile).
        kill_group(self._proc.pid)
        self._drain()
        status = self._proc.wait()
        self._report(self._outcome(status))

    def _drain(self) -> None:
        for fd in list(self._open):
            self._read(fd)
            self._close_fd(fd)

    def _outcome(self, status: int) -> Outcome:
        tail = bytes(self._stderr[-ERROR_TAIL_BYTES:]).decode("utf-8", "replace").strip()
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

    def abandon(self, reason: str) -> None:
        if self._reported:
            return
        self.abandon_reason = reason
        self._kill()
        self._on_exit()  # SIGKILL cannot be caught: reaping now takes no time


class CommandHandler:
    """Runs ``argv`` with every ``{task}`` replaced by the task text, never through a shell."""

    def __init__(self, argv: list[str], db_url: str, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> None:
        self.argv = argv
        self.db_url = db_url
        self.max_result_bytes = max_result_bytes
        self._beat_dir = tempfile.mkdtemp(prefix="onward-beat-")  # mkdtemp makes it 0700
        prepare_die_with_parent()

    def start(self, claim: Claim, runner: Runner) -> Execution:
        argv = [arg.replace("{task}", claim.name) for arg in self.argv]
        beat_file = os.path.join(self._beat_dir, f"task-{claim.task_id}-{claim.fence}")
        with open(beat_file, "wb"):
            pass
        env = dict(os.environ)
        env.update(ONWARD_TASK=claim.name, ONWARD_ATTEMPT=str(claim.attempt), ONWARD_DB=self.db_url,
                   ONWARD_HEARTBEAT_FILE=beat_file)
        # Variables meant for the worker itself must not leak to the task: a task speaking sd_notify
        # would otherwise pose as the worker to systemd.
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(name, None)
        return CommandExecution(claim, argv, env, beat_file, runner, self.max_result_bytes)

    def close(self) -> None:
        for name in os.listdir(self._beat_dir):
            os.unlink(os.path.join(self._beat_dir, name))
        os.rmdir(self._beat_dir)


def _spawn(argv: list[str], env: dict[str, str]):  # type: ignore[no-untyped-def]
    import subprocess

    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        close_fds=True, start_new_session=True, preexec_fn=die_with_parent_preexec,
    )


def _bind(read: Callable[[int], bool], fd: int) -> Callable[[], None]:
    def on_ready() -> None:
        read(fd)
    return on_ready
