"""The worker loop: claim -> run -> commit, with leases, heartbeats, timeouts and signals.

One thread owns the store and turns this loop; tasks run beside it (Python functions in threads, commands
as child processes), so the loop stays responsive while they run and its turning is a true sign of health:
the systemd/supervisor watchdog is fed from here and nowhere else.

Each turn, everything that finished since the last turn is committed together with the next claims in
one transaction (group commit), crash-safe at first; the claimed tasks are started, and then one sync makes
the commit durable while they run: with one slot that is exactly one durable commit per task, its fsync
off the path from one task to the next, and nothing (log line, output file, summary) reports a completion
before that sync returned. With several slots the loop does not stand in that fsync: it leaves it to the
store's sync thread and goes on settling and starting tasks as they end, telling what a commit settled at
the first turn after its sync returned (``_report_settled``, pipelined). At --concurrency 4, 10,000
commands of ``true``, the loop had stood in fdatasync for a quarter of its time; whole runs took 6.68 s
before, 5.96 s after (medians of 8 runs taking turns, CPU time unchanged). At one slot the loop has
nothing else to do while the fsync runs: the same at one slot measured no gain (2,000 commands: whole-run
ratios 0.88 and 0.98; 20,000: 1.01), so the sync stays in place there.

A turn may also be taken on a task's own thread (``settle_here``): when the attempt that just finished was
the only one running, there is nothing to group its commit with, and handing it to the loop's thread and the
next task back to a task thread would cost two thread hand-overs per task. Its thread then settles it
(commit with the next claim, start it, sync, report) and runs the next task itself; measured against the
loop's turn, same code, concurrency 1: no-op tasks 1.2-1.8x the throughput at 100,000 tasks, tasks
computing 0.1 ms 1.5x (medians). On SQLite its sync is left running beside the next task, on a thread that
never takes the GIL (``Store.sync_ahead``), as the loop's pipelined turns leave theirs: no turn waits for an
earlier one's sync that has not returned, and a sync starts PIPELINED_SYNC_GATHER after the first commit it
covers, so the turns of that moment share it; what a commit settled is told by the first turn after its sync
returned, on whichever thread. No-op tasks, 20,000: 1.37x the throughput of syncing in place when each turn
still waited for the sync before it; without that wait, and with the window, 20,258 -> 895 fdatasync calls,
78,700 -> 4,600 context switches, 3.77 -> 2.20 s (medians of five pairs; BENCHMARKS.md). (Without the window,
leaving it so had gained nothing: 188.5 against 183.5 us a task, the syncs one per task.) One lock
(``_turn``) makes every turn, on either thread, the only one: the loop holds it except while it waits, so
the runner's state and the store connection are only ever touched by one turn at a time. The loop keeps
what must not depend on tasks' threads: ticks (leases, reclaims, cancels), deadlines, signals and the
watchdog; a task's thread gives way to it (hands its outcome over the usual way) once a tick is due.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from . import crashpoints
from .attempt import Attempt, Handler, Outcome, cannot_run
from .config import MIN_HEARTBEAT, RunConfig
from .durations import doubling
from .errors import RESOURCE_ERRNOS, CorruptStore, Fenced, OnwardError, StoreError, WedgedTask
from .inbox import LoopInbox, StoreCall
from .keepawake import KeepAwake
from .leases import Leases
from .log import VERBOSE, Log, Throttled, quote
from .notify import Notifier
from .proc import current_owner, owner_alive
from .readable import ReadableFds
from .reclaim import mark_dead_workers, reclaim_abandoned
from .settle import RunSummary, Settler
from .stopsignals import stop_signals
from .store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITING, Claim, PendingSync, Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    # Future: the store calls' (onward.inbox), not loaded by a worker of commands.
    from concurrent.futures import Future

    from .outdir import OutDir  # loaded only with --out (its hashing and URL parsing cost start-up)

SavedSignals = tuple[dict[signal.Signals, Any], "int | None"]  # handlers and wakeup fd to restore
T = TypeVar("T")
# After a failed commit (outcomes, claims, steps) the next try waits STORE_RETRY_FIRST seconds, doubling
# while the store keeps failing, up to STORE_RETRY_MAX: a broken store costs a few calls a second at most.
STORE_RETRY_FIRST = 0.2
STORE_RETRY_MAX = 2.0
# After SIGTERM and --grace, how long outcomes that cannot be committed are still retried before the worker
# leaves them uncommitted (their tasks stay claimed; the next worker reclaims them, as after a crash). Well
# within the unit's TimeoutStopSec (grace + supervise.STOP_MARGIN).
STOP_COMMIT_SECONDS = 5.0
# How long a turn of the loop goes on with the sweep for missing result files (Settler.export_missing):
# short beside running tasks (their outcomes wait meanwhile), and the loop turns again at once until it is
# over. With no task running, longer: each turn also asks the store for work.
EXPORT_SWEEP_SLICE = 0.005
EXPORT_SWEEP_IDLE_SLICE = 0.05
# After an attempt could not start for want of the worker's own resources (errors.RESOURCE_ERRNOS), the
# attempt is given back uncounted, the worker runs fewer tasks at once (until CONCURRENCY_RAISE_AFTER), and
# claims nothing for RESOURCE_PAUSE seconds.
RESOURCE_PAUSE = 1.0
# Once no attempt has failed to start for that long, a worker that lowered its concurrency raises it again by
# a third (at least one), up to --concurrency, and so on while the shortage stays away: it was a neighbour's
# burst, or the worker's own tasks, gone since. Raised into a shortage that lasts, it costs one start given
# back uncounted and lowered again.
CONCURRENCY_RAISE_AFTER = 10.0
# The shortest pause of claims after an attempt given back because the store failed a step call (see
# Runner._put_off_claims).
STEP_FAULT_PAUSE = 1.0
# A shortfall that lasts is warned of again this often (seconds); in between, each is logged at info.
RESOURCE_WARN_EVERY = 60.0
# How often a worker looks for waits whose deadline passed (ctx.wait's timeout), while its job has some.
WAKE_DUE_EVERY = 1.0
# The loop's look (lease renewal, reclaims, cancels) comes every heartbeat, and at least this many times a lease:
# that is the default (a lease of three heartbeats), so that a renewal comes while two thirds of the lease are
# left. A lease set barely longer than the heartbeat (--heartbeat 1 --lease 1.0000001, which the rule "longer
# than the heartbeat" allows) ran out before nearly every renewal, by the moment the loop woke late: another
# worker looking in that moment could take the task over from its healthy owner.
RENEWALS_PER_LEASE = 3
# A step back of the wall clock larger than this between two turns of the loop is taken as the clock set back.
CLOCK_BACK_SECONDS = 1.0
# A command whose process was noted with its claim starts without a look at whether the claim still holds
# (check_claim) if that claim was committed by this turn less than this long ago by the boot clock and the
# wall clock both (a freeze or a pause counts on one or the other). Taking a task over needs its lease to run
# out, and a lease is longer than the heartbeat, which is at least MIN_HEARTBEAT: the look is for a worker
# frozen between its claim and its go, and cost a query a command (about 10 us, a fortieth of the worker's
# CPU a command at --concurrency 4).
FRESH_CLAIM_SECONDS = MIN_HEARTBEAT / 2
# How long a sync a turn leaves running beside the tasks (pipelined, see _report_settled) may wait before it
# starts, so that it covers the commits of the turns meanwhile (Store.sync_ahead's gather). Reports of a task
# wait that much longer. 10,000 x `true` at --concurrency 4: fdatasync calls 0.88 -> 0.33 a task, the run 3-5 %
# faster (an fdatasync costs the CPUs, here 2, about as much as a short command); no-op Python tasks at
# concurrency 1, 20,000: 1.01 -> 0.045 a task, the run 1.75x as fast (BENCHMARKS.md).
PIPELINED_SYNC_GATHER = 0.005
# The most syncs the loop leaves running beside its turns (pipelined, see _report_settled) before it waits for
# the oldest in place: one runs at a time, so these pile up only while an fsync is slow (a gathering sync
# covers the few turns of its window, and waiting for it starts it). A disk that hangs
# then stalls the loop within a few dozen turns, as an fsync in place would, instead of letting it run task
# after task whose completion it can never report (and whose reports it would keep in memory).
PIPELINED_SYNCS_MAX = 32
# How soon the loop tries again to tell reports that a MemoryError left untold (see _tell): a task that holds
# all memory usually lets it go within milliseconds.
UNTOLD_RETRY = 0.01
# An idle worker's polls double from 10 ms to a second; past this, each also asks the store when the next
# retry is due, so that it wakes then (``_idle_timeout``). The wake comes this much after the due time: a
# claim takes only tasks whose time has come (``ready_at <= now``), and the store's clock is not this one.
ASK_NEXT_READY_PAST = 0.03
NEXT_READY_MARGIN = 0.002


class Runner:
    def __init__(self, store: Store, handler: Handler, config: RunConfig, log: Log, *,
                 notifier: Notifier | None = None, keep_awake: KeepAwake | None = None,
                 out: OutDir | None = None, secrets: Sequence[str] = ()) -> None:
        self.store = store
        # The store's password in every form it may take (redact.url_secrets): kept out of every error a
        # task reports, since a command gets the store's URL (ONWARD_DB) and may well print it.
        self.secrets = tuple(secrets)
        self.handler = handler
        self.config = config
        self.log = log
        self.store_errors = Throttled(log)  # a failing store is reported once, then counted
        self._out_of_memory_since: float | None = None  # since when heartbeats have found no memory (see _tick)
        self.notifier = notifier or Notifier(None)
        self.keep_awake = keep_awake
        self.out = out
        self.worker_id = 0
        self.concurrency = config.concurrency  # lowered when the worker runs out of resources, then raised back
        self._concurrency_changed = 0.0  # monotonic time it was last lowered or raised
        self._step_faults_in_a_row = 0  # attempts given back since the last done one: the store failed a step
        self._claim_paused_until = 0.0  # after a resource error: monotonic time before which nothing is claimed
        # When a start last warned that it ran out of resources, and the shortfalls told only at info since.
        self._resources_warned: float | None = None
        self._log_warned: float | None = None  # when the store's log held back by a reader was last warned of
        self._resources_unwarned = 0
        self.attempts: dict[int, Attempt] = {}  # task id -> its attempt, while it runs here
        # A supervisor does not treat a worker that gets somewhere as crash-looping.
        self.settler = Settler(store, log, out, config.retry_delay, config.max_retry_delay,
                               on_progress=self.notifier.progress)
        self.summary: RunSummary = self.settler.summary
        # Outcomes from attempts' threads and store calls from tasks' threads, waiting for the loop.
        self.inbox = LoopInbox()
        self.readable = ReadableFds()
        self.readable.register(self.inbox.wake_r, self.inbox.drain_wakeups)
        store_fd = store.wakeup_fd()
        if store_fd is not None:
            # New work announced by the store (NOTIFY) ends an idle wait at once.
            self.readable.register(store_fd, store.drain_wakeups)
        sync_fd = store.sync_ahead_fd()
        if sync_fd is not None:
            # A sync left running beside a task (settle_here) and not waited for since: the loop's turn tells
            # what it settled (_report_settled). Waiting for it consumes the readiness; nothing to read here.
            self.readable.register(sync_fd, _nothing_to_read)
        self.leases = Leases(store, config.lease_seconds, log, self.store_errors)
        self._stop_requested: str | None = None
        self._stop_deadline: float | None = None
        self._unsettled: list[tuple[Attempt, Outcome]] = []  # outcomes whose commit failed, to retry
        self._unreported: list[Callable[[], None]] = []  # what the last commit settled, told once it is durable
        # A MemoryError stopped the telling of durable reports (see _tell): how many of the first list in line
        # were told, and whether any wait (the loop then looks again soon, UNTOLD_RETRY).
        self._told_already = 0
        self._untold = False
        self._untold_since: float | None = None  # monotonic time the loop first found reports untold
        # Syncs left running beside the tasks (see _report_settled), oldest first: each with what the commits
        # it makes durable settled.
        self._syncing: list[tuple[PendingSync, list[Callable[[], None]]]] = []
        # After a failed sync: commits are durable at once again (see _report_settled), and results of tasks
        # settled meanwhile are written to --out after the next good commit.
        self._durable_now = False
        self._exports_owed = False
        self._sweep_retry_at = 0.0  # after a store error in the sweep for missing result files: its next try
        self._store_retry_at = 0.0  # monotonic time before which no commit is tried, after a failed one
        self._store_backoff = 0.0
        # The store's counts as of the last heartbeat, with this worker's tally (done, failed) at that
        # moment: what a progress bar reads on its own timer (onward.progress), costing no query of its own.
        self.counts_seen: tuple[dict[str, int], int, int] = ({}, 0, 0)
        self._paused = False  # the job is paused (onward pause), as last read: claims return nothing then
        self._marker_held = False  # this worker made the keep-awake marker exist
        self._waits_seen = False  # the job had waiting tasks at the last heartbeat, or one parked here since
        # A task to run alone (see Store.reclaim) was ready at the last heartbeat: claim nothing more until
        # nothing runs, then those tasks one by one (concurrency 1 claims them in turn as any other).
        self._alone_ready = False
        # The claims the last commit made, and when by the boot and wall clocks: see FRESH_CLAIM_SECONDS.
        self._fresh_claims: set[tuple[int, int]] = set()
        self._claimed_at = (0.0, 0.0)
        self._wake_due_at = 0.0  # monotonic time before which waits' deadlines are not looked at again
        # Whether the next look at waits' deadlines also wakes the tasks parked at a later moment than the
        # store's clock now (it went back since, see _loop): at this worker's first look, and after its wall
        # clock was seen going back.
        self._clock_went_back = True
        # After this worker was frozen: monotonic time before which it takes over no task by its lease's expiry
        # (see _loop). Tasks of owners known dead are taken back at once as ever.
        self._lease_takeovers_from = 0.0
        # Held by whichever thread takes a turn (see the module's docstring). Once a tick is due
        # (_tick_due_at), a task's thread hands its outcome to the loop instead of taking the turn itself.
        self._turn = threading.Lock()
        self._tick_due_at = 0.0  # monotonic time of the loop's next tick
        self._waiting_until = 0.0  # monotonic time the loop's current wait ends at the latest
        self._closed = False  # run() returned: a task's thread settles nothing more
        self._lane_error: BaseException | None = None  # a turn on a task's thread failed: the loop raises it

    # --- called from other threads -------------------------------------------------------------------
    def post(self, attempt: Attempt, outcome: Outcome) -> None:
        """Hand a finished attempt to the loop (thread-safe)."""
        self.inbox.post(attempt, outcome)

    def settle_here(self, attempt: Attempt, outcome: Outcome) -> bool:
        """From an attempt's own thread, once it has its outcome: settle it on this thread, now, in a turn of
        its own (commit it with the next claims, start them, sync, report), if it is the only attempt running
        and no tick is due (see the module's docstring); True then. Otherwise hand it to the loop (``post``) and
        return False. The handler may give this thread the next attempt to run (PythonHandler does)."""
        if len(self.attempts) != 1:
            # Others run beside it: the loop commits its outcome with theirs. Looked at before taking the turn
            # (a read without the lock; when it says one, the lock's look below decides), so that a task's
            # thread does not wait for the loop's turn only to hand its outcome over: at concurrency 4 that
            # wait cost each task two more context switches (no-op tasks, 20,000: 83,000 voluntary switches
            # against 43,000, 3.3-3.5 s against 2.8-3.0 s).
            self.inbox.post(attempt, outcome)
            return False
        with self._turn:
            if self._closed:
                return False  # the worker left; the attempt was given back on the way out
            if not self._lane_open(attempt):
                self.inbox.post(attempt, outcome)
                return False
            try:
                finished = self._take_finished()
                finished.append((attempt, outcome))
                claims = self._settle_and_claim(finished, self._want(finished, time.monotonic()))
                for claim in claims:
                    self._start(claim)
                # Nothing started here (the job may be over), the store failed, or an attempt started here is
                # due (--timeout) before the loop planned to wake: the loop looks again.
                loop_looks = not claims or self.stopping or self._store_retry_at > time.monotonic() \
                    or self._next_deadline(self._waiting_until, time.monotonic()) < self._waiting_until
                self._report_settled(pipelined=not loop_looks)
            except BaseException as e:  # the loop's own turn would have ended the worker: let it do so
                self._lane_error = e
                self.wake()
                return True
            if loop_looks or self._untold or self._store_retry_at > time.monotonic():  # (or the sync just failed)
                self.wake()
            return True

    def abort(self, error: BaseException) -> None:
        """From an attempt's thread that cannot report its outcome (no memory left to): the loop raises
        ``error`` at its next turn and the worker stops, as after an error of its own turn."""
        if self._lane_error is None:
            self._lane_error = error
        self.wake()

    def _alone(self) -> bool:
        """With the turn held: whether a task's thread may commit on its own now. One attempt is running
        (nothing to group its commit with), no tick is due (the loop takes that turn itself) and no failed
        commit is waiting for its backoff."""
        now = time.monotonic()
        return len(self.attempts) == 1 and self._store_retry_at <= now < self._tick_due_at

    def _lane_open(self, attempt: Attempt) -> bool:
        """Whether a task's thread may take a turn for ``attempt`` (``settle_here``): it is alone (``_alone``)
        and that one attempt, the worker is not stopping, and no outcome waits to be committed again."""
        return (self._alone() and self.attempts.get(attempt.claim.task_id) is attempt and not self.stopping
                and not self._unsettled)

    def store_call(self, fn: Callable[[Store], T]) -> T:
        """From a task's thread: run ``fn(store)`` and return its value once its commit is durable. This is
        how a task records steps. While the task is the only one running, on its own thread in a durable
        transaction of its own (nothing to share the fsync with); otherwise on the loop's thread, inside its
        next group commit, so that steps of many tasks share one fsync."""
        if len(self.attempts) == 1:  # a look without the lock, as in settle_here: others run, no turn to wait for
            with self._turn:
                if not self._closed and self._alone() and not self.inbox.has_calls():
                    try:
                        with self.store.batch(durable=True):
                            return fn(self.store)
                    except StoreError as e:
                        self._back_off(e)
                        self.wake()
                        raise
        return self.inbox.store_call(fn)

    def note_child(self, claim: Claim, pid: int, start: int) -> None:
        """On the loop's thread, while an attempt starts: its command's pid, before the command runs."""
        if not self.store.note_child(claim.task_id, claim.fence, pid, start):
            raise Fenced(f"task {claim.name!r} was taken over before its command could start")

    def out_of_resources(self, claim: Claim, error: OSError) -> None:
        """See ``Loop.out_of_resources``: the same answer as to a start that failed so (``_start``)."""
        self._lower_concurrency(claim, error)

    def check_claim(self, claim: Claim) -> None:
        """On the loop's thread, before a command whose pid was noted with its claim runs: the claim holds."""
        if (claim.task_id, claim.fence) in self._fresh_claims:
            boot, wall = self._claimed_at
            if time.clock_gettime(time.CLOCK_BOOTTIME) - boot < FRESH_CLAIM_SECONDS \
                    and abs(time.time() - wall) < FRESH_CLAIM_SECONDS:
                return
        if not self.store.holds(claim.task_id, claim.fence):
            raise Fenced(f"task {claim.name!r} was taken over before its command could start")

    def register(self, fd: int, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop's thread whenever ``fd`` is readable (an attempt's pipe or pidfd)."""
        self.readable.register(fd, callback)

    def unregister(self, fd: int) -> None:
        self.readable.unregister(fd)

    def wake(self) -> None:
        self.inbox.wake()

    _stop_said = False  # the loop said that a stop was asked for (see _loop)

    def request_stop(self, reason: str) -> None:
        if self._stop_requested is None:
            self._stop_requested = reason
            self._stop_deadline = time.monotonic() + self.config.grace
        self.wake()

    @property
    def stopping(self) -> bool:
        return self._stop_requested is not None

    # --- the loop ------------------------------------------------------------------------------------
    def run(self) -> RunSummary:
        cfg = self.config
        self._turn.acquire()  # the loop's, except while it waits (see _wait)
        try:
            return self._run(cfg)
        finally:
            self._closed = True
            self._turn.release()

    def _run(self, cfg: RunConfig) -> RunSummary:
        saved_signals = self._catch_stop_signals()
        self.inbox.loop_thread = threading.get_ident()  # Job.run may run the loop on another thread than built it
        self.worker_id = self.store.register_worker(current_owner(), f"concurrency={cfg.concurrency}")
        self.settler.worker_id = self.worker_id
        job = "" if self.store.job == "default" else f" job={self.store.job}"
        self.log.info(f"worker started: id={self.worker_id} store={self.store.url}{job} concurrency={cfg.concurrency}")
        stop_reason = "finished"
        try:
            self._start_up()
            self._loop()
            self.store.check_still_there()  # "finished" only if it was the store everyone else reads
            stop_reason = f"stopped by {self._stop_requested}" if self.stopping else "finished"
        except BaseException as e:
            stop_reason = f"crashed: {type(e).__name__}: {e}"
            raise
        finally:
            self.notifier.stopping()
            self.inbox.refuse_calls()
            self._shutdown_attempts()
            store_said = self._record_stop(stop_reason)
            self._restore_signals(saved_signals)
            self.readable.close()
            self.inbox.close()
        self.store_errors.flush()
        self.summary.stopped = self.stopping
        self.summary.unexported = len(self.settler.unexported)
        self.summary.export_error = self.settler.export_error
        self.log.info(
            f"worker stopped: {stop_reason}; this run: done={self.summary.done} failed={self.summary.failed}"
            f" retried={self.summary.retried}"
            + (f" cancelled={self.summary.cancelled}" if self.summary.cancelled else "") + f"; store: {store_said}"
        )
        return self.summary

    def _catch_stop_signals(self) -> SavedSignals:
        """SIGTERM/SIGINT/SIGHUP request a graceful stop, and wake the loop (main thread only); returns what to restore."""
        old_handlers: dict[signal.Signals, Any] = {}
        old_wakeup = None
        if self.config.install_signal_handlers and threading.current_thread() is threading.main_thread():
            for sig in stop_signals():  # SIGHUP left alone while it is ignored (nohup)
                old_handlers[sig] = signal.signal(sig, self._on_signal)
            old_wakeup = signal.set_wakeup_fd(self.inbox.wake_w, warn_on_full_buffer=False)
        return old_handlers, old_wakeup

    def _restore_signals(self, saved: SavedSignals) -> None:
        old_handlers, old_wakeup = saved
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)

    def _start_up(self) -> None:
        """Before the first claim: take back what dead workers left, start the sweep for missing result files
        (the loop goes through it), tell ready."""
        mark_dead_workers(self.store, self.worker_id)
        self._reclaim_abandoned()
        self.settler.start_export_sweep()  # gone through by the loop, a slice a turn (_sweep_exports)
        counts = self.store.counts()
        self._update_keep_awake(counts, self._note_pause())
        self.notifier.ready(self.keep_awake.path if self.keep_awake is not None else None)
        self._notify_status(counts)

    def _record_stop(self, stop_reason: str) -> str:
        """The store's final counts, the worker's stop and the keep-awake marker (best effort on the way out).
        Returns what the worker's last line says of the store: its counts, or why they are not known (a
        server gone, a disk failing), rather than nothing."""
        said: str | None = None
        try:
            self.summary.counts = self.store.counts()
            said = " ".join(f"{k}={v}" for k, v in self.summary.counts.items())
            self.store.worker_stopped(self.worker_id, stop_reason)
            self._release_keep_awake(self.summary.counts)
        except OnwardError as e:
            self.log.warning(f"could not record the stop: {e}")
            said = said if said is not None else f"counts unknown ({e})"
        finally:
            if self.keep_awake is not None:
                # Left in place or removed: either way no longer held by this worker (Job.run may return into a
                # process that lives on, whose lock would keep every other worker from removing it).
                self.keep_awake.leave()
        return said or ""

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stopping:
            return
        self.request_stop(name)
        for attempt in list(self.attempts.values()):  # (a task's thread may be taking a turn)
            attempt.request_stop()

    def _loop(self) -> None:
        cfg = self.config
        idle_wait = 0.01
        next_tick = self._tick_due_at = time.monotonic() + self._tick_period()
        last_turn, last_wall = time.monotonic(), time.time()
        while True:
            now, wall = time.monotonic(), time.time()
            if self._lane_error is not None:
                raise self._lane_error
            self.notifier.watchdog()
            # The loop never sleeps past a tick; a much longer gap means the process was not running. A gap
            # longer than the lease is reported whatever the heartbeat: the leases may be gone. The wall clock
            # too: a VM or sandbox resumed from a snapshot may count none of its pause on the monotonic clock,
            # then have its wall clock set forward, and leases are kept in wall-clock time (SQLite: this
            # machine's, PostgreSQL: the server's, which may have been paused along).
            gap = max(now - last_turn, wall - last_wall)
            if gap > min(max(2.0, 2 * cfg.heartbeat), cfg.lease_seconds):
                # The whole process was frozen (sandbox pause, SIGSTOP): leases may have expired meanwhile. Or
                # the turn was held up that long (store calls each waiting out a lock held elsewhere): this
                # loop cannot tell the two apart, and the message does not pretend to.
                self.log.warning(f"resumed after {gap:.1f} s pause (or a turn held up as long); renewing leases now")
                try:
                    self.store.log_event("resumed", worker_id=self.worker_id, detail=f"after {gap:.1f} s pause")
                except StoreError as e:
                    self.log.warning(f"could not journal the pause: {e}")
                next_tick = self._tick_due_at = now
                # Whatever froze this process (a sandbox pause) may have frozen the other workers of this job
                # too: their leases ran out meanwhile, but they are alive and renew at their first turn after
                # the thaw, as this one does now. Taking their tasks over in the moment before would kill live
                # commands and count an attempt for nothing. Give them a lease's time to renew first.
                self._lease_takeovers_from = now + cfg.lease_seconds
            if wall < last_wall - CLOCK_BACK_SECONDS:
                # The wall clock was set back (a VM resumed from an older snapshot, an NTP step): waits' and
                # sleeps' deadlines, kept in wall-clock time, now lie further ahead than promised. Their tasks
                # run again at once and park until at most their wait's length from now.
                self.log.warning(f"the wall clock went back {last_wall - wall:.1f} s; waiting tasks look at their"
                                 " deadlines again")
                self._clock_went_back = True
                self._wake_due_at = 0.0
            last_turn, last_wall = now, wall
            if self._stop_requested is not None and not self._stop_said:
                # Said by the loop, not by the signal's handler (which may interrupt a log line being written).
                self._stop_said = True
                running = len(self.attempts)
                self.log.info(f"stopping on {self._stop_requested}: claiming nothing new"
                              + (f"; {running} running task{'s' if running != 1 else ''} get up to"
                                 f" {self.config.grace:g} s (--grace) to finish" if running else ""))
            if now >= next_tick:
                self._tick()
                next_tick = self._tick_due_at = now + self._tick_period()
            self._enforce_deadlines(now)
            if self._stop_deadline is not None and now >= self._stop_deadline + STOP_COMMIT_SECONDS:
                return  # stopping, and the store kept failing: leave what is not committed (see the constant)
            claims: list[Claim] = []
            if now >= self._store_retry_at:
                finished = self._take_finished()
                claims = self._settle_and_claim(finished, self._want(finished, now))
            for claim in claims:
                self._start(claim)
            # With tasks running at --concurrency above 1, the fsync is left to the sync thread (pipelined).
            # At concurrency 1, pipelined too while tasks' own turns left syncs running (Python tasks, see
            # settle_here): waiting for them here would start a gathering sync at once, and hold the turn
            # while it runs. Commands at concurrency 1 sync in place (no gain measured from the window).
            self._report_settled(pipelined=bool(self.attempts) and (self.concurrency > 1 or bool(self._syncing)))
            self._sweep_exports(EXPORT_SWEEP_SLICE if self.attempts else EXPORT_SWEEP_IDLE_SLICE)
            if self.stopping and not self.attempts and not self._untold:
                return
            if claims:
                idle_wait = 0.01
            else:
                if not self.attempts and now >= self._store_retry_at and not self.settler.export_sweep_left \
                        and not self._untold and self._nothing_left():
                    # The job is over, and every result file written: a sweep still going on keeps the worker
                    # turning (a slice a turn, the watchdog fed between them) until it is over.
                    return
                idle_wait = min(idle_wait * 2, 1.0, cfg.heartbeat)
            timeout = self._next_deadline(next_tick, now) - time.monotonic()
            if len(self.attempts) < self.concurrency and not self.stopping:
                # Free slots: look again soon for new work, or when the next retry's backoff runs out (a
                # store that can announce new work wakes the wait at once).
                timeout = min(timeout, idle_wait if claims else self._idle_timeout(idle_wait))
            if self._sweep_due():
                timeout = 0.0  # the next slice of the sweep for missing result files
            if self._store_retry_at > now:
                # Outcomes wait in memory for the store to come back: try again once the backoff is over.
                timeout = min(timeout, self._store_retry_at - time.monotonic())
            if self.notifier.watchdog_every is not None:
                # A watchdog shorter than the heartbeat must still be fed, from this loop turning.
                timeout = min(timeout, self.notifier.watchdog_every)
            if self._untold:
                # Reports a MemoryError left untold (see _tell): looked at again soon. Memory that stays gone for a
                # whole lease is the machine's, not a task's moment: then the worker ends, as for its heartbeat.
                if self._untold_since is None:
                    self._untold_since = now
                elif now - self._untold_since > cfg.lease_seconds:
                    raise MemoryError("no memory to tell what was settled, for a whole lease")
                timeout = min(timeout, UNTOLD_RETRY)
            else:
                self._untold_since = None
            if self.inbox.has_finished() and time.monotonic() >= self._store_retry_at:
                # Posted from this thread (a command that exited, a start that failed): no wake-up came.
                timeout = 0.0
            self._wait(max(0.0, timeout))

    def _idle_timeout(self, idle_wait: float) -> float:
        """How long a worker with free slots and nothing to claim waits before it looks again: ``idle_wait``,
        or less when a pending task's backoff runs out sooner. Without this a retry due in 1 s ran 1.27 s
        later, at the poll after (the polls' sum: 10 ms + 20 ms + ... + 640 ms). A task due already but not
        claimed (the job is paused, another worker took it) leaves the backoff as it is."""
        if idle_wait <= ASK_NEXT_READY_PAST or time.monotonic() < self._store_retry_at:
            return idle_wait
        try:
            ready_in = self.store.next_ready_in()
        except StoreError:
            return idle_wait  # said when the claim fails the same way
        if ready_in is not None and 0 < ready_in < idle_wait:
            return ready_in + NEXT_READY_MARGIN
        return idle_wait

    def _tick_period(self) -> float:
        # Every heartbeat, and at least RENEWALS_PER_LEASE times a lease (see there).
        period = min(self.config.heartbeat, self.config.lease_seconds / RENEWALS_PER_LEASE)
        if self.config.stall_timeout:
            period = min(period, self.config.stall_timeout / 4)
        # Cannot renew: look again in time to stop our tasks before the leases run out, not a whole
        # heartbeat later, and at once if the moment to stop them passed during this look (the renewal
        # failed just before it, and the rest of the look took us past it).
        fence_in = self.leases.until_fence(self.attempts, time.monotonic())
        if fence_in is not None:
            period = min(period, fence_in)
        return max(period, 0.02)

    def _want(self, finished: list[tuple[Attempt, Outcome]], now: float) -> int:
        """How many tasks to claim in a turn that settles ``finished``: the slots free once they are. Both
        kinds of turn (the loop's, settle_here's) ask it before they settle: among ``finished``, attempts
        given back for a store fault put claims off first (``_put_off_claims``)."""
        self._put_off_claims(finished, now)
        if self.stopping or now < self._claim_paused_until:
            return 0
        running = len(self.attempts) - len(finished)  # once ``finished`` is settled
        if running > 0:
            # One ready to run alone waits for what runs to end.
            if self._alone_ready:
                return 0
            # A task to run alone runs with nothing beside it: claimed only when nothing ran, and nothing is
            # claimed while it runs, so it can only be the one attempt left (no scan of every attempt here,
            # at every turn of a worker that runs thousands).
            if running == 1:
                settled = {attempt.claim.task_id for attempt, _ in finished}
                if any(a.claim.alone for task_id, a in self.attempts.items() if task_id not in settled):
                    return 0
        return self.concurrency - len(self.attempts) + len(finished)

    def _wait(self, timeout: float) -> None:
        """Wait for something to do, letting tasks' threads take turns meanwhile (see settle_here)."""
        self._waiting_until = time.monotonic() + timeout
        self._turn.release()
        try:
            ready = self.readable.wait(timeout)
        finally:
            self._turn.acquire()
        for callback in ready:
            callback()  # the inbox's wake-up, new work in the store, or a child's pipe or exit

    def _take_finished(self) -> list[tuple[Attempt, Outcome]]:
        finished = self.inbox.take_finished()
        if self._unsettled:
            finished = self._unsettled + finished
            self._unsettled = []
        return finished

    # --- committing ----------------------------------------------------------------------------------
    def _settle_and_claim(self, finished: list[tuple[Attempt, Outcome]], want: int) -> list[Claim]:
        """Commit every finished attempt, the tasks' requested writes (steps) and claims of up to ``want``
        new tasks, in one transaction, crash-safe: ``_report_settled`` makes it durable, then tells."""
        calls = self.inbox.take_calls()
        if not finished and want <= 0 and not calls:
            return []
        after_commit: list[Callable[[], None]] = []
        started = time.monotonic()
        wake_due = want > 0 and self._waits_seen and started >= self._wake_due_at
        # Processes the handler made ready for the next commands: their pids are noted with the claims, in
        # the same commit, instead of each in a commit of its own before its command may run.
        spares = self.handler.spare_children(want) if want > 0 else []
        child = spares[0] if spares else None
        # Nothing runs once ``finished`` is settled: a task to run alone may be claimed (by itself).
        idle = len(self.attempts) == len(finished)
        try:
            if not calls and not wake_due and len(finished) == 1 and finished[0][1].kind == "done" \
                    and not finished[0][0].fenced and not (idle and self._alone_ready and want > 1):
                # One successful attempt and the next claims: one store call (one statement on PostgreSQL).
                report, claims = self.settler.done_and_claim(*finished[0], want, self.config.lease_seconds,
                                                             self.config.max_attempts, self._durable_now, child,
                                                             idle and want == 1)
                after_commit.append(report)
            else:
                claims = self._settle_and_claim_in_batch(calls, finished, want, started, after_commit, spares, idle)
        except StoreError as e:
            # Taken as not committed: keep the outcomes and try again after a backoff; the tasks that
            # asked for writes are told, since they wait on them. A COMMIT whose answer was lost may still
            # have been carried out (the server held it while paused): its claims are then reclaimed once
            # their leases run out, harmlessly, for nothing ran for them; but a process made ahead and noted
            # there would be killed by that reclaim, whatever command it runs by then. It is not used.
            if spares:
                self.handler.discard_spares()
            self._back_off(e)
            self._unsettled = finished
            for attempt, _ in finished:
                attempt.awaiting_commit = True
            for _, future in calls:
                future.set_exception(e)
            return []
        if self._store_backoff:
            self._store_backoff = 0.0
            self.store_errors.flush("store error, will retry")
        self._fresh_claims = {(claim.task_id, claim.fence) for claim in claims}
        if claims:
            self._claimed_at = (time.clock_gettime(time.CLOCK_BOOTTIME), time.time())
            if crashpoints.ARMED:  # the claims are committed (attempts counted, fences moved); none started
                crashpoints.hit("claim_committed")
            # A claim's lease runs from (at the latest) the moment we asked for it.
            self.leases.claimed(started)
            if self.keep_awake is not None and not self._marker_held:
                # Work again after every task waited (the marker was released): restore it now, not at
                # the next heartbeat.
                self.keep_awake.hold(self.store.url)
                self._marker_held = True
        self._unreported += after_commit
        for attempt, _ in finished:
            self.attempts.pop(attempt.claim.task_id, None)
        if self.log.level >= VERBOSE:  # skip formatting lines nobody will see (hot path)
            for claim in claims:
                self.log.debug(f"claimed task={quote(claim.name)} attempt={claim.attempt}")
        return claims

    def _settle_and_claim_in_batch(self, calls: list[StoreCall], finished: list[tuple[Attempt, Outcome]],
                                   want: int, started: float, after_commit: list[Callable[[], None]],
                                   spares: list[tuple[int, int]], idle: bool) -> list[Claim]:
        # Tasks waiting on their writes (steps) get a durable commit at once: their thread waits on it anyway.
        with self.store.batch(durable=self._durable_now or bool(calls)):
            for fn, future in calls:
                after_commit.append(_resolve_later(future, fn, self.store))
            for attempt, outcome in finished:
                after_commit.append(self.settler.settle(attempt, outcome))
                self._waits_seen = self._waits_seen or outcome.kind == "parked"
            if want > 0 and self._waits_seen and started >= self._wake_due_at:
                # Waits whose deadline passed become claimable: one statement on a small index, at most
                # once a second, and only while the job has waiting tasks (as of the last heartbeat, or
                # parked here since).
                self._wake_due_at = started + WAKE_DUE_EVERY
                self.store.wake_due(behind=self._clock_went_back)
                self._clock_went_back = False
            claims = self._claim(want, idle, spares[0] if spares else None) if want > 0 else []
            for i in range(1, min(len(claims), len(spares))):
                # The first claim noted the first spare (the claim statement itself); the others are noted
                # here, in the same commit.
                pid, start = spares[i]
                if self.store.note_child(claims[i].task_id, claims[i].fence, pid, start):
                    claims[i] = claims[i]._replace(child_pid=pid)
            for claim in claims:
                self.store.log_event("claimed", task_id=claim.task_id, worker_id=self.worker_id,
                                     attempt=claim.attempt)
        return claims

    def _claim(self, want: int, idle: bool, child: tuple[int, int] | None) -> list[Claim]:
        """Claims of up to ``want`` tasks, in the open batch; ``idle``: nothing runs once it commits. A task to
        run alone is claimed only by itself, when nothing runs: first of all while one is known ready
        (``_alone_ready``), else when nothing else is left."""
        cfg = self.config
        if idle and want > 1 and self._alone_ready:
            claims = self.store.claim(self.worker_id, 1, cfg.lease_seconds, cfg.max_attempts, child, alone=True)
            if claims and claims[0].alone:
                return claims
            # None of those is first in line any more (all run, or an older task came first): the flag goes
            # now, not at the next heartbeat. Kept till then, it had every turn drain the worker and claim one
            # task, ordinary ones too, as if each had to run alone.
            self._alone_ready = False
            if claims:
                return claims
        claims = self.store.claim(self.worker_id, want, cfg.lease_seconds, cfg.max_attempts, child, idle and want == 1)
        if not claims and idle and want > 1:
            claims = self.store.claim(self.worker_id, 1, cfg.lease_seconds, cfg.max_attempts, child, alone=True)
        return claims

    def _back_off(self, e: StoreError) -> None:
        """After a failed commit or sync: say so (throttled), and commit nothing before the backoff is over. A
        store found corrupt ends the worker (exit 2, which no supervisor restarts): a damaged page stays
        damaged, and trying again for good kept its tasks' leases from every other worker, a completion
        uncommitted, and nothing flagged to anyone."""
        if isinstance(e, CorruptStore):
            raise e
        self._store_backoff = min(max(2 * self._store_backoff, STORE_RETRY_FIRST), STORE_RETRY_MAX)
        self._store_retry_at = time.monotonic() + self._store_backoff
        self.store_errors.warning("store error, will retry", str(e))

    def _report_settled(self, pipelined: bool = False) -> None:
        """Make the last settling commit durable, then tell what it settled (log lines, output files, the
        tally, steps' values to their tasks). Called once the tasks it claimed have started, so that the
        fsync overlaps their run.

        ``pipelined`` (the loop's turn while tasks run at concurrency above 1, and settle_here's, whose
        thread runs the next task itself): the sync is started and left running beside the tasks
        (``Store.sync_ahead``), and no earlier sync is waited for: what a finished one made durable is told,
        the others are left running, and the next turn, on whichever thread, looks again; the store wakes the
        loop when a sync returned and no turn came to tell it within a moment (SYNC_AHEAD_LINGER). So no turn
        stands in an fsync while tasks end around it; the store's sync thread starts a sync up to
        PIPELINED_SYNC_GATHER after the first request it covers (or once the one under way returns), syncing
        the latest commit then, so one fsync covers the turns of that moment. Otherwise the sync is made in
        place (commands at concurrency 1, the last turn), after every earlier one was waited for.

        Whatever the order of turns, the reports of one commit are told before those of the next, and never
        before their commit is durable."""
        told = False
        self._untold = False
        while self._syncing:
            wait, earlier = self._syncing[0]
            if pipelined and len(self._syncing) < PIPELINED_SYNCS_MAX and not wait.finished():
                break
            try:
                wait()  # (again, after a MemoryError below: it returns at once)
            except StoreError as e:
                self._sync_failed(e)
                return
            if not self._tell(earlier):
                return
            del self._syncing[0]
            told = told or bool(earlier)
        if self._unreported:
            try:
                wait_for_sync = self.store.sync_ahead(PIPELINED_SYNC_GATHER) if pipelined else None
                if not pipelined:
                    self.store.sync()
            except StoreError as e:
                self._sync_failed(e)
                return
            reports, self._unreported = self._unreported, []
            if wait_for_sync is not None:
                self._syncing.append((wait_for_sync, reports))
                reports = []
            elif self._syncing:
                # (pipelined) Durable already (nothing new was owed, or synced in place), but earlier commits'
                # syncs still run: told after what they settled.
                self._syncing[-1][1].extend(reports)
                reports = []
            if not self._tell(reports):
                self._unreported = reports  # first in line: nothing was synced nor told after them
                return
            told = told or bool(reports)
        if not told:
            return  # nothing told
        if self._exports_owed and not self._store_backoff:
            self._exports_owed = False
            self.settler.start_export_sweep()

    def _tell(self, reports: list[Callable[[], None]]) -> bool:
        """Tell ``reports``, durable, in order; True once all are told. A MemoryError while telling one (most
        likely a Python task of this worker holds all there is, in the moment before its own MemoryError ends
        its attempt and frees it) leaves that report and those after it to the next turn, which the loop takes
        soon (``_untold``), with the tally as it was before that report: a report writes its log line last (a
        done one its --out file after it, which takes a MemoryError as an I/O error: Settler._export), so
        nothing of one is said twice. Those told already are counted in ``_told_already`` (the list stays
        first in line), as a MemoryError may leave no memory for anything else here. Before, it ended the
        worker with a traceback: tests/crash/test_memory_faults.py, a task filling memory, in about half the
        runs once the loop told a report while the task's next attempt filled it."""
        i = self._told_already
        while i < len(reports):
            tally = None
            try:
                tally = self.summary.__dict__.copy()
                reports[i]()
            except MemoryError:
                if tally is not None:
                    self.summary.__dict__.update(tally)  # same keys: no memory needed
                self._told_already = i
                self._untold = True
                return False
            i += 1
        self._told_already = 0
        return True

    def _sync_failed(self, e: StoreError) -> None:
        """After a failed sync: the commit it was to vouch for, and every one after it, is visible but not
        vouched for: what they settled is never told (none of those tasks was reported done, so running one
        again breaks no promise). The syncs still running are waited for all the same (the last covers the
        others; it fails as the first did), so that none is left unclaimed: the store's descriptor would wake
        the loop for it at every turn. The worker stays up like after a failed commit, backs off, and commits
        durably at once from now on, as SQLite does on its own."""
        syncing, self._syncing, self._unreported = self._syncing, [], []
        self._told_already = 0
        if syncing:
            try:
                syncing[-1][0]()
            except StoreError:
                pass
        self._durable_now = self._exports_owed = True
        self._back_off(e)

    # --- running attempts ----------------------------------------------------------------------------
    def _start(self, claim: Claim) -> None:
        if self.stopping:
            # Claimed in the moment before a SIGTERM was handled: nothing of it ran, so it is given back
            # uncounted rather than started only to be told to stop.
            self._not_started(claim, Outcome.released(f"stopped by {self._stop_requested} before it started"))
            return
        if len(self.attempts) >= self.concurrency:
            # Claimed along with an attempt that ran out of resources: given back without trying.
            self._not_started(claim, Outcome.released(f"worker lowered its concurrency to {self.concurrency}"))
            return
        try:
            attempt = self.handler.start(claim, self)
        except (StoreError, Fenced) as e:
            # The command's pid could not be noted, so it was not let run: a frozen worker must never leave
            # a command nobody taking the task over could find, nor start one for a claim taken over while
            # it was frozen. Given back uncounted, as when out of resources (settling a claim that is gone
            # journals it as fenced); a store error shows again at the settling commit.
            self._not_started(claim, Outcome.released(f"could not record the command's pid: {e}"))
            return
        except OSError as e:
            if e.errno in RESOURCE_ERRNOS:
                self._lower_concurrency(claim, e)
                self._not_started(claim, Outcome.released(f"worker out of resources: {e.strerror or e}"))
                return
            # The command could not even start (it vanished, or is no longer executable): a failed attempt
            # like any other, naming the program.
            program = e.filename if e.filename is not None else "the command"
            self._not_started(claim, Outcome.failure(cannot_run(program, e)))
            return
        self.attempts[claim.task_id] = attempt
        if self.stopping:
            # A SIGTERM handled while it was being started: the handler told the attempts it found, and this one
            # was not among them yet (its task would have run on, unaware, until the grace ran out).
            attempt.request_stop()

    def _not_started(self, claim: Claim, outcome: Outcome) -> None:
        attempt = Attempt(claim)
        self.attempts[claim.task_id] = attempt
        self.post(attempt, outcome)

    def _put_off_claims(self, finished: list[tuple[Attempt, Outcome]], now: float) -> None:
        """After attempts given back because the store failed their step calls: claim nothing for a while,
        --retry-delay (at least 1 s) doubling with each such attempt in a row, at most --max-retry-delay.
        The next attempt does again the work done since the last recorded step (a model call paid again):
        under a fault that lasts (a lock held on the steps for minutes), claiming at once paid it at every
        lock timeout, with no bound. A task done here ends the row."""
        for _, outcome in finished:
            if outcome.store_fault:
                cfg = self.config
                pause = doubling(max(cfg.retry_delay, STEP_FAULT_PAUSE), self._step_faults_in_a_row,
                                 max(cfg.max_retry_delay, STEP_FAULT_PAUSE))
                self._step_faults_in_a_row += 1
                self._claim_paused_until = max(self._claim_paused_until, now + pause)
                self.log.info(f"claiming nothing for {pause:g} s: the store failed a step call"
                              f" ({self._step_faults_in_a_row} attempt(s) in a row)")
            elif outcome.kind == "done":
                self._step_faults_in_a_row = 0

    def _lower_concurrency(self, claim: Claim, e: OSError) -> None:
        """Run fewer tasks at once, until no start has failed so for a while (``_raise_concurrency``): three
        quarters of those running now, since a shortage can strike midway through starting a command, and a
        start that failed may leave a descriptor or two open."""
        lowered = min(self.concurrency, max(1, 3 * len(self.attempts) // 4))
        self._claim_paused_until = time.monotonic() + RESOURCE_PAUSE
        change = (f"lowering concurrency from {self.concurrency} to {lowered}" if lowered < self.concurrency
                  else f"concurrency stays {lowered}")
        text = (f"out of resources starting task={quote(claim.name)}: {e.strerror or e}; {change}; attempts that"
                " could not start are given back uncounted")
        now = time.monotonic()
        if self._resources_warned is not None and now - self._resources_warned < RESOURCE_WARN_EVERY:
            self.log.debug(text)  # warned already: the rest is the same story (-v shows it; the default
            # level showed it, one more line about every second and a quarter while the shortage lasted)
            self._resources_unwarned += 1
        else:
            # Again once a minute while it lasts: a limit that lets not even one task start (ulimit -n 16)
            # would otherwise leave a worker that looks idle, having said so once, an hour ago.
            more = (f" ({self._resources_unwarned} more since the last warning)" if self._resources_unwarned
                    else "")
            self.log.warning(text + more)
            self._resources_warned, self._resources_unwarned = now, 0
        self.concurrency = lowered
        self._concurrency_changed = now

    def _raise_concurrency(self, now: float) -> None:
        """Back towards --concurrency, once no start has failed for want of resources for a while."""
        target = self.config.concurrency
        if self.concurrency >= target or now - self._concurrency_changed < CONCURRENCY_RAISE_AFTER:
            return
        raised = min(target, max(self.concurrency + 1, 4 * self.concurrency // 3))
        self.log.info(f"raising concurrency from {self.concurrency} to {raised}: no shortage of resources for"
                      f" {now - self._concurrency_changed:.0f} s")
        self.concurrency, self._concurrency_changed = raised, now

    def _enforce_deadlines(self, now: float) -> None:
        cfg = self.config
        for attempt in list(self.attempts.values()):
            if attempt.cancelled:
                continue
            if cfg.timeout is not None and now - attempt.started > cfg.timeout:
                attempt.cancel(f"timed out after {cfg.timeout:g}s")
            elif cfg.stall_timeout is not None and now - attempt.last_progress() > cfg.stall_timeout:
                attempt.cancel(f"stalled: no progress for {cfg.stall_timeout:g}s")
        if self.stopping and self._stop_deadline is not None and now > self._stop_deadline:
            for attempt in list(self.attempts.values()):
                attempt.abandon(f"stopped by {self._stop_requested} after {cfg.grace:g}s grace")
        for attempt in list(self.attempts.values()):
            grace = cfg.grace
            if attempt.must_end_by is not None and attempt.cancelled_at is not None:
                grace = min(grace, attempt.must_end_by - attempt.cancelled_at)  # its lease runs out soon
            if attempt.unresponsive(now, grace):
                # A Python task ignored its cancellation: a thread cannot be killed, so the worker exits
                # with an error and its supervisor starts a clean one (the attempt is already counted).
                raise WedgedTask(attempt.claim.name, attempt.cancel_reason or "cancelled")

    def _next_deadline(self, next_tick: float, now: float) -> float:
        """The next moment something is due. A deadline already acted upon (an attempt cancelled, the
        grace over) is not waited for again: while its outcome waits for the store it would spin the loop."""
        deadline = next_tick
        cfg = self.config
        for attempt in self.attempts.values():
            if attempt.cancelled:
                if attempt.must_end_by is not None and attempt.must_end_by > now:
                    deadline = min(deadline, attempt.must_end_by)  # a task that must be gone by then
                continue
            if cfg.timeout is not None:
                deadline = min(deadline, attempt.started + cfg.timeout)
            if cfg.stall_timeout is not None:
                deadline = min(deadline, attempt.last_progress() + cfg.stall_timeout)
        if self._stop_deadline is not None:
            for at in (self._stop_deadline, self._stop_deadline + STOP_COMMIT_SECONDS):
                if at > now:
                    deadline = min(deadline, at)
                    break
        return deadline

    def _shutdown_attempts(self) -> None:
        """On the way out (also after an error): no child may outlive this worker."""
        for attempt in list(self.attempts.values()):
            attempt.abandon("worker exiting")
        # Give back what was still running, uncounted, when we leave on a graceful stop; after an error
        # the tasks stay claimed and are reclaimed as soon as any worker starts.
        leftovers = self._take_finished()
        for attempt, _ in leftovers:
            self.attempts.pop(attempt.claim.task_id, None)
        if not self.stopping:
            return
        leftovers += [(attempt, Outcome.released("worker stopped")) for attempt in self.attempts.values()]
        if not leftovers:
            return
        try:  # one last try, in one transaction: a failing store costs one call, not one per task
            with self.store.batch():
                reports = [self.settler.settle(attempt, outcome) for attempt, outcome in leftovers]
        except OnwardError as e:
            # Safe to leave: an uncommitted outcome's task stays claimed, and its owner (this process) is
            # about to be gone, so the next worker reclaims it at once, as after a crash.
            self.log.warning(f"could not commit {len(leftovers)} outcome(s) on the way out: {e}; their tasks stay"
                             " claimed, and the next worker reclaims them (attempt counted, as after a crash)")
            return
        for report in reports:
            report()

    # --- leases and other workers' tasks -------------------------------------------------------------
    def _tick(self) -> None:
        try:
            self._heartbeat()
        except MemoryError:
            # Most likely a Python task of this worker holds all there is, in the moment before its own
            # MemoryError ends its attempt and frees it: skip this heartbeat rather than end the worker (the
            # Python API raised it; `onward run` exited 75). Said once memory is back (saying it now would
            # need memory too). Memory that stays gone for a whole lease is the machine's, not a moment's,
            # and the leases lapse: then it ends the worker as before.
            now = time.monotonic()
            if self._out_of_memory_since is None:
                self._out_of_memory_since = now
            if now - self._out_of_memory_since > self.config.lease_seconds:
                raise
            return
        if self._out_of_memory_since is not None:
            self.log.warning(f"the worker's heartbeat found no memory for {time.monotonic() - self._out_of_memory_since:.1f}"
                             " s (a task holding it all?); those heartbeats were skipped")
            self._out_of_memory_since = None

    def _heartbeat(self) -> None:
        # A store deleted or replaced under us raises StoreGone: stop rather than commit where nobody looks.
        self.store.check_still_there()
        self.leases.renew(self.worker_id, self.attempts, self.summary.done)
        self._raise_concurrency(time.monotonic())
        self._warn_of_a_held_log()
        self.store.tidy()
        try:
            self._reclaim_abandoned()
            self._obey_cancels()
            counts = self.store.counts()
            self._update_keep_awake(counts, self._note_pause())
        except StoreError as e:
            if isinstance(e, CorruptStore):
                raise  # as in _back_off
            self.store_errors.warning("store unavailable", str(e))
            return
        self._notify_status(counts)

    def _warn_of_a_held_log(self) -> None:
        """Say, once a minute while it lasts, that the store's log keeps growing because a reader holds it back
        (a sqlite3 shell left in a transaction): nothing else shows it until the disk is full."""
        size = self.store.log_held_back()
        now = time.monotonic()
        if size is None or (self._log_warned is not None and now - self._log_warned < RESOURCE_WARN_EVERY):
            return
        self._log_warned = now
        self.log.warning(f"the store's log is {size / (1 << 20):,.0f} MiB and growing: another connection holds"
                         " a read transaction open (a sqlite3 shell after BEGIN, a script that never commits),"
                         " so it cannot be copied into the database; it shrinks back once that reader ends")

    def _notify_status(self, counts: dict[str, int]) -> None:
        self.counts_seen = (counts, self.summary.done, self.summary.failed)
        self._waits_seen = bool(counts.get(WAITING, 0))
        cancelled = f", {counts[CANCELLED]} cancelled" if counts.get(CANCELLED) else ""
        waiting = f" {counts[WAITING]} waiting," if counts.get(WAITING) else ""
        self.notifier.status(f"{counts.get(DONE, 0)}/{sum(counts.values())} done, {counts.get(RUNNING, 0)} running,"
                             f"{waiting} {counts.get(FAILED, 0)} failed{cancelled}" + (", paused" if self._paused else ""))

    def _obey_cancels(self) -> None:
        """Stop the attempts whose tasks were cancelled (``onward cancel``) like a timed-out attempt: a command's
        process group is killed, a Python task's ``ctx.check()`` raises. The store then ends them cancelled.
        One statement per heartbeat, and none while this worker runs nothing."""
        if not self.attempts:
            return
        for task_id in self.store.cancelling(self.worker_id):
            attempt = self.attempts.get(task_id)
            if attempt is not None and not attempt.cancelled:
                self.log.info(f"cancelling task={quote(attempt.claim.name)} attempt={attempt.claim.attempt}:"
                              " cancelled by request")
                attempt.cancel("cancelled by request (onward cancel)")

    def _note_pause(self) -> bool:
        """Read the job's pause flag (once per heartbeat) and say when it changed. The loop needs it for the
        log, the status line and the keep-awake marker only: a paused job's claims come back empty anyway."""
        paused = self.store.paused()
        if paused != self._paused:
            self._paused = paused
            if paused:
                self.log.info("job paused: claiming nothing new; running tasks go on (onward resume to go on)")
            else:
                self.log.info("job resumed: claiming again")
        return paused

    def _reclaim_abandoned(self) -> None:
        """At start-up and every heartbeat: take back what dead workers left, and look for tasks to run alone
        (some may just have been taken back)."""
        reclaim_abandoned(self.store, self.worker_id, self.attempts, self.log,
                          expired_leases=time.monotonic() >= self._lease_takeovers_from)
        if self.concurrency > 1:
            self._alone_ready = self.store.alone_ready()

    def _sweep_due(self) -> bool:
        """Whether the sweep for missing result files has a slice to go through now: only once every
        completion this worker committed was made durable and told (a result file must never come before its
        commit is durable), and not while the store is failing."""
        return (self.settler.export_sweep_left and not self._syncing and not self._unreported
                and not self._store_backoff and time.monotonic() >= self._sweep_retry_at)

    def _sweep_exports(self, seconds: float) -> None:
        """Go on with the sweep for missing result files for about ``seconds``."""
        if self._syncing and self.settler.export_sweep_left:
            # The sweep must not see a commit before it is durable: the syncs the loop left running are waited
            # for here (only while a sweep is left, after a start that found result files missing), so that a
            # busy loop, which leaves one running at almost every turn, does not put the sweep off to its end.
            self._report_settled()
        if not self._sweep_due():
            return
        try:
            self.settler.export_missing(seconds)
        except StoreError as e:
            self.store_errors.warning("could not look for missing result files", str(e))
            self._sweep_retry_at = time.monotonic() + self.config.heartbeat

    def _nothing_left(self) -> bool:
        """Nothing pending, running or waiting anywhere. Other workers' running tasks keep this one
        waiting: they may fail and come back, or their owner may die and leave them to be reclaimed. So do
        waiting tasks (ctx.wait): the worker stays (a supervisor or systemd sees no exit) and polls for them
        about once a second, or is woken by NOTIFY, until their values come."""
        try:
            counts = self.store.counts()
        except StoreError as e:
            self.store_errors.warning("store unavailable", str(e))
            return False
        return counts.get(PENDING, 0) == 0 and counts.get(RUNNING, 0) == 0 and counts.get(WAITING, 0) == 0

    def _update_keep_awake(self, counts: dict[str, int], paused: bool) -> None:
        """Hold the marker while the job has work that will get done: running tasks, or pending ones unless
        the job is paused. A paused job with nothing running keeps nobody awake: it waits for a person to
        resume it, and the machine may sleep meanwhile (its workers go on when it wakes and the job is
        resumed). Released once, when the pause takes effect, so that a worker of another job holding the
        same marker is not fought every heartbeat. Likewise when every task left waits for a value
        (ctx.wait): nothing will happen until someone sends it, and the machine may sleep until then; the
        marker comes back as soon as a task is claimed again (``_settle_and_claim``)."""
        if self.keep_awake is None:
            return
        if _work_left(counts, paused):
            self.keep_awake.hold(self.store.url)
            self._marker_held = True
        elif (paused or counts.get(WAITING, 0)) and self._marker_held:
            self.keep_awake.release()
            self._marker_held = False

    def _release_keep_awake(self, counts: dict[str, int]) -> None:
        """Remove the marker when nothing is left to do, or when no other live worker remains to do it."""
        if self.keep_awake is None:
            return
        work_left = _work_left(counts, self.store.paused())
        others = [w for w in self.store.workers()
                  if w.worker_id != self.worker_id and w.heartbeat_age < self.config.lease_seconds
                  and owner_alive(w.owner) is not False]
        if not work_left or not others:
            self.keep_awake.release()


def _work_left(counts: dict[str, int], paused: bool) -> bool:
    """Whether the job has work that will get done: running tasks, or pending ones while it is not paused.
    Done, failed and cancelled tasks are final."""
    return bool(counts.get(RUNNING, 0) or (counts.get(PENDING, 0) and not paused))


def _resolve_later(future: Future[Any], fn: Callable[[Store], Any], store: Store) -> Callable[[], None]:
    """Run a task's write inside the open batch; hand its value (or error) over once committed."""
    try:
        value = fn(store)
    except OnwardError as e:
        error = e  # `e` itself is unbound when the except block ends
        return lambda: future.set_exception(error)
    return lambda: future.set_result(value)


def _nothing_to_read() -> None:
    """The callback for the store's sync-ahead descriptor (see Runner.__init__)."""
