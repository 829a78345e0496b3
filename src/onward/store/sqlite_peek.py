"""A quick read of a SQLite store, for ``onward status``: named queries of sqlite.sql run in one read
transaction with nothing but sqlite3 loaded, on a store that is plainly fine. Anything else (no file, not a
regular file, not SQLite, another schema version, not in WAL mode, no such job, a lock, a damaged page)
raises ``NotPlain``, having changed nothing: the caller then opens the store the usual way (``open_store``),
which says what is wrong, or does what it must (create, upgrade, wait for a lock).

Only reads: the checks below are those ``SqliteStore`` makes before it would change anything, made here as
questions rather than repairs."""

from __future__ import annotations

import os
import sqlite3
import stat
import time

from .sql import latest_version, load_queries
from .sqlite_locks import close_beside, connected, disconnected, lock_shared_bytes, read_head, unlock

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# The first bytes of every SQLite database file: anything else is not handed to SQLite at all (it could
# roll a stray "-journal" back into a file that is not a database).
SQLITE_MAGIC = b"SQLite format 3\x00"
Q = load_queries("sqlite.sql")
SCHEMA_VERSION = latest_version(Q)


def unsynced_mark(path: str) -> str:
    """The file beside a store while its log may hold pages a failed sync did not write (made by
    ``SqliteStore._suspect_log``): another process (the next worker, after one was killed before its
    rewrite; one whose log descriptor was opened after the failure, which the kernel then does not tell;
    ``onward status``) finds it at its open, keeps SQLite from checkpointing the log on its own, and a
    worker reads the log back and rewrites it before it vouches for anything."""
    return path + "-unsynced"


def odd_sibling(path: str) -> str | None:
    """What is wrong with the first of SQLite's own files beside the store (its log, the log's index) that
    is there and is not a regular file: "X is a symbolic link" (SQLite opens none there, whether or not it
    leads to a file), "X is not a regular file" (a FIFO, a device); or None. SQLite's every open of such a
    store was a "disk I/O error" or "unable to open database file". An error other than "not there" goes on
    (OSError)."""
    for sibling in (path + "-wal", path + "-shm"):
        try:
            mode = os.lstat(sibling).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            return f"{sibling} is a symbolic link"
        if not stat.S_ISREG(mode):
            return f"{sibling} is not a regular file"
    return None


def hold_off_checkpoint_on_close(path: str) -> int:
    """A new descriptor of the database file at ``path`` holding ``sqlite_locks.lock_shared_bytes``: while it is
    open, no connection's close, in any process, checkpoints the log. -1 when the file cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    lock_shared_bytes(fd)
    return fd


class NotPlain(Exception):
    """The store cannot be read the quick way: open it with ``open_store``, which says why or copes."""


class QuickRead:
    """One read transaction on the store at ``path`` (a plain file path), for the job named ``job``; every
    query gets ``job`` (its id) and ``now`` (the store's clock, read when the transaction began)."""

    def __init__(self, path: str, job: str) -> None:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise NotPlain  # missing, empty (to be initialised), a directory, a FIFO...
            self._key = st.st_dev, st.st_ino
            if read_head(path, len(SQLITE_MAGIC), self._key) != SQLITE_MAGIC:
                raise NotPlain
            real = os.path.realpath(path)  # SQLite keeps its files beside the file a symlink leads to
            if os.path.lexists(unsynced_mark(real)):
                raise NotPlain  # its log must not be checkpointed as it is: SqliteStore guards it
            if odd_sibling(real) is not None:
                raise NotPlain  # a FIFO where SQLite keeps its log: SqliteStore refuses it
            self._db = sqlite3.connect(path, isolation_level=None)
            self._path = real
            connected(self._key)
        except (OSError, ValueError, sqlite3.Error):
            raise NotPlain from None
        try:
            # journal_mode asked, not set: a store that is not in WAL mode yet is switched by SqliteStore.
            if str(self._db.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                raise NotPlain
            self._db.execute("BEGIN")
            meta = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN ('app', 'schema_version')"))
            # Compared as text, as SqliteStore writes it: any other spelling goes the long way, which refuses
            # what is not a version number.
            if meta.get("app") != "onward" or meta.get("schema_version") != str(SCHEMA_VERSION):
                raise NotPlain
            found = self._db.execute(Q["find_job"], {"name": job}).fetchone()
            if found is None:
                raise NotPlain
            self.now = time.time()  # SQLite's clock is this host's (SqliteStore.now)
            self._params: dict[str, object] = {"job": int(found[0]), "now": self.now}
        except (sqlite3.Error, ValueError, TypeError, NotPlain):
            self._db.close()
            disconnected(self._key)
            raise NotPlain from None

    def rows(self, name: str, **params: object) -> list[Any]:
        """The rows of the named query."""
        try:
            return self._db.execute(Q[name], {**self._params, **params}).fetchall()
        except (sqlite3.Error, ValueError):  # ValueError: a text that is not UTF-8 (a damaged page)
            raise NotPlain from None

    def close(self) -> None:
        """End the read transaction and the connection; should a worker's sync have failed meanwhile (the
        mark is there now), without the checkpoint SQLite makes when the last connection closes."""
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error:
            pass  # a read: nothing to lose
        guard = hold_off_checkpoint_on_close(self._path) if os.path.lexists(unsynced_mark(self._path)) else -1
        self._db.close()
        disconnected(self._key)
        if guard >= 0:
            unlock(guard)
            close_beside(guard, self._key)
