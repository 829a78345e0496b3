"""Benchmark of onward's core on the embedded SQLite store (issue 2's targets). Prints a Markdown section.

    python bench/bench_core.py [--quick] [--keep]

What it measures, each in fresh temporary folders under ``$ONWARD_BENCH_DIR`` (default ``bench/out/``), only
through onward's public Python API and CLI:

- no-op tasks through the Python API at N = 1k, 10k, 100k, 1M, concurrency 1 and 4: the add phase and the run
  phase each in their own process (so each one's peak RSS is its own), tasks/s, µs per task, store size;
- the same durable-commit loop in plain ``sqlite3`` (WAL, synchronous=FULL, one UPDATE + COMMIT per task on
  a table of N rows): the floor onward is compared with, measured in the same run;
- ``onward run --tasks FILE -- true`` at 1k and 10k (whole process), beside the cost of spawning ``true``
  from Python alone;
- ``onward status`` (and ``--json``) on the largest store, whole process;
- resume: ``onward run`` on that store with 10 tasks left, time until the first of them starts.

``--quick`` is a smoke run (N up to 10k). Progress goes to stderr. The process exits 1 if any part failed
(the section still says what was measured and what failed).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"
THIS = Path(__file__).resolve()

# N -> how many runs (medians are over these). At 1M one run each: a full run should stay near 10 minutes.
API_SIZES = {False: {1_000: 5, 10_000: 5, 100_000: 3, 1_000_000: 1}, True: {1_000: 3, 10_000: 1}}
# (N, concurrency) -> runs. `true` at 10k takes ~45 s a run here; concurrency 4 is shown at 1k only.
CLI_RUNS = {False: {(1_000, 1): 3, (1_000, 4): 3, (10_000, 1): 3}, True: {(1_000, 1): 1, (1_000, 4): 1}}
CONCURRENCIES = (1, 4)
FLOOR_MAX_COMMITS = 200_000  # on the 1M-row table, time this many commits: the per-commit cost is flat
SPAWN_REFERENCE_N = 1_000
STATUS_RUNS = {False: 7, True: 3}
RESUME_RUNS = {False: 5, True: 3}
RESUME_LEFT = 10
CHILD_TIMEOUT = 3600.0

TARGET_RATE = 3_000  # durable completions/s through the Python API
TARGET_RATIO = 1.5  # per-task cost at 1M / at 1k
TARGET_STATUS_S = 0.3
TARGET_RESUME_S = 1.0
TARGET_RSS_MB = 150


def task_name(i: int) -> str:
    return f"task-{i:07d}"


def log(text: str) -> None:
    print(f"[core {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def maxrss_mb() -> float:
    """This process's peak RSS in MB (10^6 bytes); Linux reports ru_maxrss in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def emit(**values: Any) -> None:
    print(json.dumps(values), flush=True)


# --- workers: each runs in its own process --------------------------------------------------------------
def worker_api_add(db: str, n: int) -> None:
    import onward.log
    from onward import Job

    job = Job(db, log_level=onward.log.QUIET)
    started = time.perf_counter()
    added = job.add(task_name(i) for i in range(n))
    seconds = time.perf_counter() - started
    job.close()
    emit(seconds=seconds, added=added, rss_mb=maxrss_mb())


def worker_api_run(db: str, concurrency: int, n: int) -> None:
    import onward.log
    from onward import Job

    job = Job(db, concurrency=concurrency, log_level=onward.log.QUIET)

    @job.task
    def noop(task: str, ctx: Any) -> str:
        return task

    started = time.perf_counter()
    summary = job.run()
    seconds = time.perf_counter() - started
    store_bytes = sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p))
    job.close()
    if summary.done != n:
        raise SystemExit(f"expected {n} tasks done, the run did {summary.done} ({summary})")
    emit(seconds=seconds, done=summary.done, rss_mb=maxrss_mb(), store_bytes=store_bytes)


def worker_floor(db: str, n: int, commits: int) -> None:
    """The floor: plain sqlite3, one durable commit per task, like the simplest durable loop would do."""
    import sqlite3

    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA journal_mode = WAL")
    con.execute("PRAGMA synchronous = FULL")
    con.execute("CREATE TABLE tasks (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,"
                " state TEXT NOT NULL DEFAULT 'pending')")
    con.execute("BEGIN")
    con.executemany("INSERT INTO tasks (name) VALUES (?)", ((task_name(i),) for i in range(n)))
    con.execute("COMMIT")
    started = time.perf_counter()
    for task_id in range(1, commits + 1):
        con.execute("BEGIN IMMEDIATE")
        con.execute("UPDATE tasks SET state = 'done' WHERE id = ?", (task_id,))
        con.execute("COMMIT")
    seconds = time.perf_counter() - started
    con.close()
    emit(seconds=seconds, commits=commits, rss_mb=maxrss_mb())


def worker_spawn(n: int) -> None:
    """How fast this Python alone can run `true` as a child with its output piped: the CLI's ceiling."""
    started = time.perf_counter()
    for _ in range(n):
        subprocess.run(["true"], stdin=subprocess.DEVNULL, capture_output=True, check=True)
    emit(seconds=time.perf_counter() - started, rss_mb=maxrss_mb())


WORKERS: dict[str, Callable[..., None]] = {
    "api-add": lambda db, n: worker_api_add(db, int(n)),
    "api-run": lambda db, c, n: worker_api_run(db, int(c), int(n)),
    "floor": lambda db, n, commits: worker_floor(db, int(n), int(commits)),
    "spawn": lambda n: worker_spawn(int(n)),
}


# --- running processes ---------------------------------------------------------------------------------
def compile_onward(package: Path = SRC / "onward") -> bool:
    """Compile onward's modules to bytecode, as pip does when it installs onward (nothing to do when they are up
    to date; ``PYTHONDONTWRITEBYTECODE`` stops only the interpreter's own writing, not this). False if they
    could not all be written (a read-only install without them)."""
    return bool(compileall.compile_dir(str(package), quiet=1))


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONWARD_DB", "ONWARD_KEEP_AWAKE")}
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if str(SRC) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), *paths])
    return env


@dataclass
class Proc:
    argv: list[str]
    seconds: float  # wall time, from just before the fork to the reaped exit
    code: int
    rss_mb: float  # peak RSS of the process (and any children it waited for)
    stdout: str
    stderr: str
    started_at: float  # time.time() just before the fork
    cpu: float = 0.0  # user + system seconds of the process and every child it waited for (wait4's rusage)


def run_process(argv: list[str], scratch: Path) -> Proc:
    """Run one process, timing it whole and reading its peak RSS from wait4's rusage."""
    out_path, err_path = scratch / "proc.out", scratch / "proc.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        started_at = time.time()
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=child_env(),
                                cwd=REPO)
        timer = threading.Timer(CHILD_TIMEOUT, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - started
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    out_path.unlink()
    err_path.unlink()
    return Proc(argv, seconds, code, usage.ru_maxrss * 1024 / 1e6, stdout, stderr, started_at,
                usage.ru_utime + usage.ru_stime)


class PartFailed(Exception):
    pass


def check(proc: Proc, what: str) -> Proc:
    if proc.code != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise PartFailed(f"{what}: `{shlex.join(proc.argv)}` exited {proc.code}:\n{tail}")
    return proc


def call_worker(kind: str, *args: Any, scratch: Path) -> dict[str, Any]:
    proc = check(run_process([sys.executable, str(THIS), "--worker", kind, *map(str, args)], scratch), kind)
    values: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    values["process_rss_mb"] = proc.rss_mb
    return values


def onward(*args: str) -> list[str]:
    return [sys.executable, "-m", "onward", *args]


def write_tasks(path: Path, names: Iterator[str]) -> None:
    with open(path, "w") as f:
        for name in names:
            f.write(name + "\n")


def copy_store(src: Path, dst: Path) -> None:
    """A closed store is its database file plus any write-ahead log (the -shm index is rebuilt on open)."""
    for suffix in ("", "-wal"):
        if Path(str(src) + suffix).exists():
            shutil.copyfile(str(src) + suffix, str(dst) + suffix)


def store_mb(db: Path) -> float:
    return sum(os.path.getsize(str(db) + s) for s in ("", "-wal") if os.path.exists(str(db) + s)) / 1e6


# --- statistics and formatting -------------------------------------------------------------------------
def med(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], fmt: str) -> str:
    """'median (min–max)', or just the value for one run."""
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(med(values), fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def size_label(n: int) -> str:
    return f"{n // 1_000_000}M" if n >= 1_000_000 and n % 1_000_000 == 0 else (
        f"{n // 1000}k" if n % 1000 == 0 else str(n))


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


# --- the parts -----------------------------------------------------------------------------------------
@dataclass
class Results:
    quick: bool
    root: Path
    api: dict[tuple[int, int], list[dict[str, Any]]] = field(default_factory=dict)  # (N, concurrency) -> runs
    floor: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    cli: dict[tuple[int, int], list[Proc]] = field(default_factory=dict)
    spawn: list[dict[str, Any]] = field(default_factory=list)
    startup: list[float] = field(default_factory=list)
    template: Path | None = None  # the largest store, every task done
    template_n: int = 0
    template_mb: float = 0.0
    import_full: Proc | None = None
    import_grown: Proc | None = None
    status: dict[str, list[Proc]] = field(default_factory=dict)
    status_json: dict[str, Any] | None = None
    resume: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # variant -> (first start, wall)
    commands: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def show(self, argv: list[str], folder: Path | None = None) -> str:
        """A command as the reader would type it: $D for the run's fresh folder."""
        text = shlex.join(argv)
        if folder is not None:
            text = text.replace(str(folder), "$D")
        text = text.replace(str(THIS), str(THIS.relative_to(REPO)))
        return text.replace(sys.executable, "python")


def part_api(r: Results) -> None:
    sizes = API_SIZES[r.quick]
    largest = max(sizes)
    for n, runs in sizes.items():
        for concurrency in CONCURRENCIES:
            rows = r.api.setdefault((n, concurrency), [])
            for i in range(runs):
                folder = Path(tempfile.mkdtemp(prefix=f"api-{n}-c{concurrency}-", dir=r.root))
                db = folder / "store.db"
                add = call_worker("api-add", db, n, scratch=folder)
                run = call_worker("api-run", db, concurrency, n, scratch=folder)
                rows.append({"add": add, "run": run})
                r.commands.setdefault("api-add", r.show([sys.executable, str(THIS), "--worker", "api-add",
                                                          str(db), "N"], folder))
                r.commands.setdefault("api-run", r.show([sys.executable, str(THIS), "--worker", "api-run",
                                                          str(db), "CONCURRENCY", "N"], folder))
                log(f"api N={n} concurrency={concurrency} run {i + 1}/{runs}: add {add['seconds']:.2f} s,"
                    f" run {run['seconds']:.2f} s = {n / run['seconds']:,.0f} tasks/s,"
                    f" rss {run['rss_mb']:.0f} MB")
                if n == largest and concurrency == 1 and i == runs - 1:
                    r.template, r.template_n = db, n
                else:
                    shutil.rmtree(folder)


def part_floor(r: Results) -> None:
    for n, runs in API_SIZES[r.quick].items():
        commits = min(n, FLOOR_MAX_COMMITS)
        for i in range(runs):
            folder = Path(tempfile.mkdtemp(prefix=f"floor-{n}-", dir=r.root))
            row = call_worker("floor", folder / "floor.db", n, commits, scratch=folder)
            r.floor.setdefault(n, []).append(row)
            r.commands.setdefault("floor", r.show([sys.executable, str(THIS), "--worker", "floor",
                                                   str(folder / "floor.db"), "N", "COMMITS"], folder))
            log(f"sqlite3 floor N={n} run {i + 1}/{runs}: {commits / row['seconds']:,.0f} commits/s")
            shutil.rmtree(folder)


def part_cli(r: Results) -> None:
    for (n, concurrency), runs in CLI_RUNS[r.quick].items():
        for i in range(runs):
            folder = Path(tempfile.mkdtemp(prefix=f"cli-{n}-c{concurrency}-", dir=r.root))
            tasks = folder / "tasks.txt"
            write_tasks(tasks, (task_name(j) for j in range(n)))
            argv = onward("run", "--db", str(folder / "store.db"), "--tasks", str(tasks), "--concurrency",
                          str(concurrency), "-q", "--", "true")
            proc = check(run_process(argv, folder), "onward run")
            status = onward("status", "--db", str(folder / "store.db"), "--json")
            done = json.loads(check(run_process(status, folder), "onward status --json").stdout)["done"]
            if done != n:
                raise PartFailed(f"onward run -- true: {done} of {n} tasks done")
            r.cli.setdefault((n, concurrency), []).append(proc)
            r.commands.setdefault(f"cli-{concurrency}", r.show(argv, folder))
            log(f"cli N={n} concurrency={concurrency} run {i + 1}/{runs}: {proc.seconds:.2f} s ="
                f" {n / proc.seconds:,.0f} tasks/s")
            shutil.rmtree(folder)
    folder = Path(tempfile.mkdtemp(prefix="spawn-", dir=r.root))
    for _ in range(CLI_RUNS[r.quick][(1_000, 1)]):
        r.spawn.append(call_worker("spawn", SPAWN_REFERENCE_N, scratch=folder))
    r.commands["spawn"] = r.show([sys.executable, str(THIS), "--worker", "spawn", str(SPAWN_REFERENCE_N)])
    shutil.rmtree(folder)


def part_prepare_resume(r: Results) -> None:
    """Turn the largest API store (every task done) into one with RESUME_LEFT tasks left, the way a user
    would: the tasks file is imported (all its tasks already known), then grows by RESUME_LEFT lines."""
    assert r.template is not None
    folder = r.template.parent
    tasks = folder / "tasks.txt"
    write_tasks(tasks, (task_name(i) for i in range(r.template_n)))
    argv = onward("add", "--db", str(r.template), "--tasks", str(tasks))
    r.import_full = check(run_process(argv, folder), "onward add (full file)")
    r.commands["add-file"] = r.show(argv, folder)
    with open(tasks, "a") as f:
        for i in range(RESUME_LEFT):
            f.write(f"left-{i}\n")
    r.import_grown = check(run_process(argv, folder), "onward add (grown file)")
    r.template_mb = store_mb(r.template)
    log(f"store of {r.template_n:,} tasks + {RESUME_LEFT} left: import of the full file"
        f" {r.import_full.seconds:.2f} s, of {RESUME_LEFT} appended lines {r.import_grown.seconds:.2f} s")


def part_status(r: Results) -> None:
    assert r.template is not None
    folder = r.template.parent
    for _ in range(STATUS_RUNS[r.quick]):
        r.startup.append(check(run_process(onward("--version"), folder), "onward --version").seconds)
    for variant, extra in (("status", []), ("status --json", ["--json"])):
        argv = onward("status", "--db", str(r.template), *extra)
        r.commands[variant] = r.show(argv, folder)
        for _ in range(STATUS_RUNS[r.quick]):
            proc = check(run_process(argv, folder), f"onward {variant}")
            r.status.setdefault(variant, []).append(proc)
            if extra:
                r.status_json = json.loads(proc.stdout)
        log(f"onward {variant}: median {med([p.seconds for p in r.status[variant]]):.3f} s")
    assert r.status_json is not None
    expected = {"total": r.template_n + RESUME_LEFT, "pending": RESUME_LEFT, "done": r.template_n}
    wrong = {k: r.status_json.get(k) for k, v in expected.items() if r.status_json.get(k) != v}
    if wrong:
        raise PartFailed(f"onward status --json: expected {expected}, got {wrong}")


def part_resume(r: Results) -> None:
    assert r.template is not None
    folder = r.template.parent
    tasks = folder / "tasks.txt"
    for variant, extra in (("with --tasks", ["--tasks", str(tasks)]), ("without --tasks", [])):
        for i in range(RESUME_RUNS[r.quick]):
            run_folder = folder / f"resume-{i}"
            run_folder.mkdir()
            db = run_folder / "store.db"
            copy_store(r.template, db)
            starts = run_folder / "starts"
            argv = onward("run", "--db", str(db), *extra, "-q", "--", "sh", "-c", 'date +%s.%N >> "$0"', str(starts))
            proc = check(run_process(argv, folder), f"onward run (resume, {variant})")
            times = [float(line) for line in starts.read_text().split()]
            if len(times) != RESUME_LEFT:
                raise PartFailed(f"resume {variant}: {len(times)} task starts recorded, expected {RESUME_LEFT}")
            r.resume.setdefault(variant, []).append((min(times) - proc.started_at, proc.seconds))
            r.commands.setdefault(f"resume {variant}", r.show(argv, folder).replace("/resume-0/", "/resume-$i/"))
            shutil.rmtree(run_folder)
        log(f"resume {variant}: first start after median {med([x[0] for x in r.resume[variant]]):.3f} s")


# --- the report ----------------------------------------------------------------------------------------
def render(r: Results) -> str:
    out: list[str] = []
    w = out.append
    w("## Core: the SQLite store, the Python API and `onward run` (bench/bench_core.py)")
    w("")
    if r.quick:
        w("**Quick smoke run** (`--quick`): N up to 10k and few runs; not for comparison.")
        w("")
    w("Every run starts in a fresh folder `$D` under the benchmark folder (same disk as the fsync figure"
      " above), with a fresh store, using only onward's public Python API and CLI. `python` is the"
      " interpreter that ran the benchmark; `PYTHONPATH` holds this tree's `src/`. Figures are"
      " **median (min–max)** over the runs counted in each table. MB = 10^6 bytes.")
    w("")
    w(_api_section(r))
    w(_cli_section(r))
    w(_status_resume_section(r))
    w(_targets_section(r))
    if r.failures:
        w("### Parts that failed")
        w("")
        for failure in r.failures:
            w("```text\n" + failure.strip() + "\n```")
        w("")
    return "\n".join(out).rstrip() + "\n"


def _api_section(r: Results) -> str:
    if not r.api:
        return ""
    lines = ["### Python API: no-op tasks", "",
             "A task function that returns its task text; `Job(db, concurrency=C, log_level=onward.log.QUIET)`."
             " The add phase (`job.add` of N names, one process) and the run phase (`job.run()`, a second"
             " process opening the same store) are timed separately with `time.perf_counter`; peak RSS is each"
             " process's own `ru_maxrss`; store size is the database plus its WAL when `job.run()` returns.",
             "",
             "* **concurrency 1** is issue 2's contract: one durable commit (`synchronous=FULL`, an fsync) per"
             " completion; the runner commits a completion together with the next claim in one transaction.",
             "* **concurrency 4**: up to 4 tasks in flight; completions that finish together share one commit"
             " (group commit), each still durable before it is reported.",
             "", "```sh",
             r.commands.get("api-add", ""), r.commands.get("api-run", ""), "```", "",
             "```python",
             textwrap.dedent("""\
                 job = Job(db, log_level=onward.log.QUIET)           # process 1: add
                 job.add(task_name(i) for i in range(n))              # task-0000000, task-0000001, ...
                 job = Job(db, concurrency=c, log_level=onward.log.QUIET)  # process 2: run
                 @job.task
                 def noop(task, ctx): return task
                 summary = job.run()                                  # checked: summary.done == n""").rstrip(),
             "```", "",
             "| N | concurrency | runs | add: s | add: tasks/s | run: s | run: tasks/s | µs per task"
             " | peak RSS add / run (MB) | store at end (MB) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (n, c), rows in r.api.items():
        add_s = [x["add"]["seconds"] for x in rows]
        run_s = [x["run"]["seconds"] for x in rows]
        lines.append(
            f"| {n:,} | {c} | {len(rows)} | {spread(add_s, '.2f')} | {spread([n / s for s in add_s], ',.0f')}"
            f" | {spread(run_s, '.2f')} | {spread([n / s for s in run_s], ',.0f')}"
            f" | {spread([s / n * 1e6 for s in run_s], '.0f')}"
            f" | {max(x['add']['process_rss_mb'] for x in rows):.0f} / {max(x['run']['process_rss_mb'] for x in rows):.0f}"
            f" | {med([x['run']['store_bytes'] / 1e6 for x in rows]):.1f} |")
    lines.append("")
    if r.floor:
        lines += ["#### Reference: the raw sqlite3 floor, same run", "",
                  "Plain Python `sqlite3` on a table of N rows (`id INTEGER PRIMARY KEY, name TEXT UNIQUE,"
                  " state TEXT`), WAL, `synchronous=FULL`: per task `BEGIN IMMEDIATE; UPDATE tasks SET"
                  f" state = 'done' WHERE id = ?; COMMIT`. On tables over {FLOOR_MAX_COMMITS:,} rows the"
                  f" first {FLOOR_MAX_COMMITS:,} rows are timed (the cost per commit does not depend on how"
                  " many follow). While a fresh store's WAL is still growing (until SQLite's first automatic"
                  " checkpoint at 1,000 pages) every commit also extends the file, and its fsync costs more"
                  " (measured here: ~150-220 µs against ~90-110 µs once the WAL is reused): small N pay more per"
                  " commit, the floor at 1k most of all, since it writes 1 page per commit where onward writes"
                  " several.", "",
                  "```sh", r.commands.get("floor", ""), "```", "",
                  "| N (rows) | runs | commits timed | commits/s | µs per commit | onward at concurrency 1 /"
                  " floor (time per task) |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for n, rows in r.floor.items():
            rates = [x["commits"] / x["seconds"] for x in rows]
            per = [x["seconds"] / x["commits"] * 1e6 for x in rows]
            api = r.api.get((n, 1))
            ratio = (f"{med([x['run']['seconds'] / n * 1e6 for x in api]) / med(per):.2f}×" if api else "-")
            lines.append(f"| {n:,} | {len(rows)} | {rows[0]['commits']:,} | {spread(rates, ',.0f')}"
                         f" | {spread(per, '.0f')} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


def _cli_section(r: Results) -> str:
    if not r.cli:
        return ""
    lines = ["### CLI: `onward run --tasks FILE -- true`", "",
             "The whole `onward` process, timed from fork to exit (wall clock), so each figure includes"
             " starting Python and onward, importing the tasks file and creating the store. Each task forks and"
             " execs `true` in its own process group with its output piped: the cost per task is mostly that"
             " spawn, not the store (compare the spawn reference below and the API table above). Every run is"
             " checked with `onward status --json` (done = N).", "",
             "```sh", r.commands.get("cli-1", ""), r.commands.get("cli-4", ""), "```", "",
             "| N | concurrency | runs | wall: s | tasks/s | ms per task | peak RSS (MB) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for (n, c), procs in r.cli.items():
        secs = [p.seconds for p in procs]
        lines.append(f"| {n:,} | {c} | {len(procs)} | {spread(secs, '.2f')} | {spread([n / s for s in secs], ',.0f')}"
                     f" | {spread([s / n * 1e3 for s in secs], '.2f')} | {max(p.rss_mb for p in procs):.0f} |")
    if r.spawn:
        per = [x["seconds"] / SPAWN_REFERENCE_N * 1e3 for x in r.spawn]
        lines += ["", f"Spawn reference, same interpreter, no onward: `subprocess.run(['true'], capture_output=True)`"
                      f" {SPAWN_REFERENCE_N:,} times in a loop ({plural(len(r.spawn), 'run')}): {spread(per, '.2f')} ms per"
                      f" spawn = {spread([1e3 / p for p in per], ',.0f')} spawns/s.", "",
                  "```sh", r.commands.get("spawn", ""), "```"]
    lines.append("")
    return "\n".join(lines)


def _status_resume_section(r: Results) -> str:
    if r.template is None or (not r.status and not r.resume):
        return ""
    n = r.template_n
    lines = [f"### `onward status` and resume on a store of {n + RESUME_LEFT:,} tasks", "",
             f"The store is the one the concurrency-1 API run at N = {n:,} left (every task done, its journal holding"
             f" a claim and a completion per task), turned into one with {RESUME_LEFT} tasks left as a user would: a tasks"
             f" file of the same {n:,} names is imported (`onward add --tasks`, all known), then {RESUME_LEFT}"
             f" lines are appended and imported again: {n:,} done, {RESUME_LEFT} pending, {r.template_mb:.0f} MB"
             " on disk. The page cache is warm (the store was just written or copied): a cold disk adds its own"
             " read time.", "",
             "```sh", r.commands.get("add-file", "") + "   # run twice: full file, then with 10 lines appended",
             "```", ""]
    if r.import_full and r.import_grown:
        lines += [f"* Import of the {n:,}-line file, every task already in the store: {r.import_full.seconds:.2f} s"
                  f" (peak RSS {r.import_full.rss_mb:.0f} MB); of the same file grown by {RESUME_LEFT} lines:"
                  f" {r.import_grown.seconds:.2f} s (only the new lines are read).", ""]
    if r.status:
        lines += ["**`onward status`**, whole process (wall clock, stdout to a file), beside the cost of"
                  " starting the CLI at all:", "", "```sh",
                  r.commands.get("status", ""), r.commands.get("status --json", ""), "python -m onward --version",
                  "```", "", "| command | runs | wall: s | peak RSS (MB) |", "|---|---:|---:|---:|"]
        for variant, procs in r.status.items():
            lines.append(f"| `onward {variant}` | {len(procs)} | {spread([p.seconds for p in procs], '.3f')}"
                         f" | {max(p.rss_mb for p in procs):.0f} |")
        if r.startup:
            lines.append(f"| `onward --version` (start-up only) | {len(r.startup)} | {spread(r.startup, '.3f')} | |")
        lines.append("")
    if r.resume:
        lines += ["**Resume**: a fresh copy of the store per run; time from just before `onward run` is forked to"
                  " the moment the first of the 10 left tasks starts (each task's command appends its start"
                  " time, `date +%s.%N`, to a file); and the whole run (all 10 done, process exited).", "",
                  "```sh", r.commands.get("resume with --tasks", ""), r.commands.get("resume without --tasks", ""),
                  "```", "",
                  "| `onward run` | runs | to first task start: s | whole run: s |", "|---|---:|---:|---:|"]
        for variant, pairs in r.resume.items():
            lines.append(f"| {variant} | {len(pairs)} | {spread([p[0] for p in pairs], '.3f')}"
                         f" | {spread([p[1] for p in pairs], '.3f')} |")
        lines.append("")
    return "\n".join(lines)


def _targets_section(r: Results) -> str:
    lines = ["### Issue 2's targets", ""]
    largest = max((n for n, _ in r.api), default=0)
    caveat = "" if largest >= 1_000_000 else f" (quick run: largest N is {largest:,}, not 1M)"
    lines += ["| target | measured | |", "|---|---|---|"]
    c1 = {n: rows for (n, c), rows in r.api.items() if c == 1}
    if c1:
        rates = {n: med([n / x["run"]["seconds"] for x in rows]) for n, rows in c1.items()}
        worst = min(rates, key=lambda n: rates[n])
        lines.append(f"| Python API ≥ {TARGET_RATE:,} durable completions/s (concurrency 1, every N) |"
                     f" lowest median {rates[worst]:,.0f}/s at N = {worst:,}; "
                     + ", ".join(f"{size_label(n)}: {v:,.0f}" for n, v in rates.items())
                     + f" | {met(rates[worst] >= TARGET_RATE)} |")
        if 1_000 in c1 and largest != 1_000:
            for c in CONCURRENCIES:
                small, big = r.api.get((1_000, c)), r.api.get((largest, c))
                if small and big:
                    ratio = med([x["run"]["seconds"] / largest for x in big]) / med(
                        [x["run"]["seconds"] / 1_000 for x in small])
                    lines.append(f"| per-task cost at {size_label(largest)} within {TARGET_RATIO}× of 1k"
                                 f" (concurrency {c}){caveat} | {ratio:.2f}× | {met(ratio <= TARGET_RATIO)} |")
    if r.status:
        worst_status = max(med([p.seconds for p in procs]) for procs in r.status.values())
        lines.append(f"| `onward status` on 1M tasks < {TARGET_STATUS_S} s{caveat} | "
                     + ", ".join(f"`{v}` {med([p.seconds for p in procs]):.3f} s" for v, procs in r.status.items())
                     + f" (whole process) | {met(worst_status < TARGET_STATUS_S)} |")
    if r.resume:
        worst_resume = max(med([p[0] for p in pairs]) for pairs in r.resume.values())
        lines.append(f"| resume < {TARGET_RESUME_S:g} s to the first task left{caveat} | "
                     + ", ".join(f"{v}: {med([p[0] for p in pairs]):.3f} s" for v, pairs in r.resume.items())
                     + f" | {met(worst_resume < TARGET_RESUME_S)} |")
    big = [x for (n, _), rows in r.api.items() if n == largest for x in rows]
    if big:
        run_rss = max(x["run"]["process_rss_mb"] for x in big)
        add_rss = max(x["add"]["process_rss_mb"] for x in big)
        lines.append(f"| peak RSS < {TARGET_RSS_MB} MB at 1M tasks{caveat} | run process {run_rss:.0f} MB;"
                     f" add process (`job.add` of all N names at once) {add_rss:.0f} MB"
                     f" | {met(max(run_rss, add_rss) < TARGET_RSS_MB)} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        sys.path.insert(0, str(SRC))
        WORKERS[argv[1]](*argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: N up to 10k, few runs")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders")
    args = parser.parse_args(argv)
    base = Path(os.environ.get("ONWARD_BENCH_DIR") or REPO / "bench" / "out")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="core-", dir=base))
    r = Results(quick=args.quick, root=root)
    started = time.monotonic()
    log(f"working in {root}")
    parts: list[tuple[str, Callable[[Results], None], bool]] = [
        ("Python API", part_api, False), ("sqlite3 floor", part_floor, False), ("CLI", part_cli, False),
        ("resume store", part_prepare_resume, True), ("status", part_status, True), ("resume", part_resume, True)]
    try:
        for name, part, needs_template in parts:
            if needs_template and r.template is None:
                r.failures.append(f"{name}: skipped, no store from the Python API part")
                continue
            try:
                part(r)
            except Exception as e:  # a part that fails is reported, and the others still run
                detail = str(e) if isinstance(e, PartFailed) else traceback.format_exc()
                r.failures.append(f"{name}: {detail}")
                log(f"{name} FAILED: {detail}")
                if part is part_prepare_resume:
                    r.template = None
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    log(f"done in {time.monotonic() - started:.0f} s")
    print(render(r))
    return 1 if r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
