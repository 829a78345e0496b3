"""The embedded store: one SQLite file in WAL mode, every completion durable (synchronous=FULL).

Why these settings:
- WAL: readers (``onward status``) never block the worker, and a commit is one append plus one fsync of
  the log instead of rewriting pages in place.
- ``synchronous=FULL``: in WAL mode, NORMAL only fsyncs at checkpoints, so a power cut could lose the
  last completions; FULL fsyncs the log at every commit, which is what "a committed completion is never
  run again" needs. Writes that only have to survive the *process* (lease renewals, the child's pid, the
  journal) switch the connection to NORMAL for that one transaction: they reach the OS page cache, which a
  ``kill -9`` does not lose, and the next FULL commit's fsync covers them too, since the log is sequential.
- ``BEGIN IMMEDIATE`` for every write: the write lock is taken up front, so two workers never deadlock
  upgrading read locks, and ``busy_timeout`` makes the other wait instead of failing.
"""

from __future__ import annotations

import functools
import inspect
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from ..errors import CorruptStore, NotAStore, SchemaTooNew, SchemaTooOld, StoreError, StoreGone, StoreMissing
from ..proc import hostname
from .base import (
    PENDING,
    Claim,
    Event,
    Lease,
    Owner,
    Reclaimed,
    RunningTask,
    SourceMark,
    Stats,
    StepRecord,
    StoredResult,
    TaskRow,
    WorkerRow,
)
from .rows import event_of, running_task_of, step_of, worker_of
from .sql import load_queries, migration

SCHEMA_VERSION = 2
SQLITE_MAGIC = b"SQLite format 3\x00"
BUSY_TIMEOUT_MS = 30_000
Q = load_queries("sqlite.sql")
T = TypeVar("T")


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
        raise StoreError(f"cannot read store {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise NotAStore(f"not an onward store: {path} is a directory")
    if not stat.S_ISREG(st.st_mode):
        raise NotAStore(f"not an onward store: {path} is not a regular file")
    return True


def _check_header(path: str) -> None:
    """Refuse any existing file that is not an SQLite database, before SQLite gets to touch it."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except IsADirectoryError:
        raise NotAStore(f"not an onward store: {path} is a directory") from None
    except OSError as e:
        raise StoreError(f"cannot read store {path}: {e.strerror}") from None
    # An empty file holds nothing to lose (e.g. a store whose creation was interrupted): it is initialised.
    if head and head != SQLITE_MAGIC:
        raise NotAStore(f"not an onward store: {path} is not an SQLite database")


def _translate(e: sqlite3.Error, path: str) -> StoreError:
    text = str(e)
    if "malformed" in text or "not a database" in text or "corrupt" in text:
        return CorruptStore(f"store {path} is corrupt ({text}); it was left untouched")
    if "readonly" in text or "read-only" in text:
        return StoreError(f"store {path} is read-only ({text})")
    if "disk is full" in text or "disk I/O" in text:
        return StoreError(f"store {path}: {text}")
    return StoreError(f"store {path}: {text}")


def _translating(method: Callable[..., Any]) -> Callable[..., Any]:
    """The method, raising ``StoreError`` instead of a bare sqlite3 error; a generator (``iter_tasks``) is
    translated for as long as it is iterated, since its reads happen then, not when it is called."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def generator(self: SqliteStore, *args: Any, **kwargs: Any) -> Iterator[Any]:
            try:
                yield from method(self, *args, **kwargs)
            except sqlite3.Error as e:
                raise _translate(e, self.path) from None
        return generator

    @functools.wraps(method)
    def wrapper(self: SqliteStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as e:
            raise _translate(e, self.path) from None
    return wrapper


def _translating_every_method(cls: type[T]) -> type[T]:
    """Apply ``_translating`` to every public method of the class: applied to the class as a whole, so a
    method added later cannot be left out (writes are translated in ``_write`` as well)."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(member):
            setattr(cls, name, _translating(member))
    return cls


@_translating_every_method
class SqliteStore:
    """``Store`` on one SQLite file. One instance is one connection: use it from one thread."""

    def __init__(self, url: str, *, create: bool = True, upgrade: bool = False) -> None:
        self.path = path_from_url(url)
        self.url = self.path
        self._batch_depth = 0
        exists = _check_regular_file(self.path)
        if not exists and not create:
            raise StoreMissing(f"no onward store at {self.path}")
        if exists:
            _check_header(self.path)
        else:
            self._create_file()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as e:
            raise _translate(e, self.path) from None
        try:
            # Identify the file before changing anything in it (switching to WAL rewrites its header).
            self._db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            self._schema_version()
            self._configure()
            self._ensure_schema(upgrade)
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise _translate(e, self.path) from None
        except StoreError:
            self._db.close()
            raise
        # The file just opened, to notice later that it was deleted or replaced (see check_still_there).
        self._where = os.path.abspath(self.path)
        self._identity = self._file_identity()

    # --- opening -------------------------------------------------------------------------------------
    def _create_file(self) -> None:
        parent = Path(self.path).parent
        if not parent.exists():
            try:
                os.makedirs(parent, mode=0o700, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create folder {parent}: {e.strerror}") from None
        try:
            # Create it ourselves, private from the first byte; SQLite gives the -wal and -shm files the
            # same mode as the database file.
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
            os.close(fd)
        except FileExistsError:
            _check_header(self.path)  # another worker created it first
        except OSError as e:
            raise StoreError(f"cannot create store {self.path}: {e.strerror}") from None

    def _configure(self) -> None:
        mode = self._db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":
            raise StoreError(f"store {self.path}: cannot switch to WAL mode (got {mode})")
        self._db.execute("PRAGMA synchronous = FULL")
        self._db.execute("PRAGMA foreign_keys = OFF")
        # The journal and task rows are appended in order; a bigger cache keeps status and claims hot.
        self._db.execute("PRAGMA cache_size = -16000")
        self._durable = True

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
                    for target in range(self.upgraded_from + 1, SCHEMA_VERSION + 1):
                        for statement in _split_statements(migration(Q, target)):
                            self._db.execute(statement)
                    self._db.execute(Q["set_meta"], (str(SCHEMA_VERSION),))
                    version = SCHEMA_VERSION
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"store {self.path} has schema version {version}, newer than this onward's {SCHEMA_VERSION};"
                " upgrade onward"
            )
        if version < SCHEMA_VERSION:
            raise SchemaTooOld(f"store {self.path} has schema version {version}; run `onward db upgrade`")

    def _schema_version(self) -> int | None:
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables:
            return None
        if "meta" not in tables:
            raise NotAStore(f"not an onward store: {self.path} is another SQLite database")
        rows = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN ('app', 'schema_version')"))
        if rows.get("app") != "onward" or "schema_version" not in rows:
            raise NotAStore(f"not an onward store: {self.path} is another SQLite database")
        return int(rows["schema_version"])

    def close(self) -> None:
        db = getattr(self, "_db", None)
        if db is not None:
            db.close()
            self._db = None  # type: ignore[assignment]

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
        # SQLite goes on writing to the file it opened after that file was unlinked or renamed over: every
        # commit would succeed, into a file nobody will open again. Hence a look at the path itself.
        try:
            found = self._file_identity()
        except OSError:
            return  # cannot look right now (permissions, I/O): not a sign that it is gone
        if found != self._identity:
            what = "was deleted" if found is None else "was replaced by another file"
            raise StoreGone(f"store {self.path} {what} while this worker was using it; stopping")

    def wakeup_fd(self) -> int | None:
        return None  # one file, no server to signal: idle workers poll (with backoff, at most 1 s)

    def drain_wakeups(self) -> None:
        pass

    # --- transactions --------------------------------------------------------------------------------
    @contextmanager
    def _write(self, durable: bool = True) -> Iterator[None]:
        """One write transaction, unless a batch is open (then its commit covers this write)."""
        if self._batch_depth:
            yield
            return
        try:
            if not durable:
                self._db.execute("PRAGMA synchronous = NORMAL")
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            finally:
                if not durable:
                    self._db.execute("PRAGMA synchronous = FULL")
        except sqlite3.Error as e:
            raise _translate(e, self.path) from None

    @contextmanager
    def batch(self) -> Iterator[None]:
        if self._batch_depth:
            self._batch_depth += 1
            try:
                yield
            finally:
                self._batch_depth -= 1
            return
        with self._write():
            self._batch_depth = 1
            try:
                yield
            finally:
                self._batch_depth = 0

    # --- tasks ---------------------------------------------------------------------------------------
    def add(self, names: Iterable[str]) -> int:
        now = self.now()
        with self._write():
            before = self._db.total_changes
            self._db.executemany(Q["add_task"], ((name, now) for name in names))
            added = self._db.total_changes - before
            # Counted once here rather than by an insert trigger: a million-line import stays one pass.
            if added:
                self._db.execute(Q["count_added"], (added,))
                self._db.execute(Q["log_event"], (now, "added", os.getpid(), hostname(), None, None, None,
                                                  f"{added} new task{'s' if added != 1 else ''}"))
        return added

    def get_source(self, path_key: str) -> SourceMark | None:
        row = self._db.execute(Q["get_source"], (path_key,)).fetchone()
        return SourceMark(*row) if row else None

    def set_source(self, path_key: str, mark: SourceMark) -> None:
        with self._write():
            self._db.execute(
                Q["set_source"],
                (path_key, mark.identity, mark.size, mark.lines, mark.mtime_ns, mark.head_digest,
                 mark.tail_digest),
            )

    def claim(self, worker_id: int, limit: int, lease_seconds: float, max_attempts: int) -> list[Claim]:
        params = {"worker_id": worker_id, "now": self.now(), "lease": lease_seconds, "limit": limit,
                  "max_attempts": max_attempts}
        with self._write():
            rows = self._db.execute(Q["claim"], params).fetchall()
        rows.sort()  # RETURNING gives no order guarantee; hand tasks out in the order they were added
        return [Claim(task_id=r[0], name=r[1], attempt=r[2], fence=r[3], max_attempts=r[4]) for r in rows]

    def renew(self, worker_id: int, leases: Sequence[Lease], lease_seconds: float, completed: int) -> list[int]:
        now = self.now()
        lost: list[int] = []
        with self._write(durable=False):
            for lease in leases:
                progress_at = None if lease.progress_age is None else now - lease.progress_age
                cur = self._db.execute(
                    Q["renew"],
                    {"now": now, "lease": lease_seconds, "progress_at": progress_at, "note": lease.note,
                     "task_id": lease.task_id, "fence": lease.fence},
                )
                if cur.rowcount == 0:
                    lost.append(lease.task_id)
            self._db.execute(Q["worker_beat"], (now, completed, worker_id))
        return lost

    def note_child(self, task_id: int, fence: int, child_pid: int, child_start: int) -> None:
        with self._write(durable=False):
            self._db.execute(Q["note_child"], (child_pid, child_start, task_id, fence))

    def complete(self, task_id: int, fence: int, result: bytes, kind: str) -> bool:
        with self._write():
            cur = self._db.execute(
                Q["complete"],
                {"now": self.now(), "result": result, "kind": kind, "task_id": task_id, "fence": fence},
            )
        return cur.rowcount == 1

    def fail(self, task_id: int, fence: int, error: str, retry_delay: float) -> str | None:
        with self._write():
            row = self._db.execute(
                Q["fail"],
                {"now": self.now(), "delay": retry_delay, "error": error, "task_id": task_id, "fence": fence},
            ).fetchone()
        return row[0] if row else None

    def release(self, task_id: int, fence: int, reason: str) -> bool:
        with self._write():
            row = self._db.execute(Q["release"], {"task_id": task_id, "fence": fence}).fetchone()
        return row is not None

    def running(self) -> list[RunningTask]:
        rows = self._db.execute(Q["running"], {"now": self.now()}).fetchall()
        return sorted((running_task_of(r) for r in rows), key=lambda t: t.task_id)

    def reclaim(self, task_id: int, fence: int, reason: str) -> Reclaimed | None:
        with self._write():
            row = self._db.execute(
                Q["reclaim"], {"now": self.now(), "reason": reason, "task_id": task_id, "fence": fence}
            ).fetchone()
        return Reclaimed(state=row[0], counted=bool(row[1])) if row else None

    def retry(self, names: Sequence[str] | None) -> int:
        with self._write():
            if names is None:
                return len(self._db.execute(Q["retry_failed"]).fetchall())
            return sum(len(self._db.execute(Q["retry_one"], (n,)).fetchall()) for n in names)

    # --- reading -------------------------------------------------------------------------------------
    def task(self, name: str) -> TaskRow | None:
        row = self._db.execute(Q["task"], (name,)).fetchone()
        return TaskRow(*row) if row else None

    def task_id(self, name: str) -> int | None:
        row = self._db.execute(Q["task_id"], (name,)).fetchone()
        return row[0] if row else None

    def result(self, name: str) -> StoredResult | None:
        row = self._db.execute(Q["result"], (name,)).fetchone()
        return StoredResult(kind=row[0], data=bytes(row[1])) if row else None

    def iter_tasks(self, state: str | None = None) -> Iterator[TaskRow]:
        # Pages by id rather than holding one cursor open: a long listing never pins an old WAL snapshot.
        after = 0
        while True:
            if state is None:
                rows = self._db.execute(Q["iter_tasks"], (after, 1000)).fetchall()
            else:
                rows = self._db.execute(Q["iter_tasks_in_state"], (after, state, 1000)).fetchall()
            if not rows:
                return
            for r in rows:
                yield TaskRow(*r[1:])
            after = rows[-1][0]

    def counts(self) -> dict[str, int]:
        return dict(self._db.execute(Q["counts"]).fetchall())

    def stats(self) -> Stats:
        # One read transaction, so the numbers agree with each other.
        self._db.execute("BEGIN")
        try:
            now = self.now()
            counts = self.counts()
            running = self.running()
            workers = self.workers()
            last_id = self._db.execute(Q["last_event_id"]).fetchone()[0]
            since = self._first_event_at_or_after(now - 60.0, last_id)
            done_last_minute = self._db.execute(Q["count_done_since_event"], (since,)).fetchone()[0]
            first = self._db.execute(Q["event_time"], (since,)).fetchone()
            # A job younger than a minute is measured over its own age, not diluted over 60 s.
            window = min(60.0, max(1.0, now - first[0])) if first else 60.0
            errors = [event_of(r) for r in self._db.execute(Q["recent_errors"], (5,))]
            restarts = self._db.execute(Q["count_restarts"]).fetchone()[0]
        finally:
            self._db.execute("COMMIT")
        return Stats(counts=counts, running=running, workers=workers, errors=errors,
                     done_last_minute=done_last_minute, restarts=restarts, rate_window=window)

    def _first_event_at_or_after(self, at: float, last_id: int) -> int:
        """Binary search on the rowid: events are appended in time order, so no index on time is needed
        (which would cost every completion an index insert)."""
        lo, hi = 1, last_id + 1
        while lo < hi:
            mid = (lo + hi) // 2
            row = self._db.execute(Q["event_time"], (mid,)).fetchone()
            if row is None or row[0] < at:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def workers(self) -> list[WorkerRow]:
        return [
            worker_of(r)
            for r in self._db.execute(Q["live_workers"], {"now": self.now()})
        ]

    # --- workers and the journal ---------------------------------------------------------------------
    def register_worker(self, owner: Owner, detail: str) -> int:
        now = self.now()
        with self._write():
            worker_id = self._db.execute(
                Q["register_worker"], (owner.host, owner.host_key, owner.pid, owner.pid_start, now, now, detail)
            ).fetchone()[0]
            self._db.execute(Q["log_event"], (now, "worker started", owner.pid, owner.host, worker_id, None,
                                              None, detail))
        return int(worker_id)

    def worker_stopped(self, worker_id: int, reason: str) -> None:
        now = self.now()
        with self._write():
            self._db.execute(Q["worker_stopped"], (now, reason, worker_id))
            self._db.execute(Q["log_event"], (now, "worker stopped", os.getpid(), hostname(), worker_id,
                                              None, None, reason))

    def log_event(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                  attempt: int | None = None, detail: str | None = None, durable: bool = False) -> None:
        with self._write(durable=durable):
            self._db.execute(Q["log_event"], (self.now(), kind, os.getpid(), hostname(), worker_id, task_id,
                                              attempt, detail))

    def events(self, after_id: int = 0, task: str | None = None, limit: int = 1000,
               last: int | None = None) -> list[Event]:
        if last is not None:
            last_id = self._db.execute(Q["last_event_id"]).fetchone()[0]
            after_id = max(after_id, last_id - last) if task is None else after_id
        if task is None:
            rows = self._db.execute(Q["events_after"], (after_id, limit)).fetchall()
        else:
            rows = self._db.execute(Q["events_after_for_task"], (after_id, task, limit)).fetchall()
            if last is not None:
                rows = rows[-last:]
        return [event_of(r) for r in rows]

    # --- durable steps -------------------------------------------------------------------------------
    def steps(self, task_id: int) -> list[StepRecord]:
        return [step_of(r) for r in self._db.execute(Q["steps"], (task_id,))]

    def record_step(self, task_id: int, fence: int, step: StepRecord) -> bool:
        with self._write():
            if self._db.execute(Q["step_progress"], {"task_id": task_id, "fence": fence, "idx": step.index}
                                ).rowcount != 1:
                return False  # fenced out
            self._db.execute(
                Q["record_step"],
                {"task_id": task_id, "idx": step.index, "name": step.name, "kind": step.kind, "data": step.data,
                 "at": step.at},
            )
        return True

    def drop_steps(self, task_id: int, fence: int, from_index: int) -> bool:
        with self._write():
            self._db.execute(Q["drop_steps"], {"task_id": task_id, "fence": fence, "from_idx": from_index})
            return self._db.execute(Q["fence_holds"], (task_id, fence)).fetchone() is not None

    # --- maintenance ---------------------------------------------------------------------------------
    def integrity_check(self) -> str:
        return str(self._db.execute("PRAGMA integrity_check").fetchone()[0])


def upgrade(url: str) -> tuple[int, int]:
    """``onward db upgrade``: create the store, or bring its schema to this onward's version. Returns the
    versions before (0: there was no store) and after. Refuses a newer store (``SchemaTooNew``)."""
    store = SqliteStore(url, upgrade=True)
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


__all__ = ["SqliteStore", "SCHEMA_VERSION", "PENDING", "upgrade"]
