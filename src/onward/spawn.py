"""Starting a command's process for one attempt, in the first of three ways this system allows:
``clone3(CLONE_VM)`` from the worker's loop thread (``onward.clonespawn``, a C module built at install);
through the worker's spawner process (``onward.spawner``); or by the old fork with a ``preexec_fn``. Every
way the command gets
its own session and process group, stdin from /dev/null, stdout and stderr on pipes to the worker, SIGKILL
when its worker dies (PDEATHSIG, with the parent check), and, where an attempt cgroup is given, that cgroup
from before its first instruction. It is a child of the worker either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from .cgroups import AttemptCgroup, WorkerCgroups
from .clonespawn import Cloned, CloneSpawner
from .errors import RESOURCE_ERRNOS
from .proc import child_start_time, die_with_parent_preexec, prepare_die_with_parent
from .spawner import Spawner, exec_error

# "spawner" skips the clone path, "fork" both it and the spawner (a fork of the worker with a preexec_fn):
# escape hatches, and how the tests run those paths on systems where a faster one works.
SWITCH = "ONWARD_SPAWN"

# What a clone-path child says once it took its go (the C source's SAID_GOING): past that, it calls execve.
CHILD_TOOK_GO = 2
# The most processes a clone-path starter keeps ready for commands not claimed yet (``CommandStarter``).
SPARES_KEPT = 2


def spawn_mode() -> str:
    """How this worker will start its commands: "clone", "spawner" (unless it turns out unusable when it is
    first started, see ``Spawner.start``) or "fork"."""
    switch = os.environ.get(SWITCH)
    if switch == "fork":
        return "fork"
    if switch != "spawner":
        from . import clonespawn

        if clonespawn.available():
            return "clone"
    return "spawner"


class CommandProcess:
    """A started command as its attempt sees it: its pid (which is also its process group's id), the read
    ends of its stdout and stderr pipes, ``wait`` to reap it (it is always the worker's own child), and
    whether its ``execve`` failed (``exec_error``, known once it has exited)."""

    def __init__(self, pid: int, stdout: int, stderr: int, report: int = -1, popen: Any = None,
                 memory: Any = None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        # The child's report pipe: on the spawner path past its pid (read before its go), on the clone path
        # from its start (not waited for: see onward.clonespawn).
        self._report = report
        self._popen = popen  # the fork path's Popen, which keeps the exit status it reaped
        # The clone path: the child's stack, arguments and words, the worker's until reaped; what it said there
        # (whether it took its go, why its execve failed) is read when it is reaped.
        self._memory = memory
        self._said: tuple[bool, int] | None = None
        self._status: int | None = None
        self._open = {stdout, stderr} | ({report} if report >= 0 else set())
        # Known once it has exited (exec_error): False if the process died before it could run anything of
        # its command (before it set itself up, on every path; on the clone path, also before it took its go).
        self.set_up = True

    def exec_error(self) -> OSError | None:
        """After the process exited: the error of its ``execve`` if that failed, as ``subprocess`` raises
        it (errno, message, the program as filename); None if its program ran (or it died before trying:
        ``set_up`` tells whether it got as far as its go). On the fork path ``execve`` errors are raised by
        ``start`` itself."""
        if self._said is not None:
            took_go, failure = self._said
            self.set_up = took_go
            return OSError(failure, os.strerror(failure)) if failure else None
        if self._report < 0 or self._report not in self._open:
            return None
        rest = b""
        while chunk := os.read(self._report, 64):  # all written: the process is gone, and its end with it
            rest += chunk
        self.close_pipe(self._report)
        reported = exec_error(rest)
        return None if reported is None else OSError(reported, os.strerror(reported))

    def wait(self) -> int:
        """Reap the command; its exit status, negative for a signal (as ``Popen.returncode``)."""
        if self._popen is not None:
            return int(self._popen.wait())
        if self._status is None:
            self._status = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            if self._memory is not None:
                said, failure = self._memory.said()
                self._said = (said >= CHILD_TOOK_GO, failure)
                self._memory.release()  # reaped: nothing runs on it any more
                self._memory = None
        return self._status

    def close_pipe(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            os.close(fd)

    def close_pipes(self) -> None:
        for fd in list(self._open):
            self.close_pipe(fd)


class Spare(NamedTuple):
    """A process cloned ahead for the next command (the clone path), with the attempt cgroup it was born in
    and its start time (with its pid: what the store notes)."""

    cloned: Cloned
    start: int
    cgroup: AttemptCgroup | None

    @property
    def pid(self) -> int:
        return self.cloned.pid


class CommandStarter:
    """Starts one handler's commands, all with the environment ``env`` plus each attempt's own variables.

    Commands are cloned from the thread that starts them (the worker loop's), whose death their PDEATHSIG
    follows. Where that cannot be done (``spawn_mode``), the spawner is started with the first command,
    from the same thread: a command's PDEATHSIG then follows the thread that started the spawner. Where
    the spawner cannot be used either (``Spawner.start`` says None, or ``SWITCH``), commands are forked.

    On the clone path, once a command is started the next one's process is cloned at once, in the cgroup
    of the next attempt, and waits set up (a ``Spare``): the worker notes its pid with its next claim
    (``spare_children``), and the attempt of that claim takes it (``take_spare``), so neither the clone nor a
    commit of its own stands between one command's end and the next one's start. As many are kept as the
    worker has asked for at once (at most ``SPARES_KEPT``): at --concurrency 4, a turn that settles two
    commands that ended together claims two tasks, and the second had paid a commit of its own for its pid."""

    def __init__(self, env: Mapping[str, str], cgroups: WorkerCgroups | None) -> None:
        self._env = dict(env)
        self._cgroups = cgroups
        self._spawner: Spawner | None = None
        mode = spawn_mode()
        self._clone = CloneSpawner(env) if mode == "clone" else None
        self._spares: list[Spare] = []
        self._spares_wanted = 1  # raised by spare_children, up to SPARES_KEPT
        self._fork = mode == "fork"
        if self._clone is None:
            prepare_die_with_parent()  # for the fork path (also the spawner's fallback): libc's prctl is loaded before any fork

    @property
    def forks(self) -> bool:
        """Whether commands are started by fork (known for sure once the first command started)."""
        return self._fork

    def spare_children(self, limit: int) -> list[tuple[int, int]]:
        """The pids and start times of up to ``limit`` spares, in the order ``take_spare`` expects them noted
        (see the class); from now on, up to ``limit`` are kept ready (at most ``SPARES_KEPT``)."""
        self._spares_wanted = max(self._spares_wanted, min(limit, SPARES_KEPT))
        return [(spare.pid, spare.start) for spare in self._spares[:limit]]

    def take_spare(self, pid: int | None) -> Spare | None:
        """The spare whose pid a claim noted (``pid``); None (and the spares kept) for any other."""
        if pid is None:
            return None
        for i, spare in enumerate(self._spares):
            if spare.pid == pid:
                return self._spares.pop(i)
        return None

    def start(self, argv: Sequence[str], env: Mapping[str, str], cgroup: AttemptCgroup | None,
              before_go: Callable[[int], None], spare: Spare | None = None) -> CommandProcess:
        """Start one command (in ``spare``, taken with ``take_spare``, when given: ``cgroup`` is then its
        own). Through the spawner, ``before_go(pid)`` is called before any of it runs (see
        ``Spawner.spawn``). On the fork path it is not called: a preexec function cannot wait for a go
        (Popen waits for the exec), so the pid is known only once the command runs, and the caller notes
        it then; the window the spawner closes stays open on that path."""
        if self._clone is not None:
            pid, stdout, stderr, memory = self._clone.spawn(
                argv, env, cgroup.directory() if cgroup else None, before_go,
                spare.cloned if spare is not None else None)
            self._prepare_spare()
            return CommandProcess(pid, stdout, stderr, memory=memory)
        if not self._fork and self._spawner is None:
            self._spawner = Spawner.start(self._env, self._cgroups is not None)
            self._fork = self._spawner is None
        if self._spawner is None:
            return spawn_forked(list(argv), dict(self._env, **env), cgroup)
        try:
            pid, stdout, stderr, report = self._spawner.spawn(argv, env, cgroup.directory() if cgroup else None,
                                                              before_go)
        except OSError as e:
            if cgroup is not None and e.filename is None and e.errno not in RESOURCE_ERRNOS:
                raise OSError(e.errno, f"cannot move the command into its cgroup {cgroup.path}: {e.strerror}"
                              ) from e
            raise
        # The next command's process is cloned and set up now, beside the loop, while this one runs: then
        # starting it costs the loop a write, not a wait.
        with contextlib.suppress(OSError):
            self._spawner.prepare(self._cgroups.next_attempt().directory() if self._cgroups else None)
        return CommandProcess(pid, stdout, stderr, report)

    def _prepare_spare(self) -> None:
        """Clone the next commands' processes now, while this one runs (the clone path; see the class). A
        failure (out of descriptors, processes) leaves one fewer: the next start clones as before and meets
        the shortage there, where the worker knows what to do about it."""
        while self._clone is not None and len(self._spares) < self._spares_wanted:
            cgroup = self._cgroups.attempt() if self._cgroups is not None else None
            try:
                cloned = self._clone.prepare(cgroup.directory() if cgroup is not None else None)
            except OSError:
                if cgroup is not None and self._cgroups is not None:
                    self._cgroups.finished(cgroup)
                return
            start = child_start_time(cloned.pid, cloned.made_after, cloned.made_before)
            spare = Spare(cloned, start or 0, cgroup)
            if start is None:  # gone from /proc (read when the clock could not tell): killed from outside, no use
                self._discard(spare)
                return
            self._spares.append(spare)

    def discard_spares(self) -> None:
        """End the spares unstarted (nothing of a command ran in them), and give their cgroups back."""
        spares, self._spares = self._spares, []
        for spare in spares:
            self._discard(spare)

    def _discard(self, spare: Spare) -> None:
        spare.cloned.discard()
        if spare.cgroup is not None and self._cgroups is not None:
            self._cgroups.finished(spare.cgroup)

    def close(self) -> None:
        self.discard_spares()
        if self._clone is not None:
            self._clone.close()
            self._clone = None
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None


def spawn_forked(argv: list[str], env: dict[str, str], cgroup: AttemptCgroup | None) -> CommandProcess:
    """The fork path: ``subprocess`` with a ``preexec_fn`` (so CPython forks the whole worker)."""
    import subprocess

    pipes: list[int] = []
    try:
        for _ in range(2):
            pipes += os.pipe2(os.O_CLOEXEC)
        try:
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=pipes[1], stderr=pipes[3], env=env, close_fds=True,
                start_new_session=True, preexec_fn=_in_child(cgroup))
        except subprocess.SubprocessError as e:  # only the preexec function raises it: the cgroup step
            raise OSError(f"cannot move the command into its cgroup {cgroup.path if cgroup else ''}") from e
    except BaseException:
        for fd in pipes:
            os.close(fd)
        raise
    os.close(pipes[1])
    os.close(pipes[3])
    return CommandProcess(popen.pid, pipes[0], pipes[2], popen=popen)


def _in_child(cgroup: AttemptCgroup | None) -> Callable[[], None]:
    """What the child does between fork and exec: enter the attempt's cgroup first, before it can fork
    anything that would be born outside, then arrange to die with its parent."""
    if cgroup is None:
        return die_with_parent_preexec

    def setup() -> None:
        cgroup.enter()
        die_with_parent_preexec()
    return setup
