"""The shared store: PostgreSQL, for many workers on many machines (``--db postgresql://…``).

Same contract and semantics as the SQLite store (base.py); what differs, and why:

- **The server's clock.** Every time (leases, retry readiness, heartbeats, the journal) is taken in SQL
  from the server (``onward.epoch()`` = ``now()``); workers' clocks are never compared with each other.
- **Claims with ``FOR UPDATE SKIP LOCKED``.** Claiming workers lock different rows instead of queueing on
  the same ones, and the state of a locked row is re-checked under its lock, so two workers never hold
  one task. The fence (bumped by every claim and reclaim) guards every later write, as in SQLite.
- **Durability.** The session runs with ``synchronous_commit = on``: a durable method returns after the
  commit record is flushed on the server. Crash-safe writes (renew, note_child, the journal outside a
  batch) turn it off for their own transaction only: they survive the worker being killed (the server
  has them), not necessarily a crash of the server, and a lease only has to outlive its owner.
- **No hot rows.** Each statement that changes states appends its count deltas (see postgres.sql), so
  concurrent claims and completions never wait on one counter row, and a worker cut off mid-transaction
  stalls nobody else's commits.
- **Wake-ups.** ``add``, ``fail`` (with a retry left), ``release``, ``reclaim`` and ``retry`` NOTIFY in
  their transaction; a second connection LISTENs in a small thread that turns each notification into a
  byte on a pipe, whose read end is ``wakeup_fd()``. The thread, not the worker's loop, owns that
  connection, so the descriptor stays the same across reconnections.
- **Faults.** A call never waits long: ``TCP_USER_TIMEOUT`` and keepalives make a cut-off server an
  error, and ``lock_timeout`` a lock held by someone else, within a quarter of the lease the runner uses
  (``STALL_MS``); the server ends a transaction of ours left idle for twice that, so a worker cut off
  mid-transaction holds no lock for long. A lost connection is re-established by a background thread with
  backoff while calls fail at once with ``StoreError`` (the runner retries next turn, and fences itself
  when it cannot renew before its lease runs out). A commit whose answer was lost is ambiguous: retrying
  it is safe, because the fence refuses to complete a task twice.
- **Secrets.** ``url`` and every message hold the URL with its password replaced by ``***``; texts from
  psycopg are scrubbed of it too (they can quote the connection string); the password is also wiped from
  the process's own command line (what ``ps`` shows) as soon as the store is opened.
"""

from __future__ import annotations

import functools
import hashlib
import os
import select
import socket
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import NotAStore, SchemaTooNew, SchemaTooOld, StoreError, StoreGone, StoreMissing
from ..proc import hostname
from ..secrets import hide_secrets_in_argv, redact_url, scrub, url_secrets
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

if TYPE_CHECKING:
    import psycopg

SCHEMA_VERSION = 2
CHANNEL = "onward_work"  # LISTEN/NOTIFY channel announcing work that may be ready
APP_NAME = "onward"  # application_name of every connection (see events_bound in postgres.sql)
ADD_CHUNK = 5000  # names per INSERT when adding tasks
EVENTS_PER_INSERT = 1000  # journal rows per INSERT (7 parameters each; a statement takes at most 65535)
COMPACT_COUNTS_AFTER = 500  # delta rows in onward.counts before counts() folds them
RECONNECT_BACKOFF = (0.05, 1.0)  # first and longest wait between reconnection attempts (s)
# How long a call may be kept waiting by the network (TCP_USER_TIMEOUT) or by a row lock (lock_timeout),
# at least and at most. Tied to the lease once the runner names one (a quarter of it, see _set_lease): a
# worker loop stuck in a call for longer could not fence itself before its lease runs out.
STALL_MS = (250, 3000)
CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "1",
    "keepalives_interval": "1",
    "keepalives_count": "3",
    "tcp_user_timeout": str(STALL_MS[1]),
    "application_name": APP_NAME,
}
Q = load_queries("postgres.sql")
F = TypeVar("F")


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError:
        raise StoreError("the PostgreSQL store needs psycopg: pip install 'onward[postgres]'") from None
    return psycopg


def task_key(name: str) -> bytes:
    """The unique key of a task name (names may be up to 4 KiB, more than a btree index entry holds)."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()


# --- wake-ups ------------------------------------------------------------------------------------------
class _Listener:
    """A thread holding a LISTEN connection; each notification becomes a byte in a pipe.

    The pipe's read end never changes, so the runner can keep it in its selector while this thread
    reconnects. After every (re)connection it writes a byte too: notifications sent while it was away
    are lost, so the worker should look for work once.
    """

    def __init__(self, connect: Any, on_error: Any) -> None:
        self._connect = connect
        self._on_error = on_error
        self.read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stop_r, self._stop_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="onward-pg-listen", daemon=True)
        self._thread.start()

    def _signal(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except (BlockingIOError, OSError):
            pass  # full: a wake-up is already due

    def _run(self) -> None:
        delay = RECONNECT_BACKOFF[0]
        while not self._stopping.is_set():
            conn = None
            try:
                conn = self._connect()
                conn.execute(Q["listen_onward_work"])
                delay = RECONNECT_BACKOFF[0]
                self._signal()
                self._listen(conn)
            except Exception as e:  # psycopg.Error, OSError: the connection is gone; make another
                if not self._stopping.is_set():
                    self._on_error(e)
            finally:
                if conn is not None:
                    try:
                        conn.close()
                    except Exception:
                        pass
            if self._wait(delay):
                return
            delay = min(delay * 2, RECONNECT_BACKOFF[1])

    def _listen(self, conn: Any) -> None:
        pgconn = conn.pgconn
        fd = conn.fileno()
        while not self._stopping.is_set():
            ready, _, _ = select.select([fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            pgconn.consume_input()  # raises when the server or the network went away
            got = False
            while pgconn.notifies() is not None:
                got = True
            if got:
                self._signal()
            if conn.broken or conn.closed:
                raise OSError("LISTEN connection lost")

    def _wait(self, seconds: float) -> bool:
        """Sleep, unless asked to stop (then True)."""
        ready, _, _ = select.select([self._stop_r], [], [], seconds)
        return bool(ready) or self._stopping.is_set()

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._stopping.set()
        try:
            os.write(self._stop_w, b"\0")
        except OSError:
            pass
        # The thread may be inside a connection attempt; it is a daemon and closes what it opened.
        self._thread.join(0.5)
        if not self._thread.is_alive():
            for fd in (self._stop_r, self._stop_w):
                os.close(fd)
        os.close(self.read_fd)
        os.close(self._write_fd)


# --- where the store is --------------------------------------------------------------------------------
class _Target:
    """A PostgreSQL URL as onward uses it: the connection string (with onward's defaults for what the URL
    does not set), the form fit to show, and the secrets to scrub from any text."""

    def __init__(self, url: str) -> None:
        self.pg = _psycopg()
        self.secrets = url_secrets(url)
        hide_secrets_in_argv(self.secrets)
        self.shown = redact_url(url)
        try:
            given = self.pg.conninfo.conninfo_to_dict(url)
            extra = {k: v for k, v in CONNECT_DEFAULTS.items() if k not in given}
            self.conninfo = str(self.pg.conninfo.make_conninfo(url, **extra))
        except self.pg.Error as e:
            raise StoreError(f"bad PostgreSQL URL {self.shown}: {self.text(e)}") from None

    def text(self, e: BaseException) -> str:
        """An error's first line, scrubbed."""
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        return scrub(lines[0] if lines else type(e).__name__, self.secrets)


# --- the store -----------------------------------------------------------------------------------------
def _translating(method: F) -> F:
    """Every psycopg error leaves a method as a ``StoreError`` with a scrubbed, one-line message."""
    @functools.wraps(method)  # type: ignore[arg-type]
    def wrapper(self: PostgresStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)  # type: ignore[operator]
        except self._pg.Error as e:
            raise self._error(e) from None
    return wrapper  # type: ignore[return-value]


class PostgresStore:
    """``Store`` on a PostgreSQL database, in its schema ``onward``. One instance is one connection (plus
    its LISTEN connection once ``wakeup_fd`` is asked for): use it from one thread."""

    def __init__(self, url: str, *, create: bool = True) -> None:
        self._target = _Target(url)
        self._pg = self._target.pg
        self.url = self._target.shown
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()  # guards the hand-over of a connection made in the background
        self._fresh: psycopg.Connection[Any] | None = None
        self._reconnector: threading.Thread | None = None
        self._closing = threading.Event()
        self._last_error = ""
        self._listener: _Listener | None = None
        self._batch_depth = 0
        self._events: list[tuple[Any, ...]] = []  # journal rows buffered by the open batch
        self._stall_ms = STALL_MS[1]  # the bound wanted on how long a call may wait (see STALL_MS)
        self._tuned_ms: int | None = None  # the bound the current connection applies (None: defaults)
        try:
            self._conn = self._connect()
            self._ensure_schema(create)
            self._identity = self._schema_identity()
        except self._pg.Error as e:
            self.close()
            raise self._error(e) from None
        except StoreError:
            self.close()
            raise

    # --- connections ---------------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        conn = self._pg.connect(self._target.conninfo, autocommit=True)
        try:
            conn.execute(Q["session"])
        except BaseException:
            conn.close()
            raise
        return conn

    def _tune(self, conn: psycopg.Connection[Any]) -> None:
        """Apply the stall bound to the connection: unacknowledged data for longer kills the socket (then
        the call fails and a new connection is made), a lock waited for longer fails the statement, and an
        idle transaction of ours is not left holding locks for longer than twice that."""
        ms = self._stall_ms
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
        conn.execute(Q["set_stall_limits"], {"timeout": f"{ms}ms", "idle": f"{2 * ms}ms"})
        self._tuned_ms = ms

    def _set_lease(self, lease_seconds: float) -> None:
        """Tie how long a call may wait to the lease the runner works with (applied by ``_live``)."""
        low, high = STALL_MS
        self._stall_ms = int(min(high, max(low, lease_seconds * 1000 / 4)))

    def _live(self) -> psycopg.Connection[Any]:
        """The connection to use now. Never waits for the network: a lost connection is replaced by a
        background thread, and until it is, calls fail at once."""
        conn = self._conn
        if conn is not None and not conn.broken and not conn.closed:
            if self._tuned_ms != self._stall_ms and not self._batch_depth and not _in_transaction(conn):
                self._tune(conn)
            return conn
        if self._batch_depth:
            raise StoreError(f"store {self.url}: connection lost in a transaction; nothing was committed")
        with self._lock:
            fresh, self._fresh = self._fresh, None
        if fresh is not None:
            self._conn, self._tuned_ms = fresh, None
            if conn is not None:
                conn.close()
            return self._live()
        self._drop_connection()
        raise StoreError(f"store {self.url}: not connected ({self._last_error or 'connection lost'});"
                         " reconnecting")

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass
        if self._closing.is_set():
            return
        if self._reconnector is None or not self._reconnector.is_alive():
            self._reconnector = threading.Thread(target=self._reconnect, name="onward-pg-reconnect", daemon=True)
            self._reconnector.start()

    def _reconnect(self) -> None:
        delay = RECONNECT_BACKOFF[0]
        while not self._closing.is_set():
            try:
                conn = self._connect()
            except Exception as e:  # psycopg.Error, OSError
                self._last_error = self._target.text(e)
                self._closing.wait(delay)
                delay = min(delay * 2, RECONNECT_BACKOFF[1])
                continue
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                else:
                    self._fresh = conn
            return

    def _error(self, e: BaseException) -> StoreError:
        """The StoreError for a psycopg error; a connection it broke is replaced in the background."""
        text = self._target.text(e)
        self._last_error = text
        conn = self._conn
        if conn is not None and (conn.broken or conn.closed) and not self._batch_depth:
            self._drop_connection()
        return StoreError(f"store {self.url}: {text}")

    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            fresh, self._fresh = self._fresh, None
        for conn in (self._conn, fresh):
            if conn is not None:
                try:
                    conn.close()
                except Exception:
                    pass
        self._conn = None

    # --- the schema ----------------------------------------------------------------------------------
    def _ensure_schema(self, create: bool) -> None:
        assert self._conn is not None
        version = _schema_version(self._conn, self.url)
        if version is None:
            if not create:
                raise StoreMissing(f"no onward store in {self.url}")
            version = _migrate(self._conn, self.url, create=True)
        _check_version(version, self.url)

    @_translating
    def _schema_identity(self) -> int | None:
        """The oid of onward's meta table: a schema dropped and created again has another one."""
        return self._live().execute(Q["schema_identity"]).fetchone()[0]  # type: ignore[index]

    def check_still_there(self) -> None:
        try:
            found = self._schema_identity()
        except StoreError:
            return  # unreachable right now: renewals report that; only the server's answer can say "gone"
        if found != self._identity:
            what = "was dropped" if found is None else "was replaced (dropped and created again)"
            raise StoreGone(f"store {self.url}: its schema \"onward\" {what} while this worker was using it;"
                            " stopping")

    @_translating
    def now(self) -> float:
        return float(self._live().execute(Q["now"]).fetchone()[0])  # type: ignore[index]

    # --- transactions --------------------------------------------------------------------------------
    @contextmanager
    def _write(self, durable: bool = True) -> Iterator[psycopg.Connection[Any]]:
        """One transaction, unless a batch is open (then its commit covers this write). A crash-safe write
        skips waiting for the flush of its commit record: a kill of the worker cannot lose it (the server
        has it), only a crash of the server could."""
        conn = self._live()
        if self._batch_depth:
            yield conn
            return
        with conn.transaction():
            if not durable:
                conn.execute(Q["crash_safe"])
            yield conn

    @contextmanager
    def batch(self) -> Iterator[None]:
        if self._batch_depth:
            self._batch_depth += 1
            try:
                yield
            finally:
                self._batch_depth -= 1
            return
        conn = self._live()
        try:
            # (Not in pipeline mode: it would save two round trips of five, but costs psycopg more CPU than
            # that on a busy machine; measured slower here.)
            with conn.transaction():
                self._batch_depth = 1
                self._events = []
                try:
                    yield
                    self._flush_events(conn)
                finally:
                    self._batch_depth = 0
                    self._events = []
        except self._pg.Error as e:
            raise self._error(e) from None

    def wakeup_fd(self) -> int | None:
        if self._listener is None:
            self._listener = _Listener(self._connect, self._listener_error)
        return self._listener.read_fd

    def _listener_error(self, e: BaseException) -> None:
        self._last_error = self._target.text(e)

    def drain_wakeups(self) -> None:
        if self._listener is not None:
            self._listener.drain()

    def _notify(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(Q["notify"], {"channel": CHANNEL})

    # --- tasks ---------------------------------------------------------------------------------------
    @_translating
    def add(self, names: Iterable[str]) -> int:
        it = iter(names)
        chunk = list(islice(it, ADD_CHUNK))
        if not chunk:
            return 0
        added = 0
        with self._write() as conn:
            # Another worker importing the same names holds their keys until it commits: wait for it, however
            # long its import takes, then find them present (a big import is not stuck, just long).
            conn.execute(Q["add_limits"])
            while chunk:
                added += _one(conn.execute(Q["add_tasks"], {"keys": [task_key(n) for n in chunk], "names": chunk}))
                chunk = list(islice(it, ADD_CHUNK))
            if added:
                self._log(conn, "added", detail=f"{added} new task{'s' if added != 1 else ''}")
                self._notify(conn)
        return added

    @_translating
    def get_source(self, path_key: str) -> SourceMark | None:
        row = self._live().execute(Q["get_source"], {"path": path_key}).fetchone()
        return SourceMark(*row) if row else None

    @_translating
    def set_source(self, path_key: str, mark: SourceMark) -> None:
        self._live().execute(
            Q["set_source"],
            {"path": path_key, "identity": mark.identity, "size": mark.size, "lines": mark.lines,
             "mtime_ns": mark.mtime_ns, "head_digest": mark.head_digest, "tail_digest": mark.tail_digest},
        )

    @_translating
    def claim(self, worker_id: int, limit: int, lease_seconds: float, max_attempts: int) -> list[Claim]:
        self._set_lease(lease_seconds)
        rows = self._live().execute(
            Q["claim"],
            {"worker_id": worker_id, "lease": lease_seconds, "limit": limit, "max_attempts": max_attempts},
        ).fetchall()
        rows.sort()  # RETURNING gives no order guarantee; hand tasks out in the order they were added
        return [Claim(task_id=r[0], name=r[1], attempt=r[2], fence=r[3], max_attempts=r[4]) for r in rows]

    @_translating
    def renew(self, worker_id: int, leases: Sequence[Lease], lease_seconds: float, completed: int) -> list[int]:
        self._set_lease(lease_seconds)
        params = {
            "worker_id": worker_id, "completed": completed, "lease": lease_seconds,
            "ids": [lease.task_id for lease in leases], "fences": [lease.fence for lease in leases],
            "ages": [lease.progress_age for lease in leases], "notes": [lease.note for lease in leases],
        }
        with self._write(durable=False) as conn:
            if not self._batch_depth:
                conn.execute(Q["renew_limits"], {"timeout": f"{self._stall_ms}ms"})
            kept = {r[0] for r in conn.execute(Q["renew"], params)}
        return [lease.task_id for lease in leases if lease.task_id not in kept]

    @_translating
    def note_child(self, task_id: int, fence: int, child_pid: int, child_start: int) -> None:
        with self._write(durable=False) as conn:
            conn.execute(Q["note_child"], {"pid": child_pid, "start": child_start, "task_id": task_id,
                                           "fence": fence})

    @_translating
    def complete(self, task_id: int, fence: int, result: bytes, kind: str) -> bool:
        cur = self._live().execute(Q["complete"], {"result": result, "kind": kind, "task_id": task_id,
                                                   "fence": fence})
        return cur.fetchone() is not None

    @_translating
    def fail(self, task_id: int, fence: int, error: str, retry_delay: float) -> str | None:
        with self._write() as conn:
            row = conn.execute(Q["fail"], {"delay": retry_delay, "error": error, "task_id": task_id,
                                           "fence": fence}).fetchone()
            if row is not None and row[0] == PENDING:
                self._notify(conn)
        return row[0] if row else None

    @_translating
    def release(self, task_id: int, fence: int, reason: str) -> bool:
        with self._write() as conn:
            row = conn.execute(Q["release"], {"task_id": task_id, "fence": fence}).fetchone()
            if row is not None:
                self._notify(conn)
        return row is not None

    @_translating
    def running(self) -> list[RunningTask]:
        return [running_task_of(r) for r in self._live().execute(Q["running"])]

    @_translating
    def reclaim(self, task_id: int, fence: int, reason: str) -> Reclaimed | None:
        with self._write() as conn:
            row = conn.execute(Q["reclaim"], {"reason": reason, "task_id": task_id, "fence": fence}).fetchone()
            if row is not None and row[0] == PENDING:
                self._notify(conn)
        return Reclaimed(state=row[0], counted=bool(row[1])) if row else None

    @_translating
    def retry(self, names: Sequence[str] | None) -> int:
        with self._write() as conn:
            if names is None:
                changed = _one(conn.execute(Q["retry_failed"]))
            else:
                changed = _one(conn.execute(Q["retry_named"], {"keys": [task_key(n) for n in names]}))
            if changed:
                self._notify(conn)
        return changed

    # --- reading -------------------------------------------------------------------------------------
    @_translating
    def task(self, name: str) -> TaskRow | None:
        row = self._live().execute(Q["task"], {"key": task_key(name)}).fetchone()
        return TaskRow(*row) if row else None

    @_translating
    def task_id(self, name: str) -> int | None:
        row = self._live().execute(Q["task_id"], {"key": task_key(name)}).fetchone()
        return row[0] if row else None

    @_translating
    def result(self, name: str) -> StoredResult | None:
        row = self._live().execute(Q["result"], {"key": task_key(name)}).fetchone()
        return StoredResult(kind=row[0], data=bytes(row[1])) if row else None

    def iter_tasks(self, state: str | None = None) -> Iterator[TaskRow]:
        # Pages by id, each page its own statement: a long listing holds no snapshot open.
        after = 0
        while True:
            rows = self._page(after, state)
            if not rows:
                return
            for r in rows:
                yield TaskRow(*r[1:])
            after = rows[-1][0]

    @_translating
    def _page(self, after: int, state: str | None) -> list[tuple[Any, ...]]:
        if state is None:
            return self._live().execute(Q["iter_tasks"], {"after": after, "limit": 1000}).fetchall()
        return self._live().execute(Q["iter_tasks_in_state"],
                                    {"after": after, "state": state, "limit": 1000}).fetchall()

    @_translating
    def counts(self) -> dict[str, int]:
        conn = self._live()
        counts = {state: 0 for state in ("pending", "running", "done", "failed")}
        rows = 0
        for state, n, k in conn.execute(Q["counts"]):
            counts[state] = int(n)
            rows += k
        if rows > COMPACT_COUNTS_AFTER and not self._batch_depth and not _in_transaction(conn):
            try:
                conn.execute(Q["counts_compact"])
            except self._pg.Error:
                pass  # only an optimisation: a read-only role (or a replica) reads the deltas as they are
        return counts

    @_translating
    def stats(self) -> Stats:
        conn = self._live()
        with _snapshot(conn, self._batch_depth > 0):
            counts = self.counts()
            running = self.running()
            workers = self.workers()
            done_last_minute, window = conn.execute(Q["done_last_minute"]).fetchone()  # type: ignore[misc]
            errors = [event_of(r) for r in conn.execute(Q["recent_errors"], {"limit": 5})]
            restarts = conn.execute(Q["count_restarts"]).fetchone()[0]  # type: ignore[index]
        return Stats(counts=counts, running=running, workers=workers, errors=errors,
                     done_last_minute=int(done_last_minute), restarts=int(restarts), rate_window=float(window))

    @_translating
    def workers(self) -> list[WorkerRow]:
        return [
            worker_of(r)
            for r in self._live().execute(Q["live_workers"])
        ]

    # --- workers and the journal ---------------------------------------------------------------------
    @_translating
    def register_worker(self, owner: Owner, detail: str) -> int:
        with self._write() as conn:
            row = conn.execute(Q["register_worker"], {"host": owner.host, "host_key": owner.host_key,
                                                      "pid": owner.pid, "pid_start": owner.pid_start,
                                                      "detail": detail}).fetchone()
            assert row is not None
            worker_id = int(row[0])
            self._log(conn, "worker started", worker_id=worker_id, detail=detail, pid=owner.pid, host=owner.host)
        return worker_id

    @_translating
    def worker_stopped(self, worker_id: int, reason: str) -> None:
        with self._write() as conn:
            conn.execute(Q["worker_stopped"], {"reason": reason, "worker_id": worker_id})
            self._log(conn, "worker stopped", worker_id=worker_id, detail=reason)

    @_translating
    def log_event(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                  attempt: int | None = None, detail: str | None = None, durable: bool = False) -> None:
        if self._batch_depth:
            self._log(None, kind, task_id=task_id, worker_id=worker_id, attempt=attempt, detail=detail)
            return
        with self._write(durable=durable) as conn:
            self._log(conn, kind, task_id=task_id, worker_id=worker_id, attempt=attempt, detail=detail)

    def _log(self, conn: psycopg.Connection[Any] | None, kind: str, *, task_id: int | None = None,
             worker_id: int | None = None, attempt: int | None = None, detail: str | None = None,
             pid: int | None = None, host: str | None = None) -> None:
        """Journal one event: inside a batch it waits in memory and all of the batch's events are written by
        one statement just before its commit (the journal costs a batch one round trip, not one per event)."""
        row = (kind, pid or os.getpid(), host or hostname(), worker_id, task_id, attempt, detail)
        if self._batch_depth:
            self._events.append(row)
        else:
            assert conn is not None
            _insert_events(conn, [row])

    def _flush_events(self, conn: psycopg.Connection[Any]) -> None:
        if self._events:
            _insert_events(conn, self._events)
            self._events = []

    @_translating
    def events(self, after_id: int = 0, task: str | None = None, limit: int = 1000,
               last: int | None = None) -> list[Event]:
        conn = self._live()
        bound = conn.execute(Q["events_bound"], {"app": _application_name(conn)}).fetchone()[0]  # type: ignore[index]
        params: dict[str, Any] = {"after": after_id, "bound": bound, "limit": last if last is not None else limit}
        name = "events_last" if last is not None else "events_after"
        if task is not None:
            params["key"] = task_key(task)
            name += "_for_task"
        return [event_of(r) for r in conn.execute(Q[name], params)]

    # --- durable steps -------------------------------------------------------------------------------
    @_translating
    def steps(self, task_id: int) -> list[StepRecord]:
        return [step_of(r) for r in self._live().execute(Q["steps"], {"task_id": task_id})]

    @_translating
    def record_step(self, task_id: int, fence: int, step: StepRecord) -> bool:
        cur = self._live().execute(
            Q["record_step"],
            {"task_id": task_id, "fence": fence, "idx": step.index, "name": step.name, "kind": step.kind,
             "data": step.data, "at": step.at},
        )
        return cur.fetchone() is not None

    @_translating
    def drop_steps(self, task_id: int, fence: int, from_index: int) -> bool:
        row = self._live().execute(Q["drop_steps"], {"task_id": task_id, "fence": fence,
                                                     "from_idx": from_index}).fetchone()
        return bool(row and row[0])


# --- schema versions -----------------------------------------------------------------------------------
def _schema_version(conn: psycopg.Connection[Any], url: str) -> int | None:
    """The store's schema version; None when there is no store yet (no schema ``onward``, or an empty
    one); ``NotAStore`` when the schema holds something else."""
    exists, relations, has_meta = conn.execute(Q["schema_state"]).fetchone()  # type: ignore[misc]
    if not exists or (relations == 0 and not has_meta):
        return None
    foreign = NotAStore(f"not an onward store: {url} has a schema \"onward\" that onward did not create")
    if not has_meta:
        raise foreign
    rows = dict(conn.execute(Q["schema_meta"]).fetchall())
    if rows.get("app") != "onward" or "schema_version" not in rows:
        raise foreign
    try:
        return int(rows["schema_version"])
    except ValueError:
        raise foreign from None


def _check_version(version: int, url: str) -> None:
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(f"store {url} has schema version {version}, newer than this onward's {SCHEMA_VERSION};"
                           " upgrade onward")
    if version < SCHEMA_VERSION:
        raise SchemaTooOld(f"store {url} has schema version {version}, older than this onward's"
                           f" {SCHEMA_VERSION}; run `onward db upgrade`")


def _migrate(conn: psycopg.Connection[Any], url: str, *, create: bool) -> int:
    """Bring the schema to SCHEMA_VERSION under the schema lock, in one transaction: workers that start
    at the same moment wait for the first one, then find the store made. Returns the version found
    before (0: there was none). With ``create`` only, an existing store is left as it is."""
    with conn.transaction():
        conn.execute(Q["lock_schema"])
        found = _schema_version(conn, url)
        if found is not None and (create or found >= SCHEMA_VERSION):
            return found
        for version in range((found or 0) + 1, SCHEMA_VERSION + 1):
            conn.execute(migration(Q, version))
        conn.execute(Q["set_meta"], {"version": str(SCHEMA_VERSION)})
        return SCHEMA_VERSION if create else (found or 0)


def upgrade(url: str) -> tuple[int, int]:
    """``onward db upgrade``: create the store, or bring its schema to this onward's version. Returns the
    versions before and after. Refuses a newer store (``SchemaTooNew``) and a foreign schema."""
    target = _Target(url)
    pg, shown = target.pg, target.shown
    try:
        conn = pg.connect(target.conninfo, autocommit=True)
    except pg.Error as e:
        raise StoreError(f"store {shown}: {target.text(e)}") from None
    try:
        before = _schema_version(conn, shown) or 0
        if before > SCHEMA_VERSION:
            _check_version(before, shown)
        if before < SCHEMA_VERSION:
            before = _migrate(conn, shown, create=False)
        return before, SCHEMA_VERSION
    except pg.Error as e:
        raise StoreError(f"store {shown}: {target.text(e)}") from None
    finally:
        conn.close()


# --- helpers -------------------------------------------------------------------------------------------
def _one(cur: psycopg.Cursor[Any]) -> int:
    """The single number a statement returns (its count, as a row)."""
    row = cur.fetchone()
    return int(row[0]) if row else 0


def _insert_events(conn: psycopg.Connection[Any], rows: Sequence[tuple[Any, ...]]) -> None:
    """Journal rows (kind, pid, host, worker_id, task_id, attempt, detail), in order: one statement per run
    of rows from the same process (in practice, one for the whole batch)."""
    start = 0
    while start < len(rows):
        pid, host = rows[start][1:3]
        end = start + 1
        while end < len(rows) and end - start < EVENTS_PER_INSERT and rows[end][1:3] == (pid, host):
            end += 1
        values: list[Any] = [pid, host]
        for kind, _, _, worker_id, task_id, attempt, detail in rows[start:end]:
            values += (kind, worker_id, task_id, attempt, detail)
        conn.execute(_events_sql(end - start), values)
        start = end


@functools.lru_cache(maxsize=64)
def _events_sql(n: int) -> str:
    """The journal insert for ``n`` events. Plain VALUES rather than arrays: a batch writes a few events,
    and for so few, unpacking arrays costs the server and psycopg more than the extra text (and psycopg
    keeps its parsed form of a statement with up to 50 parameters: nine events)."""
    return Q["log_events"].replace("{rows}", ", ".join(["(%s, %s, %s, %s, %s)"] * n))


def _in_transaction(conn: psycopg.Connection[Any]) -> bool:
    return bool(conn.info.transaction_status != conn.info.transaction_status.IDLE)


@contextmanager
def _snapshot(conn: psycopg.Connection[Any], nested: bool) -> Iterator[None]:
    """One read-only snapshot, so that numbers read by several statements agree with each other."""
    if nested:
        yield
        return
    with conn.transaction():
        conn.execute(Q["snapshot"])
        yield


def _application_name(conn: psycopg.Connection[Any]) -> str:
    return conn.info.parameter_status("application_name") or APP_NAME








__all__ = ["PostgresStore", "SCHEMA_VERSION", "redact_url", "upgrade", "hide_secrets_in_argv"]
