"""Where a job stands: the status report (``onward status``, also as JSON) and journal lines (``onward logs``)."""

from __future__ import annotations

import json
from typing import Any

from .errors import StoreError
from .log import iso_time, one_line, printable
from .proc import owner_alive
from .store.base import DONE, FAILED, PENDING, RUNNING, Event, Store


def status_dict(store: Store) -> dict[str, Any]:
    """The status as plain data; ``onward status --json`` prints exactly this."""
    stats = store.stats()
    counts = {state: stats.counts.get(state, 0) for state in (PENDING, RUNNING, DONE, FAILED)}
    rate = stats.done_last_minute / stats.rate_window
    left = counts[PENDING] + counts[RUNNING]
    workers = []
    for w in stats.workers:
        alive = owner_alive(w.owner)
        workers.append({
            "id": w.worker_id, "host": w.owner.host, "pid": w.owner.pid,
            "heartbeat_age": round(w.heartbeat_age, 1), "done": w.done, "running": w.running,
            "started_at": iso_time(w.started_at),
            # Same host: we can tell for sure; elsewhere the heartbeat is all we have.
            "alive": alive if alive is not None else None,
        })
    return {
        "store": store.url,
        "total": stats.total,
        **counts,
        "workers": workers,
        "tasks_running": [
            {"task": t.name, "attempt": t.attempt, "worker_pid": t.owner.pid if t.owner else None,
             "host": t.owner.host if t.owner else None,
             "heartbeat_age": round(t.heartbeat_age, 1) if t.heartbeat_age is not None else None,
             "note": t.note, "steps": _steps_of(store, t.task_id, t.fence)}
            for t in stats.running
        ],
        "errors": [{"at": iso_time(e.at), "kind": e.kind, "task": e.task, "attempt": e.attempt,
                    "error": one_line(e.detail, 200)} for e in stats.errors],
        "restarts": stats.restarts,
        "rate_per_second": round(rate, 2),
        "eta_seconds": round(left / rate) if rate > 0 and left else (0 if not left else None),
    }


def _steps_of(store: Store, task_id: int, fence: int) -> dict[str, Any] | None:
    """A running task's durable steps: recorded, replayed on this resume, and the time those took at first.
    None when the task records no steps. Reads only this task's rows (an index range)."""
    from .steps import summarize

    try:
        records = store.steps(task_id)
    except StoreError:
        return None
    return summarize(records, fence) if records else None


def render_status(report: dict[str, Any]) -> None:
    """The status for a person. Every text that comes from the store (task names, notes, errors, hosts)
    is shown with its control characters escaped and never read as markup: a task's stderr must not be
    able to clear or retitle the reader's terminal."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def shown(text: str) -> Text:
        return Text(printable(text))

    console = Console(highlight=False)
    total = report["total"] or 1
    done, failed = report[DONE], report[FAILED]
    console.print(Text.assemble(("onward", "bold"), " ", shown(report["store"])))
    console.print(
        f"  total {report['total']}   pending {report[PENDING]}   running {report[RUNNING]}   "
        f"[green]done {done}[/green]   [red]failed {failed}[/red]   ({100 * (done + failed) / total:.1f}% finished)"
    )
    eta = report["eta_seconds"]
    eta_text = "-" if eta is None else _duration(eta)
    console.print(f"  rate {report['rate_per_second']:.1f}/s over the last minute   eta {eta_text}   "
                  f"restarts {report['restarts']}")
    if report["workers"]:
        table = Table(title="workers", title_justify="left", box=None, pad_edge=False)
        for col in ("id", "host", "pid", "heartbeat", "running", "done", "alive"):
            table.add_column(col)
        for w in report["workers"]:
            alive = {True: "yes", False: "no (dead)", None: "?"}[w["alive"]]
            table.add_row(str(w["id"]), shown(w["host"]), str(w["pid"]), f"{w['heartbeat_age']}s ago",
                          str(w["running"]), str(w["done"]), alive)
        console.print(table)
    if report["tasks_running"]:
        table = Table(title="running", title_justify="left", box=None, pad_edge=False)
        for col in ("task", "attempt", "worker pid", "heartbeat", "steps", "note"):
            table.add_column(col)
        for t in report["tasks_running"][:20]:
            age = "-" if t["heartbeat_age"] is None else f"{t['heartbeat_age']}s ago"
            table.add_row(shown(t["task"]), str(t["attempt"]), str(t["worker_pid"]), age,
                          _steps_text(t.get("steps")), shown(t["note"] or ""))
        console.print(table)
    if report["errors"]:
        console.print("[bold]latest errors[/bold]")
        for e in report["errors"]:
            console.print(shown(f"  {e['at']} {e['kind']} {e['task']!r} attempt {e['attempt']}: {e['error']}"))


def _steps_text(steps: dict[str, Any] | None) -> str:
    if not steps:
        return ""
    text = f"{steps['recorded']} recorded"
    if steps["replayed"]:
        text += f", {steps['replayed']} replayed (saved {steps['saved_seconds']:.1f}s)"
    return text


def format_event(event: Event) -> str:
    """One journal line for ``onward logs``, its control characters escaped (the stored detail stays raw)."""
    parts = [iso_time(event.at, precise=True), f"pid={event.pid}", event.kind]
    if event.task is not None:
        parts.append("task=" + json.dumps(event.task, ensure_ascii=False))
    if event.attempt is not None:
        parts.append(f"attempt={event.attempt}")
    if event.detail:
        parts.append(one_line(event.detail, 500))
    return printable(" ".join(parts))




def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
