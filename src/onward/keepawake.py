"""The keep-awake marker: a file that exists while work remains, so a sandbox that idle-pauses stays up.

Sandboxes that pause when idle look for a marker file (by convention ``~/.sandboxer/keep-awake``) and stay
awake while it exists. onward creates it while the store has pending or running work and a worker is
alive, and removes it when nothing is left to do, or when the last live worker leaves.

One marker may be shared by workers of several jobs and stores (the conventional path is shared by every
one of them): each worker that holds it keeps a shared lock (``flock``) on it, and one that lets it go
removes it only when no other worker holds it. A lock dies with its process, so a killed worker's marker
is never held by it; and, where no supervisor is there to let it go, a killed worker's marker keeper
(``onward.markerkeeper``) removes it by that same rule.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys

from . import markerkeeper
from .errors import UsageError
from .folders import create_private_folders
from .log import Log
from .markerkeeper import not_a_marker, open_marker, remove_unheld, same_file

TYPE_CHECKING = False
if TYPE_CHECKING:
    import subprocess

SANDBOX_DIR = "~/.sandboxer"
SANDBOX_MARKER = "keep-awake"


def marker_path(flag: str | None) -> str | None:
    """The marker to keep: the flag, else $ONWARD_KEEP_AWAKE, else ~/.sandboxer/keep-awake when the
    ~/.sandboxer folder exists, else none. Raises ``UsageError`` for a marker that could never be a file."""
    path = chosen_marker(flag)
    if path:
        _check_marker_path(path)
    return path


def chosen_marker(flag: str | None) -> str | None:
    """The marker ``onward run --keep-awake flag`` keeps, without checking it (see ``marker_path``)."""
    if flag:
        return flag
    env = os.environ.get("ONWARD_KEEP_AWAKE")
    if env:
        return env
    sandbox = os.path.expanduser(SANDBOX_DIR)
    if os.path.isdir(sandbox):
        return os.path.join(sandbox, SANDBOX_MARKER)
    return None


NAME_MAX = 255  # the longest name of a file or folder on Linux's filesystems
# Errors of a marker's first write that may be gone by the time it is written (a full disk, a shortage):
# not a reason to refuse the run (see _check_marker_path).
MAYBE_LATER_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EMFILE, errno.ENFILE, errno.ENOMEM,
                                errno.EINTR, errno.EAGAIN})


def _check_marker_path(path: str) -> None:
    """Refuse, before anything is written, a marker that could never be a file (a directory, or a path
    under something that is not a directory) and a file there that is not a marker (``not_a_marker``).
    (A full or failing disk is only found when writing: that is a warning then, see ``KeepAwake.hold``.)"""
    if os.path.isdir(path):
        raise UsageError(f"keep-awake marker {path} is a directory; give the path of a file")
    if any(len(os.fsencode(part)) > NAME_MAX for part in path.split(os.sep)):
        raise UsageError(f"keep-awake marker {path[:80]}…: a name in it is longer than {NAME_MAX} bytes")
    why = not_a_marker(path)
    if why:
        raise UsageError(f"keep-awake marker {path} {why}; give a path of its own (nothing was changed)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the folders that do not exist yet are created on first hold
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"keep-awake marker {path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"keep-awake marker {path} cannot be created: {parent} is not writable")
    # access() answers for the permission bits, and yes to root everywhere: /sys and /proc take no new file
    # whoever asks (the marker was accepted there, then warned about at every heartbeat). A file made and
    # removed at once tells for sure; a full disk or a shortage is only found when writing (see above).
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".onward-probe-")
    except OSError as e:
        if e.errno in MAYBE_LATER_ERRNOS:
            return
        # /proc says ENOENT to a file it does not know (the folder exists: it was just looked at).
        why = "takes no new files" if e.errno == errno.ENOENT else e.strerror
        raise UsageError(f"keep-awake marker {path} cannot be created: {parent}: {why}") from None
    os.close(fd)
    os.unlink(probe)


# How many times ``hold`` looks again when the marker it opened was being removed by another worker.
HOLD_TRIES = 20


class KeepAwake:
    def __init__(self, path: str, log: Log) -> None:
        self.path = path
        self.log = log
        self._fd: int | None = None  # the marker, open and under our shared lock, while we hold it
        self._failure: str | None = None  # the last failure warned about, so a full disk warns once

    def hold(self, store: str) -> None:
        """Make sure the marker exists (it may have been removed by a worker that finished), and hold it: a
        shared lock on it tells every other worker sharing it that it is still wanted. A marker that cannot
        be written (a full disk) is a warning, never a reason to stop the work it is there for."""
        if self._fd is not None and same_file(self._fd, self.path):
            self._watch_for_death()  # (its keeper may have been killed on its own: then another is started)
            return
        self.leave()
        why = not_a_marker(self.path)
        if why:  # put there since this worker started
            self._warn(f"keep-awake marker {self.path} {why} now; left as it is, the work goes on")
            return
        try:
            for _ in range(HOLD_TRIES):
                fd = open_marker(self.path)
                if fd is None:
                    self._create(store)
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # another worker is removing it: once gone, it is made anew
                    os.close(fd)
                    continue
                if not same_file(fd, self.path):
                    os.close(fd)
                    continue
                self._fd = fd
                self._failure = None
                self._watch_for_death()  # (once a marker per process)
                return
        except OSError as e:
            self._warn(f"cannot write the keep-awake marker {self.path}: {e.strerror}; the work goes on")
            return
        self._warn(f"keep-awake marker {self.path} kept being removed by another worker; trying again at the"
                   " next heartbeat")

    def _create(self, store: str) -> None:
        """Create the marker unless it exists (then another worker made it a moment ago: it is shared)."""
        create_private_folders(os.path.dirname(os.path.abspath(self.path)))
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return
        try:
            os.write(fd, f"onward pid={os.getpid()} store={store}\n".encode())
        finally:
            os.close(fd)

    def leave(self) -> None:
        """Stop holding the marker without removing it (another worker still has work to keep awake for)."""
        if self._fd is not None:
            # Unlocked before it is closed: a process this worker made and that has not exec'd yet (a command
            # made ahead, see onward.clonespawn) shares the open file, and with it the lock, until then.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Let the marker go, and remove it unless another worker holds it."""
        self.leave()
        why = not_a_marker(self.path)
        if why:  # put there since this worker started: not ours to remove
            self._warn(f"keep-awake marker {self.path} {why} now; left as it is")
            return
        try:
            # Unless held by a worker of another job or store sharing it: that worker removes it.
            remove_unheld(self.path)
        except OSError as e:
            self._warn(f"cannot remove the keep-awake marker {self.path}: {e.strerror}")

    def _watch_for_death(self) -> None:
        failed = keep_after_death(self.path, "worker")
        if failed:
            self._warn(failed)

    def _warn(self, text: str) -> None:
        if text != self._failure:
            self.log.warning(text)
            self._failure = text


def keep_after_death(path: str, who: str) -> str | None:
    """Have a marker keeper (``onward.markerkeeper``) remove the marker at ``path`` once this process is
    gone, however it ends, unless another worker holds it then. Not where a supervisor restarts this process
    (``NOTIFY_SOCKET``: ``onward supervise``, systemd): the marker is meant to stay across a restart, and the
    supervisor lets it go when it gives up (``onward supervise`` has a keeper of its own for its own death).
    One keeper a marker per process, for as long as the process lives; called again, it starts another if
    that one died first (killed on its own: by a ``pkill`` meant for something else, the OOM killer).
    Returns a warning for ``who`` to give (the work goes on), or None."""
    if os.environ.get("NOTIFY_SOCKET"):  # (set empty, it is not: as sd_notify takes it)
        return None
    # By process too: a child forked from a process with a keeper (multiprocessing) holds the parent's pipe
    # as well, and a keeper of its own watches it alone.
    key = (os.getpid(), os.path.abspath(path))
    replaced = ""
    if key in _keepers:
        keeper, held = _keepers[key]
        if keeper.returncode is not None:
            return None  # it ended by itself, and that was told once (below)
        ended = keeper.poll()
        if ended is None:
            return None
        from .proc import describe_status  # here: rare, and ``onward status`` imports this module

        replaced = f"{_keeper_named(path, who)} (pid {keeper.pid}) ended first ({describe_status(ended)})"
        if ended >= 0:  # not killed: it could not do its work, and another would fail alike
            return f"{replaced}; not started again"
        del _keepers[key]
        os.close(held)
    try:
        _keepers[key] = _start_keeper(key[1])
    except (OSError, ValueError) as e:  # no descriptor, process or memory left
        why = getattr(e, "strerror", None) or e
        if replaced:
            return f"{replaced}; cannot start another: {why}; the work goes on"
        return f"cannot start {_keeper_named(path, who)}: {why}; the work goes on"
    return f"{replaced}; started another (pid {_keepers[key][0].pid})" if replaced else None


def keeper_pids() -> set[int]:
    """The pids of this process's marker keepers (``keep_after_death``): children of its own that a
    subreaper must not take for a dead worker's leftovers."""
    me = os.getpid()
    return {keeper.pid for (pid, _), (keeper, _) in _keepers.items() if pid == me}


def _keeper_named(path: str, who: str) -> str:
    """The keeper, as the worker's warnings name it."""
    return f"the process that removes the keep-awake marker {path} should this {who} be killed"


# Per process and marker (absolute path), the keeper watching that process and the write end of the pipe it
# watches, kept open (and referenced, so that neither is collected) for as long as the process lives.
_keepers: dict[tuple[int, str], tuple[subprocess.Popen[bytes], int]] = {}

# What the keeper is told comes in its environment, not on its command line: the package's folder and the
# marker's path would put "onward" there, and a ``pkill -9 -f onward`` meant for the worker would kill the
# keeper with it, leaving the marker it was there to remove.
_BOOT = ("import os, sys; sys.path.append(os.environ['KEEPER_MODULE_DIR']); import markerkeeper; "
         "markerkeeper.keep(os.environ['KEEPER_MARKER'], int(os.environ['KEEPER_WATCHED_FD']))")


def _start_keeper(path: str) -> tuple[subprocess.Popen[bytes], int]:
    """Start a keeper for the marker at ``path`` (see ``onward.markerkeeper``): in a session of its own, so
    that a signal to the worker's process group (Ctrl-C, ``kill -9 -PGID``) does not reach it; with no
    descriptor of the worker's but the pipe's read end, and nothing to print to. The write end stays here,
    close-on-exec, so that no command of the worker's holds it open after the worker is gone."""
    import subprocess  # here: ``onward status`` imports this module, and starts no keeper

    if not sys.executable:
        raise OSError(0, "no Python interpreter to run it with")
    watched, held = os.pipe()
    try:
        keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=[watched],
            cwd="/", env={"KEEPER_MODULE_DIR": os.path.dirname(os.path.abspath(markerkeeper.__file__)),
                          "KEEPER_MARKER": path, "KEEPER_WATCHED_FD": str(watched)},
            start_new_session=True)
    except BaseException:
        os.close(held)
        raise
    finally:
        os.close(watched)
    return keeper, held
