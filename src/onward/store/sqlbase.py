"""What the two SQL backends share: one class, ``SqlStore``, holding every part of the ``Store`` contract
that does not depend on the database (decoding rows, paging, the order claims are handed out in, nested
batches, the journal's wording, schema-version checks, error translation). A backend derives from it and
supplies its SQL (its ``.sql`` file, with named parameters of the same names in both) and what truly
differs: how a statement is run and committed, whose clock the SQL reads, how a task name is keyed, and
how its driver's errors read.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, NamedTuple, TypeVar

from ..errors import JobMissing, SchemaTooNew, SchemaTooOld, StoreError, WorkersRunning
from ..proc import hostname, worker_live
from .base import (
    CANCELLED,
    DONE,
    FAILED,
    FENCED_DETAIL,
    FINAL_STATES,
    PENDING,
    RUNNING,
    STATES,
    WAITING,
    Claim,
    HostRestarts,
    JobRow,
    Owner,
    PendingSync,
    Reclaimed,
    RunningTask,
    SourceMark,
    StepRecord,
    StoredResult,
    TaskRow,
    Totals,
    WaitRow,
    WorkerRow,
)
from .rows import running_task_of, step_of, task_row_of, worker_of

# The schema both backends write; each one's .sql file holds its migrations to it (see sql.migration).
SCHEMA_VERSION = 6
# Tasks per page when listing: each page is its own statement, so a long listing pins no old snapshot.
PAGE_SIZE = 1000
# How long one store call may be kept waiting (for a lock, or by the network), in ms: a quarter of the lease
# the runner works with, at least the first figure. The runner stops its tasks a third of a lease before the
# lease runs out, so a call stuck for longer than a quarter could leave it no time to do so.
STALL_FLOOR_MS = 250
# The job of a handle opened for no job (store.list_jobs): never a job's name (job_name refuses it).
NO_JOB = ""
NO_TASK_ID = 1 << 62  # above every task id: task_page()'s ``until`` when none is given
# task_page() reads pending tasks from their index (and sorts them) up to this many; beyond, they are common
# enough for a walk along the ids to fill a page soon.
FEW_PENDING = 50_000
# activity() takes a bucket for closed (never to change again) once it ended this many seconds ago.
ACTIVITY_SETTLE = 300.0
# The live workers a refused upgrade names by host and pid (refuse_live_workers); the rest are counted.
LIVE_WORKERS_SHOWN = 10
M = TypeVar("M", bound=Callable[..., Any])
_IN_THE_BATCH = nullcontext()  # a write inside a batch: the batch's commit covers it


class JournalRow(NamedTuple):
    """One event for the journal, as ``_journal`` was given it (``at``: the time of that call on SQLite;
    None on PostgreSQL, where the server stamps the row)."""

    kind: str
    pid: int
    host: str
    worker_id: int | None
    task_id: int | None
    attempt: int | None
    detail: str | None
    at: float | None


def stall_ms(lease_seconds: float, ceiling_ms: int | None = None) -> int:
    """The bound on one call's wait for a lease of ``lease_seconds`` (see STALL_FLOOR_MS)."""
    ms = max(STALL_FLOOR_MS, int(lease_seconds * 1000 / 4))
    return ms if ceiling_ms is None else min(ceiling_ms, ms)


def parse_schema_version(text: str) -> int | None:
    """The schema version a store's meta table records, or None when the text is not one: a whole number
    from 1 up, in plain digits. Anything else (a damaged or hand-edited meta row) would name no migration
    to start from, and must be refused as a damaged store, not upgraded from."""
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        return None
    return int(text)


def check_schema_version(found: int, wanted: int, where: str) -> None:
    """Refuse a store whose schema version is not ``wanted`` (the backend's ``SCHEMA_VERSION``, passed in
    so that it is read when the check runs), with the one message that says what to do."""
    if found > wanted:
        raise SchemaTooNew(f"store {where} has schema version {found}, newer than this onward's {wanted};"
                           " upgrade onward")
    if found < wanted:
        raise SchemaTooOld(f"store {where} has schema version {found}, older than this onward's {wanted};"
                           " run `onward db upgrade`")


def refuse_live_workers(rows: Iterable[tuple[str, str, int, int, float]], where: str) -> None:
    """Refuse to upgrade a store that records a live worker (``rows``: host, host_key, pid, pid_start and
    heartbeat age of each one not stopped). This onward refuses a store that is not upgraded, so such a
    worker runs an older onward, whose queries would meet the new schema: indexes it names gone (it retried
    for minutes holding its task), tasks of every job claimed as its own. Its code cannot be changed; the
    upgrade waits for it to stop. Live as everywhere else: its process running on this host, a heartbeat
    under a minute old elsewhere."""
    live = [(host, pid) for host, key, pid, start, age in rows if worker_live(Owner(host, key, pid, start), age)]
    if live:
        shown = ", ".join(f"{host} pid {pid}" for host, pid in live[:LIVE_WORKERS_SHOWN])
        more = f" and {len(live) - LIVE_WORKERS_SHOWN} more" if len(live) > LIVE_WORKERS_SHOWN else ""
        raise WorkersRunning(f"store {where}: {len(live)} worker{'s' if len(live) > 1 else ''} of an older onward"
                             f" still running ({shown}{more}); stop {'them' if len(live) > 1 else 'it'} before"
                             " `onward db upgrade` (nothing was changed)")


def like_pattern(search: str) -> str:
    """A LIKE pattern matching names that contain ``search``, its ``%``, ``_`` and ``\\`` taken literally
    (the queries say ``ESCAPE '\\'``)."""
    escaped = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def added_message(added: int) -> str:
    """The journal's detail for one ``add`` call."""
    return f"{added} new task{'s' if added != 1 else ''}"


def translating(method: M) -> M:
    """The method, raising ``StoreError`` (via the backend's ``_translate_error``) instead of a bare driver
    error; a generator (``iter_tasks``) is translated for as long as it is iterated, since its reads happen
    then, not when it is called."""
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def generator(self: SqlStore, *args: Any, **kwargs: Any) -> Iterator[Any]:
            with self._translated():
                yield from method(self, *args, **kwargs)
        return generator  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: SqlStore, *args: Any, **kwargs: Any) -> Any:
        # A plain try rather than _translated(): this runs on every call, and costs nothing until a raise.
        try:
            return method(self, *args, **kwargs)
        except self._driver_error() as e:
            raise self._translate_error(e) from None
    return wrapper  # type: ignore[return-value]


def _translate_public_methods(cls: type) -> None:
    """Apply ``translating`` to every public method the class defines: done to each class as a whole (the
    base and every backend), so a method added later cannot be left out."""
    for name, member in list(vars(cls).items()):
        if not name.startswith("_") and inspect.isfunction(member):
            setattr(cls, name, translating(member))


class SqlStore:
    """The shared part of a SQL ``Store``. Subclasses implement the hooks below (``_exec`` and the rest)."""

    url: str
    job: str  # the job this handle sees
    _job_id = 0  # its id in the store, passed to every query as ``job``
    # activity(): per bucket size, the time up to which buckets are closed, and their completions
    _activity_kept: dict[int, tuple[float, dict[float, int]]]
    _batch_depth = 0
    _events: list[JournalRow]  # the journal rows of the open batch, written just before its commit
    _sync_owed = False  # a batch was committed crash-safe (durable=False) since the last sync
    _stall_ms: int | None = None  # the bound on one call's wait, once the runner named a lease
    _stall_ceiling_ms: int | None = None  # the longest that bound may be, whatever the lease

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _translate_public_methods(cls)

    # --- what a backend supplies ---------------------------------------------------------------------
    def _driver_error(self) -> type[BaseException] | tuple[type[BaseException], ...]:
        """The base class (or classes) of the errors the driver raises."""
        raise NotImplementedError

    def _translate_error(self, e: BaseException) -> StoreError:
        """The ``StoreError`` (one line, no secret) for a driver error."""
        raise NotImplementedError

    def _exec(self, name: str, params: dict[str, Any] | None = None) -> Any:
        """Run the named query with named parameters, on the transaction open now if any; its cursor."""
        raise NotImplementedError

    def _clock(self) -> dict[str, Any]:
        """Parameters giving the SQL the time (SQLite: ``now`` from here; PostgreSQL: none, the server's)."""
        raise NotImplementedError

    def _key(self, name: str) -> Any:
        """How the SQL finds a task by name (the ``key`` parameter)."""
        raise NotImplementedError

    def _transaction(self, durable: bool) -> AbstractContextManager[None]:
        """One write transaction; a crash-safe one (not ``durable``) may skip waiting for stable storage."""
        raise NotImplementedError

    def _on_its_own(self, name: str, params: dict[str, Any]) -> list[Any]:
        """Run one write statement as a transaction of its own (or in the open batch); its rows."""
        raise NotImplementedError

    def _apply_stall_bound(self) -> None:
        """Make the connection keep to ``_stall_ms`` (at once, or before its next call)."""
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        """Number of tasks in each state (every state present): the backend reads them its own way."""
        raise NotImplementedError

    def now(self) -> float:
        """The store's clock (see ``Connection.now``)."""
        raise NotImplementedError

    def record_step(self, task_id: int, fence: int, step: StepRecord) -> bool:
        """See ``StepJournal.record_step``: the backend checks the fence its own way."""
        raise NotImplementedError

    def complete(self, task_id: int, fence: int, result: bytes, kind: str) -> bool:
        """See ``WorkQueue.complete``: the backend keeps its counts its own way."""
        raise NotImplementedError

    def _work_ready(self) -> None:
        """Tell idle workers that a task became ready, in the open transaction (a no-op where they poll)."""

    def _journal(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                 attempt: int | None = None, detail: str | None = None, pid: int | None = None,
                 host: str | None = None) -> None:
        """Append one event to the journal in the open transaction. Inside a batch the event waits in memory,
        and the batch writes all of its events with one statement just before its commit: the journal costs
        a completion and its next claim one statement, not one per event."""
        event = JournalRow(kind, pid or os.getpid(), host or hostname(), worker_id, task_id, attempt, detail,
                           self._clock().get("now"))
        if self._batch_depth:
            self._events.append(event)
        else:
            self._insert_events([event])

    def _insert_events(self, events: Sequence[JournalRow]) -> None:
        """Write journal rows, in the order given, in the open transaction."""
        raise NotImplementedError

    # --- errors and transactions ---------------------------------------------------------------------
    @contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except self._driver_error() as e:
            raise self._translate_error(e) from None

    def _write(self, durable: bool = True) -> AbstractContextManager[None]:
        """One write transaction, unless a batch is open (then its commit covers this write). Its driver
        errors are translated by the public method it serves."""
        return _IN_THE_BATCH if self._batch_depth else self._transaction(durable)

    @contextmanager
    def batch(self, durable: bool = True) -> Iterator[None]:
        if self._batch_depth:
            self._batch_depth += 1
            try:
                yield
            finally:
                self._batch_depth -= 1
            return
        with self._translated(), self._batch_transaction(durable):
            self._batch_depth = 1
            self._events = []
            try:
                yield
                if self._events:
                    self._insert_events(self._events)
            finally:
                self._batch_depth = 0
                self._events = []
        self._note_commit(durable)

    # Whether the last commit changed anything: a backend whose commits can be empty says so (SQLite).
    _last_commit_wrote = True

    def _note_commit(self, durable: bool) -> None:
        """After a batch's commit: a crash-safe one owes a sync; a durable one that wrote covers the crash-safe
        ones before it, as the log is sequential. A durable commit that wrote nothing synced nothing."""
        if not durable:
            self._sync_owed = True
        elif self._last_commit_wrote:
            self._sync_owed = False

    def _batch_transaction(self, durable: bool) -> AbstractContextManager[None]:
        return self._transaction(durable)

    def sync(self) -> None:
        if self._sync_owed:
            self._sync()
            self._sync_owed = False

    def _sync(self) -> None:
        """Bring every commit so far to stable storage (``sync``, when a crash-safe batch is not yet)."""
        raise NotImplementedError

    def sync_ahead(self, gather: float = 0.0) -> PendingSync | None:
        self.sync()  # no background sync here: in place (a backend that has one overrides both)
        return None

    def sync_ahead_fd(self) -> int | None:
        return None

    def idle(self) -> None:
        pass  # nothing held between looks (SQLite's log index: SqliteStore overrides)

    def log_held_back(self) -> int | None:
        return None  # the server keeps its own log (SqliteStore overrides)

    def tidy(self) -> None:
        pass  # nothing to look after (PostgresStore overrides)

    def _set_lease(self, lease_seconds: float) -> None:
        """Tie how long one call may wait to the lease the runner works with (see STALL_FLOOR_MS)."""
        bound = stall_ms(lease_seconds, self._stall_ceiling_ms)
        if bound != self._stall_ms:
            self._stall_ms = bound
            self._apply_stall_bound()

    # --- the job ------------------------------------------------------------------------------------
    def _open_job(self, create: bool) -> None:
        """Find this handle's job, creating it (with its counts) when ``create``; ``StoreMissing`` when there
        is no such job and ``create`` is false. Run once, when the store is opened."""
        self._activity_kept = {}
        if self.job == NO_JOB:
            self._job_id = 0  # no job has that id: such a handle (store.list_jobs) reads what spans the jobs
            return
        row = self._exec("find_job", {"name": self.job}).fetchone()
        if row is None:
            if not create:
                raise JobMissing(f"no job {self.job!r} in store {self.url}")
            with self._write():
                self._exec("create_job", {**self._clock(), "name": self.job})
                row = self._exec("find_job", {"name": self.job}).fetchone()
                self._job_id = int(row[0])
                self._exec("create_job_counts")
        self._job_id = int(row[0])

    def jobs(self) -> list[JobRow]:
        found: dict[str, tuple[bool, dict[str, int]]] = {}
        for name, paused, state, n in self._exec("jobs").fetchall():
            entry = found.setdefault(name, (bool(paused), dict.fromkeys(STATES, 0)))
            if state is not None:
                entry[1][state] = int(n)
        return [JobRow(name=name, counts=counts, paused=paused) for name, (paused, counts) in found.items()]

    def paused(self) -> bool:
        row = self._exec("paused").fetchone()
        return bool(row and row[0])

    def set_paused(self, paused: bool) -> bool:
        with self._write():
            changed = self._exec("set_paused", {"paused": paused}).fetchone() is not None
            if changed:
                self._journal("paused" if paused else "resumed",
                              detail="claiming nothing new" if paused else "claiming again")
                if not paused:
                    self._work_ready()
        return changed

    # --- the work queue ------------------------------------------------------------------------------
    def cancel(self, names: Sequence[str]) -> dict[str, str]:
        outcome: dict[str, str] = {}
        with self._write():
            for name in names:
                if name in outcome:
                    continue
                key = self._key(name)
                # The task's row lock first (see lock_task): a park, a send or a claim committed between the
                # statements below was missed by all three (a task parked meanwhile stayed waiting).
                found = self._exec("task_id", {"key": key}).fetchone()
                if found is not None:
                    self._exec("lock_task", {"task_id": found[0]})
                row = self._exec("cancel_pending", {**self._clock(), "key": key}).fetchone()
                if row is not None:
                    outcome[name] = CANCELLED
                    self._journal("cancelled", task_id=row[0], detail="cancelled while pending")
                    continue
                row = self._exec("cancel_waiting", {**self._clock(), "key": key}).fetchone()
                if row is not None:
                    outcome[name] = CANCELLED
                    self._journal("cancelled", task_id=row[0], detail="cancelled while waiting")
                    continue
                row = self._exec("cancel_running", {"key": key}).fetchone()
                if row is not None:
                    outcome[name] = "cancelling"
                    self._journal("cancel requested", task_id=row[0], attempt=row[1],
                                  detail="its worker stops it at its next heartbeat")
                    continue
                task = self._exec("task", {"key": key}).fetchone()
                outcome[name] = "unknown" if task is None else f"already {task[2]}"
        return outcome

    def cancelling(self, worker_id: int) -> list[int]:
        return [r[0] for r in self._exec("cancelling", {"worker_id": worker_id}).fetchall()]

    def claim(self, worker_id: int, limit: int, lease_seconds: float, max_attempts: int,
              child: tuple[int, int] | None = None, alone: bool = False) -> list[Claim]:
        self._set_lease(lease_seconds)
        # A process made ahead for one claim is noted by the claim itself; for more, on the first task after.
        one = child if limit == 1 else None
        params = {**self._clock(), "worker_id": worker_id, "lease": lease_seconds, "limit": limit,
                  "max_attempts": max_attempts, "child_pid": one[0] if one else None,
                  "child_start": one[1] if one else None, "alone": alone and limit == 1}
        if child is None or one is not None:
            rows = self._on_its_own("claim", params)
        else:
            with self._write():
                rows = self._exec("claim", params).fetchall()
                if rows:
                    first = min(rows)
                    self._exec("note_child", {"pid": child[0], "start": child[1], "task_id": first[0],
                                              "fence": first[3]})
        rows.sort()  # RETURNING gives no order guarantee; hand tasks out in the order they were added
        claims = [Claim(task_id=r[0], name=r[1], attempt=r[2], fence=r[3], max_attempts=r[4], alone=bool(r[5]))
                  for r in rows]
        if child is not None and claims:
            claims[0] = claims[0]._replace(child_pid=child[0])
        return claims

    def alone_ready(self) -> bool:
        return bool(self._exec("alone_ready", self._clock()).fetchone()[0])

    def next_ready_in(self) -> float | None:
        row = self._exec("next_ready_in", self._clock()).fetchone()
        return None if row is None else float(row[0])

    def complete_and_claim(self, done: Claim, result: bytes, kind: str, worker_id: int, limit: int,
                           lease_seconds: float, max_attempts: int, durable: bool = True,
                           child: tuple[int, int] | None = None, alone: bool = False) -> tuple[bool, list[Claim]]:
        # The hot path at concurrency 1 takes the backend's straight way (_complete_and_claim_straight): outside
        # a batch, and with a process made ahead noted on the one claim (the claim statement notes it; for
        # more claims, on the first of them, the batch's way).
        if not self._batch_depth and (child is None or limit == 1):
            return self._complete_and_claim_straight(done, result, kind, worker_id, limit, lease_seconds,
                                                     max_attempts, durable, child, alone and limit == 1)
        return self._complete_and_claim_in_batch(done, result, kind, worker_id, limit, lease_seconds, max_attempts,
                                                 durable, child, alone)

    def _complete_and_claim_straight(self, done: Claim, result: bytes, kind: str, worker_id: int, limit: int,
                                     lease_seconds: float, max_attempts: int, durable: bool,
                                     child: tuple[int, int] | None, alone: bool) -> tuple[bool, list[Claim]]:
        """``complete_and_claim`` in a transaction of its own, the backend's straight way (see there)."""
        raise NotImplementedError

    def _complete_and_claim_in_batch(self, done: Claim, result: bytes, kind: str, worker_id: int, limit: int,
                                     lease_seconds: float, max_attempts: int, durable: bool,
                                     child: tuple[int, int] | None, alone: bool) -> tuple[bool, list[Claim]]:
        with self.batch(durable):
            if self.complete(done.task_id, done.fence, result, kind):
                completed = True
                self._journal("done", task_id=done.task_id, worker_id=worker_id, attempt=done.attempt)
            else:
                completed = self.settled_under(done.task_id, done.fence) == DONE  # journaled by that commit
                if not completed:
                    self._journal("fenced", task_id=done.task_id, worker_id=worker_id, attempt=done.attempt,
                                  detail=FENCED_DETAIL)
            claims = self.claim(worker_id, limit, lease_seconds, max_attempts, child, alone) if limit > 0 else []
            for claim in claims:
                self._journal("claimed", task_id=claim.task_id, worker_id=worker_id, attempt=claim.attempt)
        return completed, claims

    def note_child(self, task_id: int, fence: int, child_pid: int, child_start: int) -> bool:
        with self._write(durable=False):
            return self._exec("note_child", {"pid": child_pid, "start": child_start, "task_id": task_id,
                                             "fence": fence}).rowcount == 1

    def holds(self, task_id: int, fence: int) -> bool:
        return self._exec("fence_holds", {"task_id": task_id, "fence": fence}).fetchone() is not None

    def settled_under(self, task_id: int, fence: int) -> str | None:
        row = self._exec("settled_under", {"task_id": task_id, "fence": fence}).fetchone()
        return None if row is None else row[0]

    def fail(self, task_id: int, fence: int, error: str, retry_delay: float) -> str | None:
        with self._write():
            row = self._exec("fail", {**self._clock(), "delay": retry_delay, "error": error, "task_id": task_id,
                                      "fence": fence}).fetchone()
            if row is not None and row[0] == PENDING:
                self._work_ready()
        return row[0] if row else None

    def release(self, task_id: int, fence: int, reason: str) -> str | None:
        with self._write():
            row = self._exec("release", {**self._clock(), "task_id": task_id, "fence": fence}).fetchone()
            if row is not None and row[0] == PENDING:
                self._work_ready()
        return str(row[0]) if row is not None else None

    def reclaim(self, task_id: int, fence: int, decide: Callable[[RunningTask], str | None],
                shared: bool = False) -> Reclaimed | None:
        with self._write():
            # Read again under the lock the reclaim commits with (see running_one): the owner can renew
            # neither before the caller decides on this read nor before what it decides is committed.
            found = self._exec("running_one", {**self._clock(), "task_id": task_id, "fence": fence}).fetchone()
            why = decide(running_task_of(found)) if found is not None else None
            if why is None:
                return None
            row = self._exec("reclaim", {**self._clock(), "reason": why, "task_id": task_id, "fence": fence,
                                         "shared": shared}).fetchone()
            if row is not None and row[0] == PENDING:
                self._work_ready()
        return Reclaimed(state=row[0], counted=bool(row[1])) if row else None

    def running_tasks(self) -> list[RunningTask]:
        rows = self._exec("running", self._clock()).fetchall()
        return sorted((running_task_of(r) for r in rows), key=lambda t: t.task_id)

    # --- reading -------------------------------------------------------------------------------------
    def task(self, name: str) -> TaskRow | None:
        row = self._exec("task", {"key": self._key(name)}).fetchone()
        return task_row_of(row) if row else None

    def task_id(self, name: str) -> int | None:
        row = self._exec("task_id", {"key": self._key(name)}).fetchone()
        return row[0] if row else None

    def result(self, name: str) -> StoredResult | None:
        row = self._exec("result", {"key": self._key(name)}).fetchone()
        return StoredResult(kind=row[0], data=bytes(row[1])) if row else None

    def iter_tasks(self, state: str | None = None) -> Iterator[TaskRow]:
        # Pages by id, each page its own statement: a long listing never pins an old snapshot.
        after = 0
        while True:
            if state is None:
                rows = self._exec("iter_tasks", {"after": after, "limit": PAGE_SIZE}).fetchall()
            else:
                params = {"after": after, "until": NO_TASK_ID, "state": state, "limit": PAGE_SIZE}
                rows = self._exec("iter_tasks_in_state", params).fetchall()
            if not rows:
                return
            for r in rows:
                yield task_row_of(r)
            after = rows[-1][0]

    def task_page(self, state: str | None, search: str | None, after: int, limit: int,
                  until: int | None = None) -> list[TaskRow]:
        # Keyset paging on the id: a page costs the same wherever it starts. Running, failed and cancelled
        # tasks are read from their own small indexes (waiting ones too), and pending ones from theirs while they are few (a
        # job near its end has them all at its end: walking the ids would pass every done task first); the
        # rest walk the ids from ``after`` and stop once the page is full (see the SQL).
        params = {"after": after, "limit": limit, "state": state, "until": NO_TASK_ID if until is None else until,
                  "pattern": like_pattern(search) if search else None}
        if state == RUNNING:
            name = "iter_running_tasks"
        elif state == WAITING:
            name = "iter_waiting_tasks"
        elif state == PENDING and self.counts().get(PENDING, 0) <= FEW_PENDING:
            name = "iter_pending_tasks"
        elif state in (FAILED, CANCELLED):
            name = "iter_tasks_ended_badly"
        elif search:
            name = "task_page_search" if state is None else "task_page_search_in_state"
        else:
            name = "iter_tasks" if state is None else "iter_tasks_in_state"
        rows = [task_row_of(r) for r in self._exec(name, params).fetchall()]
        # The searches and the walks in one state stop at ``until`` in SQL; the small indexes above are read
        # whole, so their rows beyond it are dropped here. Ids come in order, so what is kept is still a prefix.
        return rows if until is None else [r for r in rows if r.task_id <= until]

    def activity(self, bucket_seconds: int = 60) -> list[tuple[float, int, int]]:
        # Completions are counted from the index of done tasks' finish times. Done is final, so a bucket
        # that closed a while ago never changes: this handle keeps those, and each later call reads only
        # the tasks finished since (a live chart on a million-task job reads a few minutes' worth). Failed
        # attempts come from the journal's small index of failures, read whole each time.
        bucket = max(1, int(bucket_seconds))
        kept_until, kept = self._activity_kept.get(bucket, (0.0, {}))
        recent = dict(self._exec("activity_done", {"bucket": bucket, "since": kept_until}).fetchall())
        done = {**kept, **{float(at): int(n) for at, n in recent.items()}}
        # Closed: buckets that ended ACTIVITY_SETTLE seconds ago (a commit stamped earlier than it became
        # visible, on PostgreSQL, is well within that).
        closed = (self.now() - ACTIVITY_SETTLE) // bucket * bucket
        self._activity_kept[bucket] = (closed, {at: n for at, n in done.items() if at < closed})
        failed = {float(at): int(n) for at, n in self._exec("activity_failed", {"bucket": bucket}).fetchall()}
        return [(at, done.get(at, 0), failed.get(at, 0)) for at in sorted(done.keys() | failed.keys())]

    def totals(self) -> Totals:
        counts = self.counts()
        return Totals(completions=counts.get(DONE, 0),
                      failed_attempts=int(self._exec("count_failed_attempts").fetchone()[0]),
                      final_failures=counts.get(FAILED, 0), cancelled=counts.get(CANCELLED, 0),
                      restarts=int(self._exec("count_restarts").fetchone()[0]),
                      step_replays=int(self._exec("count_step_replays").fetchone()[0]))

    def workers(self) -> list[WorkerRow]:
        return [worker_of(r) for r in self._exec("live_workers", self._clock())]

    def restarts_by_host(self) -> list[HostRestarts]:
        # Both backends' SQL gives host, count, the latest one's time and detail (SQLite adds max(id)).
        return [HostRestarts(host=r[0], count=int(r[1]), last_at=r[2], last_cause=r[3])
                for r in self._exec("restarts_by_host")]

    # --- workers and the journal ---------------------------------------------------------------------
    def register_worker(self, owner: Owner, detail: str) -> int:
        with self._write():
            worker_id = int(self._exec("register_worker", {
                **self._clock(), "host": owner.host, "host_key": owner.host_key, "pid": owner.pid,
                "pid_start": owner.pid_start, "detail": detail}).fetchone()[0])
            self._journal("worker started", worker_id=worker_id, detail=detail, pid=owner.pid, host=owner.host)
        return worker_id

    def worker_stopped(self, worker_id: int, reason: str) -> None:
        with self._write():
            self._exec("worker_stopped", {**self._clock(), "reason": reason, "worker_id": worker_id})
            self._journal("worker stopped", worker_id=worker_id, detail=reason)

    def _journal_retried(self, changed: int, by: str | None) -> None:
        """The journal line of a retry, in its transaction: a journal that cannot be written (a damaged
        store) rolls the retry back, so a refused retry has changed nothing."""
        if changed:
            self._journal("retried", detail=f"{changed} task{'s' if changed != 1 else ''} back to pending"
                                            + (f" ({by})" if by else ""))

    def log_event(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                  attempt: int | None = None, detail: str | None = None, durable: bool = False) -> None:
        with self._write(durable=durable):
            self._journal(kind, task_id=task_id, worker_id=worker_id, attempt=attempt, detail=detail)

    # --- import marks and durable steps --------------------------------------------------------------
    def get_source(self, path_key: str) -> SourceMark | None:
        row = self._exec("get_source", {"path": path_key}).fetchone()
        return SourceMark(*row) if row else None

    def set_source(self, path_key: str, mark: SourceMark) -> None:
        with self._write():
            self._exec("set_source", {"path": path_key, "identity": mark.identity, "size": mark.size,
                                      "lines": mark.lines, "mtime_ns": mark.mtime_ns,
                                      "head_digest": mark.head_digest, "tail_digest": mark.tail_digest})

    def steps(self, task_id: int) -> list[StepRecord]:
        return [step_of(r) for r in self._exec("steps", {"task_id": task_id})]

    # --- durable waits -------------------------------------------------------------------------------
    def send(self, name: str, key: str, value: str) -> str:
        with self._write():
            task = self._exec("task", {"key": self._key(name)}).fetchone()
            if task is None:
                return "unknown"
            task_id = task[0]
            locked = self._exec("lock_task", {"task_id": task_id}).fetchone()  # its state, as of the lock
            if locked is None:
                return "unknown"
            state = locked[0]
            if state in FINAL_STATES:
                return f"already {state}"
            params = {**self._clock(), "task_id": task_id, "wait_key": key, "value": value}
            if self._exec("send", params).fetchone() is None:
                return "already sent"
            delivered = self._exec("deliver", {"task_id": task_id, "wait_key": key}).fetchone() is not None
            self._journal("sent", task_id=task_id,
                          detail=f"a value for {key!r} ({len(value.encode())} bytes)"
                          + ("; the task waited for it: runnable again" if delivered else "; kept until it waits"))
            if delivered:
                self._work_ready()
        return "delivered" if delivered else "stored"

    def mail(self, task_id: int, key: str) -> tuple[str | None, float | None]:
        self._exec("lock_task", {"task_id": task_id})  # a send waits until the wait is recorded or parked
        row = self._exec("mail", {"task_id": task_id, "wait_key": key}).fetchone()
        return (None, None) if row is None else (row[0], row[1])

    def record_wait(self, task_id: int, fence: int, step: StepRecord, key: str) -> bool:
        with self.batch():
            if not self.record_step(task_id, fence, step):
                return False
            self._exec("take_mail", {"task_id": task_id, "wait_key": key})
            self._exec("wait_done", {"task_id": task_id})
        return True

    def park(self, task_id: int, fence: int, key: str, until: float | None) -> str | None:
        with self._write():
            self._exec("lock_task", {"task_id": task_id})  # before the park's statement reads the mailbox
            row = self._exec("park", {**self._clock(), "task_id": task_id, "fence": fence, "wait_key": key,
                                      "until": until}).fetchone()
            if row is not None and row[0] == PENDING:
                self._work_ready()
        return str(row[0]) if row is not None else None

    def wake_due(self, behind: bool = False) -> int:
        with self._write():
            cur = self._exec("wake_due", {**self._clock(), "behind": behind})
            row = cur.fetchone() if cur.description else None
            woken = int(row[0]) if row is not None else max(cur.rowcount, 0)
            if woken:
                self._work_ready()
        return woken

    def waits(self, limit: int = 100) -> list[WaitRow]:
        return [WaitRow(name=r[0], key=r[1], until=None if r[2] is None else float(r[2]))
                for r in self._exec("waits", {"limit": limit}).fetchall()]


_translate_public_methods(SqlStore)
