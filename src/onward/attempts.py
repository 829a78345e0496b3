"""Running one attempt of a task beside the worker loop: a Python function in a thread (or on the worker's
event loop), or a command in its own process group. Each attempt reports exactly one ``Outcome`` to the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from . import results
from . import steps as durable
from .attempt import ERROR_TAIL_BYTES, Attempt, Cancelled, Loop, Outcome, error_tail
from .cgroups import AttemptCgroup, WorkerCgroups
from .config import DEFAULT_MAX_RESULT_BYTES
from .context import AsyncTaskContext, ContextBase, TaskContext
from .errors import StepDrift, UsageError
from .proc import die_with_parent_preexec, kill_group, pid_exists, pid_start_time, prepare_die_with_parent
from .store.base import Claim
from .threads import EventLoopThread, ThreadPool


# --- Python functions ---------------------------------------------------------------------------------
class PythonAttempt(Attempt):
    def __init__(self, claim: Claim, fn: Callable[..., Any], loop: Loop, replay: str = "strict") -> None:
        super().__init__(claim)
        self.stop_requested = False
        self.replay = replay
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
        token = durable.CURRENT.set(self.ctx)
        try:
            try:
                outcome = self._done(self._fn(self.claim.name, self.ctx))
            except BaseException as e:  # the task's own failure, whatever it raised
                outcome = self._failed(e)
            if self.ctx.used_step_log is not None:
                self.ctx.used_step_log.finish()
        finally:
            durable.CURRENT.reset(token)
        self._report(outcome)

    # -- a coroutine on the worker's event loop --
    def start_async(self, loop: asyncio.AbstractEventLoop) -> None:
        self.ctx = AsyncTaskContext(self, self._worker)
        self._aio_loop = loop
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
        if self.ctx.used_step_log is not None:
            await asyncio.to_thread(self.ctx.used_step_log.finish)
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
        log = self.ctx.used_step_log
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
                          self._worker.secrets)
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

    def __init__(self, fn: Callable[..., Any], replay: str = "strict") -> None:
        if replay not in durable.REPLAY_POLICIES:
            raise UsageError(f"replay must be one of {', '.join(durable.REPLAY_POLICIES)} (got {replay!r})")
        self.fn = fn
        self.replay = replay
        self.is_async = inspect.iscoroutinefunction(fn)
        self._pool = ThreadPool()
        self._event_loop: EventLoopThread | None = None

    def start(self, claim: Claim, loop: Loop) -> Attempt:
        attempt = PythonAttempt(claim, self.fn, loop, self.replay)
        if self.is_async:
            if self._event_loop is None:
                self._event_loop = EventLoopThread()
            attempt.start_async(self._event_loop.loop)
        else:
            self._pool.submit(attempt.run)
        return attempt

    def close(self) -> None:
        if self._event_loop is not None:
            self._event_loop.close()
            self._event_loop = None


# --- commands -----------------------------------------------------------------------------------------
class CommandAttempt(Attempt):
    """A child process in its own process group (and session), killed with its parent (PDEATHSIG), and in
    a cgroup of its own where ``cgroups`` is given (everything it starts ends with the attempt)."""

    def __init__(self, claim: Claim, argv: list[str], env: dict[str, str], heartbeat_file: str | None,
                 loop: Loop, max_result_bytes: int, cgroups: WorkerCgroups | None = None) -> None:
        super().__init__(claim)
        self._worker = loop
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
                self._worker.register(fd, _bind(self._read, fd))
                self._open[fd] = (stream, sink)
            self._worker.register(pidfd, self._on_exit)
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
            self._worker.unregister(fd)
            pipe[0].close()

    def _on_exit(self) -> None:
        if self._proc_exited:
            return
        self._proc_exited = True
        self._worker.unregister(self._pidfd)
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
                          self._worker.secrets).strip()
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
            self._worker.post(self, outcome)

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

    def __init__(self, argv: list[str], db_url: str, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                 job: str | None = None) -> None:
        self.argv = argv
        self.max_result_bytes = max_result_bytes
        _remove_stale_beat_dirs()
        # The heartbeat files live in a private folder of this worker (mkdtemp makes it 0700).
        self._beat_dir = tempfile.mkdtemp(prefix=f"{BEAT_DIR_PREFIX}{os.getpid()}-")
        env = dict(os.environ, ONWARD_DB=db_url)
        if job is not None:
            env["ONWARD_JOB"] = job  # an `onward` the command runs works on the same job        # Variables meant for the worker itself must not leak to the task: a task speaking sd_notify
        # would otherwise pose as the worker to systemd.
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(name, None)
        self._env = env
        prepare_die_with_parent()
        self._cgroups = WorkerCgroups.create()

    def start(self, claim: Claim, loop: Loop) -> Attempt:
        argv = [arg.replace("{task}", claim.name) for arg in self.argv]
        # Not created here (a file per task would cost a create and a delete each): the command creates
        # or touches it to show progress, and the runner removes it when the attempt ends.
        beat_file = os.path.join(self._beat_dir, f"task-{claim.task_id}-{claim.fence}")
        env = dict(self._env, ONWARD_TASK=claim.name, ONWARD_ATTEMPT=str(claim.attempt),
                   ONWARD_HEARTBEAT_FILE=beat_file)
        return CommandAttempt(claim, argv, env, beat_file, loop, self.max_result_bytes, self._cgroups)

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
