"""Test-only crash points: a worker SIGKILLs (or SIGSTOPs) itself the n-th time it passes a named phase.

The torture tests (tests/crash/test_kill_torture.py) need kills at exact moments of the runner's life (a
claim just committed, a completion committed but its result file not yet written, ...), far more often and
more precisely than a kill from outside can land them. Each such moment calls, at its site::

    if crashpoints.ARMED:
        crashpoints.hit("completion_committed")

``ARMED`` is resolved once, at import, from the environment: ``ONWARD_CRASH_AT=phase:n`` (or several,
comma-separated) is honoured only when ``ONWARD_TEST_HOOKS=1`` is set too, so a stray variable in a user's
environment cannot kill their worker. Unarmed (always, outside tests), a site costs one global lookup and a
test of a constant.

The kill is real: ``os.kill(os.getpid(), SIGKILL)``, nothing flushed, no handler run, no ``finally``.
"""

from __future__ import annotations

import os
import signal
import threading

# The phases a site may name, in the order a task passes them (the torture tests target each one).
PHASES = (
    "claim_committed",  # claims returned by a committed batch; no attempt started yet
    "child_noted",  # a command's process exists and its pid is noted in the store; the command has not run
    "attempt_started",  # the command's process (or the Python task's thread) is running
    "step_recorded",  # a durable step's record committed; the step call has not returned yet
    "completion_committed",  # the task is done in the store; nothing reported, no --out file yet
    "export_written",  # the result file is in --out (renamed and its folder fsynced)
    "lease_renewed",  # the renewal of this worker's leases committed
    "retry_scheduled",  # a failed attempt committed as pending again (retry later)
    "reclaim",  # another worker's abandoned tasks committed back to pending (and journaled); not logged yet
    # Durable waits (ctx.wait, parked sleeps):
    "wait_parking",  # the wait found no value: the attempt ends parked, nothing of that committed yet
    "wait_parked",  # the park committed (the task waits, slot and lease given back); not reported yet
    "wait_recorded",  # the wait's outcome (value or timeout) committed as a step; ctx.wait not returned yet
)


def _parse(spec: str) -> dict[str, int]:
    """``"phase:n,phase2:m"`` -> {phase: n}; a bad spec is an error at import, loud in the test that set it."""
    targets: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        phase, _, count = part.partition(":")
        if phase not in PHASES:
            raise ValueError(f"ONWARD_CRASH_AT: unknown phase {phase!r} (phases: {', '.join(PHASES)})")
        n = int(count) if count else 1
        if n < 1:
            raise ValueError(f"ONWARD_CRASH_AT: {part!r}: the count must be 1 or more")
        targets[phase] = n
    return targets


_HOOKS = os.environ.get("ONWARD_TEST_HOOKS") == "1"
_TARGETS: dict[str, int] = _parse(os.environ.get("ONWARD_CRASH_AT", "")) if _HOOKS else {}
# ``ONWARD_FREEZE_AT``, same form: the worker SIGSTOPs itself there instead (a VM paused, a process frozen at
# that exact moment), for the test to thaw with SIGCONT once another worker has taken its tasks over.
_FREEZES: dict[str, int] = _parse(os.environ.get("ONWARD_FREEZE_AT", "")) if _HOOKS else {}
ARMED: bool = bool(_TARGETS or _FREEZES)
_passes: dict[str, int] = {}
_lock = threading.Lock()  # sites are passed from the loop's thread and from tasks' threads (steps)


def hit(phase: str) -> None:
    """Count one pass of ``phase``; SIGKILL this process on the pass its target names."""
    with _lock:
        n = _passes.get(phase, 0) + 1
        _passes[phase] = n
    if _TARGETS.get(phase) == n:
        os.kill(os.getpid(), signal.SIGKILL)
    if _FREEZES.get(phase) == n:
        os.kill(os.getpid(), signal.SIGSTOP)
