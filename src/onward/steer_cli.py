"""Steering a running job from anywhere: ``onward pause``, ``onward resume``, ``onward cancel TASK...`` and
``onward jobs``. Each one is a store call (``Store.set_paused``, ``Store.cancel``, ``Store.jobs``) that every
worker of the job, on every host, obeys; ``onward.cli`` registers them on its group."""

from __future__ import annotations

import json
import sys

import click

from .cli_types import TASK_TEXT, db_option, job_option
from .errors import UsageError
from .store.base import STATES


@click.command("pause")
@db_option
@job_option
def pause_command(db: str | None, job: str) -> None:
    """Stop the job's workers (on every host) from claiming new tasks. What they run goes on and is
    committed; they stay up, and go on once the job is resumed. `onward status` says paused."""
    _set_paused(db, job, True)


@click.command("resume")
@db_option
@job_option
def resume_command(db: str | None, job: str) -> None:
    """Let the job's workers claim tasks again after `onward pause`."""
    _set_paused(db, job, False)


def _set_paused(db: str | None, job: str, paused: bool) -> None:
    from .store import open_store

    store = open_store(db, create=False, job=job)
    try:
        changed = store.set_paused(paused)
    finally:
        store.close()
    word = "paused" if paused else "resumed"
    if not changed:
        click.echo(f"job {job!r} is already {'paused' if paused else 'running (not paused)'}", err=True)
    elif paused:
        click.echo(f"job {job!r} {word}: its workers finish what they hold and claim nothing new", err=True)
    else:
        click.echo(f"job {job!r} {word}: its workers claim again", err=True)


@click.command("send")
@db_option
@job_option
@click.argument("task", type=TASK_TEXT)
@click.argument("key")
@click.argument("value", metavar="JSON")
def send_command(db: str | None, job: str, task: str, key: str, value: str) -> None:
    """Send a JSON value to a task's durable wait (ctx.wait(KEY)). A task waiting for it runs again at once
    (it was parked, holding no worker); a task not waiting yet gets it when it waits.

    \b
    Refused, nothing stored: bad JSON (NaN, infinity, over 64 KiB) or key: exit 2; a task not in the job, a
    finished task, or a second value for a key whose first was not received yet: exit 1.
    Example:
      onward send report-42 approval '{"approved": true, "by": "ana"}'
    """
    from .store import open_store
    from .waits import check_key, parse_value_text, send

    check_key(key)
    text = parse_value_text(value)
    store = open_store(db, create=False, job=job)
    try:
        outcome = send(store, task, key, text)
    finally:
        store.close()
    if outcome == "delivered":
        click.echo(f"sent {key!r} to task {task!r}: it was waiting and runs again", err=True)
    else:
        click.echo(f"sent {key!r} to task {task!r}: kept until it waits for it", err=True)


@click.command("cancel")
@db_option
@job_option
@click.argument("tasks", nargs=-1, type=TASK_TEXT)
def cancel_command(db: str | None, job: str, tasks: tuple[str, ...]) -> None:
    """Cancel tasks: a pending one is cancelled at once (final, never run); a running one is stopped by its
    worker within about a heartbeat, like a timeout (its process group killed, a Python task's ctx.check()
    raises), and ends cancelled, not retried. `onward retry TASK` brings a cancelled task back.

    \b
    A name that is not in the job changes nothing at all: exit 1, no task cancelled.
    Example:
      onward cancel "https://example.com/huge.iso"
    """
    from .store import cancel_all_or_nothing, open_store

    if not tasks:
        raise UsageError("give the names of the tasks to cancel")
    store = open_store(db, create=False, job=job)
    try:
        outcome = cancel_all_or_nothing(store, tasks)
    finally:
        store.close()
    for name, what in outcome.items():
        if what == "cancelled":
            click.echo(f"cancelled {name!r}", err=True)
        elif what == "cancelling":
            click.echo(f"cancelling {name!r}: its worker stops it at its next heartbeat", err=True)
        else:
            click.echo(f"task {name!r} is {what}: left as it is", err=True)


@click.command("jobs")
@db_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job, one per line.")
def jobs_command(db: str | None, as_json: bool) -> None:
    """The jobs of the store, with their task counts and whether they are paused."""
    from .store import list_jobs

    jobs = list_jobs(db)  # (not through the job "default": a store need not hold it)
    out = sys.stdout
    if as_json:
        for j in jobs:
            out.write(json.dumps({"job": j.name, "paused": j.paused, "total": sum(j.counts.values()), **j.counts})
                      + "\n")
        return
    columns = ("job", "paused", "total", *STATES)
    rows = [(j.name, "yes" if j.paused else "no", str(sum(j.counts.values())), *(str(j.counts[s]) for s in STATES))
            for j in jobs]
    widths = [max([len(col), *(len(row[i]) for row in rows)]) for i, col in enumerate(columns)]  # (rows: maybe none)
    for row in (columns, *rows):
        out.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
