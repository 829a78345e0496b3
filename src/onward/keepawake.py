"""The keep-awake marker: a file that exists while work remains, so a sandbox that idle-pauses stays up.

Sandboxes that pause when idle look for a marker file (by convention ``~/.sandboxer/keep-awake``) and stay
awake while it exists. onward creates it while the store has pending or running work and a worker is
alive, and removes it when nothing is left to do, or when the last live worker leaves.

One marker may be shared by workers of several jobs and stores (the conventional path is shared by every
one of them): each worker that holds it keeps a shared lock (``flock``) on it, and one that lets it go
removes it only when no other worker holds it. A lock dies with its process, so a killed worker's marker
is never held by it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from .errors import UsageError
from .folders import create_private_folders
from .log import Log

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


MARKER_TEXT = b"onward pid="  # what every marker onward writes begins with
NAME_MAX = 255  # the longest name of a file or folder on Linux's filesystems


def _not_a_marker(path: str) -> str | None:
    """Why the file at ``path`` is something onward must neither overwrite nor remove (None: nothing is
    there, or it is a marker: one onward wrote, or an empty file, as ``touch`` makes by the sandboxes'
    convention). A typo'd path (``--keep-awake tasks.txt``) would otherwise be replaced by a marker and
    deleted when the work is done."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link"
        if e.errno == errno.EISDIR:
            return "is a directory"
        return None  # unreadable: whether it can be replaced is found when writing (a warning then)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "is not a regular file"
        head = os.read(fd, len(MARKER_TEXT))
    finally:
        os.close(fd)
    if head and not MARKER_TEXT.startswith(head):  # (a prefix: read while another worker writes it)
        return "holds something other than a keep-awake marker"
    return None


def _check_marker_path(path: str) -> None:
    """Refuse, before anything is written, a marker that could never be a file (a directory, or a path
    under something that is not a directory) and a file there that is not a marker (``_not_a_marker``).
    (A full or failing disk is only found when writing: that is a warning then, see ``KeepAwake.hold``.)"""
    if os.path.isdir(path):
        raise UsageError(f"keep-awake marker {path} is a directory; give the path of a file")
    if any(len(os.fsencode(part)) > NAME_MAX for part in path.split(os.sep)):
        raise UsageError(f"keep-awake marker {path[:80]}…: a name in it is longer than {NAME_MAX} bytes")
    why = _not_a_marker(path)
    if why:
        raise UsageError(f"keep-awake marker {path} {why}; give a path of its own (nothing was changed)")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # the folders that do not exist yet are created on first hold
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"keep-awake marker {path} cannot be created: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"keep-awake marker {path} cannot be created: {parent} is not writable")


# How many times ``hold`` looks again when the marker it opened was being removed by another worker.
HOLD_TRIES = 20


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open on ``fd`` (not removed, nor replaced, since)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _open_marker(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


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
        if self._fd is not None and _same_file(self._fd, self.path):
            return
        self.leave()
        why = _not_a_marker(self.path)
        if why:  # put there since this worker started
            self._warn(f"keep-awake marker {self.path} {why} now; left as it is, the work goes on")
            return
        try:
            for _ in range(HOLD_TRIES):
                fd = _open_marker(self.path)
                if fd is None:
                    self._create(store)
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # another worker is removing it: once gone, it is made anew
                    os.close(fd)
                    continue
                if not _same_file(fd, self.path):
                    os.close(fd)
                    continue
                self._fd = fd
                self._failure = None
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
        why = _not_a_marker(self.path)
        if why:  # put there since this worker started: not ours to remove
            self._warn(f"keep-awake marker {self.path} {why} now; left as it is")
            return
        try:
            fd = _open_marker(self.path)
            if fd is None:
                return
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # held by a worker of another job or store sharing it: that worker removes it
                if _same_file(fd, self.path):
                    os.unlink(self.path)
            finally:
                os.close(fd)
        except OSError as e:
            self._warn(f"cannot remove the keep-awake marker {self.path}: {e.strerror}")

    def _warn(self, text: str) -> None:
        if text != self._failure:
            self.log.warning(text)
            self._failure = text
