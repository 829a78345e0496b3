"""Running one attempt of a command: a child process in its own session and process group, started by
the worker's spawner (``onward.spawn``), watched from the worker loop through its pidfd and pipes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

from . import crashpoints
from .attempt import ERROR_TAIL_BYTES, Attempt, Loop, Outcome, cannot_run, error_tail
from .cgroups import WorkerCgroups
from .config import DEFAULT_MAX_RESULT_BYTES
from .errors import RESOURCE_ERRNOS, UsageError
from .proc import kill_command, kill_group, pid_exists, pid_start_time
from .spawn import CommandStarter
from .store import absolute_location
from .store.base import Claim


class CommandAttempt(Attempt):
    """A child process in its own process group (and session), killed with its parent (PDEATHSIG), and in
    a cgroup of its own where ``cgroups`` is given (everything it starts ends with the attempt)."""

    def __init__(self, claim: Claim, argv: list[str], env: dict[str, str], heartbeat_file: str,
                 loop: Loop, max_result_bytes: int, starter: CommandStarter, beats: HeartbeatFiles,
                 cgroups: WorkerCgroups | None = None) -> None:
        super().__init__(claim)
        self._worker = loop
        self._program = argv[0]
        self._max_result = max_result_bytes
        self._stdout = bytearray()
        self._overflow = False
        self._stderr = bytearray()
        self._stderr_cut = False  # its beginning was dropped
        self._heartbeat_file = heartbeat_file
        self._beats = beats  # told when the attempt ended, to remove its heartbeat file
        # No stat now: the file is named after this claim's fence in the worker's private folder, so it
        # cannot exist before the command makes it (README), and its first appearance is progress.
        self._heartbeat_mtime: int | None = None
        self._reported = False
        self._killed = False
        self._proc_exited = False
        self._cgroups = cgroups
        # The process the claim noted (made ahead while the last command ran), if it is this worker's spare:
        # the command runs in it, in the cgroup it was born in, and its pid needs no note of its own.
        spare = starter.take_spare(claim.child_pid)
        self._noted = (spare.pid, spare.start) if spare is not None else None
        if spare is not None:
            self._cgroup = spare.cgroup
        else:
            self._cgroup = cgroups.attempt() if cgroups is not None else None
        try:
            self._proc = starter.start(argv, env, self._cgroup, self._before_go, spare)
        except BaseException:
            if cgroups is not None and self._cgroup is not None:
                cgroups.finished(self._cgroup, reusable=False)
            raise
        self._open: dict[int, Callable[[bytes], None]] = {}  # a pipe's fd -> where its bytes go
        pidfd = -1
        try:
            if self.child_pid is None:  # forked: its pid is known only now, with the command running
                self._note_child(self._proc.pid)
            pidfd = os.pidfd_open(self._proc.pid)
            for fd, sink in ((self._proc.stdout, self._on_stdout), (self._proc.stderr, self._on_stderr)):
                os.set_blocking(fd, False)
                self._worker.register(fd, _bind(self._read, fd))
                self._open[fd] = sink
            self._worker.register(pidfd, self._on_exit)
        except BaseException:
            # Out of descriptors or memory after the command was spawned, or its pid could not be noted: it
            # must not run on unwatched (the attempt is given back, and the task would run twice at once).
            self._discard(pidfd)
            raise
        self._pidfd = pidfd

    def _before_go(self, pid: int) -> None:
        """Before the command runs in process ``pid``: its pid in the store (noted with the claim already,
        for the spare)."""
        if self._noted is not None and pid == self._noted[0]:
            # Noted with the claim, maybe long ago: as note_child does, make sure the claim still holds, or a
            # worker frozen since then would start a command for a task another worker took over meanwhile.
            self._worker.check_claim(self.claim)
            self.child_pid, self.child_start = self._noted
            if crashpoints.ARMED:  # the command's pid is noted (with its claim); the command has not run yet
                crashpoints.hit("child_noted")
            return
        self._note_child(pid)

    def _note_child(self, pid: int) -> None:
        # Before the command runs: a worker frozen (SIGSTOP, a paused VM) from here on leaves a pid in the
        # store, so whoever takes the task over when the lease runs out kills this command first.
        self.child_pid = pid
        self.child_start = pid_start_time(pid)
        self._worker.note_child(self.claim, pid, self.child_start or 0)
        if crashpoints.ARMED:  # the command's pid is noted (crash-safe); the command has not run yet
            crashpoints.hit("child_noted")

    def _discard(self, pidfd: int) -> None:
        """Undo a start that failed after the spawn: kill and reap the command, close what was opened."""
        kill_command(self._proc.pid)
        self._proc.wait()
        if self._cgroups is not None and self._cgroup is not None:
            self._cgroups.finished(self._cgroup)  # kills what the command started outside its group
        for fd in list(self._open):
            self._close_fd(fd)
        self._proc.close_pipes()
        if pidfd >= 0:
            os.close(pidfd)

    def _mtime(self) -> int | None:
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
        sink = self._open[fd]
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
        if self._open.pop(fd, None) is not None:
            self._worker.unregister(fd)
            self._proc.close_pipe(fd)

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
        self._beats.ended(self._heartbeat_file)
        self._report(self._outcome(status, self._proc.exec_error()))

    def _drain(self) -> None:
        for fd in list(self._open):
            self._read(fd)
            self._close_fd(fd)

    def _outcome(self, status: int, exec_error: OSError | None) -> Outcome:
        if status == 0 and not self._killed:
            if self._overflow:
                return Outcome.failure(f"result exceeds the limit of {self._max_result} bytes of stdout")
            return Outcome.done(bytes(self._stdout), "bytes")
        if self.abandon_reason is not None:
            return Outcome.released(self.abandon_reason)
        if not self._proc.set_up and not self._killed:
            # Killed from outside in the moment after its clone (see onward.clonespawn): nothing of the
            # command ran, so the attempt is given back uncounted, as when it could not be made at all.
            return Outcome.released("the command's process was killed before it could start the command")
        if exec_error is not None:
            # The program could not be run (the spawner reports this after the fact): the same outcome, in
            # the same words, as a fork's error raised at start (``Runner._start``).
            if exec_error.errno in RESOURCE_ERRNOS:
                # Told to the loop as a start that could not make the process is: without the pause it
                # takes then, the task was claimed again at once and failed the same way, some 200 times a
                # second, each a commit and a journal row, with no warning.
                self._worker.out_of_resources(self.claim, exec_error)
                return Outcome.released(f"worker out of resources: {exec_error.strerror}")
            return Outcome.failure(cannot_run(self._program, exec_error))
        if self.cancel_reason is not None:
            what = self.cancel_reason
        elif status < 0:
            what = f"killed by signal {signal.Signals(-status).name}"
        else:
            what = f"exit status {status}"
        return Outcome.failure(f"{what}\n{self._error_tail()}".strip())

    def _error_tail(self) -> str:
        """The end of the command's stderr as a failure shows it (redacted); only a failure needs it."""
        cut = self._stderr_cut or len(self._stderr) > ERROR_TAIL_BYTES
        return error_tail(bytes(self._stderr[-ERROR_TAIL_BYTES:]).decode("utf-8", "replace"), cut,
                          self._worker.secrets).strip()

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
            kill_command(self._proc.pid)
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
        base = _temp_folder()
        _remove_stale_beat_dirs(base)
        # The heartbeat files live in a private folder of this worker (mkdtemp makes it 0700).
        self._beats = HeartbeatFiles(tempfile.mkdtemp(prefix=f"{BEAT_DIR_PREFIX}{os.getpid()}-", dir=base))
        # Absolute: a command that changed folder and ran `onward status` or `onward send` found no store.
        env = dict(os.environ, ONWARD_DB=absolute_location(db_url))
        if job is not None:
            env["ONWARD_JOB"] = job  # an `onward` the command runs works on the same job
        # Variables meant for the worker itself must not leak to the task: a task speaking sd_notify
        # would otherwise pose as the worker to systemd.
        for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID"):
            env.pop(name, None)
        self._cgroups = WorkerCgroups.create()
        self._starter = CommandStarter(env, self._cgroups)

    def spare_children(self, limit: int) -> list[tuple[int, int]]:
        return self._starter.spare_children(limit)

    def discard_spares(self) -> None:
        self._starter.discard_spares()

    def start(self, claim: Claim, loop: Loop) -> Attempt:
        argv = [arg.replace("{task}", claim.name) for arg in self.argv]
        # Not created here (a file per task would cost a create and a delete each): the command creates
        # or touches it to show progress, and it is removed once the attempt ended (HeartbeatFiles).
        beat_file = self._beats.path(claim)
        env = {"ONWARD_TASK": claim.name, "ONWARD_ATTEMPT": str(claim.attempt), "ONWARD_HEARTBEAT_FILE": beat_file}
        attempt = CommandAttempt(claim, argv, env, beat_file, loop, self.max_result_bytes, self._starter, self._beats,
                                 self._cgroups)
        if crashpoints.ARMED:  # the command's process runs (claim committed, its pid noted in the store)
            crashpoints.hit("attempt_started")
        return attempt

    def close(self) -> None:
        self._starter.close()
        shutil.rmtree(self._beats.folder, ignore_errors=True)
        if self._cgroups is not None:
            self._cgroups.close()


BEAT_DIR_PREFIX = "onward-beat-"
# How often the heartbeat files of ended attempts are looked for and removed (HeartbeatFiles), at most.
BEAT_SWEEP_EVERY = 1.0


class HeartbeatFiles:
    """The commands' heartbeat files ($ONWARD_HEARTBEAT_FILE), in a private folder of this worker, one name
    per claim (its task and fence). None is made here: a command creates or touches its own to show
    progress. The file of an ended attempt is removed a moment later, by a look through the folder at most
    every BEAT_SWEEP_EVERY, rather than at once: most commands never make theirs, and an ``unlink`` that
    found nothing cost about 8 us a command (some 2 % of the worker's CPU a command at --concurrency 4)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._ended: set[str] = set()  # file names of ended attempts, not looked for yet
        self._sweep_at = time.monotonic() + BEAT_SWEEP_EVERY

    def path(self, claim: Claim) -> str:
        return os.path.join(self.folder, f"task-{claim.task_id}-{claim.fence}")

    def ended(self, path: str) -> None:
        """The attempt that had ``path`` ended: its command and whatever it started are gone."""
        self._ended.add(os.path.basename(path))
        if time.monotonic() >= self._sweep_at:
            self.sweep()

    def sweep(self) -> None:
        """Remove the files of the attempts ended so far. A name not found was not made by the attempt's
        command; one a process that outlived its attempt makes later goes with the folder, at close."""
        ended, self._ended = self._ended, set()
        self._sweep_at = time.monotonic() + BEAT_SWEEP_EVERY
        try:
            with os.scandir(self.folder) as entries:
                names = [entry.name for entry in entries if entry.name in ended]
        except OSError:
            return  # looked at again at close (the folder goes whole)
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.folder, name))


def _temp_folder() -> str:
    """The folder for the heartbeat files: ``tempfile``'s ($TMPDIR, else /tmp, ...). It takes a folder where
    it can create a file, and when none will do it says "no usable temporary directory", whatever made each
    try fail: a worker out of descriptors (``ulimit -n``) must say that (exit 75, tried again later), and
    one with no folder it may write to, that in one line (exit 2)."""
    try:
        return tempfile.gettempdir()
    except FileNotFoundError:
        os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))  # raises EMFILE or ENFILE when that is why
        raise UsageError("no temporary folder to write the commands' heartbeat files in: set TMPDIR to a"
                         " folder this user may write") from None


def _remove_stale_beat_dirs(base: str) -> None:
    """Heartbeat folders of workers that died without cleaning up (kill -9) are removed by the next one."""
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




def _bind(read: Callable[[int], bool], fd: int) -> Callable[[], None]:
    def on_ready() -> None:
        read(fd)
    return on_ready
