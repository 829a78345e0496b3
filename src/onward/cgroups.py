"""cgroup v2 for commands: each attempt runs in a cgroup of its own, so everything it starts, even what
leaves its process group (``setsid``, a double fork), ends with it; and a dead worker's leftovers are found
by name and killed.

Layout. A worker that runs commands makes one directory in its own cgroup,
``onward-<pid>-<start>-<pidns>-<n>`` (its pid and process start time, the pair that names a process for
good, the pid namespace they are valid in, and a count of the command handlers the process made), holding the leaves its attempts run
in, ``attempt-<n>`` (one per attempt running at a time, reused). No controller is ever enabled: cgroup v2's
"no internal processes" rule only forbids processes in a cgroup whose ``cgroup.subtree_control`` enables
controllers, and a cgroup that holds the worker itself cannot have any enabled (the kernel refuses both
ways; the root cgroup, exempt from the rule, is no exception to what follows), so the worker stays where
it is and its children go into controller-less leaves of a directory that enables none either. Anyone started later in the same cgroup (the
next worker, the supervisor, a restart by systemd) sees the directory of a dead worker by its name, and
kills and removes it (``sweep_dead_workers``).

Where there is no cgroup v2 hierarchy, or our own cgroup is not writable (not root and no delegated
subtree), ``WorkerCgroups.create()`` returns None and commands rely on process groups alone (see README).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import signal
import time
from functools import cache

from .proc import pid_start_time, process_alive

WORKER_DIR = re.compile(r"onward-(\d+)-(\d+)-(\d+)-\d+")
# SIGKILLed processes are gone within milliseconds unless the kernel holds them (a freezer, an
# uninterruptible wait); past this a cgroup is left for a later sweep instead of holding up the caller.
REMOVE_WAIT = 0.5


def hierarchy() -> str | None:
    """Where the cgroup v2 hierarchy is mounted, from /proc/self/mountinfo (first cgroup2 mount), or None."""
    mount = _mount()
    return mount[1] if mount is not None else None


def _mount() -> tuple[str, str] | None:
    """The first cgroup2 mount: (the cgroup it shows as its top, where it is mounted)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                # "id parent major:minor root mount-point options [optional fields] - fstype source ..."
                before, _, after = line.partition(" - ")
                if after.split(" ", 1)[0] == "cgroup2":
                    fields = before.split(" ")
                    return _unescape(fields[3]), _unescape(fields[4])
    except OSError:
        pass
    return None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def own_cgroup() -> str | None:
    """The directory of this process's cgroup v2, or None when there is no cgroup v2 or ours is not
    visible in the mounted hierarchy."""
    mount = _mount()
    if mount is None:
        return None
    top, where = mount
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="surrogateescape") as f:
            ours = next((line[3:].rstrip("\n") for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if ours is None or ours.startswith("/.."):  # "/..": outside our cgroup namespace's view
        return None
    # A hierarchy mounted from below its top (a container's bind mount) shows only that subtree.
    if top != "/":
        if not (ours == top or ours.startswith(top + "/")):
            return None
        ours = ours[len(top):]
    path = os.path.normpath(os.path.join(where, ours.lstrip("/")))
    return path if os.path.isdir(path) else None


def worker_dir_name(pid: int, start: int, handler: int) -> str:
    """``onward-<pid>-<start>-<pidns>-<n>``: the worker process, and which of its command handlers (one a
    job)."""
    return f"onward-{pid}-{start}-{pid_namespace()}-{handler}"


@cache
def pid_namespace() -> int:
    """Our pid namespace (its inode): pids of another one cannot be checked from here."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_handlers = itertools.count(1)


class AttemptCgroup:
    """A leaf that one attempt's command runs in. Its directory is kept open for the spawner, which has
    the command born in it (``CLONE_INTO_CGROUP``); and so is ``cgroup.procs``, for a forked child, which
    only has to write to an open descriptor to move itself in (``enter``) before it can start anything;
    and ``cgroup.events``, read at the end of every attempt (``populated``)."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.mkdir(path)
        opened: list[int] = []
        try:
            for name, flags in ((".", os.O_RDONLY | os.O_DIRECTORY), ("cgroup.procs", os.O_WRONLY),
                                ("cgroup.events", os.O_RDONLY)):
                opened.append(os.open(os.path.join(path, name), flags | os.O_CLOEXEC))
        except OSError:
            for fd in opened:
                os.close(fd)
            os.rmdir(path)
            raise
        self._dir, self._procs, self._events = opened

    def directory(self) -> int:
        """The open directory of this cgroup (for ``clone3``'s ``CLONE_INTO_CGROUP``)."""
        return self._dir

    def populated(self) -> bool:
        """Whether any live process is in this cgroup (``cgroup.events``). A ``pread`` of the descriptor
        kept open: the kernel writes the file anew for every read from its start, and this is one system
        call where ``populated(path)`` takes an open, a read and a close (and a Python file object)."""
        try:
            return b"populated 1" in os.pread(self._events, 256, 0)
        except OSError:
            return populated(self.path)

    def empty(self) -> bool:
        """``empty(self.path)``: kill what is left in the cgroup, if anything, and wait for it to go. A kill
        marks it ``killed`` (never reused, see there): a command that left a process behind (``cmd &``)
        had its leaf killed with cgroup.kill and then reused, and every command born in it after that died
        at once, ``the command's process died three times before it could start``; the worker took that
        for a shortfall and fell to one task at a time, a second's pause after every such attempt."""
        if not self.populated():
            return True
        self.killed = True
        return empty(self.path)

    def enter(self) -> None:
        """In the child, between fork and exec: move the calling process (``0``) into this cgroup, so
        everything it forks afterwards is born inside."""
        os.write(self._procs, b"0")

    # Killed with cgroup.kill: never to be reused. Seen on Linux 6.18: every process later born into
    # such a cgroup with CLONE_INTO_CGROUP is SIGKILLed at once (before clone3 returns; likely the
    # kernel's kill_seq check comparing the parent's cgroup with the target's), so a leaf reused after a
    # timeout or a lost lease made every command started in it die at birth.
    killed = False

    def kill(self) -> None:
        self.killed = True
        kill(self.path)

    def close(self) -> None:
        """Close the descriptors (the cgroup itself stays: ``remove`` it)."""
        if self._procs >= 0:
            for fd in (self._dir, self._procs, self._events):
                os.close(fd)
            self._dir = self._procs = self._events = -1


class WorkerCgroups:
    """This worker's ``onward-<pid>-<start>-<pidns>-<n>`` directory and the attempt leaves in it.

    A leaf is reused by later attempts once it is empty: moving a process into a cgroup that was just
    created, and removing it afterwards, costs the kernel more (an RCU grace period now and then) than a
    leaf that stays, and a worker spawns a command per task."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._idle: list[AttemptCgroup] = []  # empty leaves, ready for the next attempt
        self._made = 0
        self._leftovers: list[str] = []  # leaves that did not empty in time: removed later
        self._next: AttemptCgroup | None = None  # chosen for the next attempt (``next_attempt``)

    @classmethod
    def create(cls) -> WorkerCgroups | None:
        """Make this worker's directory in its own cgroup; None where cgroup v2 is missing or our own
        cgroup is not writable (then commands have process groups only). Dead workers' directories found
        there are killed and removed first."""
        own = own_cgroup()
        if own is None or not os.access(os.path.join(own, "cgroup.procs"), os.W_OK):
            return None
        sweep_dead_workers(own)
        pid = os.getpid()
        path = os.path.join(own, worker_dir_name(pid, pid_start_time(pid) or 0, next(_handlers)))
        try:
            os.mkdir(path)
        except OSError:  # read-only, no permission, too deep: no cgroups
            return None
        return cls(path)

    def attempt(self) -> AttemptCgroup:
        """An empty leaf for one attempt: the one ``next_attempt`` chose, if any. (A dead worker's
        leftovers, which a reclaimed task of theirs must not overlap, are swept where the task is
        reclaimed, ``reclaim``: not here, on every start.)"""
        if self._next is not None:
            chosen, self._next = self._next, None
            return chosen
        if self._leftovers:
            self._leftovers = [path for path in self._leftovers if not remove(path, wait=0)]
        if self._idle:
            return self._idle.pop()
        self._made += 1
        return AttemptCgroup(os.path.join(self.path, f"attempt-{self._made}"))

    def next_attempt(self) -> AttemptCgroup:
        """The leaf that the next ``attempt`` will return, chosen now: the spawner makes the next command's
        process in it ahead of time."""
        if self._next is None:
            self._next = self.attempt()
        return self._next

    def finished(self, cgroup: AttemptCgroup, reusable: bool = True) -> None:
        """The attempt is over and its main process reaped: kill whatever it left, and keep the leaf for
        the next attempt once it is empty (unless not ``reusable``: the command could not enter it)."""
        if reusable and cgroup.empty() and not cgroup.killed:  # empty() first: a kill there marks it killed
            self._idle.append(cgroup)
        else:  # something the kernel holds (a freezer), a broken or killed leaf: removed later, never reused
            cgroup.close()
            self._leftovers.append(cgroup.path)

    def close(self) -> None:
        """The worker is leaving: kill every attempt cgroup left and remove the directory."""
        if self._next is not None:
            self._idle.append(self._next)
            self._next = None
        for cgroup in self._idle:
            cgroup.close()
        self._idle.clear()
        remove(self.path)


def kill(path: str) -> None:
    """SIGKILL every process in the cgroup ``path`` and below it. ``cgroup.kill`` (Linux 5.14+) does it at
    once and cannot miss a process forking meanwhile; older kernels get ``kill_listed_until_empty``."""
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
        return
    except FileNotFoundError:
        if not os.path.isdir(path):
            return
    except OSError:
        pass
    kill_listed_until_empty(path)


def kill_listed_until_empty(path: str, timeout: float = REMOVE_WAIT) -> None:
    """Without ``cgroup.kill``: SIGKILL every pid listed in ``cgroup.procs`` of ``path`` and its
    descendants, again and again, until none is left (a process may fork between the read and the kill)
    or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _listed(path)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def _listed(path: str) -> list[int]:
    pids: list[int] = []
    for folder, _, _ in os.walk(path):
        try:
            with open(os.path.join(folder, "cgroup.procs")) as f:
                pids += [int(line) for line in f if line.strip()]
        except OSError:
            continue
    return pids


def populated(path: str) -> bool:
    """Whether any live process is in the cgroup or below it (``cgroup.events``)."""
    try:
        with open(os.path.join(path, "cgroup.events")) as f:
            return "populated 1" in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return bool(_listed(path))


def empty(path: str, wait: float = REMOVE_WAIT) -> bool:
    """Make sure no process is left in the cgroup ``path`` or below: kill them if any, and wait up to
    ``wait`` seconds for them to be gone. True once it is empty."""
    if not populated(path):
        return True  # the usual end of an attempt: its command left nothing, and costs no kill
    kill(path)
    deadline = time.monotonic() + wait
    pause = 0.0005
    while populated(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True


def remove(path: str, wait: float = REMOVE_WAIT) -> bool:
    """Kill everything in the cgroup ``path`` (and below), wait up to ``wait`` seconds for it to empty,
    and remove it with its sub-cgroups. True if it is gone; False if something still runs in it (a frozen
    process): it is then left for a later ``sweep_dead_workers`` or ``remove``."""
    if not os.path.isdir(path):
        return True
    if not empty(path, wait):
        return False
    # Deepest first: a cgroup with sub-cgroups cannot be removed (nested onward workers make some).
    for folder, _, _ in sorted(os.walk(path), key=lambda entry: entry[0].count(os.sep), reverse=True):
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno == errno.EBUSY:  # a process entered meanwhile: let a later sweep have it
                return False
            raise
    return True


def sweep_dead_workers(own: str | None = None) -> int:
    """Kill and remove the ``onward-<pid>-<start>-<pidns>-<n>`` directories of workers that are gone, in
    ``own`` (our own cgroup by default). Returns how many were removed. Never touches a live worker's
    directory, nor one from another pid namespace (whether its worker lives cannot be told from here)."""
    own = own if own is not None else own_cgroup()
    if own is None:
        return 0
    try:
        names = os.listdir(own)
    except OSError:
        return 0
    removed = 0
    for name in names:
        match = WORKER_DIR.fullmatch(name)
        if match is None:
            continue
        pid, start, namespace = int(match.group(1)), int(match.group(2)), int(match.group(3))
        if namespace != pid_namespace() or process_alive(pid, start):
            continue
        with contextlib.suppress(OSError):  # someone else swept it meanwhile, or it is not ours to remove
            removed += remove(os.path.join(own, name))
    return removed
