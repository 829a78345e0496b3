"""The marker keeper: a small process that removes the keep-awake marker of a worker that died without
removing it (``kill -9``, the OOM killer), when no supervisor is there to do it.

Why. A worker removes the marker itself when the work is done or when it leaves, and ``onward supervise``
removes a killed worker's marker when it gives up on it. A lone ``onward run`` killed outright does
neither: its marker stayed until a worker ran the job again, and a sandbox that idle-pauses was kept
awake, and paid for, with no worker left to do the work it was kept awake for.

How. The worker that first holds a marker starts this file as ``python -I -S -c`` (standard library only,
~10 ms once per worker and marker; told the marker in its environment, so that its command line does not
match a ``pkill -f onward``) in a session of its own, with the read end of a pipe whose write end
only the worker holds (close-on-exec: its commands never get it). The keeper blocks reading it. End of
file comes when the worker is gone, whatever killed it: the kernel closes a dead process's descriptors.
The keeper then removes the marker if it is still a marker and no live worker holds it, by the same rule
as a worker leaving (``remove_unheld``: every worker holding a marker keeps a shared ``flock`` on it, and a
lock dies with its process), and exits. A worker that left normally already let the marker go: the keeper
then finds nothing to do, or a marker another worker holds, and leaves it.

Not started where a supervisor restarts the worker (``NOTIFY_SOCKET`` set: ``onward supervise`` or
systemd's ``Type=notify``): there the marker is meant to stay across a restart, and the supervisor lets
it go when it gives up. ``onward supervise`` starts a keeper of its own instead, watching itself: killed
outright, it takes its worker with it (PDEATHSIG), and neither can let the marker go then.

This file is also imported by ``onward.keepawake``, which shares its two rules (what counts as a marker,
and when one may be removed); it imports nothing but the standard library.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

MARKER_TEXT = b"onward pid="  # what every marker onward writes begins with


def not_a_marker(path: str) -> str | None:
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


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open on ``fd`` (not removed, nor replaced, since)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def open_marker(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


def remove_unheld(path: str, patience: float = 0.0) -> bool:
    """Remove the marker at ``path`` unless a worker holds it (a shared lock on it), waiting up to
    ``patience`` seconds for a lock to go. True if removed. The exclusive lock taken first keeps a worker
    from taking the file over meanwhile: one that opens it waits for it to be gone and makes a new one
    (``KeepAwake.hold``). Raises ``OSError`` from the disk."""
    fd = open_marker(path)
    if fd is None:
        return False
    try:
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False  # held by another worker (of this job, or of another sharing the marker)
                time.sleep(0.02)
        if not same_file(fd, path):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)


# How long the keeper waits for a lock on the marker to go. A process the dead worker made and that had not
# exec'd yet (a command made ahead, onward.clonespawn) shares the worker's open marker, and with it its lock,
# until it dies with the worker (PR_SET_PDEATHSIG), a moment later; and it may close the pipe the keeper
# watches before it closes the marker. A worker that holds the marker holds it for longer.
LOCK_PATIENCE = 2.0


def keep(path: str, watched: int) -> None:
    """Wait for end of file on ``watched`` (the worker is gone), then remove the marker at ``path`` if it
    is still one and no worker holds it."""
    while True:
        try:
            if not os.read(watched, 64):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    if not_a_marker(path) is None:
        try:
            remove_unheld(path, LOCK_PATIENCE)
        except OSError:
            pass  # a disk that fails now: nothing left to tell it to (the worker is gone); as before, it stays
