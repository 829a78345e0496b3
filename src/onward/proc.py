"""Processes: who we are (host, pid, start time), whether another process is still alive, and children
that never outlive their parent.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from collections.abc import Container
from functools import cache

from .store.base import Owner

TYPE_CHECKING = False
if TYPE_CHECKING:  # no threading at run time: the plain `onward status` loads this module
    import threading

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# A worker on another host cannot be checked by its pid: one whose heartbeat is older than this (twelve
# default heartbeats) is taken for gone when judging whether anyone is working, so that a machine that died
# without saying so does not keep an ETA alive forever (nor an upgrade refused).
SILENT_WORKER_SECONDS = 60.0


def start_thread(thread: threading.Thread) -> None:
    """Start ``thread``; when none can be started (pthread_create failed: a pids cgroup or RLIMIT_NPROC used
    up, no memory), raise ``OSError`` EAGAIN, as a failed fork does, instead of the ``RuntimeError`` Python
    raises ("can't start new thread"), which no caller took for the shortfall of the machine it is (the
    runner gives the attempt back, the store says it is unavailable)."""
    try:
        thread.start()
    except RuntimeError:
        raise OSError(errno.EAGAIN, "no thread could be started (a pids limit, ulimit -u, no memory)") from None


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/PID/stat from field 3 (the state) on, so ``fields[0]`` is field 3 of proc(5),
    ``fields[1]`` the parent pid; None if there is no such process (or it cannot be read)."""
    # os.open and os.read, not open(): a Python file object costs an fstat, an ioctl and seeks more, and
    # this runs at the start of every command (``pid_start_time``). The file is a few hundred bytes (the
    # command name in it is at most 15), and the kernel hands it over whole in one read.
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
    except (FileNotFoundError, ProcessLookupError, PermissionError):  # gone, or not ours to read
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and parentheses.
    return stat[stat.rindex(b")") + 2 :].split()


def pid_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no such process.

    With the pid it identifies a process for good: a pid can be reused, a (pid, start time) pair cannot.
    """
    fields = stat_fields(pid)
    if fields is None:
        return None
    if fields[0] == b"Z":  # a zombie has finished; only its exit status remains
        return None
    return int(fields[19])


# A process's start time is the boot clock's reading when it was made (CLOCK_BOOTTIME, taken in the clone), in
# ticks of USER_HZ: the unit of pid_start_time.
BOOT_CLOCK_TICK_NS = 10**9 // os.sysconf("SC_CLK_TCK")


def boot_clock_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def child_start_time(pid: int, made_after: int, made_before: int) -> int | None:
    """The start time of ``pid``, a process this one made between two readings of ``boot_clock_ns``: the
    clock's tick when both readings fall in the same one (the kernel notes the clock's reading at the clone
    as the process's start, in those ticks), else ``pid_start_time`` (once in a few hundred, for a clone of
    some tens of microseconds against ticks of 10 ms). It is the value /proc gives, without the read: an
    open, read and close of /proc/PID/stat cost about 10 us of the worker's CPU per command."""
    tick = made_after // BOOT_CLOCK_TICK_NS
    if made_before // BOOT_CLOCK_TICK_NS == tick:
        return tick
    return pid_start_time(pid)


def pid_exists(pid: int) -> bool:
    """Whether any process has this pid (a zombie or another user's process counts). For files named
    after their writer's pid, where no start time was recorded."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def process_alive(pid: int | None, start: int | None) -> bool:
    """Whether the very process (pid, start time) still runs on this host."""
    if not pid:
        return False
    current = pid_start_time(pid)
    return current is not None and (start is None or current == start)


@cache
def hostname() -> str:
    """This host's name, as shown to people (in the journal, status, logs): ``gethostname(2)``, which on
    Linux is the node name of ``uname(2)`` (read so, without loading the socket module)."""
    return os.uname().nodename


@cache
def host_key() -> str:
    """Equal for two processes exactly when their pids can be compared: same host name, same boot (pids
    restart after a reboot), same pid namespace (containers have their own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "unknown-pidns"
    return f"{hostname()}/{boot}/{pidns}"


def current_owner() -> Owner:
    pid = os.getpid()
    return Owner(host=hostname(), host_key=host_key(), pid=pid, pid_start=pid_start_time(pid) or 0)


def owner_alive(owner: Owner) -> bool | None:
    """True or False when the owner is on this host (its pid can be checked); None when it is elsewhere."""
    if owner.host_key != host_key():
        return None
    return process_alive(owner.pid, owner.pid_start)


def worker_live(owner: Owner, heartbeat_age: float) -> bool:
    """Whether a worker the store records (not stopped) is still at work (see ``seen_live``)."""
    return seen_live(owner_alive(owner), heartbeat_age)


def seen_live(alive: bool | None, heartbeat_age: float) -> bool:
    """The one rule for a recorded worker being at work, given ``owner_alive``'s answer: on this host, whether
    its process runs; elsewhere (None), where only the heartbeat can tell, whether it beat within
    SILENT_WORKER_SECONDS. Status, metrics and ``db upgrade`` all go by it."""
    return alive if alive is not None else heartbeat_age < SILENT_WORKER_SECONDS


@cache
def _prctl():
    import ctypes  # only where prctl is called: ``onward status`` and the like never load it

    # The process's own symbols, libc's among them: no search for the library (``find_library`` runs
    # ldconfig in a subprocess).
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent_preexec() -> None:
    """For ``preexec_fn``: the child gets SIGKILL when the thread that forked it exits.

    Two caveats decide how the runner uses it: the signal follows the forking *thread*, so children are
    started from the runner's long-lived main thread; and the parent may already have died between fork
    and prctl, so the child checks that it was not re-parented meanwhile.
    """
    parent = os.getppid()
    _prctl()(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(137)


def prepare_die_with_parent() -> None:
    """Resolve libc before any fork: a preexec_fn must not load libraries."""
    _prctl()


def set_child_subreaper(on: bool) -> None:
    """Make this process (``on``) the reaper of its descendants' orphans, in place of init: a process whose
    parent dies is re-parented to us, so we can still find and kill it."""
    _prctl()(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


def children(parent: int | None = None) -> list[int]:
    """The pids of the children of ``parent`` (this process by default), zombies included (from
    /proc/PID/task/*/children, or a scan of /proc where the kernel lacks that file)."""
    where = "self" if parent is None else str(parent)
    try:
        pids: list[int] = []
        for tid in os.listdir(f"/proc/{where}/task"):
            with open(f"/proc/{where}/task/{tid}/children", "rb") as f:
                pids += [int(pid) for pid in f.read().split()]
        return pids
    except FileNotFoundError:
        pass
    me = str(os.getpid() if parent is None else parent).encode()
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = stat_fields(name)
            if fields is not None and fields[1] == me:
                found.append(int(name))
    return found


def reap_orphans(keep: Container[int]) -> None:
    """Reap every exited child not in ``keep`` (children we started ourselves, whose exit statuses are
    their owners' to collect): a subreaper inherits orphans, and must reap them or they stay zombies."""
    for pid in children():
        if pid not in keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


def kill_orphans(keep: Container[int], timeout: float) -> int:
    """SIGKILL every child not in ``keep``, with its process group, and reap it; again for the
    grandchildren that are re-parented to us as their parents die, until none is left or ``timeout``
    passes. For a subreaper whose worker died: whatever its tasks left behind reaches us, however it left
    its process group or session. Returns how many were killed."""
    own_group = os.getpgrp()
    deadline = time.monotonic() + timeout
    killed: set[int] = set()
    while time.monotonic() < deadline:
        orphans = [pid for pid in children() if pid not in keep]
        if not orphans:
            break
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                group = os.getpgid(pid)
                if group != own_group:  # never our own group: that would kill us
                    os.killpg(group, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        time.sleep(0.001)
    return len(killed)


def describe_status(returncode: int) -> str:
    """``exit status N`` or ``signal SIGNAME``, as ``Popen.returncode`` (negative for a signal) says."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> bool:
    """Signal a whole process group. False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def kill_command(pid: int) -> None:
    """SIGKILL a command's process, ``pid``, and its process group: the group for whatever it started,
    the process itself for the moment before it leads a group of its own (on the clone path it calls
    setsid only once it runs, beside the worker: onward.clonespawn). The process first: once it is dead,
    it starts nothing more that the group would miss. Only for a pid that cannot have been reused: the
    caller's own child not yet reaped, or one whose start time was just checked."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    kill_group(pid)
