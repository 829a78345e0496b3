"""Starting a command with ``clone3(CLONE_VM)`` from the worker's own loop thread (the C module
``onward._clonespawn``, built at install where a C compiler is found): the fastest of the three ways
``onward.spawn`` knows.

The child shares the worker's memory, so nothing is copied (a fork copies the page tables of the whole
worker; a clone of the spawner process faults in copies of the pages its Python touches), and it runs only
C: own session, PDEATHSIG SIGKILL with the parent check, then it says it is set up, waits for its go, says
it took it, and calls ``execve`` (what it says, and the go, are words of the memory it shares with the
worker: see the C source). Meanwhile the worker notes the pid in the store (``before_go``) and gives the
go, so nothing of the command runs before its pid is in the store, as through the spawner. Its stack and
arguments are the worker's memory until the child is reaped (``CommandProcess.wait`` releases them). See
the C source for the rules the child keeps.

The worker does not wait for the child to be set up before its go: the child looks at the go only once it
is, so the order inside the child is the same, and the worker's loop goes on with its next start instead of
waiting for the child to be scheduled (with every core busy running commands, 0.2 ms a command on average
here, at --concurrency 4: the loop's largest wait). So a command's process may still be in the worker's
session when its attempt wants it dead: it is killed by its pid as well as by its group
(``proc.kill_command``). Whether it took its go is read with the rest of what it said once it has
exited (``CommandProcess.exec_error``): a process killed before it took its go (before it set itself up,
or while it waited) ran nothing of its command.

The next command's process can be made before that command is known (``prepare``), while the current one
runs: it sets itself up and waits, and gets its program, arguments and environment just before its go.
Its pid is then noted in the store with the claim of the task it will run (``CommandStarter.spare_children``).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from .proc import boot_clock_ns

try:
    from ._clonespawn import available as _kernel_allows
    from ._clonespawn import spawn as _clone
except ImportError:  # built without a C compiler: the spawner serves instead
    _kernel_allows = _clone = None

# The most programs whose search order (``CloneSpawner._search_order``) a spawner keeps.
CANDIDATES_KEPT = 256


@cache  # the kernel's answer does not change: asked once per process (at the start gate, then by the handler)
def available() -> bool:
    """Whether commands can be started this way here: the module was built, the architecture is one it is
    written for (x86_64), and the kernel (5.11 and later) and any seccomp filter allow clone3 with
    CLONE_INTO_CGROUP and close_range."""
    return _kernel_allows is not None and bool(_kernel_allows())


class Cloned:
    """A process made by clone, with the worker's ends of its stdout and stderr pipes: set up (or setting
    itself up) in its own session, waiting for its go. ``pid`` is known from the clone's return."""

    def __init__(self, child: Any, stdout: int, stderr: int, made_after: int, made_before: int) -> None:
        self.child = child
        self.pid: int = child.pid
        self.stdout, self.stderr = stdout, stderr
        # The boot clock just before and just after the clone: its start lies between (proc.child_start_time).
        self.made_after, self.made_before = made_after, made_before

    def discard(self) -> None:
        """End it unstarted: told to leave, and killed in case it cannot look (it ran nothing either way),
        then reaped."""
        _close([self.stdout, self.stderr])
        self.child.leave()
        os.kill(self.pid, signal.SIGKILL)  # not reaped yet, so the pid is still its own
        _reap(self.child)


class CloneSpawner:
    """Starts one handler's commands, with the environment ``env`` plus each attempt's own variables."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
        # The environment's entries without the variables an attempt sets itself, by the names it sets: the
        # same few names each time, so a spawn encodes only those (a copy and join of the whole environment
        # per command cost about 10 us here, with 35 variables).
        self._base_envp: dict[frozenset[bytes], list[bytes]] = {}
        # As subprocess does: the program is looked up on the PATH the command gets.
        self._path = [os.fsencode(d) for d in os.get_exec_path(dict(env))]
        self._candidates: dict[str, list[bytes]] = {}
        self._devnull = _above_stdio(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))

    def prepare(self, cgroup_dir: int | None) -> Cloned:
        """A process for a command not known yet, born in the cgroup whose directory is open as
        ``cgroup_dir``: it sets itself up beside the worker and waits for ``spawn(..., ready=it)``, or for
        ``Cloned.discard``. ``OSError`` when it could not be made."""
        return self._make(None, None, None, cgroup_dir)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cgroup_dir: int | None,
              before_go: Callable[[int], None] | None,
              ready: Cloned | None = None) -> tuple[int, int, int, Any]:
        """Start ``argv`` born in the cgroup whose directory is open as ``cgroup_dir`` (in ``ready``, a
        process ``prepare`` made in that cgroup). Returns once ``before_go(pid)`` returned and the process is
        told to run its program, which it does once it is in its own session with its PDEATHSIG (it may not
        be yet: see the module's docstring): (pid, stdout, stderr, handle); ``handle.said()`` tells, once the
        process is reaped, whether it took its go and why its ``execve`` failed, and ``handle.release()``
        is to be called then. Otherwise the contract is ``Spawner.spawn``'s: if ``before_go`` raises, the
        process leaves unstarted and the exception goes on; ``OSError`` with the errno alone when the
        process could not be made. A process killed from outside before its go runs nothing: it is found
        so once it has exited."""
        program = argv[0]
        paths = self._candidates.get(program)
        if paths is None:
            if len(self._candidates) >= CANDIDATES_KEPT:
                self._candidates.clear()  # a program per task (`-- {task}`): a million would be kept for good
            paths = self._candidates[program] = self._search_order(os.fsencode(program))
        own = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
        names = frozenset(own)
        base = self._base_envp.get(names)
        if base is None:
            base = self._base_envp[names] = [k + b"=" + v for k, v in self._env.items() if k not in names]
        envp = base + [k + b"=" + v for k, v in own.items()]
        args = [os.fsencode(a) for a in argv]
        if ready is not None:
            try:
                ready.child.arm(paths, args, envp)
            except BaseException:
                ready.discard()
                raise
            return self._go(ready, before_go)
        return self._go(self._make(paths, args, envp, cgroup_dir), before_go)

    def _search_order(self, name: bytes) -> list[bytes]:
        """Where a child looks for the program ``name``, in order: a path as it is; a name on the PATH where it
        is found now (by ``shutil.which``, as ``check_command`` finds it before the run) first, then the whole
        PATH as ``subprocess`` searches it. Found once per program, as a
        shell's command hash does: each command would otherwise try every directory before it with a failed
        ``execve`` (8 of them for ``true`` on a PATH that pyenv and cargo lead). The first entry found runs
        even if an earlier directory gains a program of that name later; one that vanishes has the next
        command search the whole PATH."""
        if b"/" in name:
            return [name]
        paths = [os.path.join(d, name) for d in self._path]
        found = shutil.which(os.fsdecode(name), path=os.fsdecode(os.pathsep.encode().join(self._path)))
        if found is None:
            return paths
        first = os.fsencode(found)
        return [first] + [p for p in paths if p != first]

    def _make(self, paths: list[bytes] | None, args: list[bytes] | None, envp: list[bytes] | None,
              cgroup_dir: int | None) -> Cloned:
        """Clone a process that runs ``args`` at its go (None: given later, with ``Child.arm``)."""
        assert _clone is not None
        fds: list[int] = []
        try:
            for _ in range(2):  # stdout, stderr
                fds += [_above_stdio(fd) for fd in os.pipe2(os.O_CLOEXEC)]
        except OSError:
            _close(fds)
            raise
        out_r, out_w, err_r, err_w = fds
        try:
            made_after = boot_clock_ns()
            child = _clone(paths, args, envp, out_w, err_w, self._devnull, -1 if cgroup_dir is None else cgroup_dir)
            made_before = boot_clock_ns()
        except BaseException:
            _close(fds)
            raise
        _close([out_w, err_w])  # the child has its copies; ours would keep the pipes open
        return Cloned(child, out_r, err_r, made_after, made_before)

    def _go(self, cloned: Cloned, before_go: Callable[[int], None] | None) -> tuple[int, int, int, Any]:
        """Let ``cloned`` run its command, once ``before_go`` noted its pid."""
        # The pid is noted before the child has said it is set up: the note (a commit) and the child's
        # first steps then overlap instead of taking turns. A worker frozen from here on leaves a pid that
        # whoever takes the task over kills by itself as well as by its group (``reclaim``), so a child
        # not yet in its own session is killed all the same; and the child runs nothing before the go.
        if before_go is not None:
            try:
                before_go(cloned.pid)
            except BaseException:
                cloned.discard()
                raise
        # Not waiting for it to be set up (see the module's docstring): it looks at the go only once it is.
        # Killed while it waited, it never takes the go: found so once it has exited (nothing of it ran).
        cloned.child.go()
        return cloned.pid, cloned.stdout, cloned.stderr, cloned.child

    def close(self) -> None:
        os.close(self._devnull)


def _above_stdio(fd: int) -> int:
    """``fd``, moved above 2 if it is one of 0-2 (a worker started with its stdin closed gets pipes there):
    the child puts its own stdin, stdout and stderr there before it closes the rest."""
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _reap(child: Any) -> None:
    os.waitpid(child.pid, 0)
    child.release()
