"""The keep-awake marker: a file that exists while work remains, so a sandbox that idle-pauses stays up.

Sandboxes that pause when idle look for a marker file (by convention ``~/.sandboxer/keep-awake``) and stay
awake while it exists. onward creates it while the store has pending or running work and a worker is
alive, and removes it when nothing is left to do, or when the last live worker leaves.
"""

from __future__ import annotations

import os
from pathlib import Path

SANDBOX_DIR = "~/.sandboxer"
SANDBOX_MARKER = "keep-awake"


def marker_path(flag: str | None) -> str | None:
    """The marker to keep: the flag, else $ONWARD_KEEP_AWAKE, else ~/.sandboxer/keep-awake when the
    ~/.sandboxer folder exists, else none."""
    if flag:
        return flag
    env = os.environ.get("ONWARD_KEEP_AWAKE")
    if env:
        return env
    sandbox = Path(SANDBOX_DIR).expanduser()
    if sandbox.is_dir():
        return str(sandbox / SANDBOX_MARKER)
    return None


class KeepAwake:
    def __init__(self, path: str) -> None:
        self.path = path
        self._held = False

    def hold(self, store: str) -> None:
        """Make sure the marker exists (it may have been removed by a worker that finished)."""
        if self._held and os.path.exists(self.path):
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, f"onward pid={os.getpid()} store={store}\n".encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.path)  # appears whole: a reader never sees a half-written marker
        self._held = True

    def release(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._held = False
