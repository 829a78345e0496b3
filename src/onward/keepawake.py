"""The keep-awake marker: a file that exists while work remains, so a sandbox that idle-pauses stays up.

Sandboxes that pause when idle look for a marker file (by convention ``~/.sandboxer/keep-awake``) and stay
awake while it exists. onward creates it while the store has pending or running work and a worker is
alive, and removes it when nothing is left to do, or when the last live worker leaves.
"""

from __future__ import annotations

import contextlib
import os

from .errors import UsageError
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


def _check_marker_path(path: str) -> None:
    """Refuse, before anything is written, a marker that could never be a file: a directory, or a path
    under something that is not a directory. (A full or failing disk is only found when writing: that is a
    warning then, see ``KeepAwake.hold``.)"""
    if os.path.isdir(path):
        raise UsageError(f"keep-awake marker {path} is a directory; give the path of a file")
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
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), mode=0o700, exist_ok=True)
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
