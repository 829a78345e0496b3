"""Descriptors onward opens beside SQLite on a store's database file and its ``-shm``: none is closed while
this process has a connection to that store.

Why. POSIX record locks belong to a process and a file, not to a descriptor: closing *any* descriptor of a
file drops every such lock the process holds on it. SQLite's unix VFS locks that way. In WAL mode each
connection holds a SHARED lock on the database file for as long as it is open; the connection that closes
while no other holds one takes it to be the last, checkpoints, and deletes the log. On the ``-shm`` file its
locks keep readers' snapshots and the index itself. SQLite defers the close of its own descriptors for this
reason (its "unused descriptor" list); one opened beside it must do the same. Seen here before this module:
after a worker's rewrite of its log (``SqliteStore._rewrite_log``, which opened and closed descriptors of both
files), a plain ``sqlite3`` connection in another process, opened and closed, found itself the last one and
deleted the log under the worker. The worker's next durable commit went into the deleted file, and every
later reader got "disk I/O error".

So ``connected``/``disconnected`` count this process's connections per store (database file's device and
inode), and ``close_beside`` closes a descriptor of that store's files at once only when there is none, and
otherwise once the last one has closed. A lock onward took itself (the guard's, ``hold_off_checkpoint_on_close``,
an open-file-description lock) must be released explicitly first (``unlock``): it would last as long as the
descriptor.

A connection opened by code other than onward's (your own ``sqlite3`` in the same process) is not counted.
"""

from __future__ import annotations

import os
from _thread import allocate_lock  # not threading: this module is on the start-up path of `onward status`

Key = tuple[int, int]  # the database file's st_dev, st_ino

_mutex = allocate_lock()
_connections: dict[Key, int] = {}
_deferred: dict[Key, list[int]] = {}


def store_key(path: str) -> Key | None:
    """The key of the store whose database file is at ``path``; None when it cannot be looked at."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def connected(key: Key | None) -> None:
    """A connection of this process to the store ``key`` was opened."""
    if key is None:
        return
    with _mutex:
        _connections[key] = _connections.get(key, 0) + 1


def disconnected(key: Key | None) -> None:
    """A connection counted by ``connected`` was closed: once it was the last, close what waited for that."""
    if key is None:
        return
    with _mutex:
        left = _connections.get(key, 0) - 1
        if left > 0:
            _connections[key] = left
            return
        _connections.pop(key, None)
        waiting = _deferred.pop(key, [])
    for fd in waiting:
        os.close(fd)


def close_beside(fd: int, key: Key | None) -> None:
    """Close ``fd``, a descriptor of a file of the store ``key`` (its database file, its ``-shm``), now if this
    process has no connection to that store, else once its last one closed. ``key`` None (the store's file
    could not be looked at): left open rather than risk another's locks."""
    with _mutex:
        if key is None or _connections.get(key):
            _deferred.setdefault(key or (-1, -1), []).append(fd)
            return
    os.close(fd)


def lock_shared_bytes(fd: int) -> None:
    """Read-lock, through ``fd`` (a descriptor of a store's database file), the bytes SQLite's unix VFS locks
    for SHARED and EXCLUSIVE (SHARED_FIRST = 2^30 + 2, SHARED_SIZE = 510), as another reader's would: while
    it is held, no connection's close, in any process, gets the exclusive lock SQLite's checkpoint at the
    close of the last connection needs (see ``SqliteStore._guard_log``). An open-file-description lock: it
    conflicts with SQLite's own record locks even in this process, and lasts until ``unlock`` or the close of
    the descriptor's last copy. Not taken where none can be (a connection closing and checkpointing right
    now, or a system without such locks: Linux has them from 3.15)."""
    _ofd_lock(fd, "F_RDLCK", 0x40000002, 510)


def unlock(fd: int) -> None:
    """Release every open-file-description lock taken through ``fd`` (``lock_shared_bytes``)."""
    _ofd_lock(fd, "F_UNLCK", 0, 0)


def _ofd_lock(fd: int, kind: str, start: int, length: int) -> None:
    import fcntl  # here: `onward status` imports this module at start-up, and seldom needs these
    import struct

    ofd_setlk = getattr(fcntl, "F_OFD_SETLK", None)
    if ofd_setlk is None:
        return
    try:  # struct flock, Linux's layout: type, whence, start, length (0: to the end), pid
        fcntl.fcntl(fd, ofd_setlk, struct.pack("@hhqqi4x", getattr(fcntl, kind), os.SEEK_SET, start, length, 0))
    except OSError:
        pass


def read_head(path: str, size: int, key: Key | None = None) -> bytes:
    """The first ``size`` bytes of the file at ``path``, a file of the store ``key`` (by default the store
    whose database file ``path`` is), read through a descriptor closed as ``close_beside`` says.
    ``OSError`` as ``os.open`` or ``os.read`` raise it (``IsADirectoryError`` for a directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if key is None:
            st = os.fstat(fd)
            key = st.st_dev, st.st_ino
        return os.read(fd, size)
    finally:
        close_beside(fd, key)
