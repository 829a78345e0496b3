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
  (``sqlbase.stall_ms``); the server ends a transaction of ours left idle for twice that, so a worker cut off
  mid-transaction holds no lock for long. A server that is stopped rather than cut off (SIGSTOP, a paused
  VM) still has its kernel acknowledge every byte, so none of those fire: once a worker names its lease, a
  stall watch thread (``pgconn.StallWatch``) drops the connection of a call unanswered for twice the bound. A lost connection is re-established by a background thread with
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
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from itertools import islice
from typing import TYPE_CHECKING, Any

from ..errors import NotAStore, StoreError, StoreGone, StoreMissing, StoreUnavailable
from ..proc import hostname, start_thread
from .base import FENCED_DETAIL, STATES, Claim, Event, Lease, Stats, StepRecord
from .pgconn import (
    RECONNECT_BACKOFF,
    STALL_CEILING_MS,
    Listener,
    StallWatch,
    Target,
    application_name,
    in_transaction,
    watched_connection_class,
)
from .rows import event_of
from .sql import load_queries, migration
from .sqlbase import (
    SCHEMA_VERSION,
    JournalRow,
    SqlStore,
    added_message,
    check_schema_version,
    parse_schema_version,
    refuse_live_workers,
    translating,
)

if TYPE_CHECKING:
    import psycopg

CHANNEL = "onward_work"  # LISTEN/NOTIFY channel announcing work that may be ready
ADD_CHUNK = 5000  # names per INSERT when adding tasks
EVENTS_PER_INSERT = 1000  # journal rows per INSERT (5 parameters each, and 3 all share; a statement takes at most 65535)
COMPACT_COUNTS_AFTER = 500  # delta rows in onward.counts before counts() folds them
TIDY_EVERY = 60.0  # seconds between two looks of a worker's tidy (the journal's time index)
Q = load_queries("postgres.sql")
# The queries that name the job (%(job)s): they get the handle's job id with their other parameters. Only
# those: a parameter passed to a query without placeholders would make psycopg rewrite its text.
JOB_SCOPED = frozenset(name for name, text in Q.items() if "%(job)s" in text)


def task_key(name: str) -> bytes:
    """The unique key of a task name (names may be up to 4 KiB, more than a btree index entry holds)."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).digest()


# What libpq says when a server cannot be reached or cannot serve anyone for now; any other failed
# connection (a bad option, a database or role that does not exist, a refused password) is configuration.
_AWAY_OR_BUSY = (
    "connection refused", "could not connect", "timeout expired", "timed out", "no route to host",
    "network is unreachable", "could not translate host name", "temporary failure in name resolution",
    "server closed the connection", "connection reset", "terminating connection", "broken pipe",
    "no such file or directory",  # a Unix socket that is not there while the server is down
    "starting up", "shutting down", "in recovery mode", "too many",
    # A standby before it is consistent ("not yet accepting connections"), or one with hot_standby off ("not
    # accepting connections"): a failover or a restore under way.
    "accepting connections",
    # All connections taken but those kept for superusers (53300 as "too many clients", but worded apart:
    # "remaining connection slots are reserved for non-replication superuser connections" up to 15, "...
    # reserved for roles with the SUPERUSER attribute" since 16): busy, not misconfigured.
    "connection slots are reserved",
    "could not fork new process",  # the server out of processes or memory for a new backend
)


# What a server that is up answers when something that passes keeps it from doing this now: a lock someone
# else holds on onward's tables past lock_timeout, a statement or transaction ended by the server's timeouts
# (statement_timeout, idle_in_transaction_session_timeout, idle_session_timeout) or by an administrator
# (pg_cancel_backend), a server that takes no writes (a hot standby, default_transaction_read_only: a failover
# under way), a conflict with another transaction, a failing disk. Like a disk that is full or read-only,
# none of these is the store misconfigured.
_BUSY_SQLSTATES = frozenset({
    "55P03",  # lock_not_available
    "57014",  # query_canceled
    "25P03",  # idle_in_transaction_session_timeout
    "57P05",  # idle_session_timeout
    "25006",  # read_only_sql_transaction
    "40001",  # serialization_failure
    "40P01",  # deadlock_detected
    "57P01", "57P02", "57P03",  # admin_shutdown (pg_terminate_backend too), crash_shutdown, cannot_connect_now
})


def _database_missing(e: BaseException) -> bool:
    """Whether a failed connection was refused because the URL's database does not exist (a connection
    failure carries no SQLSTATE: libpq's text, ``FATAL:  database "…" does not exist``, decides)."""
    import psycopg

    text = str(e)
    return isinstance(e, psycopg.OperationalError) and 'database "' in text and "does not exist" in text


def _server_unavailable(e: BaseException) -> bool:
    """Whether a psycopg error means the server cannot serve us right now (exit 75, restarted) rather than
    that the store is misconfigured (exit 2). A failed connection carries no SQLSTATE, so its text decides
    (``_AWAY_OR_BUSY``): no answer (refused, unreachable, timed out, a host name that does not resolve yet)
    or a server starting, stopping or full. After connecting: a connection exception (class 08), the server
    out of resources (class 53: disk full, too many connections) or failing (class 58: an I/O error), or
    one of ``_BUSY_SQLSTATES``."""
    import psycopg

    sqlstate = getattr(e, "sqlstate", None)
    if sqlstate is not None and isinstance(e, psycopg.Error):
        return sqlstate[:2] in ("08", "53", "58") or sqlstate in _BUSY_SQLSTATES
    if not isinstance(e, psycopg.OperationalError):
        return False
    text = str(e).lower()
    return any(phrase in text for phrase in _AWAY_OR_BUSY)


class PostgresStore(SqlStore):
    """``Store`` on a PostgreSQL database, in its schema ``onward``. One instance is one connection (plus
    its LISTEN connection once ``wakeup_fd`` is asked for): use it from one thread."""

    _stall_ceiling_ms = STALL_CEILING_MS

    def __init__(self, url: str, *, create: bool = True, job: str = "default") -> None:
        self.job = job
        self._target = Target(url)
        self._pg = self._target.pg
        self.url = self._target.shown
        self._conn: psycopg.Connection[Any] | None = None
        self._in_tx: psycopg.Connection[Any] | None = None  # the connection of the open transaction
        self._lock = threading.Lock()  # guards the hand-over of a connection made in the background
        self._fresh: psycopg.Connection[Any] | None = None
        self._reconnector: threading.Thread | None = None
        self._closing = threading.Event()
        self._last_error = ""
        self._database_gone = False  # the last reconnection was refused: the database does not exist
        self._listener: Listener | None = None
        self._stall_ms = STALL_CEILING_MS  # the bound wanted on how long a call may wait
        self._tuned_ms: int | None = None  # the bound the current connection applies (None: defaults)
        self._stall_watch: StallWatch | None = None  # started once the runner names a lease
        self._unbounded = False  # a call that may wait as long as it takes (a big import)
        self._cut_after: float | None = None  # the stall watch dropped the connection after this long
        try:
            self._conn = self._connect()
            self._ensure_schema(create)
            self._open_job(create)
            self._identity = self._schema_identity()
        except self._pg.Error as e:
            self.close()
            raise self._error(e) from None
        except StoreError:
            self.close()
            raise

    @property
    def secrets(self) -> list[str]:
        return self._target.secrets

    # --- connections ---------------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        conn = watched_connection_class(self._pg).connect(self._target.conninfo, autocommit=True)
        try:
            self._target.learn_password(conn)
            conn.execute(Q["session"])
        except BaseException:
            conn.close()
            raise
        return conn

    def _tune(self, conn: psycopg.Connection[Any]) -> None:
        """Apply the stall bound to the connection: unacknowledged data for longer kills the socket (then
        the call fails and a new connection is made), a lock waited for longer fails the statement, and an
        idle transaction of ours is not left holding locks for longer than twice that."""
        ms = self._stall_ms or STALL_CEILING_MS
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
        conn.execute(Q["set_stall_limits"], {"timeout": f"{ms}ms", "idle": f"{2 * ms}ms"})
        self._tuned_ms = ms

    def _apply_stall_bound(self) -> None:
        pass  # applied by _live, between transactions

    def _set_lease(self, lease_seconds: float) -> None:
        super()._set_lease(lease_seconds)
        # A server that holds the connection open without answering is bounded by the stall watch: started
        # here, since only a worker (which names its lease) has tasks to fence in time.
        if self._stall_watch is None:
            try:
                self._stall_watch = StallWatch(lambda: self._in_tx or self._conn, self._unanswered_bound,
                                               self._stalled)
            except OSError as e:  # no thread left (start_thread): a worker that could not fence itself
                raise self._no_thread("its stall watch", e) from None

    def _unanswered_bound(self) -> float | None:
        """How long a call may go without an answer: twice the stall bound (the server's own limits end
        a slow statement or a lock wait well within it), so that the runner is free again in time to stop
        the tasks whose lease it can no longer renew."""
        return None if self._unbounded else 2 * (self._stall_ms or STALL_CEILING_MS) / 1000

    def _stalled(self, seconds: float) -> None:
        self._cut_after = seconds

    def _live(self) -> psycopg.Connection[Any]:
        """The connection to use now. Never waits for the network: a lost connection is replaced by a
        background thread, and until it is, calls fail at once."""
        conn = self._conn
        if conn is not None and not conn.broken and not conn.closed:
            if self._tuned_ms != self._stall_ms and not self._batch_depth and not in_transaction(conn):
                self._tune(conn)
            return conn
        if self._batch_depth:
            raise StoreUnavailable(f"store {self.url}: connection lost in a transaction; nothing was committed")
        with self._lock:
            fresh, self._fresh = self._fresh, None
        if fresh is not None:
            self._conn, self._tuned_ms = fresh, None
            if conn is not None:
                conn.close()
            return self._live()
        self._drop_connection()
        raise StoreUnavailable(f"store {self.url}: not connected ({self._last_error or 'connection lost'});"
                               " reconnecting")

    def connection_intact(self) -> bool:
        """Whether the connection, idle since the store was opened (ahead of need: ``onward.store.open_ahead``),
        can still be used: open, and nothing came on it meanwhile. A server that ends a session (shutting
        down, restarting, ``pg_terminate_backend``, an idle timeout) says so and closes it, and an idle
        session that LISTENs to nothing is sent nothing else, so anything readable means it is lost. Never
        waits."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return False
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
        return not readable

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
            try:
                start_thread(self._reconnector)
            except OSError as e:
                # Tried again at the next call, which finds no connection either (``_live``): meanwhile
                # every call fails as the store unavailable, saying why.
                self._reconnector = None
                self._last_error = f"cannot start a thread to reconnect: {e.strerror}"

    def _reconnect(self) -> None:
        delay = RECONNECT_BACKOFF[0]
        while not self._closing.is_set():
            try:
                conn = self._connect()
            except Exception as e:  # psycopg.Error, OSError
                self._last_error = self._target.text(e)
                self._database_gone = _database_missing(e)
                self._closing.wait(delay)
                delay = min(delay * 2, RECONNECT_BACKOFF[1])
                continue
            self._database_gone = False
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                else:
                    self._fresh = conn
            return

    def _no_thread(self, what: str, e: OSError) -> StoreUnavailable:
        """A thread the store needs could not be started (``start_thread``): the machine is out of processes
        or memory for now, so the store is unavailable: a worker rides it out as any store fault, and where it
        cannot (as it starts), exits 75 in one line. It was a traceback and exit 1, which a supervisor takes
        for a crash."""
        return StoreUnavailable(f"store {self.url}: cannot start a thread for {what}: {e.strerror}")

    # What a statement of onward's gets from a server whose onward tables were changed by hand (a column or a
    # table renamed or dropped, onward.epoch() dropped): never so by onward itself, which upgrades only with
    # no worker running, and never better by waiting. The next heartbeat stops the worker (check_still_there).
    SCHEMA_CHANGED_SQLSTATES = frozenset({"42703", "42P01", "42883"})
    _schema_changed: str | None = None  # the error that showed it, once one did

    def _error(self, e: BaseException) -> StoreError:
        """The StoreError for a psycopg error; a connection it broke is replaced in the background."""
        text = self._target.text(e)
        if getattr(e, "sqlstate", None) in self.SCHEMA_CHANGED_SQLSTATES:
            self._schema_changed = text
        kind = StoreUnavailable if _server_unavailable(e) else StoreError
        cut_after, self._cut_after = self._cut_after, None
        if cut_after is not None:
            text, kind = f"no answer from the server in {cut_after:.1f} s; connection dropped", StoreUnavailable
        self._last_error = text
        conn = self._conn
        if conn is not None and (conn.broken or conn.closed) and not self._batch_depth:
            self._drop_connection()
        return kind(f"store {self.url}: {text}")

    def close(self) -> None:
        self._closing.set()
        if self._stall_watch is not None:
            self._stall_watch.close()
            self._stall_watch = None
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

    # --- what the shared SQL layer asks of a backend -------------------------------------------------
    def _driver_error(self) -> type[BaseException]:
        return self._pg.Error

    def _translate_error(self, e: BaseException) -> StoreError:
        return self._error(e)

    def _exec(self, name: str, params: dict[str, Any] | None = None) -> Any:
        conn = self._in_tx if self._in_tx is not None else self._live()
        if name in JOB_SCOPED:
            params = {**params, "job": self._job_id} if params else {"job": self._job_id}
        return conn.execute(Q[name], params or None)

    def _clock(self) -> dict[str, Any]:
        return {}  # the SQL reads the server's clock

    def _key(self, name: str) -> bytes:
        return task_key(name)

    @contextmanager
    def _transaction(self, durable: bool) -> Iterator[None]:
        """A crash-safe write skips waiting for the flush of its commit record: a kill of the worker cannot
        lose it (the server has it), only a crash of the server could."""
        conn = self._live()
        with conn.transaction():
            self._in_tx = conn
            try:
                if not durable:
                    conn.execute(Q["crash_safe"])
                yield
            finally:
                self._in_tx = None

    def _batch_transaction(self, durable: bool) -> AbstractContextManager[None]:
        # Always a synchronous commit, whatever ``durable`` says, so ``sync`` has nothing to do: a worker
        # waits on the round trip here, not on the server's flush, and PostgreSQL offers no cheap way to
        # wait later for an asynchronous commit's flush.
        # (Not in pipeline mode: it would save two round trips of five, but costs psycopg more CPU than that
        # on a busy machine; measured slower here.)
        return self._transaction(durable=True)

    def _on_its_own(self, name: str, params: dict[str, Any]) -> list[Any]:
        return self._exec(name, params).fetchall()  # autocommit: the statement is its own transaction

    def _sync(self) -> None:
        pass  # never owed: every commit is synchronous (see _batch_transaction)

    def _work_ready(self) -> None:
        self._exec("notify", {"channel": CHANNEL})

    def _insert_events(self, events: Sequence[JournalRow]) -> None:
        _insert_events(self._in_tx or self._live(), events, self._job_id)

    # --- the schema ----------------------------------------------------------------------------------
    def _ensure_schema(self, create: bool) -> None:
        assert self._conn is not None
        version = _schema_version(self._conn, self.url)
        if version is None:
            if not create:
                raise StoreMissing(f"no onward store in {self.url}")
            version = _migrate(self._conn, self.url, create=True)
        check_schema_version(version, SCHEMA_VERSION, self.url)

    @translating
    def _schema_identity(self) -> int | None:
        """The oid of onward's meta table: a schema dropped and created again has another one."""
        return self._exec("schema_identity").fetchone()[0]

    _tidied_at: float | None = None  # monotonic time of the last tidy, None before the first
    _may_summarize = True  # False once the server refused it (not the owner of the index)

    def tidy(self) -> None:
        now = time.monotonic()
        if not self._may_summarize or (self._tidied_at is not None and now - self._tidied_at < TIDY_EVERY):
            return
        self._tidied_at = now
        try:
            self._summarize_journal()
        except StoreError as e:
            if "owner" in str(e):
                self._may_summarize = False  # a role that may write but does not own the schema: VACUUM does it

    @translating
    def _summarize_journal(self) -> None:
        with self._transaction(durable=False):
            self._exec("short_lock_wait")
            self._exec("summarize_journal").fetchone()

    def check_still_there(self) -> None:
        if self._schema_changed is not None:
            # Retried, every statement would fail the same way for good, while the renewals (which still
            # work) kept this worker's tasks from every other worker.
            raise StoreGone(f"store {self.url}: its tables were changed while this process was using it"
                            f" ({self._schema_changed}); stopping")
        try:
            found = self._schema_identity()
        except StoreError:
            # Unreachable right now: renewals report that; only the server's answer can say "gone". It did
            # when it refused the reconnection for want of the database (dropped, with its schema and all).
            if self._database_gone and self._conn is None:
                raise StoreGone(f"store {self.url}: its database was dropped while this process was using it"
                                f" ({self._last_error}); stopping") from None
            return
        if found != self._identity:
            what = "was dropped" if found is None else "was replaced (dropped and created again)"
            raise StoreGone(f"store {self.url}: its schema \"onward\" {what} while this process was using it;"
                            " stopping")

    def now(self) -> float:
        return float(self._exec("now").fetchone()[0])

    def wakeup_fd(self) -> int | None:
        if self._listener is None:
            try:
                self._listener = Listener(self._connect, self._listener_error, Q["listen_onward_work"])
            except OSError as e:
                raise self._no_thread("its LISTEN connection", e) from None
        return self._listener.read_fd

    def _listener_error(self, e: BaseException) -> None:
        self._last_error = self._target.text(e)

    def drain_wakeups(self) -> None:
        if self._listener is not None:
            self._listener.drain()

    # --- tasks ---------------------------------------------------------------------------------------
    def add(self, names: Iterable[str]) -> int:
        it = iter(names)
        chunk = list(islice(it, ADD_CHUNK))
        if not chunk:
            return 0
        added = 0
        self._unbounded = True  # a big import is long, not stuck (the server's own limits are off too)
        try:
            with self._write():
                # Another worker importing the same names holds their keys until it commits: wait for it,
                # however long its import takes, then find them present (a big import is not stuck, just long).
                self._exec("add_limits")
                while chunk:
                    added += _one(self._exec("add_tasks", {"keys": [task_key(n) for n in chunk], "names": chunk}))
                    chunk = list(islice(it, ADD_CHUNK))
                if added:
                    self._journal("added", detail=added_message(added))
                    self._work_ready()
        finally:
            self._unbounded = False
        return added

    def renew(self, worker_id: int, leases: Sequence[Lease], lease_seconds: float, completed: int) -> list[int]:
        self._set_lease(lease_seconds)
        params = {
            "worker_id": worker_id, "completed": completed, "lease": lease_seconds,
            "ids": [lease.task_id for lease in leases], "fences": [lease.fence for lease in leases],
            "ages": [lease.progress_age for lease in leases], "notes": [lease.note for lease in leases],
        }
        with self._write(durable=False):
            if not self._batch_depth:
                self._exec("renew_limits", {"timeout": f"{self._stall_ms}ms"})
            kept = {r[0] for r in self._exec("renew", params)}
        return [lease.task_id for lease in leases if lease.task_id not in kept]

    def complete(self, task_id: int, fence: int, result: bytes, kind: str) -> bool:
        cur = self._exec("complete", {"result": result, "kind": kind, "task_id": task_id, "fence": fence})
        return cur.fetchone() is not None

    def _complete_and_claim_straight(self, done: Claim, result: bytes, kind: str, worker_id: int, limit: int,
                                     lease_seconds: float, max_attempts: int, durable: bool,
                                     child: tuple[int, int] | None, alone: bool) -> tuple[bool, list[Claim]]:
        # One autocommitted statement, a synchronous commit whatever ``durable`` says (see _batch_transaction).
        # The statement notes ``child`` on what it claims (one claim here: see SqlStore.complete_and_claim).
        self._set_lease(lease_seconds)
        rows = self._exec("complete_and_claim", {
            "task_id": done.task_id, "fence": done.fence, "attempt": done.attempt, "result": result, "kind": kind,
            "worker_id": worker_id, "limit": limit, "lease": lease_seconds, "max_attempts": max_attempts,
            "pid": os.getpid(), "host": hostname(), "fenced": FENCED_DETAIL,
            "child_pid": child[0] if child else None, "child_start": child[1] if child else None,
            "alone": alone}).fetchall()
        claims = sorted((Claim(task_id=r[1], name=r[2], attempt=r[3], fence=r[4], max_attempts=r[5],
                               child_pid=child[0] if child else None, alone=bool(r[6]))
                         for r in rows if r[1] is not None), key=lambda c: c.task_id)
        return bool(rows[0][0]), claims

    def retry(self, names: Sequence[str] | None, by: str | None = None) -> int:
        with self._write():
            if names is None:
                changed = _one(self._exec("retry_failed"))
            else:
                changed = _one(self._exec("retry_named", {"keys": [task_key(n) for n in names]}))
            self._journal_retried(changed, by)
            if changed:
                self._work_ready()
        return changed

    # --- reading -------------------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        conn = self._live()
        counts = dict.fromkeys(STATES, 0)
        rows = 0
        for state, n, k in conn.execute(Q["counts"], {"job": self._job_id}):
            counts[state] = int(n)
            rows += k
        if rows > COMPACT_COUNTS_AFTER and not self._batch_depth and not in_transaction(conn):
            try:
                conn.execute(Q["counts_compact"])
            except self._pg.Error:
                pass  # only an optimisation: a read-only role (or a replica) reads the deltas as they are
        return counts

    def stats(self) -> Stats:
        conn = self._live()
        with _snapshot(conn, self._batch_depth > 0):
            counts = self.counts()
            running = self.running_tasks()
            workers = self.workers()
            done_last_minute, window = self._exec("done_last_minute").fetchone()
            errors = [event_of(r) for r in self._exec("recent_errors", {"limit": 5})]
            restarts = self._exec("count_restarts").fetchone()[0]
            paused = self.paused()
        return Stats(counts=counts, running_tasks=running, workers=workers, errors=errors,
                     done_last_minute=int(done_last_minute), restarts=int(restarts), rate_window=float(window),
                     paused=paused)

    def events(self, after_id: int = 0, task: str | None = None, limit: int = 1000,
               last: int | None = None) -> list[Event]:
        conn = self._live()
        bound = conn.execute(Q["events_bound"], {"app": application_name(conn)}).fetchone()[0]  # type: ignore[index]
        params: dict[str, Any] = {"after": after_id, "bound": bound, "limit": last if last is not None else limit}
        name = "events_last" if last is not None else "events_after"
        if task is not None:
            params["key"] = task_key(task)
            name += "_for_task"
        params["job"] = self._job_id
        return [event_of(r) for r in conn.execute(Q[name], params)]

    # --- durable steps -------------------------------------------------------------------------------
    def record_step(self, task_id: int, fence: int, step: StepRecord) -> bool:
        cur = self._exec("record_step", {"task_id": task_id, "fence": fence, "idx": step.index, "name": step.name,
                                         "kind": step.kind, "data": step.data, "at": step.at})
        return cur.fetchone() is not None

    def drop_steps(self, task_id: int, fence: int, from_index: int) -> bool:
        row = self._exec("drop_steps", {"task_id": task_id, "fence": fence, "from_idx": from_index}).fetchone()
        return bool(row and row[0])


# --- schema versions -----------------------------------------------------------------------------------
def _schema_version(conn: psycopg.Connection[Any], url: str) -> int | None:
    """The store's schema version; None when there is no store yet (no schema ``onward``, or an empty
    one); ``NotAStore`` when the schema holds something else."""
    exists, objects, has_meta = conn.execute(Q["schema_state"]).fetchone()  # type: ignore[misc]
    if not exists or (objects == 0 and not has_meta):
        return None
    foreign = NotAStore(f"not an onward store: {url} has a schema \"onward\" that onward did not create")
    if not has_meta:
        raise foreign
    import psycopg  # loaded already: the connection is its

    try:
        rows = dict(conn.execute(Q["schema_meta"]).fetchall())
    except psycopg.errors.UndefinedColumn:  # a table onward.meta of another program's: not ours
        raise foreign from None
    if rows.get("app") != "onward" or "schema_version" not in rows:
        raise foreign
    version = parse_schema_version(str(rows["schema_version"]))
    if version is None:  # (a version below 1 sent the upgrade looking for a migration that does not exist)
        raise foreign
    return version


def _migrate(conn: psycopg.Connection[Any], url: str, *, create: bool) -> int:
    """Bring the schema to SCHEMA_VERSION under the schema lock, in one transaction: workers that start
    at the same moment wait for the first one, then find the store made. Returns the version found
    before (0: there was none). With ``create`` only, an existing store is left as it is."""
    with conn.transaction():
        conn.execute(Q["lock_schema"])
        found = _schema_version(conn, url)
        if found is not None and (create or found >= SCHEMA_VERSION):
            return found
        if found is not None:
            refuse_live_workers(conn.execute(Q["unstopped_workers"]).fetchall(), url)
        for version in range((found or 0) + 1, SCHEMA_VERSION + 1):
            conn.execute(migration(Q, version))
        conn.execute(Q["set_meta"], {"version": str(SCHEMA_VERSION)})
        return SCHEMA_VERSION if create else (found or 0)


def upgrade(url: str) -> tuple[int, int]:
    """``onward db upgrade``: create the store, or bring its schema to this onward's version. Returns the
    versions before and after. Refuses a newer store (``SchemaTooNew``) and a foreign schema."""
    target = Target(url)
    pg, shown = target.pg, target.shown
    try:
        conn = pg.connect(target.conninfo, autocommit=True)
    except pg.Error as e:
        raise _upgrade_error(e, f"store {shown}: {target.text(e)}") from None
    try:
        before = _schema_version(conn, shown) or 0
        if before > SCHEMA_VERSION:
            check_schema_version(before, SCHEMA_VERSION, shown)
        if before < SCHEMA_VERSION:
            before = _migrate(conn, shown, create=False)
        return before, SCHEMA_VERSION
    except pg.Error as e:
        raise _upgrade_error(e, f"store {shown}: {target.text(e)}") from None
    finally:
        conn.close()


def _upgrade_error(e: BaseException, text: str) -> StoreError:
    """A server that cannot serve the upgrade now (down, starting, full, a lock held past the timeout) is
    unavailable (exit 75), as for every other command; anything else is configuration (exit 2)."""
    return StoreUnavailable(text) if _server_unavailable(e) else StoreError(text)


# --- helpers -------------------------------------------------------------------------------------------
def _one(cur: psycopg.Cursor[Any]) -> int:
    """The single number a statement returns (its count, as a row)."""
    row = cur.fetchone()
    return int(row[0]) if row else 0


def _insert_events(conn: psycopg.Connection[Any], rows: Sequence[JournalRow], job_id: int) -> None:
    """Journal rows of one job, in order: one statement per run of rows from the same process (in practice,
    one for the whole batch). The server stamps each row's time."""
    start = 0
    while start < len(rows):
        pid, host = rows[start].pid, rows[start].host
        end = start + 1
        while end < len(rows) and end - start < EVENTS_PER_INSERT and (rows[end].pid, rows[end].host) == (pid, host):
            end += 1
        values: dict[str, Any] = {"pid": pid, "host": host, "job": job_id}
        for i, row in enumerate(rows[start:end]):
            values.update({f"kind_{i}": row.kind, f"worker_id_{i}": row.worker_id, f"task_id_{i}": row.task_id,
                           f"attempt_{i}": row.attempt, f"detail_{i}": row.detail})
        conn.execute(_events_sql(end - start), values)
        start = end


@functools.lru_cache(maxsize=64)
def _events_sql(n: int) -> str:
    """The journal insert for ``n`` events. Plain VALUES rather than arrays: a batch writes a few events,
    and for so few, unpacking arrays costs the server and psycopg more than the extra text (and psycopg
    keeps its parsed form of a statement with up to 50 parameters: nine events)."""
    return Q["log_events"].replace("{rows}", ", ".join(
        f"(%(kind_{i})s, %(worker_id_{i})s, %(task_id_{i})s, %(attempt_{i})s, %(detail_{i})s)" for i in range(n)))


@contextmanager
def _snapshot(conn: psycopg.Connection[Any], nested: bool) -> Iterator[None]:
    """One read-only snapshot, so that numbers read by several statements agree with each other."""
    if nested:
        yield
        return
    with conn.transaction():
        conn.execute(Q["snapshot"])
        yield


__all__ = ["PostgresStore", "SCHEMA_VERSION", "upgrade"]
