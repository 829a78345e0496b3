"""Where a job stands: the status report (``onward status``, also as JSON), read from a store
(``status_dict``) or quickly from a plain SQLite file (``print_plain_status``), and its text.

What this module imports at its top stays small: ``onward status`` on a plain store (``print_plain_status``)
loads it and little else besides sqlite3. The rest is imported where it is used.
"""

from __future__ import annotations

import math
import os
import sys

from .store.states import CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITING

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .store.base import Store, WorkerRow

# The rate is that of the last minute (``Store.stats``: ``done_last_minute``).
RATE_WINDOW_SECONDS = 60.0


def status_dict(store: Store) -> dict[str, Any]:
    """The status as plain data; ``onward status --json`` prints exactly this."""
    from .log import iso_time, one_line
    from .proc import owner_alive

    stats = store.stats()
    now = store.now()
    workers = []
    working = 0
    restarts = {r.host: r for r in store.restarts_by_host()}
    for w in stats.workers:
        alive = owner_alive(w.owner)  # same host: known for sure; elsewhere (None) the heartbeat is all we have
        working += _working(w, alive)
        workers.append({
            "id": w.worker_id, "host": w.owner.host, "pid": w.owner.pid,
            "heartbeat_age": round(w.heartbeat_age, 1), "done": w.done, "running": w.running_count,
            "started_at": iso_time(w.started_at), "alive": alive, "age": round(max(now - w.started_at, 0.0), 1),
            # Restarts are journaled by the supervisor, not the worker: those of the worker's host.
            "restarts": restarts[w.owner.host].count if w.owner.host in restarts else 0,
            "last_restart": restarts[w.owner.host].last_cause if w.owner.host in restarts else None,
        })
    tasks_running = [
        {"task": t.name, "attempt": t.attempt, "worker_pid": t.owner.pid if t.owner else None,
         "host": t.owner.host if t.owner else None,
         "heartbeat_age": round(t.heartbeat_age, 1) if t.heartbeat_age is not None else None,
         "note": t.note, "steps": _steps_of(store, t.task_id, t.fence),
         "age": _claimed_age(store, t.name, now), "stale": t.lease_expired,
         "progress_age": round(t.progress_age, 1) if t.progress_age is not None else None}
        for t in stats.running_tasks
    ]
    # What the waiting tasks wait for (ctx.wait): read from their own index, and only when there are some.
    tasks_waiting = [{"task": w.name, "key": w.key, "until": None if w.until is None else iso_time(w.until)}
                     for w in (store.waits() if stats.counts.get(WAITING, 0) else [])]
    errors = [{"at": iso_time(e.at), "kind": e.kind, "task": e.task, "attempt": e.attempt,
               "error": one_line(e.detail, 200)} for e in stats.errors]
    return _report(store=store.url, job=store.job, paused=stats.paused, counts=stats.counts, workers=workers,
                   tasks_running=tasks_running, tasks_waiting=tasks_waiting, errors=errors,
                   restarts=stats.restarts, rate=stats.done_last_minute / stats.rate_window, working=working)


def _report(*, store: str, job: str, paused: bool, counts: dict[str, int], workers: list[dict[str, Any]],
            tasks_running: list[dict[str, Any]], tasks_waiting: list[dict[str, Any]], errors: list[dict[str, Any]],
            restarts: int, rate: float, working: int) -> dict[str, Any]:
    """The report from what was read: its fields in their order, the counts of every state, the ETA. Both
    ways of reading a status (``status_dict``, ``print_plain_status``) end here."""
    states = {state: counts.get(state, 0) for state in (PENDING, RUNNING, WAITING, DONE, FAILED, CANCELLED)}
    left = states[PENDING] + states[RUNNING]
    return {
        "store": store,
        "job": job,
        "paused": paused,
        "total": sum(counts.values()),
        **states,
        "workers": workers,
        "tasks_running": tasks_running,
        "tasks_waiting": tasks_waiting,
        "errors": errors,
        "restarts": restarts,
        "rate_per_second": round(rate, 2),
        "workers_alive": working,
        # Waiting tasks end when someone sends their value: the ETA is for the others; with only those left, none.
        "eta_seconds": None if not left and states[WAITING] else _eta(left, rate, working, paused),
    }


def print_plain_status(db: str | None, job: str | None, as_json: bool) -> bool:
    """``onward status [--db URL] [--job NAME] [--json]`` read and printed without the CLI's machinery (click,
    rich, the store's classes), for a fast start: only when what it prints is sure to be what ``status_dict``
    and ``render_status`` print. That is a SQLite store at a plain path that is plainly fine (see
    store.sqlite_peek), a report of counts alone (no worker, no running or waiting task, no error in the
    journal, nothing done in the last minute: nothing that needs a worker's liveness, a rate window or a
    table) and a stdout in UTF-8 that, for text, is not a terminal (see ``_plain_stdout``). Returns False,
    having printed nothing and changed nothing, in every other case: the caller runs the full command."""
    from .store import is_postgres_url, job_name, store_url

    if not (_plain_stdout() if not as_json else _utf8_stdout()):
        return False
    try:
        url, name = store_url(db), job_name(job)
    except Exception as error:
        # Imported here, not at the top: start-up of `onward status` (the error types load once one is raised).
        from .errors import OnwardError

        if isinstance(error, OnwardError):
            return False  # the full command says what is wrong
        raise
    if is_postgres_url(url) or url.startswith("sqlite:"):
        return False
    from .store.sqlite_peek import NotPlain, QuickRead

    try:
        read = QuickRead(url, name)
        try:
            # The same named queries as SqliteStore.stats, asked only whether there is anything at all.
            if (read.rows("running") or read.rows("live_workers") or read.rows("recent_errors", limit=1)
                    or read.rows("count_done_since", since=read.now - RATE_WINDOW_SECONDS, cap=1)[0][0]):
                return False
            counts = {str(state): int(n) for state, n in read.rows("counts")}
            if counts.get(WAITING, 0):
                return False
            paused = read.rows("paused")
            restarts = int(read.rows("count_restarts")[0][0])
        finally:
            read.close()
    except NotPlain:
        return False
    report = _report(store=url, job=name, paused=bool(paused and paused[0][0]), counts=counts, workers=[],
                     tasks_running=[], tasks_waiting=[], errors=[], restarts=restarts, rate=0.0, working=0)
    try:
        if as_json:
            sys.stdout.write(plain_json(report) + "\n")
            sys.stdout.flush()
        else:
            render_status(report)
    except BrokenPipeError:
        from .pipes import quiet_broken_pipe

        quiet_broken_pipe()  # as the full command does: `onward status | head -1` is no error
    return True


def plain_json(report: dict[str, Any]) -> str:
    """``log.json_line(report)``, written here without loading json when every value is
    one that json writes plainly: None, a boolean, an int or a finite float (as its ``repr``), an empty
    list, or a text of printable characters without ``"`` or ``\\`` (json escapes only those and control
    characters). Such is the plain status's report, nearly always: `onward status --json` then spares
    json's import, with the regular expressions (`re`) it compiles, which took longer than all the rest the
    plain status adds to `import sqlite3`. Any other value (a text to escape, a nested object, NaN) is left
    to json itself."""
    fields = []
    for key, value in report.items():
        key_text, value_text = _plain_json_value(key), _plain_json_value(value)
        if key_text is None or value_text is None:
            from .log import json_line

            return json_line(report)
        fields.append(f"{key_text}: {value_text}")
    return "{" + ", ".join(fields) + "}"


def _plain_json_value(value: object) -> str | None:
    """What json writes for ``value``, for the values it writes without escapes; None for any other."""
    if value is None:
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    if type(value) is int:
        return int.__repr__(value)
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)
    if type(value) is str and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    if type(value) is list and not value:
        return "[]"
    return None


def _utf8_stdout() -> bool:
    """Whether stdout is there and writes UTF-8: click and rich then write to it as it is."""
    encoding = getattr(sys.stdout, "encoding", None) or ""
    return encoding.lower().replace("_", "-") in ("utf-8", "utf8")


def _plain_stdout() -> bool:
    """Whether the status is written to stdout as plain text: a pipe or a file in UTF-8, where rich would
    print it without styles, at its full length (see ``render_status``). FORCE_COLOR and TTY_COMPATIBLE
    (which make rich take a pipe for a terminal) leave it to rich."""
    if "FORCE_COLOR" in os.environ or "TTY_COMPATIBLE" in os.environ or not _utf8_stdout():
        return False
    try:
        return not sys.stdout.isatty()
    except (OSError, ValueError):
        return False


def _claimed_age(store: Store, name: str, now: float) -> float | None:
    """Seconds since a running task was claimed (its attempt started), on the store's clock; None if it is
    no longer there. One lookup by name per running task, like its steps."""
    row = store.task(name)
    if row is None or row.started_at is None:
        return None
    return round(max(now - row.started_at, 0.0), 1)


def _working(worker: WorkerRow, alive: bool | None) -> bool:
    from .proc import seen_live  # (loaded already: status_dict's owner_alive)

    return seen_live(alive, worker.heartbeat_age)


def _eta(left: int, rate: float, workers_alive: int, paused: bool) -> int | None:
    """Seconds until nothing is left at the rate of the last minute: 0 when nothing is left; None when it
    cannot be told (no rate yet) or nobody is working on what is left (no worker alive, or the job paused:
    the rate of the last minute says nothing about when someone starts or resumes it; a paused job's ETA
    only grew); rounded up, never 0 while tasks are left."""
    if not left:
        return 0
    if not workers_alive or paused or rate <= 0:
        return None
    return math.ceil(left / rate)


def _steps_of(store: Store, task_id: int, fence: int) -> dict[str, Any] | None:
    """A running task's durable steps: recorded, replayed on this resume, and the time those took at first.
    None when the task records no steps. Reads only this task's rows (an index range)."""
    from .errors import StoreError
    from .step_records import summarize

    try:
        records = store.steps(task_id)
    except StoreError:
        return None
    return summarize(records, fence) if records else None


def render_status(report: dict[str, Any]) -> None:
    """The status for a person. Every text that comes from the store (task names, notes, errors, hosts)
    is shown with its control characters escaped and never read as markup: a task's stderr must not be
    able to clear or retitle the reader's terminal.

    Lines are made once, as pieces of text with their styles (``_summary_lines``, ``_error_lines``). A pipe
    or a file gets them whole and unstyled, however long; when there is no table to draw they are written
    as they are (what rich prints there, byte for byte), without loading rich at all."""
    summary, errors = _summary_lines(report), _error_lines(report)
    tables = report["workers"] or report.get("tasks_waiting") or report["tasks_running"]
    if not tables and _plain_stdout():
        sys.stdout.write("".join("".join(text for text, _ in line) + "\n" for line in summary + errors))
        sys.stdout.flush()
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def shown(text: str) -> Text:
        return Text(_printable(text))

    console = Console(highlight=False)
    if not console.is_terminal:
        # A pipe or a file gets whole lines, however long (a terminal gets them fitted to its width).
        console = Console(highlight=False, soft_wrap=True, width=1 << 20)
    for line in summary:
        console.print(Text.assemble(*line))
    if report["workers"]:
        table = Table(title="workers", title_justify="left", box=None, pad_edge=False)
        for col in ("id", "host", "pid", "heartbeat", "running", "done", "alive"):
            table.add_column(col)
        for w in report["workers"]:
            alive = {True: "yes", False: "no (dead)", None: "?"}[w["alive"]]
            table.add_row(str(w["id"]), shown(w["host"]), str(w["pid"]), f"{w['heartbeat_age']}s ago",
                          str(w["running"]), str(w["done"]), alive)
        console.print(table)
    if report.get("tasks_waiting"):
        table = Table(title="waiting", title_justify="left", box=None, pad_edge=False)
        for col in ("task", "waits for", "until"):
            table.add_column(col, no_wrap=True)
        for t in report["tasks_waiting"][:20]:
            table.add_row(shown(t["task"]), shown(t["key"]), t["until"] or "-")
        console.print(table)
    if report["tasks_running"]:
        table = Table(title="running", title_justify="left", box=None, pad_edge=False)
        columns = ("task", "attempt", "worker pid", "heartbeat", "steps", "note")
        for col in columns:
            table.add_column(col, no_wrap=True)
        rows = [[_printable(t["task"]), str(t["attempt"]), str(t["worker_pid"]),
                 "-" if t["heartbeat_age"] is None else f"{t['heartbeat_age']}s ago",
                 _steps_text(t.get("steps")), _printable(t["note"] or "")] for t in report["tasks_running"][:20]]
        if console.is_terminal:
            _fit_task_and_note(rows, columns, console.width)
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))
        console.print(table)
    for line in errors:
        console.print(Text.assemble(*line))


# A line of the status: pieces of text, each with its rich style ("": none).
Line = list[tuple[str, str]]


def _summary_lines(report: dict[str, Any]) -> list[Line]:
    """The three lines at the top: the store and job, the counts, the rate and ETA."""
    total = report["total"] or 1
    done, failed, cancelled = report[DONE], report[FAILED], report[CANCELLED]
    head: Line = [("onward", "bold"), (" ", ""), (_printable(report["store"]), "")]
    if report["job"] != "default":
        head += [("  job ", ""), (_printable(report["job"]), "")]
    if report["paused"]:
        head.append(("  paused: claiming nothing new (onward resume)", "bold yellow"))
    counts: Line = [
        (f"  total {report['total']}   pending {report[PENDING]}   running {report[RUNNING]}   "
         + (f"waiting {report[WAITING]}   " if report.get(WAITING) else ""), ""),
        (f"done {done}", "green"), ("   ", ""), (f"failed {failed}", "red"),
        ((f"   cancelled {cancelled}" if cancelled else "")
         + f"   ({100 * (done + failed + cancelled) / total:.1f}% finished)", ""),
    ]
    eta = report["eta_seconds"]
    if eta is None and not report["workers_alive"]:
        eta_text = "no worker running"
    else:
        from .durations import duration

        eta_text = "eta " + ("-" if eta is None else duration(eta))
    rate: Line = [(f"  rate {report['rate_per_second']:.1f}/s over the last minute   {eta_text}   "
                   f"restarts {report['restarts']}", "")]
    return [head, counts, rate]


def _error_lines(report: dict[str, Any]) -> list[Line]:
    """The latest errors, under a heading; none when there are none."""
    if not report["errors"]:
        return []
    return [[("latest errors", "bold")]] + [
        [(_printable(f"  {e['at']} {e['kind']} {e['task']!r} attempt {e['attempt']}: {e['error']}"), "")]
        for e in report["errors"]]


def _printable(text: str) -> str:
    """``log.printable(text)``, which leaves a text of printable characters as it is: such a text (nearly
    every one) is taken as it is, without loading log.py and its regular expression."""
    if text.isprintable():
        return text
    from .log import printable

    return printable(text)


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
        row[0] = cut_middle(row[0], room - note_width)
        row[-1] = cut_middle(row[-1], note_width)


def cut_middle(text: str, width: int) -> str:
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
