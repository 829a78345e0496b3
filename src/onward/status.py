"""Where a job stands: the status report (``onward status``, also as JSON) and journal lines (``onward logs``)."""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import StoreError
from .log import iso_time, one_line, printable
from .proc import owner_alive
from .store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, Event, Store, WorkerRow

# A worker on another host cannot be checked by its pid: one whose heartbeat is older than this (twelve
# default heartbeats) is taken for gone when judging whether anyone is working, so that a machine that died
# without saying so does not keep an ETA alive forever.
SILENT_WORKER_SECONDS = 60.0


def status_dict(store: Store) -> dict[str, Any]:
    """The status as plain data; ``onward status --json`` prints exactly this."""
    stats = store.stats()
    counts = {state: stats.counts.get(state, 0) for state in (PENDING, RUNNING, DONE, FAILED, CANCELLED)}
    rate = stats.done_last_minute / stats.rate_window
    left = counts[PENDING] + counts[RUNNING]
    workers = []
    working = 0
    for w in stats.workers:
        alive = owner_alive(w.owner)  # same host: known for sure; elsewhere (None) the heartbeat is all we have
        working += _working(w, alive)
        workers.append({
            "id": w.worker_id, "host": w.owner.host, "pid": w.owner.pid,
            "heartbeat_age": round(w.heartbeat_age, 1), "done": w.done, "running": w.running_count,
            "started_at": iso_time(w.started_at), "alive": alive,
        })
    return {
        "store": store.url,
        "job": store.job,
        "paused": stats.paused,
        "total": stats.total,
        **counts,
        "workers": workers,
        "tasks_running": [
            {"task": t.name, "attempt": t.attempt, "worker_pid": t.owner.pid if t.owner else None,
             "host": t.owner.host if t.owner else None,
             "heartbeat_age": round(t.heartbeat_age, 1) if t.heartbeat_age is not None else None,
             "note": t.note, "steps": _steps_of(store, t.task_id, t.fence)}
            for t in stats.running_tasks
        ],
        "errors": [{"at": iso_time(e.at), "kind": e.kind, "task": e.task, "attempt": e.attempt,
                    "error": one_line(e.detail, 200)} for e in stats.errors],
        "restarts": stats.restarts,
        "rate_per_second": round(rate, 2),
        "workers_alive": working,
        "eta_seconds": _eta(left, rate, working),
    }


def _working(worker: WorkerRow, alive: bool | None) -> bool:
    return alive if alive is not None else worker.heartbeat_age < SILENT_WORKER_SECONDS


def _eta(left: int, rate: float, workers_alive: int) -> int | None:
    """Seconds until nothing is left at the rate of the last minute: 0 when nothing is left; None when it
    cannot be told (no rate yet) or nobody is working (no worker alive: the rate of the last minute says
    nothing about when someone starts again); rounded up, never 0 while tasks are left."""
    if not left:
        return 0
    if not workers_alive or rate <= 0:
        return None
    return math.ceil(left / rate)


def _steps_of(store: Store, task_id: int, fence: int) -> dict[str, Any] | None:
    """A running task's durable steps: recorded, replayed on this resume, and the time those took at first.
    None when the task records no steps. Reads only this task's rows (an index range)."""
    from .step_records import summarize

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
    if not console.is_terminal:
        # A pipe or a file gets whole lines, however long (a terminal gets them fitted to its width).
        console = Console(highlight=False, soft_wrap=True, width=1 << 20)
    total = report["total"] or 1
    done, failed, cancelled = report[DONE], report[FAILED], report[CANCELLED]
    head = Text.assemble(("onward", "bold"), " ", shown(report["store"]))
    if report["job"] != "default":
        head.append("  job ").append_text(shown(report["job"]))
    if report["paused"]:
        head.append("  paused: claiming nothing new (onward resume)", style="bold yellow")
    console.print(head)
    console.print(
        f"  total {report['total']}   pending {report[PENDING]}   running {report[RUNNING]}   "
        f"[green]done {done}[/green]   [red]failed {failed}[/red]"
        + (f"   cancelled {cancelled}" if cancelled else "")
        + f"   ({100 * (done + failed + cancelled) / total:.1f}% finished)"
    )
    eta = report["eta_seconds"]
    if eta is None and not report["workers_alive"]:
        eta_text = "no worker running"
    else:
        eta_text = "eta " + ("-" if eta is None else _duration(eta))
    console.print(f"  rate {report['rate_per_second']:.1f}/s over the last minute   {eta_text}   "
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
        columns = ("task", "attempt", "worker pid", "heartbeat", "steps", "note")
        for col in columns:
            table.add_column(col, no_wrap=True)
        rows = [[printable(t["task"]), str(t["attempt"]), str(t["worker_pid"]),
                 "-" if t["heartbeat_age"] is None else f"{t['heartbeat_age']}s ago",
                 _steps_text(t.get("steps")), printable(t["note"] or "")] for t in report["tasks_running"][:20]]
        if console.is_terminal:
            _fit_task_and_note(rows, columns, console.width)
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))
        console.print(table)
    if report["errors"]:
        console.print("[bold]latest errors[/bold]")
        for e in report["errors"]:
            console.print(shown(f"  {e['at']} {e['kind']} {e['task']!r} attempt {e['attempt']}: {e['error']}"))


def _fit_task_and_note(rows: list[list[str]], columns: tuple[str, ...], width: int) -> None:
    """Cut the task and note cells (first and last) in the middle so that the row fits ``width``: texts
    that differ only at the end (URLs, paths) stay apart, where a cut from the right would make them one."""
    from rich.cells import cell_len

    def widest(i: int) -> int:
        return max(cell_len(columns[i]), *(cell_len(row[i]) for row in rows))

    gaps = 2 * (len(columns) - 1)  # rich pads each column by one space on each inner side
    room = max(12, width - gaps - sum(widest(i) for i in range(1, len(columns) - 1)))
    note_width = min(widest(-1), max(len(columns[-1]), room // 3))
    for row in rows:
        row[0] = _cut_middle(row[0], room - note_width)
        row[-1] = _cut_middle(row[-1], note_width)


def _cut_middle(text: str, width: int) -> str:
    """``text`` in at most ``width`` terminal cells: its start, "…", its end."""
    from rich.cells import cell_len

    if cell_len(text) <= width:
        return text
    keep = max(width - 1, 0)
    head_room, tail_room = keep - keep // 2, keep // 2
    head = tail = ""
    for char in text:
        if cell_len(head + char) > head_room:
            break
        head += char
    for char in reversed(text):
        if cell_len(char + tail) > tail_room:
            break
        tail = char + tail
    return f"{head}…{tail}"


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
