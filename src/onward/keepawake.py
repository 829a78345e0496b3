"""The keep-awake marker: a file that exists while work remains, so a sandbox that idle-pauses stays up.

Sandboxes that pause when idle look for a marker file (by convention ``~/.sandboxer/keep-awake``) and stay
awake while it exists. onward creates it while the store has pending or running work and a worker is
alive, and removes it when nothing is left to do, or when the last live worker leaves.
"""

from __future__ import annotations

import contextlib
import errno
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
    path = _chosen_marker(flag)
    if path:
        _check_marker_path(path)
    return path


def _chosen_marker(flag: str | None) -> str | None:
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
    if head and head != MARKER_TEXT:
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


class KeepAwake:
    def __init__(self, path: str, log: Log) -> None:
        self.path = path
        self.log = log
        self._held = False
        self._failure: str | None = None  # the last failure warned about, so a full disk warns once

    def hold(self, store: str) -> None:
        """Make sure the marker exists (it may have been removed by a worker that finished). A marker that
        cannot be written (a full disk) is a warning, never a reason to stop the work it is there for."""
        if self._held and os.path.exists(self.path):
            return
        why = _not_a_marker(self.path)
        if why:  # put there since this worker started
            self._warn(f"keep-awake marker {self.path} {why} now; left as it is, the work goes on")
            return
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            create_private_folders(os.path.dirname(os.path.abspath(self.path)))
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, f"onward pid={os.getpid()} store={store}\n".encode())
            finally:
                os.close(fd)
            os.replace(tmp, self.path)  # appears whole: a reader never sees a half-written marker
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._warn(f"cannot write the keep-awake marker {self.path}: {e.strerror}; the work goes on")
            return
        self._held = True
        self._failure = None

    def release(self) -> None:
        why = _not_a_marker(self.path)
        if why:  # put there since this worker started: not ours to remove
            self._warn(f"keep-awake marker {self.path} {why} now; left as it is")
            self._held = False
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn(f"cannot remove the keep-awake marker {self.path}: {e.strerror}")
        self._held = False

    def _warn(self, text: str) -> None:
        if text != self._failure:
            self.log.warning(text)
            self._failure = text
