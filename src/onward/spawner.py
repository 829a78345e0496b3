"""The spawner: a small single-threaded process, one per command handler, that starts the worker's commands
so that the worker itself never forks, where the worker cannot clone them itself (``onward.clonespawn``:
its C module not built, another architecture, an older kernel, a seccomp filter; or ``ONWARD_SPAWN=spawner``).
Both ends of the protocol live here: ``Spawner`` in the worker, and ``serve`` in the spawner process (this
file imported by ``python -I -S -c``, so it imports nothing but the standard library and starts in ~15 ms,
once per worker).

Why. Starting a command used to take ``subprocess.Popen`` with a ``preexec_fn`` (setsid, PDEATHSIG with a
parent check, the move into the attempt's cgroup): a ``preexec_fn`` makes CPython ``fork()`` the whole
multi-threaded worker (page tables of all its memory) and run Python in the child, ~1.5 ms of the worker
waiting per task (6 ms with 30 MB of heap). Without one, CPython would ``vfork``, but then nothing runs
between fork and exec: PDEATHSIG would need a trampoline (util-linux ``setpriv --pdeathsig KILL``, an exec
more per task, and it has no parent check, so a worker dying before its ``prctl`` leaves an orphan), and
no trampoline without a compiler can enter a cgroup before the command runs. Python's own ``clone3`` in
the worker is no better: without ``CLONE_VM`` it is the same full fork, and with ``CLONE_VM|CLONE_VFORK``
the child would run the interpreter on the parent's memory and stack (reference counts, the GIL's state)
while the parent's other threads run: corruption.

How. The spawner process is small (a bare interpreter: its fork copies a few MB) and has one thread, so
it may ``clone3`` and run a few lines of Python in the child. Three kernel features keep every guarantee:

- ``CLONE_PARENT``: the command is the *worker's* child, not the spawner's. The worker waits for it, reads
  its exit status, watches it by pidfd and kills its group before reaping it, exactly as with a fork of its
  own; ``$PPID`` in the command is the worker; and the command's PDEATHSIG follows the worker's thread
  that started the spawner (the loop's, as before), not the spawner, whose death harms no command.
- ``CLONE_INTO_CGROUP`` (Linux 5.7): the command is born in the attempt's cgroup, so whatever it forks,
  even at its first instruction, is inside; and a birth there spares the move of a running process
  into the cgroup (0.3-0.6 ms measured on the fork path).
- In the child, before ``execve``: ``setsid`` (own session and process group), ``PR_SET_PDEATHSIG``
  SIGKILL then a check that the parent is still the worker (it may have died before the ``prctl``), stdin
  from /dev/null, stdout and stderr to the worker's pipes; every other descriptor is close-on-exec.

Where ``clone3`` is missing or filtered (kernels before 5.3, older container seccomp profiles), or cgroups
are in use and ``CLONE_INTO_CGROUP`` is missing (before 5.7), ``Spawner.start`` returns None and the
worker starts commands the old way (``spawn.spawn_forked``: a ``preexec_fn`` fork).

Protocol. ``ctl``, a stream socket pair: the spawner first sends its capability (``REPORT``), the worker
the commands' environment (``b"E"``), then one request per command's process (``b"P"``, with
descriptors: stdout, stderr, report, go, and the cgroup's directory). The spawner answers each
with ``REPLY`` (pid, or 0 and an errno). ``report`` is a close-on-exec pipe from the child to the worker:
the child writes its pid once it is set up (own session, PDEATHSIG), then, only if ``execve`` failed, its
errno. The worker waits for the pid, not for the ``execve`` (a millisecond or more, spent beside the loop
rather than in it), and reads the rest when the process has exited: a missing program or EACCES then
fails the attempt with the words ``subprocess`` used (``cannot run PROGRAM: No such file or directory``).

Ahead of time. The process for the next command is asked for (``prepare``, ``b"P"``) as soon as a
command has started, in the cgroup its attempt will use (``WorkerCgroups.next_attempt``): it is cloned
and set up while the command before it runs, then waits on its ``go`` pipe. Starting a command is then,
for the worker, a write of argc, argv and the attempt's variables to that pipe (its end of file, once
closed, tells the process to run them); a process never told (another cgroup was wanted, the worker is
done) reads an empty end of file and exits, and is reaped. So the clone, a round trip to the spawner and
the Python steps in the child are off the worker loop's path, and on a second core.

Because the child announces itself on ``report``, a spawner that dies mid-request (killed, OOM) never
leaves a process the worker does not know: the worker reads ``report`` whatever happens to ``ctl``, adopts
a child that announced itself, and otherwise starts a new spawner and asks again.
"""

from __future__ import annotations

import _socket
import errno
import os
import struct
import sys

# The spawner process runs this file, and every process it clones starts as a copy of it (page tables
# copied by the clone, torn down by the command's execve): so the file imports little. ``_socket`` rather
# than ``socket``, and ``_signal`` rather than ``signal`` (in the spawner's end), because those two build
# their enums at import: about 1 MB of the spawner's 5 MB of private memory. Measured without them: ~19%
# less CPU in the spawner per command, ~11% less in each command's process (its clone to its exit).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Mapping, Sequence

SYS_CLONE3 = 435  # one number on every architecture (system calls added since Linux 5.0 share a table)
CLONE_PARENT = 0x00008000
CLONE_INTO_CGROUP = 0x200000000
PR_SET_PDEATHSIG = 1
CLONE_ARGS = struct.Struct("=11Q")  # struct clone_args up to ``cgroup`` (CLONE_ARGS_SIZE_VER2, 88 bytes)
HEADER = struct.Struct("=I")  # the length of a message to the spawner
REPLY = struct.Struct("=ii")  # (pid, 0) or (0, errno)
REPORT = struct.Struct("=i")
NO_CLONE3, CLONE3, CLONE3_INTO_CGROUP = 0, 1, 2  # what the kernel (and any seccomp filter) allows
# How long the worker waits for the spawner's answer (it only has to clone): past this it is taken as hung,
# killed, and replaced.
REPLY_TIMEOUT = 30.0
# Errors of a spawner that could not be started for want of the worker's resources (errors.RESOURCE_ERRNOS:
# this file imports nothing of onward).
_SHORTFALL = frozenset({errno.EAGAIN, errno.ENOMEM, errno.ENFILE, errno.EMFILE})
MAX_FDS = 5


# --- the worker's end -----------------------------------------------------------------------------------
class Spawner:
    """The worker's handle on its spawner process: ``spawn`` starts one command."""

    def __init__(self, env: Mapping[str, str], need_cgroup: bool) -> None:
        self._env = dict(env)
        self._need = CLONE3_INTO_CGROUP if need_cgroup else CLONE3
        global _early
        early, _early = _early, None
        if early is not None and early[2] == os.getpid() and early[0].poll() is None:
            self._proc, ours = early[:2]
        else:  # none, started before a fork, or dead meanwhile
            if early is not None:
                early[1].close()
            self._proc, ours = _launch()
        self._ctl = ours
        ours.settimeout(REPLY_TIMEOUT)
        self.pid = self._proc.pid
        self._prepared: _Prepared | None = None
        try:
            level = REPORT.unpack(_recv_exact(ours, REPORT.size))[0]
        except OSError:
            level = NO_CLONE3
        self.usable = level >= self._need
        if self.usable:
            try:
                ours.sendall(_env_message(env))
            except OSError:
                self.usable = False

    @classmethod
    def start(cls, env: Mapping[str, str], need_cgroup: bool) -> Spawner | None:
        """A running spawner, or None where this system cannot start commands through one (see above)."""
        if not sys.executable or not os.path.isfile(__file__):
            return None
        try:
            spawner = cls(env, need_cgroup)
        except OSError as e:
            if e.errno in _SHORTFALL:
                # Out of processes, memory or descriptors for now (a pids cgroup, ulimit -u): the attempt is
                # given back and the spawner tried again at the next start. Taken for a system without one,
                # it left the worker forking its commands for the rest of its life.
                raise
            return None
        if not spawner.usable:
            spawner.close()
            return None
        return spawner

    def prepare(self, cgroup_dir: int | None) -> None:
        """Have the next command's process made now, in the cgroup whose directory is open as
        ``cgroup_dir``: it is cloned and set up while the worker does other things (the command before it
        runs), and waits for its program. Does not wait; an error shows at ``spawn``."""
        self.discard()
        pipes: list[tuple[int, int]] = []
        try:
            for _ in range(4):  # stdout, stderr, report: to us; go: to it
                pipes.append(os.pipe2(os.O_CLOEXEC))
        except OSError:
            for pipe in pipes:
                os.close(pipe[0])
                os.close(pipe[1])
            raise
        mine = [pipes[0][0], pipes[1][0], pipes[2][0], pipes[3][1]]
        theirs = [pipes[0][1], pipes[1][1], pipes[2][1], pipes[3][0]]
        sent = True
        try:
            self._ctl.sendmsg([_PREPARE], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, _fd_array(
                theirs + ([cgroup_dir] if cgroup_dir is not None else [])))])
        except OSError:
            sent = False  # the spawner is gone: ``_take`` finds out and starts a new one
        for fd in theirs:
            os.close(fd)
        self._prepared = _Prepared(*mine, cgroup_dir=cgroup_dir, sent=sent)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cgroup_dir: int | None,
              before_go: Callable[[int], None] | None = None) -> tuple[int, int, int, int]:
        """Start ``argv`` with the handler's environment plus ``env``, born in the cgroup whose directory is
        open as ``cgroup_dir`` (a process made by ``prepare`` for that cgroup, else one made now). Returns
        once the command's process is in its own session and process group and has its PDEATHSIG, before
        its ``execve``: (pid, stdout, stderr, report), the read ends of its pipes. Whether ``execve``
        failed is read from ``report`` once the process has exited (``exec_error``).

        ``before_go(pid)`` is called once the process exists and before it is told its program: nothing of
        the command has run yet. If it raises, the process is ended unstarted and the exception goes on.

        Raises OSError with the errno alone when the process could not be created (``EAGAIN``, ``ENOMEM``,
        a cgroup that refuses it)."""
        request = _request(argv, env)
        for _ in range(3):
            if self._prepared is None or self._prepared.cgroup_dir != cgroup_dir:
                self.prepare(cgroup_dir)
            try:
                pid, ready = self._take()
            except _SpawnerGone:
                self._restart()
                continue
            except OSError as e:
                if e.errno != errno.ECHILD:
                    raise
                # The process made ahead was killed before it was set up (a cgroup it was made in was
                # killed when an attempt there ended badly): nothing of a command ran; make another.
                continue
            if before_go is not None:
                try:
                    before_go(pid)
                except BaseException:
                    ready.close_all()  # its go pipe's end of file: it leaves without running anything
                    os.waitpid(pid, 0)
                    raise
            try:
                _write_all(ready.go, request)
            except OSError as e:
                # Killed before its go is closed: a request cut short by the error must not run as a shorter
                # command. (Dead already after a broken pipe; it is our child, unreaped: the pid is its own.)
                os.kill(pid, 9)  # SIGKILL: ``signal`` is not imported in this file (see the imports)
                ready.close_all()
                os.waitpid(pid, 0)
                if isinstance(e, BrokenPipeError):  # it was killed while it waited: nothing of the command ran
                    continue
                raise
            # Closed once, on this path only: closed again after ``close_all``, the number could by then be
            # a descriptor another thread has just opened (the store's, say).
            os.close(ready.go)
            return pid, ready.stdout, ready.stderr, ready.report
        raise OSError(errno.EAGAIN, "the command spawner died three times in a row")

    def _take(self) -> tuple[int, _Prepared]:
        """The prepared process, once it is set up: (its pid, its pipes)."""
        ready, self._prepared = self._prepared, None
        assert ready is not None
        gone = not ready.sent
        pid = code = 0
        if not gone:
            try:
                pid, code = REPLY.unpack(_recv_exact(self._ctl, REPLY.size))
            except OSError:  # died, or hung past REPLY_TIMEOUT
                gone = True
        if gone:
            # Did a process come of the request? Only the report can tell, and it says so for sure once
            # the spawner is dead: the process writes its pid, or nobody holds the pipe any more.
            self._kill()
            said = read_exact(ready.report, REPORT.size)
            if len(said) < REPORT.size:
                ready.close_all()
                raise _SpawnerGone()
            return REPORT.unpack(said)[0], ready
        if pid == 0:
            ready.close_all()
            raise OSError(code, os.strerror(code))
        if len(read_exact(ready.report, REPORT.size)) < REPORT.size:
            # It died before it was set up (killed from outside): nothing of the command ran.
            ready.close_all()
            os.waitpid(pid, 0)
            raise OSError(errno.ECHILD, "the command's process died before it could start")
        return pid, ready

    def discard(self) -> None:
        """End a prepared process that will not be used (a different cgroup is asked for, or the worker
        is done): it leaves at the end of file of its ``go`` pipe, and is reaped."""
        if self._prepared is None:
            return
        try:
            pid, ready = self._take()
        except (OSError, _SpawnerGone):
            return
        ready.close_all()
        os.waitpid(pid, 0)

    def _kill(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def _restart(self) -> None:
        self._kill()
        self._ctl.close()
        fresh = Spawner(self._env, self._need == CLONE3_INTO_CGROUP)
        if not fresh.usable:
            fresh.close()
            raise OSError(errno.EAGAIN, "the command spawner died and could not be started again")
        self._proc, self._ctl, self.pid = fresh._proc, fresh._ctl, fresh.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """End the prepared process and stop the spawner (no command is its child: none is harmed)."""
        self.discard()
        self._ctl.close()
        self._kill()


def _launch() -> tuple[subprocess.Popen[bytes], _socket.socket]:
    """Start a spawner process: (the process, the worker's end of its control socket)."""
    import subprocess  # here, not at the top: the spawner process never needs it

    ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        # Its own session: a Ctrl-C at the terminal is the worker's to handle, not the spawner's.
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, os.path.abspath(__file__), str(theirs.fileno()),
             str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=[theirs.fileno()], env={},
            start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, ours


# A spawner process started ahead of the first ``Spawner`` (``launch_early``), with the pid that started it.
_early: tuple[subprocess.Popen[bytes], _socket.socket, int] | None = None


def launch_early() -> None:
    """Start the spawner process now, for the first ``Spawner`` of this process to take: its start-up (a
    Python interpreter) then overlaps the worker's own instead of delaying the first command. Call it from
    the thread that will start the commands (see ``onward.spawn.CommandStarter``). Best effort: a spawner
    that cannot be started now is started, or found missing, when needed."""
    global _early
    if _early is None and sys.executable and os.path.isfile(__file__):
        try:
            _early = (*_launch(), os.getpid())
        except OSError:
            pass


class _Prepared:
    """A process being made (or made) by the spawner for the next command: the worker's ends of its pipes."""

    def __init__(self, stdout: int, stderr: int, report: int, go: int, *, cgroup_dir: int | None,
                 sent: bool) -> None:
        self.stdout, self.stderr, self.report, self.go = stdout, stderr, report, go
        self.cgroup_dir = cgroup_dir
        self.sent = sent  # False: the request never reached the spawner

    def close_all(self) -> None:
        for fd in (self.stdout, self.stderr, self.report, self.go):
            try:
                os.close(fd)
            except OSError:
                pass


class _SpawnerGone(Exception):
    pass


# How the spawner process starts: this file imported as a module (from the end of the path, after the
# standard library), so its bytecode, compiled at install, is used; run as a script it would be compiled at
# every start, on the path to a worker's first command. Its arguments: this file's path (which names it in
# `ps`), the control socket's descriptor, and the worker's pid (last).
_BOOT = ("import sys; sys.path.append(sys.argv[1].rpartition('/')[0]); import spawner; "
         "spawner.serve(int(sys.argv[2]), int(sys.argv[3]))")


def _env_message(env: Mapping[str, str]) -> bytes:
    payload = b"E" + b"\0".join(os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items())
    return HEADER.pack(len(payload)) + payload


_PREPARE = HEADER.pack(1) + b"P"


_FS_ENCODING = (sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())  # what os.fsencode uses


def _request(argv: Sequence[str], env: Mapping[str, str]) -> bytes:
    """What a prepared process is told to run: argc, argv, then this attempt's variables, NUL-separated.
    Joined first and encoded once (as ``os.fsencode`` would each field): this runs for every command."""
    fields = [str(len(argv)), *argv, *[f"{name}={value}" for name, value in env.items()]]
    text = "\0".join(fields)
    if text.count("\0") != len(fields) - 1:
        raise ValueError("embedded null byte")  # as subprocess says
    return text.encode(*_FS_ENCODING)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fd_array(fds: list[int]) -> bytes:
    """Descriptors as SCM_RIGHTS carries them: C ints."""
    return struct.pack(f"{len(fds)}i", *fds)


def _recv_exact(sock: _socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionResetError("the spawner closed its end")
        data += chunk
    return data


def exec_error(rest: bytes) -> int | None:
    """The errno of a failed ``execve`` in what a child wrote on its report after its pid, or None when it
    wrote nothing more (it ran its program, or died before trying)."""
    return int(REPORT.unpack_from(rest)[0]) if len(rest) >= REPORT.size else None


def read_exact(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``, or fewer once it reached end of file (a child's report pipe)."""
    data = b""
    while len(data) < size and (chunk := os.read(fd, size - len(data))):
        data += chunk
    return data


# --- the spawner's end ----------------------------------------------------------------------------------
class _Server:
    def __init__(self, ctl: _socket.socket, worker: int, sigkill: int) -> None:
        self.ctl = ctl
        self.worker = worker
        self.sigkill = sigkill
        import ctypes  # here: the worker's end (imported by every worker) never needs it

        self.get_errno = ctypes.get_errno
        libc = ctypes.CDLL(None, use_errno=True)
        self.prctl = libc.prctl
        # Called with the GIL held (PyDLL): the child returns into this interpreter, which must find the
        # GIL as its one thread left it.
        syscall = ctypes.PyDLL(None, use_errno=True).syscall
        syscall.restype = ctypes.c_long
        syscall.argtypes = [ctypes.c_long, ctypes.c_char_p, ctypes.c_size_t]
        self.syscall = syscall
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.buffer = b""
        self.fds: list[int] = []
        self.env: dict[bytes, bytes] = {}
        self.path: list[bytes] = []

    def capability(self) -> int:
        """Ask the kernel, with a request it must refuse: a cgroup descriptor that cannot be open. EBADF
        means it got as far as the cgroup (clone3 and CLONE_INTO_CGROUP known); E2BIG or EINVAL, clone3
        without the cgroup field; ENOSYS or EPERM (a seccomp filter), no clone3."""
        args = CLONE_ARGS.pack(CLONE_PARENT | CLONE_INTO_CGROUP, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x7FFFFFFF)
        if self.syscall(SYS_CLONE3, args, len(args)) == 0:
            os._exit(0)  # cannot happen (no such descriptor); were it a child, it must not serve
        code = self.get_errno()
        return {errno.EBADF: CLONE3_INTO_CGROUP, errno.E2BIG: CLONE3, errno.EINVAL: CLONE3}.get(code, NO_CLONE3)

    def message(self) -> bytes | None:
        """The next message from the worker (descriptors that came with it are appended to ``fds``), or
        None once the worker closed its end."""
        while True:
            if len(self.buffer) >= HEADER.size:
                size = HEADER.unpack_from(self.buffer)[0]
                if len(self.buffer) >= HEADER.size + size:
                    payload = self.buffer[HEADER.size:HEADER.size + size]
                    self.buffer = self.buffer[HEADER.size + size:]
                    return payload
            data, ancillary, _, _ = self.ctl.recvmsg(
                1 << 16, _socket.CMSG_SPACE(MAX_FDS * 4), _socket.MSG_CMSG_CLOEXEC)
            for level, kind, blob in ancillary:
                if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                    self.fds += struct.unpack(f"{len(blob) // 4}i", blob[:len(blob) - len(blob) % 4])
            if not data:
                return None
            self.buffer += data

    def serve(self) -> None:
        while (payload := self.message()) is not None:
            if payload[:1] == b"E":
                self.env = {}
                for item in payload[1:].split(b"\0"):
                    name, _, value = item.partition(b"=")
                    if name:
                        self.env[name] = value
                self.path = [os.fsencode(d) for d in os.get_exec_path(self.env)]  # type: ignore[arg-type]
            elif payload[:1] == b"P":
                self.prepare()

    def prepare(self) -> None:
        """Clone the next command's process (descriptors: stdout, stderr, report, go, and the cgroup)."""
        fds, self.fds = self.fds, []
        out, err, report, go = fds[:4]
        cgroup = fds[4] if len(fds) > 4 else None
        flags = CLONE_PARENT | (CLONE_INTO_CGROUP if cgroup is not None else 0)
        args = CLONE_ARGS.pack(flags, 0, 0, 0, 0, 0, 0, 0, 0, 0, cgroup if cgroup is not None else 0)
        pid = self.syscall(SYS_CLONE3, args, len(args))
        if pid == 0:
            self.child(out, err, report, go)  # never returns
        code = self.get_errno() if pid < 0 else 0
        for fd in fds:  # the child has its copies; ours would keep its pipes from ending
            os.close(fd)
        self.ctl.sendall(REPLY.pack(max(pid, 0), code), _socket.MSG_NOSIGNAL)

    def child(self, out: int, err: int, report: int, go: int) -> None:
        """In the new process, born in its cgroup, a child of the worker: set up, say so, wait for the
        command on ``go``, run it."""
        try:
            os.setsid()
            self.prctl(PR_SET_PDEATHSIG, self.sigkill, 0, 0, 0)
            if os.getppid() != self.worker:
                os._exit(137)  # the worker died before the prctl: its signal was missed, do not run
            os.dup2(self.devnull, 0)
            os.dup2(out, 1)
            os.dup2(err, 2)
            os.write(report, REPORT.pack(os.getpid()))
            request = b""
            while chunk := os.read(go, 1 << 16):
                request += chunk
            if not request:
                os._exit(0)  # discarded: the worker closed ``go`` without a command
            fields = request.split(b"\0")
            argc = int(fields[0])
            argv = fields[1:1 + argc]
            env = dict(self.env)
            for item in fields[1 + argc:]:
                name, _, value = item.partition(b"=")
                env[name] = value
            program = argv[0]
            first = last = 0
            # As subprocess does: the program on the PATH the command gets; the first error other than
            # "not there", else the last. A candidate that is not there is passed over after a stat: the
            # execve would fail the same way, but only after converting argv and the whole environment
            # (~15 us a try, with a dozen directories on a PATH, and on the way to every command's start).
            for path in [program] if b"/" in program else [os.path.join(d, program) for d in self.path]:
                try:
                    os.stat(path)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.ENOTDIR):
                        last = e.errno
                        continue  # any other error is the execve's to report
                try:
                    os.execve(path, argv, env)
                except OSError as e:
                    last = e.errno or errno.ENOENT
                    if first == 0 and last not in (errno.ENOENT, errno.ENOTDIR):
                        first = last
            os.write(report, REPORT.pack(first or last or errno.ENOENT))
        finally:
            os._exit(127)


def serve(ctl_fd: int, worker: int) -> None:
    """The spawner process: die with the worker, tell it what the kernel allows, then start commands until
    the worker closes its end."""
    # Python ignores these; an ignored signal stays ignored across execve, and commands must get defaults.
    import _signal  # not signal: see the imports at the top

    for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):
        _signal.signal(sig, _signal.SIG_DFL)
    os.set_inheritable(ctl_fd, False)
    ctl = _socket.socket(fileno=ctl_fd)
    server = _Server(ctl, worker, _signal.SIGKILL)
    server.prctl(PR_SET_PDEATHSIG, server.sigkill, 0, 0, 0)
    if os.getppid() != worker:
        return  # the worker died before the prctl
    try:
        ctl.sendall(REPORT.pack(server.capability()), _socket.MSG_NOSIGNAL)
        server.serve()
    except OSError:
        pass  # the worker is gone


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
