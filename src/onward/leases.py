"""The leases of one worker's running attempts, as its loop knows them: renewed every heartbeat (and at least
three times a lease, see runner.RENEWALS_PER_LEASE), known to hold until a moment measured from before the
renewal was sent, and when they cannot be renewed, their tasks stopped in time (before another worker may
take them over) with nothing of them committed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

from . import crashpoints
from .attempt import Attempt
from .errors import StoreError
from .log import Log, Throttled, quote
from .store.base import Lease, Store

# Seconds a Python task taken over by another worker may run on once this worker learns it: its thread
# cannot be killed, and the new attempt may be running already, so if it has not stopped by then (it
# ignores its cancellation) the worker exits (WedgedTask) rather than wait out the whole --grace beside it.
TAKEN_OVER_GRACE = 1.0


class Leases:
    def __init__(self, store: Store, length: float, log: Log, store_errors: Throttled) -> None:
        self.store = store
        self.length = length
        self.log = log
        self.store_errors = store_errors
        self.valid_until = float("inf")  # monotonic time our leases are known to hold until
        self.renewal_failing = False

    @property
    def fence_margin(self) -> float:
        """How long before our leases run out we stop their tasks when we cannot renew them: longer than
        one store call may keep this loop waiting (the PostgreSQL store bounds that at a quarter of the
        lease), so that the stop is in time even if the loop was inside a call at that moment."""
        return self.length / 3

    def claimed(self, asked_at: float) -> None:
        """New claims were committed: their leases run from (at the latest) the moment we asked for them."""
        self.valid_until = min(self.valid_until, asked_at + self.length)

    def until_fence(self, attempts: Mapping[int, Attempt], now: float) -> float | None:
        """While renewals fail and tasks of ours still run: the seconds until they must be stopped (0 when
        that moment has passed already, as it may have during the look that failed to renew)."""
        if self.renewal_failing and any(a.fenceable for a in attempts.values()):
            return max(0.0, self.valid_until - self.fence_margin - now)
        return None

    def renew(self, worker_id: int, attempts: Mapping[int, Attempt], completed: int) -> None:
        """Renew the leases of our running attempts; stop those the store says were taken over, and all of
        them when the store cannot be reached and our leases are about to run out."""
        started = time.monotonic()
        leases = [Lease(task_id=a.claim.task_id, fence=a.claim.fence,
                        progress_age=started - a.last_progress(), note=a.note)
                  for a in attempts.values() if not a.fenced]
        try:
            lost = self.store.renew(worker_id, leases, self.length, completed)
            # Measured from before the renewal was sent: the store may have stamped it any time after.
            self.valid_until = started + self.length
            if crashpoints.ARMED:  # the renewal of our leases is committed
                crashpoints.hit("lease_renewed")
            self.renewal_failing = False
            self.store_errors.flush("could not renew leases")
        except StoreError as e:
            self.store_errors.warning("could not renew leases", str(e))
            self.renewal_failing = True
            lost = []
            self._fence_if_ran_out(attempts)
        for task_id in lost:
            attempt = attempts.get(task_id)
            # A lease reported lost of an attempt awaiting its commit may be that commit's own doing.
            if attempt is not None and attempt.fenceable:
                self._fence_taken_over(worker_id, attempt)

    def _fence_taken_over(self, worker_id: int, attempt: Attempt) -> None:
        attempt.fence("lease lost: the task was taken over", end_by=time.monotonic() + TAKEN_OVER_GRACE)
        self.log.warning(f"fenced task={quote(attempt.claim.name)} attempt={attempt.claim.attempt}:"
                         " lease lost, it was taken over; stopping it, nothing of it will be committed")
        with contextlib.suppress(StoreError):
            self.store.log_event("fenced", task_id=attempt.claim.task_id, worker_id=worker_id,
                                 attempt=attempt.claim.attempt, detail="lease lost: taken over; stopped")

    def _fence_if_ran_out(self, attempts: Mapping[int, Attempt]) -> None:
        """Cut off from the store past our lease: others may take our tasks over, so stop them now and
        commit nothing about them (they run again elsewhere; two attempts must not overlap)."""
        if time.monotonic() < self.valid_until - self.fence_margin:
            return
        for attempt in attempts.values():
            if attempt.fenceable:
                # A command's process group is killed at once; a Python task's thread cannot be, and may
                # ignore its cancellation: half of the margin left is its grace, then the worker exits (the
                # runner's deadlines), so that it never runs on beside the attempt that takes the task over.
                attempt.fence("lease ran out: could not reach the store to renew it",
                              end_by=self.valid_until - self.fence_margin / 2)
                self.log.warning(f"lease ran out task={quote(attempt.claim.name)}: stopped, not committing it")
