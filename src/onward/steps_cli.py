"""``onward steps TASK``: a task's recorded durable steps, one line each. ``onward.cli`` registers it."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from .cli_types import TASK_TEXT, db_option, job_option
from .errors import StoreError, UnknownTask
from .log import iso_time
from .step_records import ordinals, unframe
from .store.base import StepRecord, Store


def step_rows(store: Store, task: str) -> list[dict[str, Any]]:
    """The recorded steps of ``task`` as plain data (what ``onward steps --json`` prints): ``at``, when the
    record was committed, in ISO 8601 UTC with milliseconds, as every other JSON output of the CLI has it
    (it was seconds since the epoch, the only one)."""
    task_id = _task_id(store, task)
    records = store.steps(task_id)
    return [_row(r, label) for r, label in zip(records, ordinals(records), strict=True)]


def _task_id(store: Store, task: str) -> int:
    task_id = store.task_id(task)
    if task_id is None:
        raise UnknownTask(f"no task {task!r} in {store.url}")
    return int(task_id)


def _row(record: StepRecord, label: str) -> dict[str, Any]:
    try:
        f = unframe(record.data)
        size, seconds, attempt, serializer = len(f.payload), f.seconds, f.attempt, f.serializer
    except (StoreError, ValueError):
        size, seconds, attempt, serializer = len(record.data), None, None, None
    return {"index": record.index, "step": label, "kind": record.kind, "size": size, "seconds": seconds,
            "attempt": attempt, "serializer": serializer, "at": iso_time(record.at, precise=True)}




@click.command("steps")
@db_option
@job_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per step, one per line.")
@click.argument("task", type=TASK_TEXT)
def steps_command(db: str | None, job: str, as_json: bool, task: str) -> None:
    """A task's recorded durable steps: call index, step (name#n), kind, payload size, seconds the body
    took, the attempt that recorded it, and when it was committed.

    \b
    Example:
      onward steps --db agent.db "ticket-42"
    """
    from .store import open_store

    store = open_store(db, create=False, job=job)
    try:
        rows = step_rows(store, task)
    finally:
        store.close()
    out = sys.stdout
    if as_json:
        for row in rows:
            out.write(json.dumps(row) + "\n")
        return
    if not rows:
        click.echo(f"task {task!r} has no recorded steps", err=True)
        return
    out.write("index\tstep\tkind\tbytes\tseconds\tattempt\tcommitted\n")
    for row in rows:
        seconds = "-" if row["seconds"] is None else f"{row['seconds']:.3f}"
        out.write(f"{row['index']}\t{row['step']}\t{row['kind']}\t{row['size']}\t{seconds}\t"
                  f"{row['attempt'] or '-'}\t{row['at']}\n")
    total = sum(row["size"] for row in rows)
    took = sum(row["seconds"] or 0.0 for row in rows if row["kind"] == "value")
    count = f"{len(rows)} step" + ("" if len(rows) == 1 else "s")
    click.echo(f"{count}, {total} bytes, {took:.1f} s of step time recorded", err=True)
