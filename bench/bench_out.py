"""Benchmark of a restart with ``--out``: a job of N done tasks, each with its result file in the folder, and
10 tasks left; how long ``onward run --out DIR`` takes to start the first of them, beside the same run
without ``--out``, alternating, on a fresh copy of the store each time. Prints a Markdown section.

    python bench/bench_out.py [--quick]

A worker writes the result file of every done task that has none; it used to walk every done task (and
read every file name in the folder) before its first claim, so a restart grew with the job. It now goes
through them a page at a time beside its tasks, and before it says "finished".
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench_core import REPO, check, copy_store, med, onward, run_process, spread, task_name

DONE = {False: 100_000, True: 2_000}
LEFT = 10
ROUNDS = {False: 5, True: 2}


def log(text: str) -> None:
    print(f"[out {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


BUILD = """
import sys
from onward import Job
from onward.log import QUIET

with Job(sys.argv[1], out=sys.argv[2], log_level=QUIET) as job:
    @job.task
    def handle(task, ctx):
        return "result of " + task
    job.add(f"task-{i:07d}" for i in range(int(sys.argv[3])))
    sys.exit(job.run().exit_code)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    n, rounds = DONE[args.quick], ROUNDS[args.quick]
    scratch = Path(os.environ.get("ONWARD_BENCH_DIR") or REPO / "bench" / "out")
    scratch.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="out-", dir=scratch))
    try:
        db, template, out, starts = base / "store.db", base / "template.db", base / "out", base / "starts"
        log(f"building {n:,} done tasks, each with its result file in --out")
        build = base / "build.py"
        build.write_text(BUILD)
        began = time.monotonic()
        check(run_process([sys.executable, str(build), str(db), str(out), str(n)], base), "building the job")
        log(f"built in {time.monotonic() - began:.0f} s")
        check(run_process(onward("add", "--db", str(db), *(task_name(n + i) for i in range(LEFT))), base), "add")
        copy_store(db, template)
        variants = {"with --out DIR": ["--out", str(out)], "without --out": []}
        first: dict[str, list[float]] = {v: [] for v in variants}
        whole: dict[str, list[float]] = {v: [] for v in variants}
        rss: dict[str, list[float]] = {v: [] for v in variants}
        shown: dict[str, str] = {}
        for _ in range(rounds):
            for variant, extra in variants.items():
                for suffix in ("-wal", "-shm"):
                    Path(str(db) + suffix).unlink(missing_ok=True)
                copy_store(template, db)
                starts.unlink(missing_ok=True)
                argv = onward("run", "--db", str(db), *extra, "-q", "--", "sh", "-c", 'date +%s.%N >> "$0"',
                              str(starts))
                proc = check(run_process(argv, base), f"onward run {variant}")
                times = [float(line) for line in starts.read_text().split()]
                if len(times) != LEFT:
                    raise SystemExit(f"{variant}: {len(times)} task starts recorded, expected {LEFT}")
                first[variant].append(min(times) - proc.started_at)
                whole[variant].append(proc.seconds)
                rss[variant].append(proc.rss_mb)
                shown[variant] = shlex.join(argv).replace(str(base), "$D").replace(sys.executable, "python")
            log(" ".join(f"{v}: {first[v][-1]:.3f} s" for v in variants))
        files = sum(1 for _ in out.iterdir())
    finally:
        shutil.rmtree(base, ignore_errors=True)

    w = print
    w("## Restart with `--out` (bench/bench_out.py)")
    w("")
    if args.quick:
        w("**Quick smoke run** (`--quick`): small N, few runs; not for comparison.")
        w("")
    w(f"A job of {n:,} done tasks, built through the Python API with `out=` (each result written to the folder"
      f" as it completed: {files:,} files there), then {LEFT} tasks added. Each run starts from a fresh copy of"
      " that store (same path, so the folder stays this job's); the two ways take turns, "
      f"{rounds} runs each. Time from just before `onward run` is forked to the first of the {LEFT} tasks"
      " starting (each appends `date +%s.%N` to a file), and the whole run (all done, every missing result"
      " file looked for, process exited). Peak RSS from `wait4`. Median (min–max).")
    w("")
    w("```sh")
    for variant in variants:
        w(shown[variant])
    w("```")
    w("")
    w("| `onward run` | runs | to first task start: s | whole run: s | peak RSS (MB) |")
    w("|---|---:|---:|---:|---:|")
    for variant in variants:
        w(f"| {variant} | {len(first[variant])} | {spread(first[variant], '.3f')} | {spread(whole[variant], '.3f')}"
          f" | {med(rss[variant]):.0f} |")
    w("")
    ratio = med(first["with --out DIR"]) / med(first["without --out"])
    w(f"To the first task, `--out` costs {ratio:.2f}× the run without it (medians of this run). The whole run"
      " with `--out` includes the look at every done task's file, a page at a time beside the tasks.")


if __name__ == "__main__":
    main()
