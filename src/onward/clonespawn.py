"""Starting a command with ``clone3(CLONE_VM)`` from the worker's own loop thread (the C module
``onward._clonespawn``, built at install where a C compiler is found): the fastest of the three ways
``onward.spawn`` knows.

The child shares the worker's memory, so nothing is copied (a fork copies the page tables of the whole
worker; a clone of the spawner process faults in copies of the pages its Python touches), and it runs only
C: own session, PDEATHSIG SIGKILL with the parent check, then it says it is set up (its pid on ``report``),
waits for a byte on ``go``, and calls ``execve``. Meanwhile the worker notes the pid in the store
(``before_go``) and reads that the child is set up, so nothing of the command runs before its pid is in
the store, as through the spawner. Its stack and arguments are the worker's memory until the child is reaped (``CommandProcess.wait``
releases them). See the C source for the rules the child keeps.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from .spawner import REPORT, read_exact

try:
    from ._clonespawn import available as _kernel_allows
    from ._clonespawn import spawn as _clone
except ImportError:  # built without a C compiler: the spawner serves instead
    _kernel_allows = _clone = None

@cache  # the kernel's answer does not change: asked once per process (at the start gate, then by the handler)
def available() -> bool:
    """Whether commands can be started this way here: the module was built, the architecture is one it is
    written for (x86_64), and the kernel (5.11 and later) and any seccomp filter allow clone3 with
    CLONE_INTO_CGROUP and close_range."""
    return _kernel_allows is not None and bool(_kernel_allows())


class CloneSpawner:
    """Starts one handler's commands, with the environment ``env`` plus each attempt's own variables."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
        # As subprocess does: the program is looked up on the PATH the command gets.
        self._path = [os.fsencode(d) for d in os.get_exec_path(dict(env))]
        self._candidates: dict[str, list[bytes]] = {}
        self._devnull = _above_stdio(os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC))

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cgroup_dir: int | None,
              before_go: Callable[[int], None] | None) -> tuple[int, int, int, int, Any]:
        """Start ``argv`` born in the cgroup whose directory is open as ``cgroup_dir``. Returns once
        ``before_go(pid)`` returned and the process is in its own session with its PDEATHSIG, its program
        told to run: (pid, stdout, stderr, report, handle), ``handle.release()`` to be called once it is reaped.
        The contract is ``Spawner.spawn``'s: if ``before_go`` raises, the process leaves unstarted and the
        exception goes on; ``OSError`` with the errno alone when the process could not be made."""
        program = argv[0]
        paths = self._candidates.get(program)
        if paths is None:
            name = os.fsencode(program)
            paths = [name] if b"/" in name else [os.path.join(d, name) for d in self._path]
            self._candidates[program] = paths
        merged = dict(self._env)
        for k, v in env.items():
            merged[os.fsencode(k)] = os.fsencode(v)
        envp = [k + b"=" + v for k, v in merged.items()]
        args = [os.fsencode(a) for a in argv]
        for _ in range(3):
            started = self._start(paths, args, envp, cgroup_dir, before_go)
            if started is not None:
                return started
        raise OSError(errno.EAGAIN, "the command's process died three times before it could start")

    def _start(self, paths: list[bytes], args: list[bytes], envp: list[bytes], cgroup_dir: int | None,
               before_go: Callable[[int], None] | None) -> tuple[int, int, int, int, Any] | None:
        """One try; None when the process died before it was set up (killed from outside: nothing ran)."""
        assert _clone is not None
        fds: list[int] = []
        try:
            for _ in range(4):  # stdout, stderr, report: to us; go: to it
                fds += [_above_stdio(fd) for fd in os.pipe2(os.O_CLOEXEC)]
        except OSError:
            _close(fds)
            raise
        out_r, out_w, err_r, err_w, report_r, report_w, go_r, go_w = fds
        try:
            child = _clone(paths, args, envp, out_w, err_w, self._devnull, report_w, go_r, go_w,
                                      -1 if cgroup_dir is None else cgroup_dir)
        except BaseException:
            _close(fds)
            raise
        _close([out_w, err_w, report_w, go_r])  # the child has its copies; ours would keep the pipes open
        mine = [out_r, err_r, report_r]
        # The pid is noted before the child has said it is set up: the note (a commit) and the child's
        # first steps then overlap instead of taking turns. A worker frozen from here on leaves a pid that
        # whoever takes the task over kills by itself as well as by its group (``reclaim``), so a child
        # not yet in its own session is killed all the same; and the child runs nothing before the go.
        if before_go is not None:
            try:
                before_go(child.pid)
            except BaseException:
                _close(mine + [go_w])  # its go pipe's end of file: it leaves without running anything
                _reap(child)
                raise
        # The child writes its pid as the spawner's children do (``REPORT``), then only an execve error.
        if len(read_exact(report_r, REPORT.size)) < REPORT.size:
            # It died before it was set up (killed from outside, or its worker thread is gone): nothing of
            # the command ran.
            _close(mine + [go_w])
            _reap(child)
            return None
        try:
            os.write(go_w, b"g")
        except BrokenPipeError:  # killed while it waited: nothing of the command ran
            _close(mine)
            _reap(child)
            return None
        finally:
            os.close(go_w)
        return child.pid, out_r, err_r, report_r, child

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
