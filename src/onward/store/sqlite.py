"""The embedded store: one SQLite file in WAL mode, every completion durable (synchronous=FULL).

Why these settings:
- WAL: readers (``onward status``) never block the worker, and a commit is one append plus one fsync of
  the log instead of rewriting pages in place.
- ``synchronous=FULL``: in WAL mode, NORMAL only fsyncs at checkpoints, so a power cut could lose the
  last completions; FULL fsyncs the log at every commit, which is what "a committed completion is never
  run again" needs. Writes that only have to survive the *process* (lease renewals, the child's pid, the
  journal) are committed with the connection at NORMAL: they reach the OS page cache, which a ``kill -9``
  does not lose, and the next FULL commit's fsync covers them too, since the log is sequential. The
  connection is switched only when a transaction needs the other setting than the last one had: the switch
  is a statement of its own, and costs about as much as a claim (a worker that settles crash-safe and syncs
  itself, every task, never switches).
- A worker's settling commit (outcomes and the next claims) may be made crash-safe first and durable a
  moment later (``batch(durable=False)`` then ``sync``): the runner starts the claimed tasks in between, so
  the log's fsync overlaps their run instead of delaying them. ``sync`` is one ``fdatasync`` of the log
  file, the same call FULL makes at a commit; nothing is reported done before it returned.
- ``BEGIN IMMEDIATE`` for every write: the write lock is taken up front, so two workers never deadlock
  upgrading read locks, and ``busy_timeout`` makes the other wait instead of failing; once a worker names
  its lease, for at most a quarter of it (see sqlbase.STALL_FLOOR_MS), as PostgreSQL's lock_timeout.
"""

from __future__ import annotations

import errno
import fcntl  # noqa: F401  (loaded with the store, not when the guard first locks: see _guard_log)
import functools
import os
import sqlite3
import stat
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from ..errors import (
    RESOURCE_ERRNOS,
    UNAVAILABLE_ERRNOS,
    CorruptStore,
    NotAStore,
    StoreError,
    StoreGone,
    StoreLogLost,
    StoreMissing,
    StoreUnavailable,
)
from ..log import one_line
from ..proc import hostname
from .base import DONE, FENCED_DETAIL, Claim, Event, Lease, PendingSync, Stats, StepRecord
from .rows import event_of
from .sql import migration
from .sqlbase import (
    NO_JOB,
    SCHEMA_VERSION,
    JournalRow,
    SqlStore,
    added_message,
    check_schema_version,
    parse_schema_version,
    refuse_live_workers,
)
from .sqlite_locks import (
    close_beside,
    connected,
    disconnected,
    lock_shared_bytes,
    read_head,
    unlock,
)
from .sqlite_peek import SQLITE_MAGIC, Q, odd_sibling, unsynced_mark
from .sqlite_wal import read_back

# The extended attribute the journal probe asks to replace: no file has it, so nothing is ever changed.
PROBE_XATTR = "user.onward-journal-probe"


def posix_journal_probe(fd: int) -> bool:
    """``journal_probe`` of _syncthread.c, with the call the standard library has: a replace of an extended
    attribute the file does not have, for which ext4 starts a journal handle before it finds nothing to
    replace (the file is left as it was, its ctime too)."""
    try:
        os.setxattr(fd, PROBE_XATTR, b"", os.XATTR_REPLACE)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EIO, errno.EUCLEAN):
            raise
        return e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.ENODEV, errno.EBADF,
                               errno.EPERM, errno.EACCES)
    return True


try:
    from ._syncthread import SyncThread, journal_probe
except ImportError:  # built without a C compiler: sync_ahead syncs in place, and probes from Python
    SyncThread = None
    journal_probe = posix_journal_probe

# How long a call waits for the write lock before the runner names a lease (then: a quarter of it, see
# sqlbase.STALL_FLOOR_MS). Commands such as ``onward add`` have no lease to outlive and may wait longer.
BUSY_TIMEOUT_MS = 30_000
SQLITE_IOERR = 10  # the primary result code of every "disk I/O error" (its extended codes share the low byte)
EVENTS_PER_INSERT = 1000  # journal rows per INSERT (9 parameters each; SQLite takes 32,766)
# The most completions one rate reading counts: a job done faster than that a minute is measured over its latest
# RATE_SAMPLE completions (a few seconds at such rates), which keeps a status refresh a few milliseconds.
RATE_SAMPLE = 100_000
# How long a sync started by sync_ahead may finish unclaimed before its descriptor wakes the worker's loop:
# the worker's reports of a task wait at most about that long (plus the fsync) while the next task runs.
SYNC_AHEAD_LINGER = 0.02
# SQLite's default for wal_autocheckpoint, put back once a suspect log was rewritten (_guard_log).
AUTOCHECKPOINT_PAGES = 1000
# The size the log is cut back to when it is written again from its start after a checkpoint. In normal use
# it stays under about 4 MiB (AUTOCHECKPOINT_PAGES pages), never cut; a reader holding one snapshot for
# long (a user's sqlite3 shell in a transaction) makes it grow with every commit, since nothing can be
# checkpointed past that snapshot, and without a limit it kept that size on disk while any connection to
# the store stayed open.
JOURNAL_SIZE_LIMIT = 8 << 20
# A log this big is not what checkpoints leave behind (JOURNAL_SIZE_LIMIT): while it still grows, a worker warns
# (log_held_back) that a reader holds it back.
LOG_WARN_BYTES = 64 << 20


def path_from_url(url: str) -> str:
    """The file of a SQLite location, as ``store_url`` returns it: a plain path or ``sqlite:///path``
    (``sqlite:////abs`` or ``sqlite:///rel``)."""
    return url[len("sqlite:///"):] if url.startswith("sqlite:///") else url


def _check_regular_file(path: str) -> bool:
    """Whether the store file exists; refuse anything but a regular file before opening it: opening a FIFO
    blocks for ever, and SQLite would leave a -journal beside a device."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise _os_error(f"cannot read store {path}", e) from None
    if stat.S_ISDIR(st.st_mode):
        raise NotAStore(f"not an onward store: {path} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise NotAStore(f"not an onward store: {path} is not a regular file")
    # Not a "disk I/O error", exit 75, which a supervisor restarts for good: bad input, and it stays.
    try:
        sibling = odd_sibling(os.path.realpath(path))
    except OSError as e:
        raise _os_error(f"cannot read store {path}", e) from None
    if sibling is not None:
        raise NotAStore(f"store {path}: {sibling} (a name SQLite keeps for its own file beside the store);"
                        " remove it")
    return True


def _make_private(path: str) -> None:
    """Take group and other permissions off a store file found empty (touched, or a creation cut short),
    as if onward had created it."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            os.chmod(path, mode & 0o700)
    except OSError as e:
        raise _os_error(f"cannot make store {path} private", e) from None


def _check_header(path: str) -> None:
    """Refuse any existing file that is not an SQLite database, before SQLite gets to touch it."""
    try:
        head = read_head(path, len(SQLITE_MAGIC))  # (another connection of this process may hold locks on it)
    except IsADirectoryError:
        raise NotAStore(f"not an onward store: {path} is a directory") from None
    except OSError as e:
        raise _os_error(f"cannot read store {path}", e) from None
    # An empty file holds nothing to lose (e.g. a store whose creation was interrupted): it is initialised.
    if head and head != SQLITE_MAGIC:
        raise NotAStore(f"not an onward store: {path} is not an SQLite database")


def _on_read_only_file_system(path: str) -> bool:
    """Whether the store's file is on a file system mounted read-only (EROFS for any write)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False  # opening it says what is wrong


def _read_only_location(path: str) -> str:
    """How SQLite can read a store on a read-only file system. It reads a write-ahead log only through its
    index (``-shm``), which it cannot make there: with both left beside the database (a worker killed, or
    the disk turned read-only under it) it reads them as they are (``mode=ro``), committed pages of the log
    included. With neither (the last connection closed cleanly and put everything in the database file),
    the database file is the whole store, and ``immutable=1`` reads it without any (a read-only
    ``mode=ro`` open of a WAL database needs that index all the same). Either way nothing is written, no
    lock taken: a store written meanwhile through another, writable mount of the same disk may be read
    as it was a moment before, or torn."""
    from urllib.parse import quote

    real = os.path.realpath(path)  # SQLite keeps its files beside the file a symlink leads to
    log_left = os.path.lexists(real + "-wal") or os.path.lexists(real + "-shm")
    return "file:" + quote(os.path.abspath(path)) + ("?mode=ro" if log_left else "?immutable=1")


def _read_only_error(path: str) -> StoreUnavailable:
    return StoreUnavailable(f"store {path}: cannot write to it: its file system is read-only (EROFS)")


def _os_error(what: str, e: OSError) -> StoreError:
    """``what`` failed: unavailable (exit 75, restarted) for a fault of the disk or a process out of
    descriptors or memory, else a plain store error."""
    kind = StoreUnavailable if e.errno in UNAVAILABLE_ERRNOS else StoreError
    return kind(f"{what}: {e.strerror}")


def _out_of_descriptors(path: str) -> str | None:
    """Why SQLite could not open ``path`` ("unable to open database file", which names no cause), when that
    is the process's want of descriptors or memory: a ``ulimit -n`` reached is no mistake in the store's
    location. Three descriptors are tried at once, as many as SQLite opens for a store (the file, its -wal
    and its -shm). None when they open, or fail for another reason."""
    fds: list[int] = []
    try:
        for _ in range(3):
            fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as e:
        return e.strerror if e.errno in UNAVAILABLE_ERRNOS else None
    finally:
        for fd in fds:
            os.close(fd)
    return None


# Less free space than this beside the store is taken for a full disk: the log's index (-shm) grows 32 KiB
# at a time, and SQLite writes its log a page (4 KiB) at a time.
FULL_DISK_BYTES = 64 * 1024


def _full_disk_note(path: str) -> str:
    """": no space left on the device holding it" when the file system of the store at ``path`` has (nearly)
    none left for this process (root may use the blocks kept back for it); "" otherwise, or when it cannot
    be looked at."""
    try:
        st = os.statvfs(os.path.dirname(os.path.realpath(path)))
    except OSError:
        return ""
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    free = blocks * st.f_frsize
    return f": no space left on the device holding it ({free:,} bytes free)" if free < FULL_DISK_BYTES else ""


def _refuses_writes(path: str) -> bool:
    """Whether the file system of the store at ``path`` refuses to open it for writing (EROFS)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        return e.errno == errno.EROFS
    os.close(fd)
    return False


def _translate(e: BaseException, path: str) -> StoreError:
    if isinstance(e, UnicodeDecodeError) or "Could not decode to UTF-8" in str(e):
        return CorruptStore(f"store {path} is corrupt (a text value is not valid UTF-8); onward writes nothing more"
                            " to it: restore a copy, or recover it with sqlite3's .recover")
    text = one_line(str(e), 200)  # a damaged schema's message quotes its SQL, many lines long
    if "malformed" in text or "not a database" in text or "corrupt" in text:
        return CorruptStore(f"store {path} is corrupt ({text}); onward writes nothing more to it: restore a"
                            " copy, or recover it with sqlite3's .recover")
    if "readonly" in text or "read-only" in text:
        # SQLITE_READONLY: the file or its folder may not be written (permissions, a read-only open):
        # configuration. A disk turning read-only under a writer shows as a disk I/O error instead; one
        # that turned read-only on its own before (ext4's errors=remount-ro, which statvfs does not show as
        # read-only) says EROFS to a write open: the machine's fault, for now (75), as a disk mounted
        # read-only is (_read_only_error). It was taken for configuration: exit 2, and no supervisor
        # restarted the worker once the disk was repaired.
        if _refuses_writes(path):
            return _read_only_error(path)
        return StoreError(f"store {path} is read-only ({text})")
    if "disk is full" in text:
        return StoreUnavailable(f"store {path}: {text}")
    if "disk I/O" in text:
        # SQLite names no cause, and a full disk is the likeliest one where the log's index (-shm) cannot
        # grow: `onward run` and `onward status` alike said "disk I/O error" for a disk that was only full.
        return StoreUnavailable(f"store {path}: {text}{_full_disk_note(path)}")
    if "unable to open database file" in text:
        why = _out_of_descriptors(path)
        if why is not None:
            return StoreUnavailable(f"store {path}: {text} ({why})")
        if _refuses_writes(path):  # its -shm could not be made there (see the read-only case above)
            return _read_only_error(path)
    return StoreError(f"store {path}: {text}")


class _NotConnected:
    """In place of the connection after ``SqliteStore.idle`` closed it and could not open the store again
    (descriptors exhausted, permissions changed): each use fails as a store that cannot be read, and the next
    ``idle`` tries again."""

    in_transaction = False
    total_changes = 0

    def __init__(self, why: str) -> None:
        self.why = why

    def execute(self, *args: Any) -> Any:
        raise sqlite3.OperationalError(f"not open again yet ({self.why})")

    executemany = execute

    def close(self) -> None:
        pass


class SqliteStore(SqlStore):
    """``Store`` on one SQLite file. One instance is one connection: use it from one thread."""

    @property
    def secrets(self) -> Sequence[str]:
        return ()  # a file: no password

    def __init__(self, url: str, *, create: bool = True, upgrade: bool = False, job: str = "default") -> None:
        self.path = path_from_url(url)
        self.url = self.path
        # Where SQLite keeps the store's log, its index (STORE-wal, -shm) and onward's STORE-unsynced: beside
        # the file a symlink leads to, as SQLite itself resolves it. Beside the link, the log was "gone" at
        # every start, and a completion went unreported.
        self._real = os.path.realpath(self.path)
        self.job = job
        self._batch_depth = 0
        exists = _check_regular_file(self.path)
        if not exists and not create:
            raise StoreMissing(f"no onward store at {self.path}")
        if exists:
            _check_header(self.path)
        else:
            self._create_file()
        # The file about to be opened, to notice later that it was deleted or replaced (see check_still_there);
        # also the key its connections are counted by (sqlite_locks).
        self._where = os.path.abspath(self.path)
        self._identity = self._file_identity()
        # On a read-only mount the store can still be read (status, list, logs ...); a write then fails
        # as the disk fault it is (_translate_error), not as SQLite's "unable to open database file".
        self._read_only_fs = _on_read_only_file_system(self.path)
        self._connect(_read_only_location(self.path) if self._read_only_fs else self.path, create, upgrade)
        try:
            self._database()  # now, not at a failed sync: the guard then needs no new descriptor (_guard_log)
        except OSError as e:
            self.close()
            raise _os_error(f"cannot open store {self.path}", e) from None
        self._notice_mark()  # left by a process that did not rewrite

    def _connect(self, location: str, create: bool, upgrade: bool) -> None:
        try:
            self._db = sqlite3.connect(location, isolation_level=None, check_same_thread=False,
                                       uri=location.startswith("file:"))
        except sqlite3.DatabaseError as e:
            raise self._translate_error(e) from None
        try:
            # Identify the file before changing anything in it (switching to WAL rewrites its header).
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if self._schema_version() is None:  # an empty file, or an SQLite database with no table
                if not create:  # nothing to read; switching it to WAL mode would already write to it
                    raise StoreMissing(f"no onward store at {self.path}")
                # Before the switch to WAL mode: SQLite gives -wal and -shm the database file's mode.
                _make_private(self.path)
            self._configure()
            self._ensure_schema(upgrade)
            self._open_job(create)
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:
            self._db.close()
            self._db = None  # type: ignore[assignment]
            raise self._translate_error(e) from None
        except StoreError:
            self._db.close()
            self._db = None  # type: ignore[assignment]
            raise
        connected(self._identity)  # so that no descriptor onward opens on the store's files is closed under it

    # --- opening -------------------------------------------------------------------------------------
    def _create_file(self) -> None:
        parent = os.path.dirname(self.path) or "."  # (os.path, not pathlib: start-up of `onward status`)
        if not os.path.exists(parent):
            from ..folders import create_private_folders

            try:
                create_private_folders(parent)
            except OSError as e:
                raise _os_error(f"cannot create folder {parent}", e) from None
        try:
            # Create it ourselves, private from the first byte; SQLite gives the -wal and -shm files the
            # same mode as the database file.
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            os.close(fd)
        except FileExistsError:
            _check_header(self.path)  # another worker created it first
        except OSError as e:
            raise _os_error(f"cannot create store {self.path}", e) from None

    def _configure(self) -> None:
        # Read-only, the store stays as it is: a WAL store already (an immutable open reports "delete").
        mode = "wal" if self._read_only_fs else self._switch_to_wal()
        if mode.lower() != "wal":
            raise StoreError(f"store {self.path}: cannot switch to WAL mode (got {mode})")
        self._db.execute("PRAGMA synchronous = FULL")
        self._durable = True  # what synchronous is set to now: FULL (see _transaction)
        self._db.execute("PRAGMA foreign_keys = OFF")
        # The journal and task rows are appended in order; a bigger cache keeps status and claims hot.
        self._db.execute("PRAGMA cache_size = -16000")
        self._db.execute(f"PRAGMA journal_size_limit = {JOURNAL_SIZE_LIMIT}")

    def _switch_to_wal(self) -> str:
        """``PRAGMA journal_mode = WAL``, waiting out other connections as the busy timeout would. A new
        file's switch takes an exclusive lock, and SQLite tries that lock once without calling the busy
        handler: a reader opening the same new store (``onward status`` while a worker creates it) made the
        one or the other fail at once with "database is locked". A file already in WAL mode needs no lock."""
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        pause = 0.001
        while True:
            try:
                return str(self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() >= deadline:
                    raise
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _ensure_schema(self, upgrade: bool) -> None:
        """Create the schema in a new store, or with ``upgrade`` bring an older one to SCHEMA_VERSION: every
        migration in one transaction under the write lock, so workers of this version starting at the same
        moment find it done. ``upgraded_from`` is the version found (0: none)."""
        version = self._schema_version()
        self.upgraded_from = version or 0
        if version is None or (upgrade and version < SCHEMA_VERSION):
            with self._write():
                version = self._schema_version()  # re-check under the write lock: another worker may win
                self.upgraded_from = version or 0
                if version is None or (upgrade and version < SCHEMA_VERSION):
                    if version is not None:  # under the write lock: no worker registers before the commit
                        refuse_live_workers(self._db.execute(Q["unstopped_workers"], {"now": self.now()}),
                                            self.path)
                    for target in range(self.upgraded_from + 1, SCHEMA_VERSION + 1):
                        for statement in _split_statements(migration(Q, target)):
                            self._db.execute(statement)
                    self._exec("set_meta", {"version": str(SCHEMA_VERSION)})
                    version = SCHEMA_VERSION
        check_schema_version(version, SCHEMA_VERSION, self.path)

    def _schema_version(self) -> int | None:
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None
        if "meta" not in tables:
            raise NotAStore(f"not an onward store: {self.path} is another SQLite database")
        rows = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN ('app', 'schema_version')"))
        if rows.get("app") != "onward" or "schema_version" not in rows:
            raise NotAStore(f"not an onward store: {self.path} is another SQLite database")
        version = parse_schema_version(str(rows["schema_version"]))
        if version is None:
            # int() of it raised out of every command as a traceback, and a version below 1 sent the upgrade
            # looking for a migration that does not exist.
            shown = ascii(str(rows["schema_version"])[:40])
            raise CorruptStore(f"store {self.path} is corrupt (its schema version {shown} is not a version number);"
                               " it was left untouched")
        return version

    def close(self) -> None:
        self._close_files()
        db = getattr(self, "_db", None)
        if db is not None:
            if not self._guarded and os.path.lexists(unsynced_mark(self._real)):
                # Opened before another process's sync failed (a dashboard, a second worker): not guarded yet.
                try:
                    self._hold_off_checkpoint_on_close()
                except OSError:
                    pass  # only when the store's own open failed for want of that descriptor
            db.close()
            self._db = None  # type: ignore[assignment]
            if not isinstance(db, _NotConnected):  # (its connection was counted out when idle closed it)
                disconnected(self._identity)
        self._release_guard()  # after the connection: its close must still find the guard (_guard_log)
        if self._database_fd >= 0:
            close_beside(self._database_fd, self._identity)
            self._database_fd = -1

    def _close_files(self) -> None:
        """What the store opened beside its connection: the sync thread, the log's, the probe's and the index's
        descriptors (not ``_database_fd``, which holds the guard's lock)."""
        if self._sync_thread is not None:
            self._sync_thread.close()  # first: it may be syncing the log's descriptor closed below
            self._sync_thread = None
        if self._wal_fd >= 0:
            os.close(self._wal_fd)  # the log: SQLite holds no lock on it
        for fd in (self._probe_fd, self._index_fd):  # the database file, its -shm
            if fd >= 0:
                close_beside(fd, self._identity)
        self._wal_fd = self._probe_fd = self._index_fd = -1

    def idle(self) -> None:
        if not os.path.lexists(unsynced_mark(self._real)) and not isinstance(self._db, _NotConnected):
            # A reader left running (status --watch, logs -f) kept showing a file deleted or replaced under
            # it, for ever: one stat a look says so (StoreGone), as the contract asks.
            self.check_still_there()
            if self._guarded_for_mark:  # another process rewrote the log since (it removes the mark after)
                self._log_suspect = self._guarded_for_mark = False
                self._unguard_log()
            return
        # A handle opened before the failure holds SQLite's index of the log as it was then, frames the kernel
        # may have dropped since included: the next worker would find them and stop again (status 75), for
        # as long as this connection stays open. So let go of it, and open again: the first connection to open
        # after every other one let go rebuilds the index from the file.
        try:
            found = self._file_identity()
        except OSError:
            return  # cannot look right now: keep this connection rather than open what may not be the store
        if found != self._identity:
            raise self._gone(found)
        if not self._guarded:  # first, so that the close below cannot checkpoint (see _guard_log)
            self._hold_off_checkpoint_on_close()  # on the descriptor opened with the store: nothing to open now
        from urllib.parse import quote

        self._close_files()
        db, self._db = self._db, _NotConnected("it is being opened again")  # type: ignore[assignment]
        db.close()
        disconnected(self._identity)
        self._log_lost = None  # that connection's view of the log went with it
        try:
            # mode=rw: should the file go in the meantime, SQLite must not create an empty one in its place.
            self._connect(_read_only_location(self._where) if self._read_only_fs
                          else "file:" + quote(self._where) + "?mode=rw", create=False, upgrade=False)
        except StoreError as e:
            self._db = _NotConnected(str(e))  # type: ignore[assignment]
            raise
        if not self._log_suspect:
            self._log_suspect = self._guarded_for_mark = True
        self._db.execute("PRAGMA wal_autocheckpoint = 0")

    _read_only_fs = False  # the store's file system is mounted read-only: opened to read only (__init__)
    _identity: tuple[int, int] | None = None  # the database file's device and inode (check_still_there, sqlite_locks)
    _wal_fd = -1  # the write-ahead log, opened at the first sync (it exists once anything was committed)
    _sync_thread: Any = None  # a SyncThread, made when a worker asks for sync_ahead_fd

    _probing = True  # False once the store's filesystem turned out to take no journal probe (_vouch)
    _probe_fd = -1  # the database file, opened for writing at the first probe (nothing is written through it)

    def _sync(self) -> None:
        try:
            os.fdatasync(self._wal())
        except OSError as e:
            raise self._sync_error(e) from None
        self._vouch()

    # A sync of the log failed (or SQLite's own, at a commit): until ``_rewrite_log`` has run, no later sync
    # vouches for anything. See there.
    _log_suspect = False
    # Set (to what is wrong) once the log turned out to have lost pages in memory: see ``_lose_log``.
    _log_lost: str | None = None
    _guarded = False  # _database_fd holds the guard's lock (_guard_log)
    _database_fd = -1  # the database file, opened with the store, for the guard and the rewrite (see _database)
    _index_fd = -1  # its -shm, opened at the first read-back
    _guarded_for_mark = False  # suspect for the mark another process left alone, no failure of our own

    def _suspect_log(self) -> None:
        self._guarded_for_mark = False
        if not self._log_suspect:
            self._log_suspect = True
            try:
                # O_EXCL: whatever is there already (the mark, or a FIFO, or a link planted in its place) is
                # left as it is, never opened: a FIFO would block the open, a link would create its target.
                os.close(os.open(unsynced_mark(self._real), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                                 0o600))
            except OSError:
                pass  # there already, or a disk that takes no new file at all: this process still rewrites
        self._guard_log()

    def _notice_mark(self) -> None:
        """Suspect the log when another process left the mark (``unsynced_mark``)."""
        if not self._log_suspect and os.path.lexists(unsynced_mark(self._real)):
            self._log_suspect = self._guarded_for_mark = True
            self._guard_log()

    def _guard_log(self) -> None:
        """While the log is suspect, no checkpoint may copy it into the database before ``_rewrite_log``
        has read it back whole: a page the failed sync did not write, once the kernel drops it, reads back
        as what the disk holds there, and a checkpoint would write that over the database's page. Two
        checkpoints run without being asked: this connection's automatic one (after a commit that grows the
        log past 1,000 pages), turned off here; and the one SQLite makes when the last connection to the
        store closes (any process's: the worker's own, ``onward status`` after it), which needs the
        database file's exclusive lock. A read lock on that file's shared-lock bytes, as another reader's
        would be, keeps it from getting it (``hold_off_checkpoint_on_close``); it goes with this store's
        close, or the process's end. A store opened before another process's sync failed takes it at its
        close, should the mark be there by then. (``fcntl``, which the lock is taken with, is imported with
        this module: ``sqlite_locks`` imports it only when first needed, for `onward status`'s start-up, and
        loading a C extension takes a descriptor, which a sync failed for want of one cannot count on.)"""
        if self._guarded:
            return
        try:
            self._db.execute("PRAGMA wal_autocheckpoint = 0")
        except sqlite3.Error:
            pass  # the rewrite reads the log back before its own checkpoint whatever happens here
        self._hold_off_checkpoint_on_close()  # on the descriptor opened with the store: nothing to open now

    def _hold_off_checkpoint_on_close(self) -> None:
        lock_shared_bytes(self._database())
        self._guarded = True

    def _database(self) -> int:
        """A descriptor of the database file, opened with the store (``OSError`` if it cannot be): closed only
        with the store, the way ``sqlite_locks`` says."""
        if self._database_fd < 0:
            self._database_fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        return self._database_fd

    def _unguard_log(self) -> None:
        self._db.execute(f"PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES}")
        self._release_guard()

    def _index_descriptor(self) -> int | None:
        """The log's index (``-shm``), opened once while this connection lasts; None when there is none."""
        if self._index_fd < 0:
            try:
                self._index_fd = os.open(self._real + "-shm", os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
        return self._index_fd

    def _release_guard(self) -> None:
        if self._guarded:
            unlock(self._database_fd)
            self._guarded = False

    def _lose_log(self, damage: str) -> StoreLogLost:
        """The log lost pages in memory: ``damage`` says where. Nothing of it may be checkpointed, and this
        process cannot make SQLite forget the frames it indexed, so the worker stops (``check_still_there``
        raises this, exit status 75): SQLite's recovery, at the next open by a process that finds no other
        using the store, reads the log up to the first frame that does not check out. Every commit before
        that frame is kept; none after it was reported (nothing is vouched for while the log is suspect)."""
        self._log_lost = damage
        return StoreLogLost(
            f"store {self.path}: pages of its write-ahead log that a failed write did not put on the disk were "
            f"dropped from memory ({damage}); stopping without writing the log into the database, so that the "
            "next start recovers it up to them (no completion after them was reported). Start the worker again "
            "once no other process has the store open")

    def _vouch(self) -> None:
        """After a sync of the log returned (ours, or SQLite's at a durable commit): check that the store's
        filesystem still takes a journal transaction. ext4 can acknowledge an fdatasync in the moment
        between its journal aborting and its refusing writes, and lose what the sync was to keep; a
        transaction started now finds such an abort (see journal_probe in _syncthread.c). Asked through
        the database file, not the log: the log and the database are in one folder, so on one filesystem.
        After a failed sync, the log is first rewritten into the database (``_rewrite_log``)."""
        if self._log_suspect:
            self._rewrite_log()
        probe_fd = self._probe_target()
        if probe_fd < 0:
            return
        try:
            self._probing = journal_probe(probe_fd)
        except OSError as e:
            raise self._sync_error(e) from None

    def _rewrite_log(self) -> None:
        """Copy every commit in the log into the database file, sync that, and empty the log; only then may
        a sync vouch for anything again. Why: when the disk fails to write some of the log's pages, the
        failed sync says so once, and the kernel marks those pages clean: they are in memory (every reader
        sees them) but not on the disk, and no later sync writes them again. Worse, ext4 leaves the blocks
        it had allocated for them "unwritten" (dmesg: "failed to convert unwritten extents"), so even
        writing the same bytes there again, and syncing, reads back as zeros after a power cut. SQLite's
        recovery stops at the first frame of the log that does not check out: every commit after the hole,
        synced or not, would be lost, reported completions with them (``tests/crash/test_power_cut.py``
        showed 32 of 83). A checkpoint reads the frames from memory, writes them into the database file
        and syncs it; TRUNCATE then gives the log's blocks back, the failed ones with them. The database
        file's own pages that a checkpoint during the fault failed to write are first dropped from memory
        (they are still in the log), so that the checkpoint's writes go through a fresh mapping of their
        blocks, which ext4 then converts. Tried before every durable commit and at every vouch until it works:
        while the disk still fails, the checkpoint fails too, and nothing is vouched for.

        First the log is read back, up to the last frame the wal-index counts (``sqlite_wal.read_back``),
        inside a read transaction, so that no other writer starts the log over meanwhile. A page the kernel
        dropped since the failure reads back as what the disk holds: the checkpoint would copy that, so
        the worker stops instead (``_lose_log``). The pages read stay pinned in memory until the checkpoint
        has read them too (where the process may lock that much: see ``sqlite_wal._pinned``)."""
        if self._log_lost is not None:
            raise self._lose_log(self._log_lost)
        with ExitStack() as pinned:
            try:
                began = not self._db.in_transaction
                if began:
                    self._db.execute("BEGIN")
                try:
                    self._db.execute("PRAGMA schema_version").fetchone()  # starts the read transaction
                    damage = pinned.enter_context(read_back(self._real, self._index_descriptor()))
                finally:
                    if began:
                        self._db.execute("COMMIT")
            except OSError as e:
                raise self._sync_error(e) from None
            except sqlite3.Error as e:
                raise self._translate_error(e) from None
            if damage is not None:
                raise self._lose_log(damage)
            self._checkpoint_log()
        self._log_suspect = self._guarded_for_mark = False
        self._unguard_log()
        try:
            os.unlink(unsynced_mark(self._real))
        except OSError:
            pass  # gone already (another worker's rewrite), or left: the next open only rewrites once more

    def _checkpoint_log(self) -> None:
        try:
            os.posix_fadvise(self._database(), 0, 0, os.POSIX_FADV_DONTNEED)
            busy, _, _ = self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except OSError as e:
            raise self._sync_error(e) from None
        except sqlite3.Error as e:
            busy, why = True, one_line(str(e), 200)
        else:
            why = "another connection holds it"
        if busy:
            raise StoreUnavailable(f"store {self.path}: cannot make the last commit durable: after a failed sync, "
                                   f"its log could not be written into the database ({why})")

    def _probe_target(self) -> int:
        """The descriptor the journal probe goes through, or -1 when this filesystem takes no probe."""
        if self._probing and self._probe_fd < 0:
            try:
                self._probe_fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                raise self._sync_error(e) from None
        return self._probe_fd if self._probing else -1

    def _wal(self) -> int:
        # The log SQLite appended the crash-safe commit to: while this connection is open the file is never
        # removed or replaced (SQLite deletes it only when its last connection closes), so one descriptor
        # serves every sync. fdatasync on any descriptor of the file flushes what SQLite wrote through its own.
        if self._wal_fd < 0:
            try:
                self._wal_fd = os.open(self._real + "-wal", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise self._sync_error(e) from None
            self._notice_mark()  # a sync that failed before this descriptor was opened is not reported through it
        return self._wal_fd

    def _sync_error(self, e: OSError) -> StoreError:
        if isinstance(e, FileNotFoundError):
            self.check_still_there()  # the store was deleted under us: say so (StoreGone)
            return StoreUnavailable(f"store {self.path}: its write-ahead log {self._real}-wal is gone")
        # A failed fsync may have dropped the pages it could not write: the commits since the last sync
        # cannot be vouched for (nothing of them is reported), and no later sync vouches for anything
        # before the log was rewritten (``_rewrite_log``).
        self._suspect_log()
        return StoreUnavailable(f"store {self.path}: cannot make the last commit durable: {e.strerror}")

    def sync_ahead(self, gather: float = 0.0) -> PendingSync | None:
        if not self._sync_owed:
            return None
        if self._sync_thread is None:
            self.sync()
            return None
        wal, probe = self._wal(), self._probe_target()
        try:
            ticket = self._sync_thread.request(wal, probe, gather)
        except OSError as e:
            # Only the thread's start fails so (pthread_create: a pids cgroup or RLIMIT_NPROC used up, no
            # memory): nothing was asked of it. The sync is made here instead, as without the module; the
            # thread is tried again at the next one. It crashed the worker (BlockingIOError), its running
            # task's attempt spent by the reclaim.
            if e.errno not in RESOURCE_ERRNOS:
                raise
            self.sync()
            return None
        self._sync_owed = False
        return PendingSync(functools.partial(self._wait_for_sync, self._sync_thread, ticket),
                           functools.partial(self._sync_thread.finished, ticket))

    def _wait_for_sync(self, sync_thread: Any, ticket: int) -> None:
        try:
            sync_thread.wait(ticket)
        except OSError as e:  # the thread keeps its first failure: every later wait raises it too
            raise self._sync_error(e) from None
        except ValueError:  # closed (the store was closed meanwhile): never synced by it
            raise StoreUnavailable(f"store {self.path} was closed before its last commit was made durable") from None
        if self._log_suspect:  # SQLite's own sync failed at a commit since: the thread's cannot vouch alone
            self._vouch()

    def sync_ahead_fd(self) -> int | None:
        if SyncThread is None:
            return None
        if self._sync_thread is None:
            self._sync_thread = SyncThread(SYNC_AHEAD_LINGER)
        return int(self._sync_thread.fileno())

    def now(self) -> float:
        return time.time()

    def _file_identity(self) -> tuple[int, int] | None:
        """Device and inode of the file now at the store's path; None when there is none."""
        try:
            st = os.stat(self._where)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_dev, st.st_ino

    def check_still_there(self) -> None:
        if self._log_lost is not None:
            raise self._lose_log(self._log_lost)
        # SQLite goes on writing to the file it opened after that file was unlinked or renamed over: every
        # commit would succeed, into a file nobody will open again. Hence a look at the path itself.
        try:
            found = self._file_identity()
        except OSError:
            return  # cannot look right now (permissions, I/O): not a sign that it is gone
        if found != self._identity:
            raise self._gone(found)

    _log_seen = 0  # the log's size at the previous log_held_back

    def log_held_back(self) -> int | None:
        try:
            size = os.stat(self._real + "-wal").st_size  # (an absolute path: a task may chdir)
        except OSError:
            return None
        before, self._log_seen = self._log_seen, size
        return size if size > before and before > LOG_WARN_BYTES else None

    def _gone(self, found: tuple[int, int] | None) -> StoreGone:
        what = "was deleted" if found is None else "was replaced by another file"
        return StoreGone(f"store {self.path} {what} while this process was using it; stopping")

    def wakeup_fd(self) -> int | None:
        return None  # one file, no server to signal: idle workers poll (with backoff, at most 1 s)

    def drain_wakeups(self) -> None:
        pass

    # --- what the shared SQL layer asks of a backend -------------------------------------------------
    def _driver_error(self) -> tuple[type[BaseException], ...]:
        # A TEXT value that is not UTF-8 (a damaged page) fails in Python's decoding, not in SQLite.
        return sqlite3.Error, UnicodeDecodeError

    def _translate_error(self, e: BaseException) -> StoreError:
        error = _translate(e, self.path)
        text = str(e)
        if self._read_only_fs and ("readonly" in text or "unable to open" in text):
            # "attempt to write a readonly database", or "unable to open database file" where SQLite
            # cannot read the log without making its index: the mount, not the store or the command.
            return _read_only_error(self.path)
        if isinstance(error, CorruptStore) and self._log_suspect:
            # A page of the log the failed sync did not write, read back from the disk once the kernel dropped it:
            # the file on the disk is not damaged, the log in memory is (see _lose_log).
            return self._lose_log(f"a page read back damaged: {one_line(str(e), 200)}")
        return error

    def _exec(self, name: str, params: dict[str, Any] | None = None) -> sqlite3.Cursor:
        # Every query may name the job (:job); sqlite3 ignores the names a query does not use.
        if params is None:
            return self._db.execute(Q[name], {"job": self._job_id})
        params["job"] = self._job_id
        return self._db.execute(Q[name], params)

    def _clock(self) -> dict[str, Any]:
        return {"now": time.time()}  # self.now(), without its translation wrapper (many calls per task)

    def _key(self, name: str) -> str:
        return name

    @contextmanager
    def _transaction(self, durable: bool) -> Iterator[None]:
        self._end_leftover_transaction()  # before the pragma and the BEGIN below would run inside it
        if durable and self._log_suspect:
            # Before the commit, not at its vouch: a rewrite that fails then leaves nothing committed, and
            # the caller's retry finds its tasks as it left them (not done by a commit it was told failed).
            self._rewrite_log()
        if durable != self._durable:
            self._db.execute("PRAGMA synchronous = FULL" if durable else "PRAGMA synchronous = NORMAL")
            self._durable = durable
        changes_before = self._db.total_changes
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise
        try:
            self._db.execute("COMMIT")
        except sqlite3.Error as e:
            if getattr(e, "sqlite_errorcode", 0) & 0xFF == SQLITE_IOERR:  # its fsync, or a write, failed
                self._suspect_log()
            raise
        # A transaction that changed no row wrote no frame to the log, so SQLite synced nothing at its COMMIT:
        # there is nothing new to vouch for (no probe is owed), and it does not cover a crash-safe commit
        # before it (see SqlStore.batch).
        self._last_commit_wrote = self._db.total_changes != changes_before
        if durable and self._last_commit_wrote:
            self._vouch()  # SQLite's own sync of the log at COMMIT (synchronous=FULL)

    def _end_leftover_transaction(self) -> None:
        """Roll back a transaction an earlier one left open: its COMMIT or ROLLBACK raised something other than
        SQLite's errors (a MemoryError, out of memory while a task held it all), and its caller was told it
        failed. Left open, it failed every later BEGIN ("cannot start a transaction within a transaction")."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _on_its_own(self, name: str, params: dict[str, Any]) -> list[Any]:
        with self._write():
            return self._exec(name, params).fetchall()

    def _insert_events(self, events: Sequence[JournalRow]) -> None:
        for start in range(0, len(events), EVENTS_PER_INSERT):
            chunk = events[start:start + EVENTS_PER_INSERT]
            self._db.execute(_events_sql(len(chunk)), [
                value for e in chunk
                for value in (self._job_id, e.at, e.kind, e.pid, e.host, e.worker_id, e.task_id, e.attempt, e.detail)])

    def _apply_stall_bound(self) -> None:
        # SQLite's one lock wait: for the write lock, held by another connection's transaction.
        self._db.execute(f"PRAGMA busy_timeout = {self._stall_ms}")

    # --- tasks ---------------------------------------------------------------------------------------
    def add(self, names: Iterable[str]) -> int:
        now = self.now()
        with self._write():
            before = self._db.total_changes
            self._db.executemany(Q["add_task"], ({"name": name, "now": now, "job": self._job_id} for name in names))
            added = self._db.total_changes - before
            # Counted once here rather than by an insert trigger: a million-line import stays one pass.
            if added:
                self._exec("count_added", {"added": added})
                self._journal("added", detail=added_message(added))
        return added

    def renew(self, worker_id: int, leases: Sequence[Lease], lease_seconds: float, completed: int) -> list[int]:
        self._set_lease(lease_seconds)
        now = self.now()
        lost: list[int] = []
        with self._write(durable=False):
            for lease in leases:
                progress_at = None if lease.progress_age is None else now - lease.progress_age
                cur = self._exec("renew", {"now": now, "lease": lease_seconds, "progress_at": progress_at,
                                           "note": lease.note, "task_id": lease.task_id, "fence": lease.fence})
                if cur.rowcount == 0:
                    lost.append(lease.task_id)
            self._exec("worker_beat", {"now": now, "completed": completed, "worker_id": worker_id})
        return lost

    def _complete_and_claim_straight(self, done: Claim, result: bytes, kind: str, worker_id: int, limit: int,
                                     lease_seconds: float, max_attempts: int, durable: bool,
                                     child: tuple[int, int] | None, alone: bool) -> tuple[bool, list[Claim]]:
        # One transaction of three statements (complete, claim, the journal's rows), without the layers of the
        # batch's way (its nesting, its buffered journal, a method and a translation per write): no-op tasks,
        # 20,000, about 420 -> 360 us a task.
        self._set_lease(lease_seconds)
        now, job, db = time.time(), self._job_id, self._db
        with self._transaction(durable):
            completed = db.execute(Q["complete"], {
                "now": now, "result": result, "kind": kind, "task_id": done.task_id, "fence": done.fence,
                "job": job}).rowcount == 1
            # Refused: done already under this fence (an earlier commit of this completion landed, and
            # journaled it), or fenced out.
            earlier = not completed and db.execute(Q["settled_under"], {
                "task_id": done.task_id, "fence": done.fence}).fetchone() == (DONE,)
            rows = db.execute(Q["claim"], {
                "now": now, "worker_id": worker_id, "lease": lease_seconds, "limit": limit,
                "max_attempts": max_attempts, "child_pid": child[0] if child else None,
                "child_start": child[1] if child else None, "job": job, "alone": alone}).fetchall() if limit > 0 else []
            rows.sort()  # RETURNING gives no order guarantee; hand tasks out in the order they were added
            pid, host = os.getpid(), hostname()
            journal = [] if earlier else [job, now, "done" if completed else "fenced", pid, host, worker_id,
                                          done.task_id, done.attempt, None if completed else FENCED_DETAIL]
            for row in rows:
                journal += [job, now, "claimed", pid, host, worker_id, row[0], row[2], None]
            if journal:
                db.execute(_events_sql(len(rows) + (not earlier)), journal)
        self._note_commit(durable)  # as after a batch
        claims = [Claim(task_id=r[0], name=r[1], attempt=r[2], fence=r[3], max_attempts=r[4], alone=bool(r[5]))
                  for r in rows]
        if child is not None and claims:
            claims[0] = claims[0]._replace(child_pid=child[0])
        return completed or earlier, claims

    def complete(self, task_id: int, fence: int, result: bytes, kind: str) -> bool:
        with self._write():
            cur = self._exec("complete", {"now": self.now(), "result": result, "kind": kind, "task_id": task_id,
                                          "fence": fence})
        return cur.rowcount == 1

    def retry(self, names: Sequence[str] | None, by: str | None = None) -> int:
        with self._write():
            if names is None:
                changed = len(self._exec("retry_failed").fetchall())
            else:
                changed = sum(len(self._exec("retry_one", {"name": n}).fetchall()) for n in names)
            self._journal_retried(changed, by)
        return changed

    # --- reading -------------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        return dict(self._exec("counts").fetchall())  # every state has its row (create_job_counts)

    def stats(self) -> Stats:
        # One read transaction, so the numbers agree with each other.
        self._end_leftover_transaction()
        self._db.execute("BEGIN")
        try:
            now = self.now()
            counts = self.counts()
            running = self.running_tasks()
            workers = self.workers()
            last_id = self._exec("last_event_id").fetchone()[0]
            since = self._first_event_at_or_after(now - 60.0, last_id)
            done_last_minute = self._exec("count_done_since", {"since": now - 60.0, "cap": RATE_SAMPLE}).fetchone()[0]
            first = self._exec("event_time", {"id": since}).fetchone()
            # A job younger than a minute is measured over its own age, not diluted over 60 s.
            window = min(60.0, max(1.0, now - first[0])) if first else 60.0
            if done_last_minute >= RATE_SAMPLE:
                # Faster than RATE_SAMPLE a minute: measured over its latest RATE_SAMPLE completions instead,
                # so that a refresh never counts hundreds of thousands of index entries.
                oldest = self._exec("done_at_rank", {"rank": RATE_SAMPLE - 1}).fetchone()[0]
                window = max(0.001, now - oldest)
            errors = [event_of(r) for r in self._exec("recent_errors", {"limit": 5})]
            restarts = self._exec("count_restarts").fetchone()[0]
            paused = self.paused()
        finally:
            self._db.execute("COMMIT")
        return Stats(counts=counts, running_tasks=running, workers=workers, errors=errors,
                     done_last_minute=done_last_minute, restarts=restarts, rate_window=window, paused=paused)

    def _first_event_at_or_after(self, at: float, last_id: int) -> int:
        """Binary search on the rowid: events are appended in time order, so no index on time is needed
        (which would cost every completion an index insert)."""
        lo, hi = 1, last_id + 1
        while lo < hi:
            mid = (lo + hi) // 2
            row = self._exec("event_time", {"id": mid}).fetchone()
            if row is None or row[0] < at:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def events(self, after_id: int = 0, task: str | None = None, limit: int = 1000,
               last: int | None = None) -> list[Event]:
        if task is None:
            if last is not None:
                rows = self._exec("events_last", {"limit": last}).fetchall()[::-1]
                rows = [r for r in rows if r[0] > after_id]
            else:
                rows = self._exec("events_after", {"after": after_id, "limit": limit}).fetchall()
        else:
            rows = self._exec("events_after_for_task", {"after": after_id, "key": task, "limit": limit}).fetchall()
            if last is not None:
                rows = rows[-last:]
        return [event_of(r) for r in rows]

    # --- durable steps -------------------------------------------------------------------------------
    def record_step(self, task_id: int, fence: int, step: StepRecord) -> bool:
        with self._write():
            if self._exec("step_progress", {"task_id": task_id, "fence": fence, "idx": step.index}).rowcount != 1:
                return False  # fenced out
            self._exec("record_step", {"task_id": task_id, "idx": step.index, "name": step.name, "kind": step.kind,
                                       "data": step.data, "at": step.at})
        return True

    def drop_steps(self, task_id: int, fence: int, from_index: int) -> bool:
        with self._write():
            self._exec("drop_steps", {"task_id": task_id, "fence": fence, "from_idx": from_index})
            return self.holds(task_id, fence)

    # --- maintenance ---------------------------------------------------------------------------------
    def integrity_check(self) -> str:
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])


def exists(url: str) -> bool:
    """Whether something is at the store's path that opening without ``create`` should look at: not for a
    missing file, nor for an empty one (a store whose creation was cut short: opening would initialise it);
    anything else is opened, and refused there if it is not a store."""
    try:
        st = os.stat(path_from_url(url))
    except FileNotFoundError:
        return False
    except OSError:
        return True  # something is wrong there: opening it says what
    return not (stat.S_ISREG(st.st_mode) and st.st_size == 0)


def upgrade(url: str) -> tuple[int, int]:
    """``onward db upgrade``: create the store, or bring its schema to this onward's version. Returns the
    versions before (0: there was no store) and after. Refuses a newer store (``SchemaTooNew``)."""
    store = SqliteStore(url, upgrade=True, job=NO_JOB)  # (an upgrade makes no job, as PostgreSQL's makes none)
    store.close()
    return store.upgraded_from, SCHEMA_VERSION


def _split_statements(script: str) -> list[str]:
    """Split the schema into statements, keeping trigger bodies (which hold ';') whole."""
    statements, current = [], []
    for line in script.splitlines():
        current.append(line)
        text = "\n".join(current).strip()
        if text and sqlite3.complete_statement(text):
            statements.append(text)
            current = []
    return statements


@functools.lru_cache(maxsize=64)
def _events_sql(n: int) -> str:
    """The journal insert for ``n`` events, its values in the order of ``_insert_events``."""
    return Q["log_events"].replace("{rows}", ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?, ?)"] * n))


__all__ = ["SqliteStore", "SCHEMA_VERSION", "upgrade", "exists", "path_from_url"]
