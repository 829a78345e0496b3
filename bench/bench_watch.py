"""What watching a big job costs: one refresh of `onward status --watch` (the status query and the render of
its 80-column view) and `onward metrics`, on a store of 1M tasks whose journal holds a claim and a
completion for each, with a live worker running a few more.

Usage: ``.venv/bin/python bench/bench_watch.py [--quick] [--keep]`` from the repository root. Prints a
Markdown section on stdout, progress on stderr. Files go under $ONWARD_BENCH_DIR (default bench/out/).
Target (issue 10): a refresh costs < 50 ms per tick on 1M tasks.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

TICKS = 50  # refreshes measured
METRICS_RUNS = 5  # whole `onward metrics` processes measured
LIVE_TASKS = 8  # tasks the live worker holds while we measure
TARGET_TICK_MS = 50.0


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def onward(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("onward")
    return [str(script), *args] if script.exists() else [sys.executable, "-m", "onward", *args]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ONWARD_DB", None)
    env.pop("ONWARD_JOB", None)
    return env


def build_store(db: Path, n: int) -> float:
    """A store of ``n`` tasks, every one run to done by the Python API (so the journal is real)."""
    import onward.log
    from onward import Job

    started = time.perf_counter()
    job = Job(str(db), concurrency=32, log_level=onward.log.QUIET)  # many per group commit: a quick build
    job.add(f"https://example.com/item/{i:07d}" for i in range(n))

    @job.task
    def noop(task: str, ctx: Any) -> str:
        return task

    summary = job.run()
    job.close()
    if summary.done != n:
        raise SystemExit(f"expected {n} tasks done, got {summary.done}")
    return time.perf_counter() - started


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} ms (min {min(values) * 1000:.1f}, max {max(values) * 1000:.1f})"


FAST_WORKER = """
import sys
import onward.log
from onward import Job
job = Job(sys.argv[1], name=sys.argv[3], concurrency=32, log_level=onward.log.QUIET)
job.add(f"busy-{i:07d}" for i in range(int(sys.argv[2])))

@job.task
def noop(task, ctx):
    return task

job.run()
"""
BUSY_TASKS = 1_000_000  # more than the busy phase can finish: the fast worker is still going when measured
BUSY_WARMUP_SECONDS = 65.0  # the rate's window (a minute) full of completions


def ticks(store: Any, results: dict[str, Any], regime: str) -> None:
    """TICKS refreshes of the view (status query + render at 80 columns), and 10 of metrics_text."""
    from rich.console import Console

    from onward.metrics import metrics_text
    from onward.status import status_dict
    from onward.watch import render_view

    query, render, tick = [], [], []
    for _ in range(TICKS):
        t0 = time.perf_counter()
        report = status_dict(store)
        t1 = time.perf_counter()
        console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system="truecolor")
        console.print(render_view(report, 80))
        t2 = time.perf_counter()
        query.append(t1 - t0)
        render.append(t2 - t1)
        tick.append(t2 - t0)
    inproc = []
    for _ in range(10):
        t0 = time.perf_counter()
        metrics_text(store)
        inproc.append(time.perf_counter() - t0)
    results[regime] = {"report": report, "query": query, "render": render, "tick": tick, "metrics_inproc": inproc}


def measure(db: Path, n: int) -> dict[str, Any]:
    from onward.status import status_dict
    from onward.store import open_store

    gate = db.parent / "gate"
    subprocess.run(onward("add", "--db", str(db), *[f"live-{time.time_ns()}-{i}" for i in range(LIVE_TASKS)]),
                   env=child_env(), capture_output=True, check=True)
    worker = subprocess.Popen(
        onward("run", "--db", str(db), "--concurrency", str(LIVE_TASKS), "-q", "--", "sh", "-c",
               f"while [ ! -e {gate} ]; do sleep 0.1; done"),
        env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fast: subprocess.Popen[bytes] | None = None
    results: dict[str, Any] = {}
    try:
        store = open_store(str(db), create=False)
        try:
            deadline = time.monotonic() + 60
            while status_dict(store)["running"] < LIVE_TASKS:
                if time.monotonic() > deadline:
                    raise SystemExit("the live worker did not start its tasks")
                time.sleep(0.1)
            # Just built: the watched job's own last minute holds the build's completions (thousands a second),
            # the most the rate's count has to walk.
            log("just built: measuring")
            ticks(store, results, "just built")
            runs = []
            for _ in range(METRICS_RUNS):
                t0 = time.perf_counter()
                subprocess.run(onward("metrics", "--db", str(db)), env=child_env(), capture_output=True, check=True)
                runs.append(time.perf_counter() - t0)
            results["metrics_process"] = runs
            for regime, job in (("another job busy", "busy"), ("this job busy", "default")):
                log(f"{regime}: a fast worker runs no-op tasks of job {job!r} for {BUSY_WARMUP_SECONDS:.0f} s first")
                # Its completions fill the journal of the last minute while the view is refreshed; in the
                # watched job itself they are what the rate counts.
                fast = subprocess.Popen([sys.executable, "-c", FAST_WORKER, str(db), str(BUSY_TASKS), job],
                                        env=child_env())
                time.sleep(BUSY_WARMUP_SECONDS)  # a bench, not a test: the minute the rate counts must fill up
                ticks(store, results, regime)
                fast.terminate()
                fast.wait(120)
                fast = None
        finally:
            store.close()
    finally:
        if fast is not None:
            fast.terminate()
            fast.wait(120)
        gate.touch()
        worker.terminate()  # a graceful stop: the busy tasks left in the watched job are not its to run
        worker.wait(120)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="10,000 tasks instead of 1,000,000")
    parser.add_argument("--keep", action="store_true", help="keep the store")
    parser.add_argument("--store", metavar="PATH", help="measure on this store (one --keep left) instead of a new one")
    args = parser.parse_args()
    n = 10_000 if args.quick else 1_000_000
    base = Path(os.environ.get("ONWARD_BENCH_DIR", ROOT / "bench" / "out"))
    base.mkdir(parents=True, exist_ok=True)
    if args.store:
        db = Path(args.store)
        (db.parent / "gate").unlink(missing_ok=True)
        r = measure(db, n)
    else:
        folder = Path(tempfile.mkdtemp(prefix="watch-", dir=base))
        db = folder / "store.db"
        try:
            log(f"building a store of {n:,} done tasks in {db} …")
            built = build_store(db, n)
            log(f"built in {built:.1f} s; measuring")
            r = measure(db, n)
        finally:
            if not args.keep:
                shutil.rmtree(folder, ignore_errors=True)
    print(f"## Watching a job ({n:,} tasks)\n")
    print(f"A store of {n:,} tasks, each run to done by the Python API (its journal: a claim and a completion per "
          f"task), then {LIVE_TASKS} more held running by a live `onward run`. Measured in process: one refresh of "
          f"`status --watch` (`status_dict` + rendering the 80-column view) and `metrics_text(store)`, in three "
          f"regimes: just after the build (the watched job's last minute full of its own completions, no writer); "
          f"while a fast worker completes no-op tasks of another job of the same store; and while it completes "
          f"tasks of the watched job itself (the journal of the last minute, which the rate counts through, "
          f"filling as it is read).\n")
    for regime in ("just built", "another job busy", "this job busy"):
        q = r[regime]
        report = q["report"]
        tick_ms = statistics.median(q["tick"]) * 1000
        print(f"- {regime}: status said total {report['total']:,}, running {report['running']}, "
              f"{report['rate_per_second']:,.0f} tasks/s over the last minute. One refresh, median of {TICKS}: "
              f"{ms(q['tick'])}; the query {ms(q['query'])}, the render {ms(q['render'])}; target "
              f"< {TARGET_TICK_MS:.0f} ms: **{'met' if tick_ms < TARGET_TICK_MS else 'not met'}**. "
              f"`metrics_text`, median of 10: {ms(q['metrics_inproc'])}.")
    print(f"- `onward metrics` as a whole process (start-up included, just built), median of {METRICS_RUNS}: "
          f"{ms(r['metrics_process'])}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
