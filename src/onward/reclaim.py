"""Taking back the tasks of workers that are gone: a worker of this host that died without a word is marked
so in the store, and a running task whose owner died (same host: known at once) or whose lease expired
(any host) goes back to pending, after whatever its old attempt left running is killed.
"""

from __future__ import annotations

from collections.abc import Container

from . import crashpoints
from .cgroups import sweep_dead_workers
from .log import Log, quote
from .proc import kill_command, kill_group, owner_alive, process_alive
from .store.base import RunningTask, Store


def mark_dead_workers(store: Store, worker_id: int) -> None:
    """Workers of this host that died without a word (kill -9, OOM) are marked so in the store."""
    for w in store.workers():
        if w.worker_id != worker_id and owner_alive(w.owner) is False:
            store.worker_stopped(w.worker_id, f"died: worker {w.worker_id} pid {w.owner.pid} is gone")


def reclaim_abandoned(store: Store, worker_id: int, ours: Container[int], log: Log, *,
                      expired_leases: bool = True) -> None:
    """Take back tasks whose owner died or whose lease expired; ``ours``: the task ids this worker runs
    (a claim of ours whose commit we never heard back about is not among them, and is taken back too).
    Without ``expired_leases`` (just after this worker was frozen), only those whose owner is known dead."""
    for task in store.running_tasks():
        if task.worker_id == worker_id and task.task_id in ours:
            continue
        alive = owner_alive(task.owner) if task.owner is not None else False
        if alive is False:
            reason = "owner died"
        elif task.lease_expired and expired_leases:
            reason = "lease expired"
        else:
            continue
        _end_old_attempt(task, alive)
        _reclaim(store, worker_id, task, reason, log)


def _end_old_attempt(task: RunningTask, alive: bool | None) -> None:
    """Two attempts of one task must never overlap: the old command's process group goes first, and when
    its worker died on this host, that worker's cgroups (what left the group: ``setsid``, a double fork).
    This is the one path by which a dead worker's task runs again, so the sweep is done here rather than
    before every command a worker starts."""
    if alive is False:
        sweep_dead_workers()
    if task.child_pid and (alive is not None or task.owner is None) and process_alive(
            task.child_pid, task.child_start):
        # The process itself as well as its group: its pid is noted as soon as it exists, a moment before
        # it leads its own group (onward.clonespawn), so a worker frozen in that moment leaves a process
        # the group misses.
        kill_command(task.child_pid)
    elif task.child_pid and alive is False:
        kill_group(task.child_pid)  # the leader is gone, but its group may live on


def _reclaim(store: Store, worker_id: int, task: RunningTask, reason: str, log: Log) -> None:
    reclaimed = store.reclaim(task.task_id, task.fence, reason)
    if reclaimed is None:
        return
    if crashpoints.ARMED:  # the task is committed back to pending (fence moved); not journaled yet
        crashpoints.hit("reclaim")
    if reclaimed.counted:
        kind, detail = "reclaimed", f"{reason}; now {reclaimed.state}"
    else:
        # It got further than ever before it died: a crash of a progressing task is not poison.
        kind, detail = "interrupted", f"{reason} after recording new steps; attempt not counted, now pending"
    store.log_event(kind, task_id=task.task_id, worker_id=worker_id, attempt=task.attempt, detail=detail)
    log.warning(f"{kind} task={quote(task.name)} attempt={task.attempt}: {detail}")
