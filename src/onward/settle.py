"""What becomes of a finished attempt: its outcome written inside the worker's open batch (done, given back,
retried or failed for good), and what the worker tells about it once that batch is durable: nothing (log
line, output file, tally) reports a completion before its commit was synced. Also the run's tally.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from . import crashpoints
from .attempt import Attempt, Outcome
from .durations import doubling
from .errors import UNAVAILABLE_ERRNOS, UNAVAILABLE_EXIT
from .log import NORMAL, Log, quote
from .store.base import CANCELLED, DONE, FAILED, FENCED_DETAIL, PENDING, WAITING, Claim, Store

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .outdir import OutDir  # loaded only with --out

# The sweep for missing result files (Settler.export_missing): done tasks read per statement, at most, from a
# window of at most so many task ids.
EXPORT_SWEEP_PAGE = 256
EXPORT_SWEEP_WINDOW = 4096

Report = Callable[[], None]  # what to tell once the batch holding the outcome is durable (Store.sync)


@dataclass
class RunSummary:
    done: int = 0  # tasks this run completed
    failed: int = 0  # tasks this run failed for good
    retried: int = 0  # failed attempts that will be retried
    released: int = 0  # attempts given back on a graceful stop
    cancelled: int = 0  # tasks this run stopped because they were cancelled (onward cancel)
    fenced: int = 0  # completions refused because the task was taken over
    parked: int = 0  # attempts that ended in a wait (ctx.wait): their tasks wait for a value, uncounted
    stopped: bool = False  # a stop signal ended the run
    counts: dict[str, int] = field(default_factory=dict)  # the store's counts at the end
    unexported: int = 0  # done tasks whose --out file this run could not write (the store has their results)
    export_error: str = ""  # the last error writing one

    def unexported_line(self) -> str:
        """What the run ends with when ``unexported`` (``onward run``: ``onward: error: ...``, exit 75)."""
        return (f"{self.unexported} result files could not be written to --out (last: {self.export_error}); the"
                " store has their results: run again once the folder can be written, and the missing files are"
                " written then")

    @property
    def exit_code(self) -> int:
        """0: nothing left and no task failed (or stopped on request); 3: finished with failed tasks; 75:
        finished, but result files are missing from --out (a full or read-only disk): run again once it can
        be written, and the missing files are written from the store. Cancelled tasks are final but not
        failures: a job that ends with some cancelled and none failed exits 0."""
        if self.stopped:
            return 0
        if self.unexported:
            return UNAVAILABLE_EXIT
        return 3 if self.counts.get(FAILED, 0) else 0


class Settler:
    """Writes the outcomes of one worker's attempts and keeps its tally (``summary``)."""

    def __init__(self, store: Store, log: Log, out: OutDir | None, retry_delay: float,
                 max_retry_delay: float, on_progress: Callable[[], None] | None = None) -> None:
        self.store = store
        # Called first by the report of a settled task (done, failed, or to be retried), before anything
        # else of it is told: a supervisor learns of the progress as soon as it is durable, not after the
        # log line and the --out file (a worker killed in between was taken for one that got nowhere).
        self.on_progress = on_progress or _nothing_to_report
        self.log = log
        self.out = out
        self.retry_delay = retry_delay  # first backoff; doubles with every further attempt
        self.max_retry_delay = max_retry_delay
        self.worker_id = 0  # set once the worker is registered
        self.summary = RunSummary()
        # Done tasks whose --out file could not be written (a full or read-only disk), until a later write of
        # it works (the sweep for missing files tries again), and the last error: the run then ends 75.
        self.unexported: set[str] = set()
        self.export_error = ""
        # The sweep for missing result files (start_export_sweep): the id of the last done task looked at,
        # None when there is no sweep left to do; and how many files it wrote.
        self._sweep_after: int | None = None
        self._sweep_exported = 0
        self._sweep_temp_files: Iterator[None] | None = None  # its first part: crashed writers' temp files
        # When it began (the store's clock): tasks done since are left to the workers that did them, which
        # write their files once their commits are durable. Another SQLite worker's commit is visible before
        # its sync: writing its file then would report it before it is durable.
        self._sweep_since: float | None = None

    def settle(self, attempt: Attempt, outcome: Outcome) -> Report:
        """Write one outcome inside the open batch; return what to report once it is committed."""
        if attempt.fenced:
            return _nothing_to_report  # already reported when the lease was lost
        seconds = time.monotonic() - attempt.started
        if outcome.kind == "done":
            return self._done(attempt.claim, outcome, seconds)
        if outcome.kind == "released":
            return self._released(attempt.claim, outcome)
        if outcome.kind == "parked":
            return self._parked(attempt.claim, outcome)
        return self._failed(attempt.claim, outcome)

    def done_and_claim(self, attempt: Attempt, outcome: Outcome, want: int, lease_seconds: float,
                       max_attempts: int, durable: bool = True,
                       child: tuple[int, int] | None = None, alone: bool = False) -> tuple[Report, list[Claim]]:
        """A successful attempt (not fenced) and the claims of up to ``want`` next tasks (``child`` and
        ``alone`` as for ``Store.claim``), committed by one store call (``complete_and_claim``): the worker's
        commit when that attempt is all it has to settle."""
        seconds = time.monotonic() - attempt.started
        claim = attempt.claim
        completed, claims = self.store.complete_and_claim(claim, outcome.result, outcome.result_kind, self.worker_id,
                                                          want, lease_seconds, max_attempts, durable, child,
                                                          alone)
        return (self._report_done(claim, outcome, seconds) if completed else self._report_fenced(claim)), claims

    def _done(self, claim: Claim, outcome: Outcome, seconds: float) -> Report:
        completed = self.store.complete(claim.task_id, claim.fence, outcome.result, outcome.result_kind)
        state, first = self._settled(DONE if completed else None, claim)
        if state is None:
            return self._fenced(claim)
        if first:
            self.store.log_event("done", task_id=claim.task_id, worker_id=self.worker_id, attempt=claim.attempt)
        return self._report_done(claim, outcome, seconds)

    def _settled(self, state: str | None, claim: Claim) -> tuple[str | None, bool]:
        """The state an outcome's write left (``state``, None when it was refused), and whether this write
        did it. A refused write may be a try again after a store error whose commit landed all the same
        (``Store.settled_under``): that commit settled the same outcome and journaled it, so the outcome is
        told as usual, once the commit now made is durable (the earlier one with it), and journaled no
        more. (None, False): fenced out for real."""
        if state is not None:
            return state, True
        return self.store.settled_under(claim.task_id, claim.fence), False

    def _report_done(self, claim: Claim, outcome: Outcome, seconds: float) -> Report:
        def report_done() -> None:
            self.on_progress()
            if crashpoints.ARMED:  # the task is done in the store; not reported yet, no --out file yet
                crashpoints.hit("completion_committed")
            self.summary.done += 1
            if self.log.level >= NORMAL:  # skip formatting a line nobody will see (hot path)
                self.log.info(f"done task={quote(claim.name)} attempt={claim.attempt} in {seconds:.2f}s")
            if self.out is not None:
                self._export(claim.name, outcome.result)
        return report_done

    def _released(self, claim: Claim, outcome: Outcome) -> Report:
        state, first = self._settled(self.store.release(claim.task_id, claim.fence, outcome.error), claim)
        if state is None:
            return self._fenced(claim)
        if state == CANCELLED:  # given back while a cancel was pending: it ends there
            if first:
                self.store.log_event("cancelled", task_id=claim.task_id, worker_id=self.worker_id,
                                     attempt=claim.attempt, detail=f"given back ({outcome.error}) after a cancel")

            def report_cancelled() -> None:
                self.summary.cancelled += 1
                self.log.info(f"cancelled task={quote(claim.name)} attempt={claim.attempt}: given back, not retried")
            return report_cancelled
        if first:
            self.store.log_event("released", task_id=claim.task_id, worker_id=self.worker_id,
                                 attempt=claim.attempt, detail=outcome.error)

        def report_released() -> None:
            self.summary.released += 1
            self.log.info(f"released task={quote(claim.name)}: {outcome.error}")
        return report_released

    def _parked(self, claim: Claim, outcome: Outcome) -> Report:
        """A task waits for a value (``ctx.wait``): its claim is given back uncounted and it parks."""
        key, until = outcome.wait_key, outcome.wait_until
        state, first = self._settled(self.store.park(claim.task_id, claim.fence, key, until), claim)
        if state is None:
            return self._fenced(claim)
        if state == CANCELLED:
            if first:
                self.store.log_event("cancelled", task_id=claim.task_id, worker_id=self.worker_id,
                                     attempt=claim.attempt, detail=f"cancelled while it began to wait for {key!r}")

            def report_cancelled() -> None:
                self.summary.cancelled += 1
                self.log.info(f"cancelled task={quote(claim.name)} attempt={claim.attempt}: not waiting, not retried")
            return report_cancelled
        deadline = "" if until is None else f" (until {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(until))})"
        detail = (f"waiting for {key!r}{deadline}" if state == WAITING
                  else f"waiting for {key!r}: the value is there, runnable again")
        if first:
            self.store.log_event("waiting", task_id=claim.task_id, worker_id=self.worker_id,
                                 attempt=claim.attempt, detail=detail)

        def report_parked() -> None:
            if crashpoints.ARMED:  # the park is committed; not reported yet
                crashpoints.hit("wait_parked")
            self.summary.parked += 1
            self.log.info(f"task={quote(claim.name)} {detail}; its slot is free meanwhile")
        return report_parked

    def _failed(self, claim: Claim, outcome: Outcome) -> Report:
        delay = doubling(self.retry_delay, claim.attempt - 1, self.max_retry_delay)
        state, first = self._settled(self.store.fail(claim.task_id, claim.fence, outcome.error, delay), claim)
        if state is None:
            return self._fenced(claim)
        if first:
            kind = {PENDING: "retrying", CANCELLED: "cancelled"}.get(state, "failed")
            self.store.log_event(kind, task_id=claim.task_id, worker_id=self.worker_id, attempt=claim.attempt,
                                 detail=outcome.error)
        if state == CANCELLED:
            def report_cancelled() -> None:
                self.summary.cancelled += 1
                self.log.info(f"cancelled task={quote(claim.name)} attempt={claim.attempt}: stopped, not retried")
            return report_cancelled
        if state == PENDING:
            def report_retrying() -> None:
                self.on_progress()
                if crashpoints.ARMED:  # the failed attempt is committed, the task pending again (retry later)
                    crashpoints.hit("retry_scheduled")
                self.summary.retried += 1
                self.log.warning(f"attempt failed task={quote(claim.name)} attempt={claim.attempt}/"
                                 f"{claim.max_attempts}: {outcome.error_line}; retry in {delay:g}s")
            return report_retrying

        def report_failed() -> None:
            self.on_progress()
            self.summary.failed += 1
            self.log.warning(f"failed task={quote(claim.name)} after {claim.attempt} attempts: {outcome.error_line}")
        return report_failed

    def _fenced(self, claim: Claim) -> Report:
        self.store.log_event("fenced", task_id=claim.task_id, worker_id=self.worker_id, attempt=claim.attempt,
                             detail=FENCED_DETAIL)
        return self._report_fenced(claim)

    def _report_fenced(self, claim: Claim) -> Report:
        def report_fenced() -> None:
            self.summary.fenced += 1
            self.log.warning(f"fenced task={quote(claim.name)} attempt={claim.attempt}: it was taken over,"
                             " outcome dropped")
        return report_fenced

    def _export(self, name: str, data: bytes) -> None:
        assert self.out is not None
        try:
            self.out.write(name, data)
            if crashpoints.ARMED:  # the result file is in --out, renamed and its folder fsynced
                crashpoints.hit("export_written")
        except (OSError, MemoryError) as e:
            # The store holds the result; the next start exports what is missing. (A MemoryError: a Python task
            # holds all memory in this moment; not raised, since the report's log line is written already and
            # a report raising it is told again, see Runner._tell.)
            self.log.warning(f"could not write output for task={quote(name)}: {e or type(e).__name__}")
            if isinstance(e, MemoryError) or e.errno in UNAVAILABLE_ERRNOS:
                # The machine's fault, for now (a full or read-only disk): the run ends 75, to be run again.
                # Not one that stays (a folder of the user's at the name, no permission): a supervisor would
                # restart the worker for good.
                self.unexported.add(name)
                self.export_error = f"{e or type(e).__name__}"
        else:
            self.unexported.discard(name)

    def start_export_sweep(self) -> None:
        """Look for done tasks whose result file is missing from --out (a write failed, or the folder is new),
        from the first task on: ``export_missing`` goes through them a slice at a time."""
        if self.out is not None:
            self._sweep_after = 0
            self._sweep_exported = 0
            self._sweep_since = None
            self._sweep_temp_files = self.out.remove_stale_temp_files()

    @property
    def export_sweep_left(self) -> bool:
        """Whether the sweep started by ``start_export_sweep`` has files or done tasks left to look at."""
        return self._sweep_after is not None or self._sweep_temp_files is not None

    def export_missing(self, seconds: float) -> None:
        """Go on with the sweep for about ``seconds``: remove the temp files of writers that crashed, then
        write the result file of every done task that has none. A page of done tasks at a time, each page
        one statement, from where the last slice stopped: a worker's start no longer waits for a walk of
        every done task (which grew with the job: 0.9 to 2.3 s at 150,000 done tasks, about ten times that at
        a million), and the memory it takes does not grow with the folder (it read every file's name into a
        set). Raises StoreError with the place kept, to go on from there.

        Call it only when every completion this worker committed has been told: the sweep writes the result
        of any done task it finds without one, and a result file must not come before its commit is durable.
        """
        assert self.out is not None
        deadline = time.monotonic() + seconds
        if self._sweep_since is None:
            self._sweep_since = self.store.now()
        since = self._sweep_since
        # First the temp files crashed writers left, a name of the folder at a time.
        while self._sweep_temp_files is not None:
            try:
                for _ in range(EXPORT_SWEEP_PAGE):
                    next(self._sweep_temp_files)
            except StopIteration:
                self._sweep_temp_files = None
            except OSError as e:
                self._sweep_temp_files = None
                self.log.warning(f"could not look for temp files left in --out: {e}")
            if time.monotonic() >= deadline:
                return
        while self._sweep_after is not None:
            # A window of ids at a time: done tasks may be few among them (a job's start), and a statement
            # asking for a page of them would read on to the end.
            until = self._sweep_after + EXPORT_SWEEP_WINDOW
            page = self.store.task_page(DONE, None, self._sweep_after, EXPORT_SWEEP_PAGE, until=until)
            for row in page:
                if row.finished_at is not None and row.finished_at > since:
                    self._sweep_after = row.task_id  # done since the sweep began: its worker writes the file
                    continue
                try:
                    present = self.out.has(row.name)
                except OSError as e:
                    self.log.warning(f"could not look for missing result files in --out: {e}; the next start"
                                     " looks again")
                    self._sweep_after = None
                    return
                if not present:
                    stored = self.store.result(row.name)
                    if stored is not None:
                        self._export(row.name, stored.data)
                        self._sweep_exported += 1
                self._sweep_after = row.task_id
            if len(page) < EXPORT_SWEEP_PAGE:
                # The window is done: go on from the job's next task past it, if there is one.
                later = self.store.task_page(None, None, until, 1)
                self._sweep_after = later[0].task_id - 1 if later else None
            if self._sweep_after is None:
                if self._sweep_exported:
                    self.log.info(f"exported {self._sweep_exported} missing result files")
                return
            if time.monotonic() >= deadline:
                return


def _nothing_to_report() -> None:
    pass
