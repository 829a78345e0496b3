"""Benchmark of durable steps (issue 4's targets), beside DBOS Transact in the same run. Prints a Markdown
section on stdout; progress goes to stderr.

    python bench/bench_steps.py [--quick] [--keep]

What it measures, each run in its own process and in fresh folders under ``$ONWARD_BENCH_DIR`` (default
``bench/out/``):

- **step overhead**: steps/s of a trivial step (returns its argument), sequential, inside one task, on
  SQLite: onward's ``@step``; DBOS Transact's ``@DBOS.step`` inside a ``@DBOS.workflow`` on its SQLite
  system database; and, as the floor, plain ``sqlite3`` doing one INSERT + durable COMMIT (WAL,
  synchronous=FULL) per step. The three kinds of run are interleaved, so they share the machine's load;
  the figure is the median over the runs;
- **replay**: a task that recorded 10,000 steps runs again: the time from the task function's start (the
  first step call loads the records) to the return of its 10,000th step, all replayed;
- **recovery**: a worker under ``onward supervise`` running a step loop is SIGKILLed; the time from the kill
  to the first step body running in the restarted worker.

``--quick`` is a smoke run (fewer steps and runs). The process exits 1 if a part failed (the section says
which and why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
THIS = Path(__file__).resolve()

STEPS = {False: 2_000, True: 300}  # onward and the sqlite3 floor, per run
DBOS_STEPS = {False: 500, True: 100}  # DBOS is ~20x slower per step: fewer steps, the same number of runs
RUNS = {False: 5, True: 2}
REPLAY_STEPS = {False: 10_000, True: 2_000}
REPLAY_RUNS = {False: 5, True: 2}
RECOVERY_KILLS = {False: 5, True: 2}
CHILD_TIMEOUT = 600.0

TARGET_RATE = 3_000
TARGET_RATIO = 10.0
TARGET_REPLAY = 50_000
TARGET_RECOVERY_S = 0.5


def log(text: str) -> None:
    print(f"[steps {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def emit(**values: Any) -> None:
    print(json.dumps(values), flush=True)


# --- children: each runs in its own process ---------------------------------------------------------------
def child_onward(db: str, n: int) -> None:
    from onward import Job, step
    from onward.log import QUIET

    job = Job(db, log_level=QUIET)

    @step
    def trivial(i: int) -> int:
        return i

    @job.task
    def handle(task: str, ctx: Any) -> float:
        started = time.perf_counter()
        for i in range(n):
            trivial(i)
        return time.perf_counter() - started

    job.add(["bench"])
    summary = job.run()
    if summary.done != 1:
        raise SystemExit(f"the task did not finish: {summary}")
    emit(seconds=job.result("bench"), steps=n)
    job.close()


def child_floor(db: str, n: int) -> None:
    import sqlite3

    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = FULL")
    con.execute("CREATE TABLE steps (task_id INTEGER, idx INTEGER, data BLOB, PRIMARY KEY (task_id, idx))"
                " WITHOUT ROWID")
    started = time.perf_counter()
    for i in range(n):
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO steps VALUES (1, ?, ?)", (i, json.dumps(i).encode()))
        con.execute("COMMIT")
    emit(seconds=time.perf_counter() - started, steps=n)
    con.close()


def child_dbos(db: str, n: int) -> None:
    from dbos import DBOS, DBOSConfig

    config: DBOSConfig = {"name": "onward-bench", "system_database_url": f"sqlite:///{db}",
                          "log_level": "WARNING"}
    DBOS(config=config)

    @DBOS.step()
    def trivial(i: int) -> int:
        return i

    @DBOS.workflow()
    def workflow() -> float:
        started = time.perf_counter()
        for i in range(n):
            trivial(i)
        return time.perf_counter() - started

    DBOS.launch()
    seconds = workflow()
    DBOS.destroy()
    emit(seconds=seconds, steps=n)


def child_replay(db: str, n: int, runs: int) -> None:
    """Record ``n`` steps once (attempt 1 fails after them), then replay them ``runs`` times."""
    from onward import Job, step
    from onward.log import QUIET

    job = Job(db, max_attempts=1, log_level=QUIET)
    times: list[float] = []

    @step
    def trivial(i: int) -> int:
        return i

    @job.task
    def handle(task: str, ctx: Any) -> None:
        started = time.perf_counter()  # before the first step call, which loads the records
        for i in range(n):
            trivial(i)
        times.append(time.perf_counter() - started)
        raise RuntimeError("fail, so that the next run replays")

    job.add(["replay"])
    job.run()
    recorded = times.pop()
    for _ in range(runs):
        job.store.retry(["replay"])
        job.run()
    log_events = [e.detail for e in job.store.events(task="replay") if e.kind == "steps"]
    job.close()
    emit(recorded_seconds=recorded, replay_seconds=times, steps=n, journal=log_events[-1] if log_events else None)


RECOVERY_WORKER = r'''
import os, sys, time
from onward import Job, step
from onward.log import QUIET
db, marks = sys.argv[1], sys.argv[2]
job = Job(db, log_level=QUIET, heartbeat=1.0, max_attempts=1000)

@step
def tick(i):
    with open(marks, "a") as f:  # each step body that runs: "pid time"
        f.write(f"{os.getpid()} {time.time()}\n")
    time.sleep(0.005)
    return i

@job.task
def loop(task, ctx):
    i = 0
    while True:
        tick(i)
        i += 1

job.add(["loop"])
job.run()
'''


def measure_recovery(folder: Path, kills: int) -> list[float]:
    script = folder / "recovery_worker.py"
    script.write_text(textwrap.dedent(RECOVERY_WORKER))
    db, marks = folder / "recovery.db", folder / "marks"
    env = dict(os.environ, PYTHONPATH=str(SRC))
    argv = [sys.executable, "-m", "onward", "supervise", "--max-restarts", "1000", "--", sys.executable,
            str(script), str(db), str(marks)]
    supervisor = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    try:
        for _ in range(kills):
            # Let the worker run over 2 s, so the supervisor does not see a crash loop (no backoff).
            pid = _wait_marks(marks, lambda lines: len(lines) > 0 and time.time() - _first_time(lines) > 2.5)
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            new_lines = _wait_marks_after(marks, pid, killed_at)
            results.append(new_lines - killed_at)
    finally:
        supervisor.send_signal(signal.SIGTERM)
        try:
            supervisor.wait(30)
        except subprocess.TimeoutExpired:
            supervisor.kill()
    return results


def _read_marks(path: Path) -> list[tuple[int, float]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out.append((int(parts[0]), float(parts[1])))
            except ValueError:
                pass
    return out


def _first_time(lines: list[tuple[int, float]]) -> float:
    pid = lines[-1][0]
    return min(t for p, t in lines if p == pid)


def _wait_marks(path: Path, ready: Any) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        lines = _read_marks(path)
        if ready(lines):
            return lines[-1][0]
        time.sleep(0.01)
    raise RuntimeError("the recovery worker made no progress in 60 s")


def _wait_marks_after(path: Path, old_pid: int, after: float) -> float:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = [t for p, t in _read_marks(path) if p != old_pid and t > after]
        if new:
            return min(new)
        time.sleep(0.002)
    raise RuntimeError("no step ran within 60 s of the kill")


# --- the parent -------------------------------------------------------------------------------------------
def run_child(kind: str, folder: Path, *args: Any) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.run([sys.executable, str(THIS), "--child", kind, str(folder), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def dbos_problem() -> str | None:
    """Why DBOS cannot run here, or None."""
    try:
        import dbos  # noqa: F401
    except ImportError as e:
        return f"`dbos` is not installed ({e}); `pip install 'onward[bench]'` installs it"
    return None


def dbos_version() -> str:
    from importlib.metadata import version

    try:
        return version("dbos")
    except Exception:
        return "?"


def measure(quick: bool, base: Path) -> dict[str, Any]:
    r: dict[str, Any] = {"quick": quick, "errors": []}
    n, dn, runs = STEPS[quick], DBOS_STEPS[quick], RUNS[quick]
    rates: dict[str, list[float]] = {"onward": [], "dbos": [], "floor": []}
    problem = dbos_problem()
    r["dbos_problem"] = problem
    for run in range(runs):
        for kind, steps in (("onward", n), ("floor", n), ("dbos", dn)):
            if kind == "dbos" and problem:
                continue
            folder = Path(tempfile.mkdtemp(prefix=f"steps-{kind}-", dir=base))
            db = folder / ("dbos.sqlite" if kind == "dbos" else "store.db")
            try:
                out = run_child(kind, folder, db, steps)
                rates[kind].append(out["steps"] / out["seconds"])
                log(f"run {run + 1}/{runs} {kind}: {rates[kind][-1]:,.0f} steps/s")
            except Exception as e:
                r["errors"].append(f"{kind}: {e}")
                log(f"{kind} failed: {e}")
                if kind == "dbos":
                    problem = r["dbos_problem"] = f"it failed here: {str(e).splitlines()[-1][:300]}"
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    r["rates"] = rates
    r["steps"], r["dbos_steps"], r["runs"] = n, dn, runs

    folder = Path(tempfile.mkdtemp(prefix="steps-replay-", dir=base))
    try:
        log(f"recording {REPLAY_STEPS[quick]:,} steps, then replaying them {REPLAY_RUNS[quick]} times")
        r["replay"] = run_child("replay", folder, folder / "store.db", REPLAY_STEPS[quick], REPLAY_RUNS[quick])
    except Exception as e:
        r["errors"].append(f"replay: {e}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    folder = Path(tempfile.mkdtemp(prefix="steps-recovery-", dir=base))
    try:
        log(f"recovery under onward supervise: {RECOVERY_KILLS[quick]} kills")
        r["recovery"] = measure_recovery(folder, RECOVERY_KILLS[quick])
    except Exception as e:
        r["errors"].append(f"recovery: {e}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return r


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def verdict(ok: bool) -> str:
    return "meets" if ok else "**misses**"


def render(r: dict[str, Any]) -> str:
    lines: list[str] = []
    w = lines.append
    w("## Durable steps (issue 4)")
    w("")
    if r["quick"]:
        w("**Quick smoke run** (`--quick`): few steps and runs; not for comparison.")
        w("")
    w(f"Command: `python bench/bench_steps.py{' --quick' if r['quick'] else ''}`. Each measurement runs in its own"
      " process (`python bench/bench_steps.py --child KIND DIR DB N`), on fresh files under"
      " `$ONWARD_BENCH_DIR`; the kinds are interleaved run by run, so they share the machine's load.")
    w("")
    rates = r["rates"]
    on, fl, db = median(rates["onward"]), median(rates["floor"]), median(rates["dbos"])
    w(f"### Step overhead: a trivial step, sequential, one task, SQLite (median of {r['runs']} runs)")
    w("")
    w("| what | steps per run | steps/s (median) | µs per step | runs (steps/s) |")
    w("|---|---:|---:|---:|---|")

    def row(label: str, steps: int, values: list[float]) -> None:
        m = median(values)
        if m is None:
            w(f"| {label} | {steps:,} | - | - | - |")
        else:
            w(f"| {label} | {steps:,} | {m:,.0f} | {1e6 / m:,.0f} | {', '.join(f'{v:,.0f}' for v in values)} |")

    row("onward `@step` (SQLite, WAL, synchronous=FULL, group commit)", r["steps"], rates["onward"])
    if r["dbos_problem"] and not rates["dbos"]:
        w(f"| DBOS Transact `@DBOS.step` | - | not measured: {r['dbos_problem']} | - | - |")
    else:
        row(f"DBOS Transact {dbos_version()} `@DBOS.step` in a `@DBOS.workflow` (SQLite system database)",
            r["dbos_steps"], rates["dbos"])
    row("floor: plain `sqlite3`, one INSERT + COMMIT per step (WAL, synchronous=FULL)", r["steps"], rates["floor"])
    w("")
    if on is not None:
        w(f"- onward: **{on:,.0f} steps/s**, target ≥ {TARGET_RATE:,}: {verdict(on >= TARGET_RATE)}.")
    if on is not None and db:
        w(f"- onward / DBOS in the same run: **{on / db:.1f}×**, target ≥ {TARGET_RATIO:.0f}×:"
          f" {verdict(on / db >= TARGET_RATIO)}.")
    if on is not None and fl:
        w(f"- onward / the plain-sqlite3 floor: {on / fl:.2f}, target ≥ 0.7 (issue 12): {verdict(on / fl >= 0.7)}."
          " Each onward step is one durable commit, like the floor's, made on the task's own thread (it is the"
          " only task running), plus its fence check and the step's JSON.")
    w("")
    replay = r.get("replay")
    w("### Replay on resume")
    w("")
    if replay:
        secs = replay["replay_seconds"]
        m = statistics.median(secs)
        rate = replay["steps"] / m
        w(f"A task recorded {replay['steps']:,} steps (in {replay['recorded_seconds']:.2f} s), failed, and ran again"
          f" {len(secs)} times, replaying them all: from the task function's start (the first step call reads the"
          f" records) to the return of its last step.")
        w("")
        w("| steps | replay time (median) | steps/s | runs (s) |")
        w("|---:|---:|---:|---|")
        w(f"| {replay['steps']:,} | {m * 1000:.1f} ms | {rate:,.0f} | {', '.join(f'{s:.3f}' for s in secs)} |")
        w("")
        w(f"- Replay: **{rate:,.0f} steps/s**, target ≥ {TARGET_REPLAY:,}: {verdict(rate >= TARGET_REPLAY)}.")
        if replay.get("journal"):
            w(f"- The journal line of the last replay (`onward logs`): `{replay['journal']}`.")
    else:
        w("Not measured (see the errors below).")
    w("")
    recovery = r.get("recovery")
    w("### Recovery after kill -9 under `onward supervise`")
    w("")
    if recovery:
        m = statistics.median(recovery)
        w("A worker (`onward supervise --max-restarts 1000 -- python worker.py`, default restart delay)"
          " runs a task that loops over a 5 ms step; it is SIGKILLed after 2.5 s of work. Measured: from the"
          " kill to the first step body running in the restarted worker (restart delay, interpreter start,"
          " reclaiming the dead worker's task, claiming it, loading and replaying its steps).")
        w("")
        w(f"| kills | median | each (s) |\n|---:|---:|---|\n| {len(recovery)} | {m:.3f} s |"
          f" {', '.join(f'{s:.3f}' for s in recovery)} |")
        w("")
        w(f"- Recovery: **{m:.2f} s**, target ≤ {TARGET_RECOVERY_S} s: {verdict(m <= TARGET_RECOVERY_S)}.")
    else:
        w("Not measured (see the errors below).")
    w("")
    w("Notes: DBOS Transact keeps its SQLite system database in SQLite's default rollback-journal mode (its own"
      " choice, not changed here), so each of its step commits costs more than one fsync; onward and the floor"
      " use WAL with synchronous=FULL (one fsync per commit). Both record a step durably before it returns.")
    if r["errors"]:
        w("")
        w("**Failed parts:**")
        for e in r["errors"]:
            w(f"- {e.splitlines()[0][:500]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args and args[0] == "--child":
        kind, _folder, db, *rest = args[1:]
        children: dict[str, Callable[..., None]] = {"onward": child_onward, "floor": child_floor,
                                                    "dbos": child_dbos, "replay": child_replay}
        children[kind](db, *map(int, rest))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: fewer steps and runs")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    options = parser.parse_args(args)
    base_root = Path(os.environ.get("ONWARD_BENCH_DIR") or REPO / "bench" / "out")
    base_root.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="steps-", dir=base_root))
    try:
        r = measure(options.quick, base)
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if not options.keep:
            shutil.rmtree(base, ignore_errors=True)
    print(render(r))
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
