"""The `status --watch` view (watch.render_view) and the progress bar line (progress.bar_line) at widths and
with texts the integration tests do not reach: every line fits, hostile texts stay text."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console

from onward.progress import Progress, bar_line
from onward.watch import plain_line, render_view


def report(**extra: Any) -> dict[str, Any]:
    """A status report as status_dict returns it, for a job half done with a stale task and a failure."""
    base: dict[str, Any] = {
        "store": "/srv/jobs/crawl/" + "deep/" * 20 + "onward.db", "total": 1000, "pending": 480, "running": 3,
        "done": 500, "failed": 17, "cancelled": 0, "job": "default", "paused": False, "restarts": 2, "rate_per_second": 4.2, "workers_alive": 1, "eta_seconds": 115,
        "workers": [{"id": 3, "host": "host-with-a-very-long-name.example.internal", "pid": 4242,
                     "heartbeat_age": 0.4, "done": 500, "running": 3, "started_at": "2026-11-30T03:00:00Z",
                     "alive": True, "age": 3723.0}],
        "tasks_running": [
            {"task": "https://example.com/archive/" + "x" * 200 + f"/page-{i}", "attempt": i, "worker_pid": 4242,
             "host": "h", "heartbeat_age": 0.4 + 30 * (i == 3), "note": "fetched 3 of 9 parts" if i == 1 else None,
             "steps": {"recorded": 4, "replayed": 2, "saved_seconds": 3.0} if i == 2 else None,
             "age": 12.0 * i, "stale": i == 3, "progress_age": 1.0} for i in (1, 2, 3)],
        "errors": [{"at": "2026-11-30T03:59:58Z", "kind": "failed", "task": "<script>alert(1)</script>",
                    "attempt": 3, "error": "HTTPError: 503 Service Unavailable \x1b[2J [bold]x[/bold]"}],
    }
    base.update(extra)
    return base


def rendered(r: dict[str, Any], width: int) -> str:
    console = Console(width=width, record=True, force_terminal=True, color_system="truecolor")
    console.print(render_view(r, width))
    return console.export_text()


def test_every_line_fits_the_terminal_and_long_urls_keep_both_ends() -> None:
    for width in (40, 60, 80, 132):
        text = rendered(report(), width)
        assert all(cell_len(line) <= width for line in text.splitlines()), text
    text = rendered(report(), 80)
    for i in (1, 2, 3):
        (line,) = [line for line in text.splitlines() if f"/page-{i}" in line]
        assert line.startswith("  https://example.com") and "…" in line and f"#{i}" in line, text
    assert "fetched 3…" in text and "step 4, 2 replayed" in text
    assert "fetched 3 of 9 parts" in rendered(report(), 132)
    assert "stale" in [line for line in text.splitlines() if "/page-3" in line][0]
    assert "[" in text.splitlines()[1] and "517/1000 51.7%" in text and "eta 115s" in text


def test_store_texts_are_shown_escaped_and_never_read_as_markup() -> None:
    text = rendered(report(), 200)
    assert "<script>alert(1)</script>" in text and "[bold]x[/bold]" in text and "\\x1b[2J" in text
    assert "\x1b" not in text  # the error's own escape sequence, not one of rich's styles (export drops those)


def test_no_eta_but_no_worker_running_when_nobody_works() -> None:
    idle = report(workers_alive=0, eta_seconds=None)
    assert "no worker running" in rendered(idle, 80) and "eta" not in rendered(idle, 80)
    line = plain_line(idle)
    assert "no worker running" in line and "eta" not in line and "\n" not in line
    assert "PAUSED" in rendered(report(paused=True), 80) and "paused" in plain_line(report(paused=True))
    assert " job nightly total 1000 " in plain_line(report(job="nightly")) and " job " not in line
    assert "job nightly" in rendered(report(job="nightly"), 80).splitlines()[0]


def test_bar_line_fits_and_fills_by_what_is_finished() -> None:
    p = Progress(total=10, done=4, failed=1, rate=0.5, eta_seconds=10)
    line = bar_line(p, 60)
    assert len(line) <= 60 and line.startswith("[") and "5/10 50.0%" in line
    inside = line[1:line.index("]")]
    assert inside.count("#") == len(inside) // 2
    assert len(bar_line(p, 20)) <= 20  # too narrow for a bar: the words alone, cut
    empty = Progress(total=0, done=0, failed=0, rate=0.0, eta_seconds=0)
    assert "0/0 100.0%" in bar_line(empty, 80)
