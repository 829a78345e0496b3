"""Turning result rows into the contract's records. Both backends' SQL returns these columns in this
order (see the named queries ``task``, ``iter_*``, ``running``, ``live_workers``, ``events_*``, ``recent_errors`` and ``steps``
in each ``.sql`` file), so one decoder serves both."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .base import Event, Owner, RunningTask, StepRecord, TaskRow, WorkerRow


def running_task_of(r: Sequence[Any]) -> RunningTask:
    """task id, name, attempt, fence, worker id, host, host key, pid, pid start, child pid, child start,
    lease expired, heartbeat age, progress age, note."""
    owner = Owner(r[5], r[6], r[7], r[8]) if r[5] is not None else None
    return RunningTask(task_id=r[0], name=r[1], attempt=r[2], fence=r[3], worker_id=r[4], owner=owner,
                       child_pid=r[9], child_start=r[10], lease_expired=bool(r[11]), heartbeat_age=r[12],
                       progress_age=r[13], note=r[14])


def worker_of(r: Sequence[Any]) -> WorkerRow:
    """worker id, host, host key, pid, pid start, started at, heartbeat age, stopped at, stop reason,
    done, running."""
    return WorkerRow(worker_id=r[0], owner=Owner(r[1], r[2], r[3], r[4]), started_at=r[5], heartbeat_age=r[6],
                     stopped_at=r[7], stop_reason=r[8], done=r[9], running_count=r[10])


def event_of(r: Sequence[Any]) -> Event:
    """event id, at, kind, pid, host, task name, attempt, detail."""
    return Event(event_id=r[0], at=r[1], kind=r[2], pid=r[3], host=r[4], task=r[5], attempt=r[6], detail=r[7])


def step_of(r: Sequence[Any]) -> StepRecord:
    """index, name, kind, data, at."""
    return StepRecord(index=r[0], name=r[1], kind=r[2], data=bytes(r[3]), at=r[4])


def task_row_of(r: Sequence[Any]) -> TaskRow:
    """task id, name, state, attempts, added at, started at, finished at, error, result kind."""
    return TaskRow(name=r[1], state=r[2], attempts=r[3], added_at=r[4], started_at=r[5], finished_at=r[6],
                   error=r[7], result_kind=r[8], task_id=r[0])
