"""``onward status --watch``: the status redrawn in place on a terminal (rich ``Live``), or one plain line per
refresh when stdout is a pipe or a file.

Every figure comes from ``status_dict``, the same report ``onward status --json`` prints: one query path.
Texts from the store (task names, notes, errors, hosts) are shown with control characters escaped and
never read as markup, as in ``onward status``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .errors import StoreError, StoreGone
from .log import iso_time, printable
from .progress import Progress, bar_line, duration, progress_of_status
from .status import cut_middle, status_dict
from .store.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, WAITING

if TYPE_CHECKING:
    from rich.console import RenderableType

    from .store.base import Store

MAX_RUNNING_SHOWN = 12
MAX_WORKERS_SHOWN = 6
MAX_FAILURES_SHOWN = 5


def watch(store: Store, interval: float, *, terminal: bool) -> None:
    """Show the status every ``interval`` seconds until Ctrl-C (which ends it quietly). On a terminal the
    view is redrawn in place; elsewhere each refresh prints one plain line. SIGTERM ends it like Ctrl-C,
    so that the terminal gets its cursor back."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        if terminal:
            _watch_live(store, interval)
        else:
            _watch_lines(store, interval)
    except KeyboardInterrupt:
        pass


def _watch_live(store: Store, interval: float) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console(highlight=False)
    # Redrawn only when asked (auto_refresh off): one draw per refresh, no flicker between them.
    with Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False) as live:
        for report, trouble in _reports(store, interval):
            live.update(render_view(report, console.width, trouble), refresh=True)


def _watch_lines(store: Store, interval: float) -> None:
    for report, trouble in _reports(store, interval):
        sys.stdout.write(plain_line(report, trouble) + "\n")
        sys.stdout.flush()


def _reports(store: Store, interval: float) -> Iterator[tuple[dict[str, Any], str | None]]:
    """The latest report at every tick, with the store error of that tick if it could not be read (the last
    report stands then: a store restarting for a moment must not end the watch). Ticks keep to
    ``interval`` from start to start, however long a read takes."""
    report: dict[str, Any] | None = None
    while True:
        started = time.monotonic()
        trouble = None
        try:
            try:
                store.idle()
            except StoreGone:
                # The file at the store's location was deleted or replaced: show what is there now, as a watch
                # on PostgreSQL does once a dropped schema is made again (its connection finds the new one).
                store = _open_again(store)
            report = status_dict(store)
        except StoreError as e:
            if report is None:
                raise  # not even one read: an error to report (exit status 2), not a view to keep
            trouble = str(e)
        if report is not None:
            yield report, trouble
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


def _open_again(gone: Store) -> Store:
    """The store now at ``gone``'s location, in place of ``gone`` (closed); ``StoreMissing`` (a
    ``StoreError``: said over the last report, and tried again next tick) while there is none."""
    from .store import open_store

    fresh = open_store(gone.url, create=False, job=gone.job)
    gone.close()
    return fresh


def plain_line(report: dict[str, Any], trouble: str | None = None) -> str:
    """One refresh as one line, for a pipe or a log: time, counts, rate, ETA or why there is none."""
    progress = progress_of_status(report)
    parts = [iso_time(time.time())]
    if report.get("job") not in (None, "default"):
        parts.append(f"job {report['job']}")
    parts += [f"total {report['total']}", f"pending {report[PENDING]}",
             f"running {report[RUNNING]}", f"waiting {report.get(WAITING, 0)}", f"done {report[DONE]}",
             f"failed {report[FAILED]}"]
    parts.append(f"cancelled {report[CANCELLED]}")
    parts.append(f"rate {progress.rate:.1f}/s")
    parts.append("no worker running" if progress.no_worker else
                 "eta " + ("-" if progress.eta_seconds is None else duration(progress.eta_seconds)))
    parts.append(f"workers {report['workers_alive']}")
    if report.get("paused"):
        parts.append("paused")
    if trouble:
        parts.append(f"store unavailable: {trouble}")
    return printable(" ".join(parts))


def render_view(report: dict[str, Any], width: int, trouble: str | None = None) -> RenderableType:
    """The whole view for a terminal ``width`` columns wide: a header, the bar, running tasks, workers and
    the latest failures. Every line is cut to fit (never wrapped), so the view keeps its height."""
    from rich.console import Group
    from rich.text import Text

    width = max(width, 40)
    parts: list[RenderableType] = []
    header = Text.assemble(("onward ", "bold"), (cut_middle(printable(report["store"]), width - 20), ""))
    if report.get("job") not in (None, "default"):
        header.append(f"  job {printable(str(report['job']))}", style="bold")
    if report.get("paused"):
        header.append("  PAUSED", style="bold yellow")
    parts.append(header)
    progress = progress_of_status(report)
    parts.append(_bar(progress, width))
    counts = (f"pending {report[PENDING]}  running {report[RUNNING]}  waiting {report.get(WAITING, 0)}  done {report[DONE]}  "
              f"failed {report[FAILED]}  cancelled {report[CANCELLED]}  restarts {report['restarts']}")
    parts.append(Text(counts[:width]))
    if trouble:
        parts.append(Text(cut_middle("store unavailable: " + printable(trouble), width), style="bold red"))
    parts += _running(report["tasks_running"], width)
    parts += _workers(report["workers"], width)
    parts += _failures(report["errors"], width)
    return Group(*parts)


def _bar(progress: Progress, width: int) -> RenderableType:
    from rich.text import Text

    line = bar_line(progress, width)
    text = Text(line)
    if line.startswith("["):
        end = line.index("]")
        filled = line.count("#", 0, end)
        text.stylize("green", 1, 1 + filled)
        text.stylize("dim", 1 + filled, end)
    if progress.no_worker:
        text.highlight_words(["no worker running"], style="bold yellow")
    return text


def _running(tasks: list[dict[str, Any]], width: int) -> list[RenderableType]:
    from rich.text import Text

    if not tasks:
        return [Text("no task running", style="dim")]
    # Fixed columns: attempt, age, heartbeat age; the task text and its note share the rest, each cut in
    # the middle so that texts differing only at their end (URLs, paths) stay apart.
    fixed = "  {:>3} {:>7} {:>6}  "
    room = width - len(fixed.format("", "", "")) - 2
    title = Text(f"running ({len(tasks)})".ljust(room + 2), style="bold")
    title.append(fixed.format("try", "age", "beat") + "note / step", style="dim")
    title.truncate(width)
    lines: list[RenderableType] = [title]
    for t in tasks[:MAX_RUNNING_SHOWN]:
        note = t.get("note") or _step_words(t.get("steps")) or ""
        note = printable(note)
        name = printable(t["task"])
        mark = " stale" if t.get("stale") else ""
        note_room = min(len(note), room // 3)
        name_room = room - note_room - len(mark)
        age = "-" if t.get("age") is None else duration(t["age"])
        beat = "-" if t["heartbeat_age"] is None else f"{int(t['heartbeat_age'])}s"
        row = Text("  ")
        row.append(cut_middle(name, name_room).ljust(name_room), style="bold red" if t.get("stale") else "")
        row.append(fixed.format(f"#{t['attempt']}", age, beat))
        row.append(cut_middle(note, note_room), style="dim")
        row.append(mark, style="bold red")
        row.truncate(width)
        lines.append(row)
    if len(tasks) > MAX_RUNNING_SHOWN:
        lines.append(Text(f"  … and {len(tasks) - MAX_RUNNING_SHOWN} more", style="dim"))
    return lines


def _step_words(steps: dict[str, Any] | None) -> str:
    if not steps:
        return ""
    text = f"step {steps['recorded']}"
    if steps.get("replayed"):
        text += f", {steps['replayed']} replayed"
    return text


def _workers(workers: list[dict[str, Any]], width: int) -> list[RenderableType]:
    from rich.text import Text

    if not workers:
        return [Text("no worker registered", style="dim")]
    lines: list[RenderableType] = [Text(f"workers ({len(workers)})", style="bold")]
    for w in workers[:MAX_WORKERS_SHOWN]:
        alive = {True: "alive", False: "dead", None: "?"}[w["alive"]]
        tail = (f" pid {w['pid']:<7} up {duration(w.get('age') or 0):>6}  beat {int(w['heartbeat_age'])}s"
                f"  running {w['running']}  done {w['done']}  {alive}")
        host = cut_middle(printable(w["host"]), 16).ljust(16)
        row = Text("  " + host + tail, style="" if w["alive"] is not False else "red")
        row.truncate(width)
        lines.append(row)
        if w.get("restarts"):
            # On a line of its own: the cause is the one long text here, and the one worth reading whole.
            cause = printable(w.get("last_restart") or "?")
            restarts = Text(f"    restarts on this host {w['restarts']}, last: ", style="yellow")
            restarts.append(cut_middle(cause, max(width - len(restarts), 10)))
            restarts.truncate(width)
            lines.append(restarts)
    return lines


def _failures(errors: list[dict[str, Any]], width: int) -> list[RenderableType]:
    from rich.text import Text

    if not errors:
        return []
    lines: list[RenderableType] = [Text("latest failures", style="bold")]
    for e in errors[:MAX_FAILURES_SHOWN]:
        when = e["at"][11:19] if len(e["at"]) >= 19 else e["at"]
        head = f"  {when} {e['kind']} #{e['attempt'] if e['attempt'] is not None else '-'} "
        name = cut_middle(printable(str(e["task"])), max(12, (width - len(head)) // 3))
        row = Text(head + name + ": ")
        row.append(printable(e["error"] or ""), style="red")
        row.truncate(width)
        lines.append(row)
    return lines
