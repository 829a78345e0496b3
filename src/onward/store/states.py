"""Task states, as stored: a leaf module, so that what only needs their names (`onward status` on a plain
store) does not load the contract's classes (base.py, which re-exports them)."""

from __future__ import annotations

# Task states, as stored. A task moves pending -> running -> done | failed, and running -> pending on a
# retry, a release (graceful stop) or a reclaim. ``cancel`` ends a pending task as cancelled at once, and a
# running one once its worker stopped it (its outcome, whatever it was but done, is then cancelled).
# Done, failed and cancelled are final; ``retry`` brings failed and cancelled tasks back to pending. A running
# task that waits for a value (``ctx.wait``) parks: running -> waiting (no worker, no lease, the attempt not
# counted) -> pending once the value is sent or the wait's deadline passed; ``cancel`` ends a waiting task.
PENDING, RUNNING, WAITING, DONE, FAILED, CANCELLED = "pending", "running", "waiting", "done", "failed", "cancelled"
STATES = (PENDING, RUNNING, WAITING, DONE, FAILED, CANCELLED)
FINAL_STATES = (DONE, FAILED, CANCELLED)
