"""The storage contract: the few operations a durable runner needs, each with its guarantee.

Every backend (``sqlite.py``, ``postgres.py``) implements ``Store``; the runner, the CLI and the Python API
only ever talk to this protocol. Words used here mean one thing each (see the README glossary):

- *claim*: a worker takes a pending task; the claim counts an *attempt* and bumps the task's *fence*.
- *fence*: a number that grows on every claim. Every write a worker makes about a running task (renew,
  step, complete, fail, release) names the fence it claimed under, and is refused when the fence moved on:
  the task was reclaimed and belongs to someone else now.
- *lease*: the time until which a claim is valid, renewed by the owner's heartbeat. All lease times come
  from the store's own clock (the local clock for SQLite, the database server's for PostgreSQL).
- *durable*: a write that returned has reached stable storage (an fsync, or a synchronous commit);
  *crash-safe*: it survives the process being killed but not necessarily a power cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

# Task states: in states.py (see there), re-exported here, where the contract speaks of them.
from .states import CANCELLED, DONE, FAILED, FINAL_STATES, PENDING, RUNNING, STATES, WAITING  # noqa: F401

# The journal's detail for an outcome refused because its task was taken over (event "fenced").
FENCED_DETAIL = "outcome not committed: the task was taken over"

# How a result's bytes are to be read back (see onward.results).
RESULT_KINDS = ("bytes", "str", "json")


class PendingSync:
    """A sync started by ``Store.sync_ahead``: calling it waits for the sync (and raises as ``Store.sync``
    would); ``finished()`` says, without waiting, whether that call would return at once."""

    __slots__ = ("_wait", "_finished")

    def __init__(self, wait: Callable[[], None], finished: Callable[[], bool]) -> None:
        self._wait, self._finished = wait, finished

    def __call__(self) -> None:
        self._wait()

    def finished(self) -> bool:
        return self._finished()


# The rows below are NamedTuples (immutable, compared by value) rather than frozen dataclasses: a dataclass
# compiles its methods when its module loads, about 1.5 ms a class here, and every onward command loads
# this module (a restarted worker's start-up is on the recovery path). Two rows keep the dataclass because
# a field of theirs is named like a tuple method (count, index); Stats, for its default_factory.
class Owner(NamedTuple):
    """Who runs a worker: enough to tell, on the same host, whether that process is still alive."""

    host: str  # the host name, shown to people
    host_key: str  # host name + boot id + pid namespace: equal only for processes that share a pid space
    pid: int
    pid_start: int  # the process's start time in clock ticks since boot (/proc/PID/stat field 22)


class Claim(NamedTuple):
    """A task handed to one worker. ``fence`` must accompany every later write about it."""

    task_id: int
    name: str
    attempt: int  # 1-based count of attempts, this one included
    fence: int
    max_attempts: int
    child_pid: int | None = None  # a process noted with the claim, to run its command (``claim``'s ``child``)
    alone: bool = False  # to run alone (see ``Store.reclaim``): nothing else may run beside it


class Reclaimed(NamedTuple):
    """What ``Store.reclaim`` did with a task taken from its owner."""

    state: str  # PENDING, or FAILED when a counted attempt used up the task's attempts
    counted: bool  # False: the attempt had recorded a step beyond any before it, so it was given back


class Lease(NamedTuple):
    """A running task as the owning worker knows it, for ``Store.renew``."""

    task_id: int
    fence: int
    progress_age: float | None = None  # seconds since the last sign of progress (ctx.beat, output)
    note: str | None = None


class RunningTask(NamedTuple):
    """A task in state running, with what is needed to decide whether to reclaim it."""

    task_id: int
    name: str
    attempt: int
    fence: int
    worker_id: int | None
    owner: Owner | None
    child_pid: int | None
    child_start: int | None
    lease_expired: bool  # judged by the store's clock
    heartbeat_age: float | None  # seconds since the owner last renewed the lease, store clock
    progress_age: float | None  # seconds since the task last showed progress (beat, output)
    note: str | None


class TaskRow(NamedTuple):
    name: str
    state: str
    attempts: int
    added_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    result_kind: str | None
    task_id: int = 0  # the task's id: its place in the order tasks were added (``task_page``'s ``after``)


class JobRow(NamedTuple):
    """One job of a store, for ``Store.jobs``."""

    name: str
    counts: dict[str, int]  # state -> number of tasks (every state present)
    paused: bool


class Totals(NamedTuple):
    """Counters of one job over its whole life, derived from its tasks and journal (so they survive worker
    restarts). Monotonic, except ``final_failures`` and ``cancelled``, which drop when a user retries."""

    completions: int  # tasks done
    failed_attempts: int  # attempts that failed: retried, failed for good, or reclaimed from a dead owner
    final_failures: int  # tasks failed for good now
    cancelled: int  # tasks cancelled now
    restarts: int  # worker restarts journaled by a supervisor
    step_replays: int  # recorded steps replayed (not run again) by resumed attempts: the sum of the counts in
    # their 'replayed' journal events (one per attempt that replayed, written when it first runs a step for
    # real, or when it ends having only replayed)


class WaitRow(NamedTuple):
    """A waiting task and what it waits for, for ``Store.waits``."""

    name: str
    key: str
    until: float | None  # the wait's deadline (store clock), None: none


class StoredResult(NamedTuple):
    kind: str
    data: bytes


class WorkerRow(NamedTuple):
    worker_id: int
    owner: Owner
    started_at: float
    heartbeat_age: float
    stopped_at: float | None
    stop_reason: str | None
    done: int  # tasks this worker completed
    running_count: int  # its tasks in state running now


@dataclass(frozen=True)
class HostRestarts:
    """The worker restarts a supervisor journaled on one host, for ``Store.restarts_by_host``."""

    host: str
    count: int
    last_at: float  # when the latest one happened
    last_cause: str | None  # why: how the worker before it ended ("exit status 1", "SIGKILL", …)


class Event(NamedTuple):
    event_id: int
    at: float
    kind: str
    pid: int | None
    host: str | None
    task: str | None
    attempt: int | None
    detail: str | None


@dataclass(frozen=True)
class Stats:
    counts: dict[str, int]  # state -> number of tasks
    running_tasks: list[RunningTask]
    workers: list[WorkerRow]  # workers that have not stopped, newest first
    errors: list[Event]  # the latest failures, newest first
    done_last_minute: int  # tasks done within the rate window
    restarts: int
    rate_window: float = 60.0  # seconds the rate is measured over: the last minute, or less for a young job
    extra: dict[str, object] = field(default_factory=dict)
    paused: bool = False  # the job claims nothing new (``Store.set_paused``)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class SourceMark(NamedTuple):
    """How far a tasks file was imported, to skip re-reading it when it has not changed or only grew."""

    identity: str  # device and inode
    size: int  # bytes imported: the file up to the end of its last complete line
    lines: int  # lines in those bytes, so errors further on still name the right line
    mtime_ns: int
    head_digest: str  # digest of the file's first bytes, to notice a rewritten file
    tail_digest: str  # digest of the bytes just before ``size``, to notice an edited prefix


@dataclass(frozen=True)
class StepRecord:
    """One recorded step of a task (durable agent steps)."""

    index: int  # 1-based position among the task's recorded calls
    name: str
    kind: str  # "value" for a return value, "error" for a recorded final error, "checkpoint", "sleep"
    data: bytes
    at: float


# --- the contract, by the roles its callers use ---------------------------------------------------------
# Time bound (what the runner relies on): it stops its tasks a third of a lease before the lease runs out,
# counting on no store call taking longer than a quarter of the lease. So once a worker has named its lease
# (in ``claim`` or ``renew``), every call marked "bounded" below waits at most a quarter of it for a lock or
# the network, then raises ``StoreError`` (SQLite: its busy timeout; PostgreSQL: lock_timeout and
# TCP_USER_TIMEOUT). Before that (``onward add``, status), calls may wait longer (SQLite 30 s, PostgreSQL
# 3 s). Every method raises a ``StoreError`` subclass, never a driver's error.


class Connection(Protocol):
    """The store as a whole: where it is, its clock, transactions, and how it is watched."""

    url: str  # where the store is, printable: never holds a password
    job: str  # the name of the job this handle sees: every other method reads and writes that job only

    @property
    def secrets(self) -> Sequence[str]:
        """The store's password in every form a text may show it (redact.url_secrets), longest first: from its
        URL, PGPASSWORD, and the one the connection used, wherever libpq took it (~/.pgpass, a service file)."""

    def close(self) -> None:
        """Release the connection. Idempotent."""

    def now(self) -> float:
        """The store's clock, seconds since the epoch; lease and retry times are on this clock. Bounded."""

    def batch(self, durable: bool = True) -> AbstractContextManager[None]:
        """Group the writes inside into one transaction, committed once at the end (group commit): durably,
        or with ``durable=False`` crash-safe until the next ``sync`` (see there). An exception inside rolls
        everything back. Claims inside a batch take effect with it. Nests: only the outermost batch commits,
        and only its ``durable`` counts."""

    def sync(self) -> None:
        """Make every write this handle committed so far durable; returns once it is on stable storage.

        A batch committed with ``durable=False`` is at once visible to every reader and survives the death
        of the process, but a power cut may take it back until this returns (or until any later durable
        commit, which covers it: the log is sequential). What such a commit settled must not be reported
        before this returns. Nothing to do where every commit is durable already (PostgreSQL). Raises
        ``StoreUnavailable`` when the storage fails to sync: what was committed since the last sync may not
        be on disk, and must never be reported."""

    def sync_ahead(self, gather: float = 0.0) -> PendingSync | None:
        """Start ``sync`` and return without waiting for it: calling what it returns waits for it (and raises
        as ``sync`` would); its ``finished()`` says whether that would wait. None when every commit so far is
        durable on return already: nothing was owed, or the backend cannot sync in the background and synced
        here. Meanwhile this handle may go on
        committing; a commit made after this call is not covered by it.

        ``gather`` > 0: nothing waits for this sync yet, and it may start up to that many seconds later, so
        that one sync covers the commits made meanwhile (their own ``sync_ahead`` calls); a wait for it, or
        a ``sync_ahead`` with no ``gather``, starts it at once."""

    def sync_ahead_fd(self) -> int | None:
        """A file descriptor readable while a sync started by ``sync_ahead`` has finished and gone a moment
        (about 20 ms) without its wait being called: then its owner should call it. Calling the wait makes
        it unreadable again. None where ``sync_ahead`` syncs in place. Never waits."""

    def check_still_there(self) -> None:
        """Raise ``StoreGone`` if the store this connection writes to is no longer the one at its location
        (a SQLite file deleted, or another file renamed over it; a PostgreSQL schema dropped, or dropped
        and created again). Cheap enough for every heartbeat; a store that cannot be reached right now is
        not gone (the calls that need it report that). Bounded."""

    def log_held_back(self) -> int | None:
        """The size in bytes of a write-ahead log that keeps growing past what a checkpoint would leave (SQLite:
        over LOG_WARN_BYTES and larger than at the previous call; a reader that holds one snapshot open keeps
        SQLite from copying the log into the database), else None. Cheap enough for every heartbeat (one
        ``stat``); None where there is no such log of onward's own (PostgreSQL). Never raises."""

    def tidy(self) -> None:
        """Upkeep a worker asks for once a heartbeat, done at most once a minute, best effort (never raises),
        bounded (it waits for no lock): on PostgreSQL, index the journal's newest events by time, which
        otherwise waits for a VACUUM, so that what reads the last minute of the journal (the rate of
        ``onward status``, the dashboard, metrics) does not read every event written since. Nothing on SQLite."""

    def idle(self) -> None:
        """Called by a handle that only looks and steers (the dashboard, ``onward status --watch``,
        ``onward logs -f``) between two looks. On SQLite, while another process's failed sync left the log
        suspect (``STORE-unsynced``), the connection is closed and opened again: SQLite rebuilds its index of
        the log from the file only when no connection in any process holds that index any more, and a worker
        that found pages of the log lost can recover only from that rebuild (README, "When the kernel drops
        those pages first"). Nothing to do otherwise, nor on PostgreSQL. ``StoreGone`` if the file at the
        store's location is no longer the one opened (never another file opened in its place). Bounded."""

    def wakeup_fd(self) -> int | None:
        """A file descriptor that becomes readable when new work may be ready (PostgreSQL LISTEN/NOTIFY),
        or None when the backend cannot signal, in which case idle workers poll. Never waits."""

    def drain_wakeups(self) -> None:
        """Consume what made ``wakeup_fd`` readable. Never waits."""


class WorkQueue(Protocol):
    """What a worker does with tasks: claim, keep, finish or give back. Methods not marked otherwise
    commit durably before they return, unless called inside ``batch()``, whose commit covers them."""

    def add(self, names: Iterable[str]) -> int:
        """Add tasks by name; names already present are left alone. Returns how many were new, and
        journals one "added" event for the call when any were (not one per task: a million-line import
        stays one row). Not bounded: it waits for another import of the same names to commit."""

    def claim(self, worker_id: int, limit: int, lease_seconds: float, max_attempts: int,
              child: tuple[int, int] | None = None, alone: bool = False) -> list[Claim]:
        """Take up to ``limit`` ready pending tasks (retry time reached), oldest first, for this worker:
        state running, attempt + 1, fence + 1, lease until now + ``lease_seconds``. The claim is committed
        before this returns (or with the enclosing batch), so a task that kills its worker still has the
        attempt counted. No two workers ever hold the same task. Names the lease: bounded from here on.
        ``child`` (pid, start time): a process made ready to run the first claimed task's command; it is
        noted on that claim (as by ``note_child``) in the same transaction, and that ``Claim`` carries its
        pid as ``child_pid``. A task to run alone (``reclaim``) is taken only with ``alone``, which says
        that the worker runs nothing else and will run nothing beside what it claims (``limit`` 1); its
        ``Claim`` says ``alone``, and its ``max_attempts`` is the given one plus one for each crash it was in
        with other tasks."""

    def alone_ready(self) -> bool:
        """Whether a pending task of the job that is to run alone (see ``reclaim``) is ready to claim now.
        One read of a small index. Bounded."""

    def next_ready_in(self) -> float | None:
        """Seconds until the job's earliest pending task is ready to claim (its retry's backoff runs out), on
        the store's clock; zero or less when one is ready now; None when nothing is pending. One read of the
        claim index's first entry. An idle worker sleeps until then rather than polling past it."""

    def renew(self, worker_id: int, leases: Sequence[Lease], lease_seconds: float, completed: int) -> list[int]:
        """Extend the leases of tasks this worker runs, recording progress. Returns the ids of the tasks
        whose fence moved on (taken over): the caller must stop them and not commit them. Also heartbeats
        the worker row, with ``completed``, the number of tasks it finished so far (for status).
        Crash-safe, not necessarily durable: a lease only has to outlive its owner's process. Bounded."""

    def note_child(self, task_id: int, fence: int, child_pid: int, child_start: int) -> bool:
        """Record the process group a running task's command runs in; False (nothing written) if fenced out:
        the claim is gone, and the command must not run. Crash-safe, not durable: a power cut kills the
        children too. Bounded."""

    def holds(self, task_id: int, fence: int) -> bool:
        """Whether the claim under ``fence`` still holds (the task runs, under that fence): a read, nothing
        written. What ``note_child`` checks, for a process noted with its claim (``claim``'s ``child``).
        Bounded."""

    def complete(self, task_id: int, fence: int, result: bytes, kind: str) -> bool:
        """Mark the task done with its result, atomically. False (and nothing written) if fenced out, or if
        it is done already (see ``settled_under``). Bounded."""

    def settled_under(self, task_id: int, fence: int) -> str | None:
        """The task's state if it is no longer running under ``fence`` but still carries it: the outcome of
        the attempt holding that claim was committed (only that attempt can settle the task under its
        fence; a takeover moves the fence on), and the state is what it left, or what a command made of it
        since (``retry``, ``cancel``). None while it runs under that fence, and once the fence moved on. A
        worker asks when an outcome it writes again after a store error is refused: the commit whose error
        it got may have landed all the same (a connection cut after the server committed, a sync check that
        failed after SQLite's commit), and then nothing was taken over. A read, nothing written. Bounded."""

    def complete_and_claim(self, done: Claim, result: bytes, kind: str, worker_id: int, limit: int,
                           lease_seconds: float, max_attempts: int, durable: bool = True,
                           child: tuple[int, int] | None = None, alone: bool = False) -> tuple[bool, list[Claim]]:
        """``complete`` of ``done`` then ``claim`` of up to ``limit`` tasks, with their journal rows ("done", or
        "fenced" with FENCED_DETAIL when fenced out, and "claimed" for each claim), in one transaction, durable
        unless ``durable=False`` (then as ``batch(durable=False)``: durable at the next ``sync``): a worker's
        commit when its one finished attempt succeeded (the hot path at concurrency 1; PostgreSQL sends it as
        one statement). ``child`` and ``alone`` as for ``claim``. Returns whether the task is done under ``done``'s fence
        (completed now, or done under it already, ``settled_under``, by an earlier commit, which journaled
        it: nothing is journaled for it then), and what ``claim`` would. Bounded."""

    def fail(self, task_id: int, fence: int, error: str, retry_delay: float) -> str | None:
        """Record a failed attempt. If attempts remain, the task goes back to pending, ready after
        ``retry_delay`` seconds; else it is failed for good. Returns the new state, or None if fenced out.
        Bounded."""

    def release(self, task_id: int, fence: int, reason: str) -> str | None:
        """Give a claimed task back without counting the attempt (graceful stop). Returns its new state:
        pending, or cancelled when it was asked to be cancelled (``cancel``); None if fenced out. Bounded."""

    def running_tasks(self) -> list[RunningTask]:
        """Every task in state running, with its owner and whether its lease has expired. Bounded."""

    def reclaim(self, task_id: int, fence: int, decide: Callable[[RunningTask], str | None],
                shared: bool = False) -> Reclaimed | None:
        """Take a running task away from its owner (dead or lease expired), if ``decide`` says so: the fence
        moves on. If the attempt made durable progress (``record_step`` under this fence reached a step index
        beyond the furthest one recorded before), it is given back uncounted, like a release: a crash does
        not quarantine an agent that is getting somewhere. Nor does it count when its owner ran other tasks
        beside it (``shared``, whatever its steps): which of them ended the worker is not known. The task then
        gets an attempt more instead of the attempt back (its attempt number is not used again) and runs
        alone from then on (``claim``), so that a crash while it runs is its own. Otherwise it counts: the
        task goes back to pending, or to failed if its attempts are used up. Returns what was done, or None if the task is no
        longer running under that fence, or was left. Bounded.

        The task is read again (as ``running_tasks`` reads it) under a lock that its owner's ``renew`` and
        every write about the task wait for, and ``decide`` is called with that read, inside the
        transaction: it returns the reason to take the task over for, or None to leave it (nothing written,
        None returned). So the caller decides on a lease that cannot be renewed meanwhile, and what it does
        there (end the old attempt) is done only for a takeover that commits, unless the commit itself
        fails. A row being written right now may be left for the next round (None). ``decide`` must be
        quick: it holds up the owner's renewal."""

    def retry(self, names: Sequence[str] | None, by: str | None = None) -> int:
        """Failed tasks back to pending with attempts reset: the named ones (cancelled ones too), or every
        failed one if ``names`` is None. Returns how many changed. Durable, and journaled ``retried`` (with
        ``by``, who asked, in its detail) in the same commit: a retry that cannot be journaled changes
        nothing."""

    def cancel(self, names: Sequence[str]) -> dict[str, str]:
        """Cancel tasks by name, in one durable transaction. Returns, for each name, what was done:
        ``"cancelled"`` (it was pending: now cancelled, final, never run), ``"cancelling"`` (it was running:
        its worker sees the request at its next heartbeat, stops it like a timeout, and the task ends
        cancelled, not retried; should the attempt complete first, it ends done), ``"unknown"``, or
        ``"already done"`` / ``"already failed"`` / ``"already cancelled"`` (left as it is). Journals
        ``cancelled`` or ``cancel requested`` for each task changed."""

    def cancelling(self, worker_id: int) -> list[int]:
        """The ids of this worker's running tasks that were asked to be cancelled (``cancel``): the worker
        stops them; then ``fail``, ``release`` or ``reclaim`` under their fence end them cancelled.
        One statement, called once per heartbeat. Bounded."""

    def register_worker(self, owner: Owner, detail: str) -> int:
        """Record a new worker (and a 'worker started' event). Returns its id."""

    def worker_stopped(self, worker_id: int, reason: str) -> None:
        """Mark the worker stopped (and journal why). Bounded."""

    def log_event(self, kind: str, *, task_id: int | None = None, worker_id: int | None = None,
                  attempt: int | None = None, detail: str | None = None, durable: bool = False) -> None:
        """Append one event to the journal. Crash-safe unless ``durable``. Bounded."""


class StepJournal(Protocol):
    """The recorded steps of running tasks (durable agent steps), each write under the task's fence."""

    def steps(self, task_id: int) -> list[StepRecord]:
        """The recorded steps of a task, in order. Bounded."""

    def record_step(self, task_id: int, fence: int, step: StepRecord) -> bool:
        """Durably record one step's outcome under the task's fence. False if fenced out. A step whose index
        is beyond the furthest ever recorded for the task is progress of this claim (see ``reclaim``); the
        furthest index is kept on the task and never lowered, not even by ``drop_steps``. Bounded."""

    def drop_steps(self, task_id: int, fence: int, from_index: int) -> bool:
        """Forget recorded steps from ``from_index`` on (replay policy "prefix"). False if fenced out.
        Bounded."""


class Waits(Protocol):
    """Durable waits: values sent to tasks from outside (``onward send``), and tasks parked while they wait
    for one. A value is kept per (task, key) in the job's mailbox until the task takes it with the record of
    its wait; a waiting task holds no worker and no lease."""

    def send(self, name: str, key: str, value: str) -> str:
        """Store ``value`` (JSON text, checked by the caller) for task ``name``'s wait on ``key``, durably.
        Returns ``"delivered"`` (the task waited for it: pending now, idle workers woken, NOTIFY where the
        backend can), ``"stored"`` (kept until the task waits for it), or, with nothing stored: ``"unknown"``,
        ``"already sent"`` (a value for that key was not taken yet: it is not replaced), ``"already done"`` /
        ``"already failed"`` / ``"already cancelled"``. Journals ``sent`` when stored."""

    def mail(self, task_id: int, key: str) -> tuple[str | None, float | None]:
        """For a running task's wait on ``key``: the value sent for it (or None), and the deadline recorded
        when the task last parked on that key (or None). Inside a transaction it holds sends to the task
        off until that commits: call it in the one that records the wait (``record_wait``). Bounded."""

    def record_wait(self, task_id: int, fence: int, step: StepRecord, key: str) -> bool:
        """Record the outcome of a wait (a step record) and, in the same transaction, take the value for
        ``key`` out of the mailbox and clear the task's parked wait. False if fenced out. Bounded."""

    def park(self, task_id: int, fence: int, key: str, until: float | None) -> str | None:
        """Give the claim back uncounted and park the task on its wait for ``key`` until the value comes or
        ``until`` (store clock) passes. Returns the new state: ``waiting``; ``pending`` when the value was
        sent meanwhile; ``cancelled`` when a cancel was requested; None if fenced out. Bounded."""

    def wake_due(self, behind: bool = False) -> int:
        """Make every waiting task whose deadline passed pending (it runs again and records its timeout).
        ``behind``: also those with a deadline that were last claimed later than the store's clock now (the
        clock was set back since): they run again and park until at most their wait's length from now.
        Returns how many. Bounded."""

    def waits(self, limit: int = 100) -> list[WaitRow]:
        """The job's waiting tasks (the first ``limit``, in id order) and what each waits for. Cheap: reads
        the index of waiting tasks only."""


class Reporting(Protocol):
    """Reading what happened, for status, list, logs and results. Reads only; each call is cheap on a store
    of millions of tasks (``iter_tasks`` streams page by page)."""

    def task(self, name: str) -> TaskRow | None:
        """One task by name."""

    def task_id(self, name: str) -> int | None:
        """A task's id by name, or None."""

    def result(self, name: str) -> StoredResult | None:
        """A done task's result, or None if the task is not done."""

    def iter_tasks(self, state: str | None = None) -> Iterator[TaskRow]:
        """Every task (or those in one state), in the order they were added. Streams: constant memory, one
        statement per page, so no snapshot is held open while the caller goes through it."""

    def counts(self) -> dict[str, int]:
        """Number of tasks in each state. Cheap: does not scan the tasks. Bounded."""

    def stats(self) -> Stats:
        """What ``onward status`` shows, from one snapshot. Cheap on a store of millions of tasks."""

    def workers(self) -> list[WorkerRow]:
        """Workers not marked stopped (at most 100, newest first)."""

    def restarts_by_host(self) -> list[HostRestarts]:
        """The job's journaled worker restarts (events ``restart``), counted per host, with the latest one's
        time and cause, in host order. Cheap: reads only the restart events (a partial index)."""

    def events(self, after_id: int = 0, task: str | None = None, limit: int = 1000,
               last: int | None = None) -> list[Event]:
        """Events with id greater than ``after_id`` in order (or the ``last`` N), optionally one task's."""


class Jobs(Protocol):
    """The jobs of a store (one per name, each with its own tasks, journal, workers and pause flag), and
    this job's pause flag."""

    def jobs(self) -> list[JobRow]:
        """Every job of the store, by name, with its counts and pause flag. Cheap: no task is scanned."""

    def paused(self) -> bool:
        """Whether this job is paused."""

    def set_paused(self, paused: bool) -> bool:
        """Pause (no worker on any host claims a task of this job; running ones go on and are committed) or
        resume it. Durable; journals ``paused`` or ``resumed`` and wakes idle workers on resume (NOTIFY where
        the backend can). Returns True when the flag changed. A paused job is checked by the claim statement
        itself: pausing costs the claim path nothing."""


class Browsing(Protocol):
    """Reads for a live view or a dashboard, each cheap enough to call every few seconds on a store of a
    million tasks (see each backend's SQL for what it scans)."""

    def task_page(self, state: str | None, search: str | None, after: int, limit: int,
                  until: int | None = None) -> list[TaskRow]:
        """Up to ``limit`` tasks with id greater than ``after`` (and at most ``until``, when given), in id
        order (keyset paging: the next page starts after the last row's ``task_id``), optionally only those
        in ``state`` and only those whose name contains ``search`` (case-insensitive; ``%`` and ``_`` are
        literal characters). A search reads every row it passes, so a caller that must answer quickly
        bounds it with ``until`` and goes on from there."""

    def activity(self, bucket_seconds: int = 60) -> list[tuple[float, int, int]]:
        """Over the job's life, per bucket of ``bucket_seconds``: (bucket start, tasks completed, failed
        attempts), oldest first, only buckets with something in them."""

    def totals(self) -> Totals:
        """The job's lifetime counters (see ``Totals``)."""


class ImportMarks(Protocol):
    """How far each tasks file was imported, written in the same batch as the tasks it added."""

    def get_source(self, path_key: str) -> SourceMark | None:
        """The import mark of a tasks file, by its absolute path, or None."""

    def set_source(self, path_key: str, mark: SourceMark) -> None:
        """Record how far a tasks file was imported (call in the same batch as the ``add``)."""


class Store(Connection, WorkQueue, StepJournal, Waits, Reporting, Jobs, Browsing, ImportMarks, Protocol):
    """A durable task store: every role above, on one connection. Use it from one thread."""
