"""Benchmark of the dashboard (issue 10's targets) on a store of a million tasks. Prints a Markdown section.

    python bench/bench_dashboard.py [--quick] [--keep]

In a temporary folder under ``$ONWARD_BENCH_DIR`` (default ``bench/out/``):

- the store: ``onward add --tasks FILE`` of 1M lines (``--quick``: 20k), then, through the public store
  API, 10,000 tasks done, 1,000 failed for good and 4 left running (a live job's shape);
- ``onward dashboard`` on it, as a user starts it; each API call timed from this process over HTTP on
  loopback (a new connection per call, as a first visit makes it): ``GET /api/status``, the first page of
  ``GET /api/tasks``, a search for a common term and for one that matches only the last task (which reads
  the whole job), the failed tasks, one task's detail, and the chart's ``GET /api/activity``;
- the page in headless Chromium (Debian's, through Playwright): first contentful paint, and the time until
  the counts of the 1M-task job are on screen, each from navigation start, in a fresh browser context.

Medians over RUNS calls (the slowest is shown too). Targets: each API call < 0.3 s (but the chart's
``/api/activity``, read rarely); first paint < 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
RUNS = 7
PAGE_RUNS = 5
TARGET_API_S = 0.3
TARGET_PAINT_S = 1.0
# The chart's data reads the whole job (see the store's SQL); the page asks for it at most every
# max(5 s, 20 x its last duration), so it has no target of its own.
UNTARGETED = ("api/activity",)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def log(text: str) -> None:
    print(f"[dashboard {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def onward(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("onward")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "onward", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def build_store(root: Path, n: int) -> tuple[str, float]:
    """The store of ``n`` tasks, with done, failed and running ones. Returns its path and the add's seconds."""
    db = str(root / "store" / "onward.db")
    tasks = root / "tasks.txt"
    with tasks.open("w") as f:
        f.writelines(f"task-{i:07d}\n" for i in range(n))
    started = time.perf_counter()
    subprocess.run(onward("add", "--db", db, "--tasks", str(tasks)), check=True, env=env(), capture_output=True)
    added = time.perf_counter() - started
    sys.path.insert(0, str(SRC))
    from onward.proc import current_owner
    from onward.store import open_store

    store = open_store(db, create=False)
    worker = store.register_worker(current_owner(), "benchmark")
    done = failed = 0
    while done < 10_000 or failed < 1_000:
        with store.batch():
            for claim in store.claim(worker, 500, 3600.0, 1):
                if failed < 1_000 and claim.task_id % 11 == 0:
                    store.fail(claim.task_id, claim.fence, "exit status 1\nboom", 0.0)
                    failed += 1
                else:
                    store.complete(claim.task_id, claim.fence, claim.name.encode(), "str")
                    done += 1
    store.claim(worker, 4, 3600.0, 1)  # left running: the status lists them, the page shows them
    store.close()
    return db, added


def start_dashboard(db: str) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(onward("dashboard", "--db", db, "--port", "0"), env=env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    assert process.stdout is not None
    first = process.stdout.readline().decode()
    if not first.startswith("onward dashboard: http://"):
        process.kill()
        raise SystemExit(f"the dashboard did not start: {first!r} {process.communicate()[1]!r}")
    return process, first.split()[2]


def time_get(url: str) -> tuple[float, Any]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:
        body = response.read()
    return time.perf_counter() - started, json.loads(body)


def api_figures(base: str, n: int) -> list[tuple[str, str, list[float], str]]:
    """(what, path, seconds of each run, a note on the answer)."""
    last = f"task-{n - 1:07d}"
    calls = [
        ("status", "api/status"),
        ("first page of tasks", "api/tasks?limit=50"),
        ("search, common term", "api/tasks?q=task-00&limit=50"),
        ("search, matching only the last task", f"api/tasks?q={last}&limit=50"),
        ("failed tasks, first page", "api/tasks?state=failed&limit=50"),
        ("one task's detail", f"api/tasks/{last}"),
        ("activity (the chart)", "api/activity?bucket=60"),
    ]
    figures = []
    for what, path in calls:
        runs = []
        answer: Any = None
        for _ in range(RUNS):
            seconds, answer = time_get(base + path)
            runs.append(seconds)
        if "tasks" in answer and isinstance(answer["tasks"], list):
            note = f"{len(answer['tasks'])} rows"
        elif "total" in answer:
            note = f"total {answer['total']}"
        elif "buckets" in answer:
            note = f"{len(answer['buckets'])} buckets"
        else:
            note = answer.get("state", "")
        figures.append((what, path, runs, note))
        log(f"{what}: median {statistics.median(runs) * 1000:.1f} ms")
    return figures


def page_figures(base: str, n: int) -> tuple[list[float], list[float]] | str:
    """First contentful paint and time until the counts show, in seconds from navigation start."""
    if not Path(CHROMIUM).exists():
        return f"skipped: {CHROMIUM} is not installed"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "skipped: playwright is not installed"
    paints, counts = [], []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        for _ in range(PAGE_RUNS):
            context = browser.new_context()
            page = context.new_page()
            page.goto(base)
            page.wait_for_function(f"() => document.getElementById('count-total').textContent === '{n}'",
                                   timeout=60_000)
            shown = page.evaluate("() => performance.now()")
            paint = page.evaluate("() => (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime")
            paints.append(float(paint) / 1000)
            counts.append(float(shown) / 1000)
            context.close()
        browser.close()
    log(f"first paint median {statistics.median(paints) * 1000:.0f} ms")
    return paints, counts


def render(n: int, added: float, api: list[tuple[str, str, list[float], str]],
           page: tuple[list[float], list[float]] | str) -> str:
    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.1f} ms"

    lines = [
        "## Dashboard",
        "",
        f"A store of {n:,} tasks (`onward add --tasks FILE`: {added:.1f} s), 10,000 of them done, 1,000 failed, 4",
        "running; `onward dashboard --db STORE --port 0`, each call a new HTTP connection on loopback, timed by",
        f"the client. Median of {RUNS} calls (slowest in brackets); target < {TARGET_API_S} s each.",
        "",
        "| call | median | slowest | answer | target |",
        "|---|---|---|---|---|",
    ]
    for what, path, runs, note in api:
        median = statistics.median(runs)
        verdict = "met" if median < TARGET_API_S else "**missed**"
        if path.startswith(UNTARGETED):
            verdict = "none (read rarely)"
        lines.append(f"| {what}: `GET /{path}` | {ms(median)} | {ms(max(runs))} | {note} | {verdict} |")
    lines.append("")
    if isinstance(page, str):
        lines.append(f"Page in headless Chromium: {page}.")
    else:
        paints, counts = page
        verdict = "met" if statistics.median(paints) < TARGET_PAINT_S else "**missed**"
        lines += [
            f"Page in headless Chromium (Debian's, via Playwright), a fresh context each time, median of {PAGE_RUNS}:"
            f" first contentful paint {ms(statistics.median(paints))} (target < {TARGET_PAINT_S} s: {verdict});"
            f" the counts of the job on screen (status answered through the event stream)"
            f" {ms(statistics.median(counts))}, from navigation start.",
        ]
    lines += ["", "Reproduce: `.venv/bin/python bench/bench_dashboard.py` (`--quick`: 20k tasks)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 20k tasks")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    n = 20_000 if args.quick else 1_000_000
    base = Path(os.environ.get("ONWARD_BENCH_DIR") or REPO / "bench" / "out")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dashboard-", dir=base))
    log(f"working in {root}")
    process = None
    try:
        db, added = build_store(root, n)
        log(f"store of {n} tasks ready (add {added:.1f} s)")
        process, url = start_dashboard(db)
        api = api_figures(url, n)
        page = page_figures(url, n)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(render(n, added, api, page))
    missed = [what for what, path, runs, _ in api
              if statistics.median(runs) >= TARGET_API_S and not path.startswith(UNTARGETED)]
    if not isinstance(page, str) and statistics.median(page[0]) >= TARGET_PAINT_S:
        missed.append("first paint")
    if missed:
        log(f"targets missed: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
