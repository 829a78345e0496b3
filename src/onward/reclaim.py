"""Taking back the tasks of workers that are gone: a worker of this host that died without a word is marked
so in the store, and a running task whose owner died (same host: known at once) or whose lease expired
(any host) goes back to pending, after whatever its old attempt left running is killed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container

from . import crashpoints
from .cgroups import sweep_dead_workers
from .log import Log, quote
from .proc import kill_command, kill_group, owner_alive, process_alive
from .store.base import RunningTask, Store
from .store.states import CANCELLED


def mark_dead_workers(store: Store, worker_id: int) -> None:
    """Workers of this host that died without a word (kill -9, OOM) are marked so in the store."""
    for w in store.workers():
        if w.worker_id != worker_id and owner_alive(w.owner) is False:
            store.worker_stopped(w.worker_id, f"died: worker {w.worker_id} pid {w.owner.pid} is gone")


def reclaim_abandoned(store: Store, worker_id: int, ours: Container[int], log: Log, *,
                      expired_leases: bool = True) -> None:
    """Take back tasks whose owner died or whose lease expired; ``ours``: the task ids this worker runs
    (a claim of ours whose commit we never heard back about is not among them, and is taken back too).
    Without ``expired_leases`` (just after this worker was frozen), only those whose owner is known dead.

    A task whose owner died (this host's process is gone) while it ran others beside it is not counted
    (it gets an attempt more) and runs alone from then on (see ``Store.reclaim``): an OOM kill or a crash
    of a worker at ``--concurrency N`` is not blamed on each of its N tasks. How many an owner ran is read
    here, before any of them is taken back, and an owner's tasks are taken back in one transaction: a
    worker that read the running tasks meanwhile sees all of them running or none, never the last of
    them alone (it counted that one's attempt as if its owner had died running it alone). A lease that
    ran out is no such sign (a worker cut off from the store, or frozen, lives on; one that died on
    another host is taken back by its own host's next worker, if any, at once): its tasks count as before."""
    running = store.running_tasks()
    per_owner = Counter(task.worker_id for task in running)
    by_owner: dict[int | None, list[tuple[RunningTask, bool | None]]] = {}
    for task in running:
        if task.worker_id == worker_id and task.task_id in ours:
            continue
        alive = _owner_alive(task)
        if _takeover_reason(task, alive, expired_leases) is not None:
            by_owner.setdefault(task.worker_id, []).append((task, alive))
    for owner, tasks in by_owner.items():
        if any(alive is False for _, alive in tasks):
            # What left its command's group (``setsid``, a double fork) is in the dead worker's cgroups. This
            # is the one path by which a dead worker's task runs again, so the sweep is done here rather than
            # before every command a worker starts; a dead owner renews nothing, so it needs no lock.
            sweep_dead_workers()
        said: list[str] = []
        with store.batch():
            for task, alive in tasks:
                died_with = per_owner[owner] if alive is False and owner is not None else 1
                said += _reclaim(store, worker_id, task, expired_leases, died_with)
        if crashpoints.ARMED and said:  # the tasks are committed back to pending (fences moved), journaled
            crashpoints.hit("reclaim")
        for line in said:
            log.warning(line)


def _owner_alive(task: RunningTask) -> bool | None:
    return owner_alive(task.owner) if task.owner is not None else False


def _takeover_reason(task: RunningTask, alive: bool | None, expired_leases: bool) -> str | None:
    if alive is False:
        return "owner died"
    if task.lease_expired and expired_leases:
        return "lease expired"
    return None


def _end_old_attempt(task: RunningTask, alive: bool | None) -> None:
    """Two attempts of one task must never overlap: the old command's process group goes first."""
    if task.child_pid and (alive is not None or task.owner is None) and process_alive(
            task.child_pid, task.child_start):
        # The process itself as well as its group: its pid is noted as soon as it exists, a moment before
        # it leads its own group (onward.clonespawn), so a worker frozen in that moment leaves a process
        # the group misses.
        kill_command(task.child_pid)
    elif task.child_pid and alive is False:
        kill_group(task.child_pid)  # the leader is gone, but its group may live on


def _reclaim(store: Store, worker_id: int, task: RunningTask, expired_leases: bool,
             died_with: int) -> list[str]:
    """In the caller's batch: take ``task`` back if it is still to be taken, and journal it; the line to log
    once that commits (none if it was not taken). ``died_with``: how many tasks the owner, found dead, ran
    (this one included); 1 when it was not found dead."""
    taken: list[tuple[RunningTask, str]] = []

    def decide(locked: RunningTask) -> str | None:
        # The task as read again under the store's lock, which its owner's renewal waits for: the old
        # attempt is ended only for a takeover that commits, and no new one can start before it is ended.
        # (A slow owner near its lease's end may have renewed since the first read: its command lives on.)
        alive = _owner_alive(locked)
        reason = _takeover_reason(locked, alive, expired_leases)
        if reason is not None:
            _end_old_attempt(locked, alive)
            taken.append((locked, reason))
        return reason

    shared = died_with > 1
    reclaimed = store.reclaim(task.task_id, task.fence, decide, shared)
    if reclaimed is None:
        return []
    task, reason = taken[-1]
    if reclaimed.counted:
        kind, detail = "reclaimed", f"{reason}; now {reclaimed.state}"
    elif reclaimed.state == CANCELLED:
        # A cancel was pending: the task ends there, neither given one more attempt nor run alone.
        kind, detail = "interrupted", f"{reason}; a cancel was pending: now cancelled"
    elif shared:
        kind, detail = "interrupted", (f"{reason} while running {died_with} tasks; attempt not counted (one"
                                       f" more given), now {reclaimed.state}, to run alone")
    else:
        # It got further than ever before it died: a crash of a progressing task is not poison.
        kind, detail = "interrupted", f"{reason} after recording new steps; attempt not counted, now pending"
    store.log_event(kind, task_id=task.task_id, worker_id=worker_id, attempt=task.attempt, detail=detail)
    return [f"{kind} task={quote(task.name)} attempt={task.attempt}: {detail}"]
