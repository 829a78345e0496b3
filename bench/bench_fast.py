"""Benchmark of issue 12's fast paths, each beside its reference measured in the same run, alternating.
Prints a Markdown section.

    python bench/bench_fast.py [--quick] [--keep]

- ``onward run --tasks FILE -- true {task}`` (the whole process: import of the file, runs, exit) beside
  ``xargs -P1 -n1 true`` and GNU parallel ``-j1 --joblog J --resume true`` on the same file, at concurrency 1,
  and ``onward run --concurrency 4`` beside ``xargs -P4``; at both, a durable floor (floor_commands.py);
- at concurrency 4, that floor spending a fixed CPU time a turn, at two places: what a microsecond of a
  runner's CPU costs in throughput there, and so about how much CPU onward would have to shed to match xargs;
- no-op tasks through the Python API at concurrency 1 beside the raw sqlite3 floor (bench_core's two
  workers), and the WAL bytes each task writes, for onward and for the floor;
- start-up: ``onward status`` on a fresh store beside ``python -c 'import sqlite3'``, and whether
  ``onward run`` of a command imports asyncio.

Each figure is a median over several rounds; in each round every system runs once, in a fixed order. The
machine is shared with other work, so single runs are noisy: the rounds and their spread are shown.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench_core import (
    REPO,
    SRC,
    child_env,
    compile_onward,
    med,
    run_process,
    size_label,
    spread,
    task_name,
    write_tasks,
)

THIS = Path(__file__).resolve()
# N -> rounds; at 20k one round of the five systems takes about four minutes here, and the one round at 1M
# of the Python API about ten.
CLI_ROUNDS = {False: {2_000: 5, 20_000: 3}, True: {300: 1}}
API_ROUNDS = {False: {1_000: 5, 100_000: 3, 1_000_000: 1}, True: {1_000: 1}}
WAL_N = 2_000
# Start-up differs from `import sqlite3` by 2-4 ms of some 16-25 ms: at 21 rounds the median ratio moved by
# +-0.05 from run to run here, so more rounds (each takes well under a second).
STARTUP_ROUNDS = {False: 101, True: 5}
TARGET_XARGS_C1 = 0.7
TARGET_PARALLEL_C1 = 3.0
TARGET_XARGS_C4 = 1.0
TARGET_API = 0.5
TARGET_STARTUP = 1.2


def log(text: str) -> None:
    print(f"[fast {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def onward_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "onward", *args]


def timed_shell_free(argv: list[str], stdin_path: Path, scratch: Path) -> tuple[float, float]:
    """Wall seconds of one process reading ``stdin_path`` (xargs, parallel), and the CPU seconds of it and its
    children (wait4's rusage); fails loudly on a non-zero exit."""
    with open(stdin_path, "rb") as stdin, open(scratch / "stderr", "wb") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=err, cwd=scratch)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    if code != 0:
        raise SystemExit(f"`{shlex.join(argv)}` exited {code}: {(scratch / 'stderr').read_text()[-500:]}")
    return seconds, usage.ru_utime + usage.ru_stime


# --- commands -------------------------------------------------------------------------------------------
def cli_systems(tasks: Path) -> dict[str, Any]:
    parallel = shutil.which("parallel")
    systems: dict[str, Any] = {
        "xargs -P1": lambda scratch: timed_shell_free(["xargs", "-P1", "-n1", "true"], tasks, scratch),
        "onward c1": lambda scratch: onward_run(tasks, scratch, 1),
        "durable floor c1": lambda scratch: durable_floor(tasks, scratch, 1, sync_every=1),
        "xargs -P4": lambda scratch: timed_shell_free(["xargs", "-P4", "-n1", "true"], tasks, scratch),
        "onward c4": lambda scratch: onward_run(tasks, scratch, 4),
        "durable floor c4": lambda scratch: durable_floor(tasks, scratch, 4, sync_every=8),
    }
    if parallel:
        systems["parallel -j1"] = lambda scratch: timed_shell_free(
            [parallel, "-j1", "--joblog", str(scratch / "joblog"), "--resume", "true"], tasks, scratch)
    return systems


def timed_runner(what: str, argv: list[str], scratch: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``argv`` (bench_core.run_process), in ``scratch``; fails loudly,
    naming ``what``, on a non-zero exit."""
    proc = run_process(argv, scratch)
    if proc.code != 0:
        raise SystemExit(f"{what} exited {proc.code}: {proc.stderr[-500:]}")
    return proc.seconds, proc.cpu


def onward_run(tasks: Path, scratch: Path, concurrency: int) -> tuple[float, float]:
    return timed_runner("onward run", onward_argv("run", "--db", str(scratch / "run.db"), "--tasks", str(tasks),
                                                  "--concurrency", str(concurrency), "-q", "--", "true", "{task}"),
                        scratch)


def durable_floor(tasks: Path, scratch: Path, concurrency: int, sync_every: int,
                  burn: tuple[int, str] | None = None) -> tuple[float, float]:
    """floor_commands.py: the least a durable command runner in Python does (its docstring says what it
    leaves out), the whole process; its log synced after every ``sync_every``-th completion. ``burn``: the
    microseconds of CPU it spends a turn, and where ("exit" or "start", see its docstring)."""
    extra = [str(burn[0]), burn[1]] if burn else []
    return timed_runner("floor_commands.py", [sys.executable, str(THIS.parent / "floor_commands.py"), str(tasks),
                                              str(concurrency), str(scratch / "floor.db"), str(sync_every), *extra,
                                              "--", "true"], scratch)


def take_turns(systems: dict[str, Any], n: int, rounds: int, root: Path) -> tuple[dict[str, list[float]],
                                                                                 dict[str, list[float]]]:
    """``rounds`` rounds of every system in turn, on ``n`` tasks each time, each in a scratch folder of its own:
    tasks/s, and CPU ms per task (of the process and every child it waited for), per system and round."""
    rates: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(rounds):
        for name, run in systems.items():
            scratch = Path(tempfile.mkdtemp(prefix="cli-", dir=root))
            seconds, cpu_seconds = run(scratch)
            shutil.rmtree(scratch)
            rates[name].append(n / seconds)
            cpu[name].append(cpu_seconds / n * 1000)
            log(f"N={n} round {r + 1}/{rounds} {name}: {n / seconds:,.0f} tasks/s")
    return rates, cpu


def part_cli(quick: bool, root: Path) -> list[str]:
    lines = ["### Commands: `onward run -- true {task}` beside xargs and GNU parallel", ""]
    if not shutil.which("parallel"):
        lines += ["GNU parallel is not installed here: its column is missing (`apt-get install parallel`).", ""]
    for n, rounds in CLI_ROUNDS[quick].items():
        tasks = root / f"tasks-{n}.txt"
        write_tasks(tasks, (task_name(i) for i in range(n)))
        rates, cpu = take_turns(cli_systems(tasks), n, rounds, root)
        lines += [f"N = {n:,}, tasks/s and CPU time per task (user + system, of the process and every child it"
                  f" waited for: the commands' `true` included), median (min–max) of {rounds} round(s); cores busy"
                  f" = CPU time over wall time, of the medians (this machine has {os.cpu_count()}):", "",
                  "| system | tasks/s | CPU ms per task | cores busy |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {spread(v, ',.0f')} | {spread(cpu[name], '.2f')} | {med(v) * med(cpu[name]) / 1000:.2f} |"
                  for name, v in rates.items()]
        lines.append("")
        c1 = med(rates["onward c1"])
        lines.append(f"- concurrency 1: onward / xargs -P1 = **{c1 / med(rates['xargs -P1']):.2f}×**"
                     f" (target ≥ {TARGET_XARGS_C1}×)")
        floor_c1 = med(rates["durable floor c1"])
        lines.append(f"- concurrency 1: the durable floor / xargs -P1 = {floor_c1 / med(rates['xargs -P1']):.2f}×;"
                     f" onward / the durable floor = {c1 / floor_c1:.2f}×")
        if "parallel -j1" in rates:
            lines.append(f"- concurrency 1: onward / parallel -j1 --joblog --resume = "
                         f"**{c1 / med(rates['parallel -j1']):.2f}×** (target ≥ {TARGET_PARALLEL_C1:g}×)")
        lines.append(f"- concurrency 4: onward / xargs -P4 = **{med(rates['onward c4']) / med(rates['xargs -P4']):.2f}×**"
                     f" (target ≥ {TARGET_XARGS_C4:g}×); with as many cores busy as xargs, at most"
                     f" {med(cpu['xargs -P4']) / med(cpu['onward c4']):.2f}× (xargs' CPU per task over onward's)")
        floor_c4 = med(rates["durable floor c4"])
        lines.append(f"- concurrency 4: the durable floor / xargs -P4 = {floor_c4 / med(rates['xargs -P4']):.2f}×;"
                     f" onward / the durable floor = {med(rates['onward c4']) / floor_c4:.2f}×")
        lines.append("")
    lines += ["```sh", "xargs -P1 -n1 true < tasks.txt",
              "onward run --db run.db --tasks tasks.txt --concurrency 1 -q -- true {task}   # fresh store each run",
              "parallel -j1 --joblog joblog --resume true < tasks.txt                       # fresh joblog each run",
              "xargs -P4 -n1 true < tasks.txt",
              "onward run --db run.db --tasks tasks.txt --concurrency 4 -q -- true {task}",
              "python bench/floor_commands.py tasks.txt 1 floor.db 1 -- true                 # fresh store each run",
              "python bench/floor_commands.py tasks.txt 4 floor.db 8 -- true",
              "```", "",
              "The durable floor (`bench/floor_commands.py`, some 40 lines) is the least a durable command runner"
              " in Python does: per turn one SQLite transaction (WAL) of the completion it saw and the claims of"
              " the free slots, each command spawned with `os.posix_spawn` in its own session, the log synced"
              " while the commands just started run: after every completion at concurrency 1 (as onward syncs"
              " each commit there), after every 8th at concurrency 4 (about as often as onward's sync thread)."
              " It reads no output, keeps no journal, leases, heartbeats or process groups, and notes a pid only"
              " after its command started: it is not a rival, but what a runner of onward's design could reach"
              " on this machine beside xargs.", "",
              "Throughput is the cores busy over the CPU time per task. At concurrency 4 on this 2-core machine"
              " both runs keep most of the cores busy, so onward can match `xargs -P4` only by spending no more CPU"
              " per task than xargs does, `true` included (the bound on the concurrency-4 line). The difference of"
              " the two CPU figures is what onward's worker spends per command beyond xargs' fork and wait: its"
              " commit, its fsync, its Python. Each `onward` is the whole process, its start included (about 90"
              " ms here for one task), with onward's modules in bytecode, as an install leaves them.", ""]
    return lines


# --- concurrency 4: what the runner's CPU costs ------------------------------------------------------------
BOUND_N = {False: 5_000, True: 200}
BOUND_ROUNDS = {False: 5, True: 1}
BURNS_US = (150, 300)


def part_bound(quick: bool, root: Path) -> list[str]:
    """The durable floor at concurrency 4 spending some CPU a turn, at each command's end or just after the
    starts: what a microsecond of a runner's CPU costs in throughput, and whether where it is spent
    matters; from that, about how much CPU per command onward would have to shed to match ``xargs -P4``."""
    n, rounds = BOUND_N[quick], BOUND_ROUNDS[quick]
    tasks = root / f"tasks-bound-{n}.txt"
    write_tasks(tasks, (task_name(i) for i in range(n)))
    floor = "durable floor c4"
    systems: dict[str, Any] = {
        "xargs -P4": lambda scratch: timed_shell_free(["xargs", "-P4", "-n1", "true"], tasks, scratch),
        "onward c4": lambda scratch: onward_run(tasks, scratch, 4),
        floor: lambda scratch: durable_floor(tasks, scratch, 4, sync_every=8),
    }
    burned = {(us, at): f"floor c4, {us} µs at {at}" for us in BURNS_US for at in ("exit", "start")}
    for (us, at), name in burned.items():
        systems[name] = lambda scratch, us=us, at=at: durable_floor(tasks, scratch, 4, sync_every=8, burn=(us, at))
    rates, cpu = take_turns(systems, n, rounds, root)
    wall_us = {name: 1e6 / med(v) for name, v in rates.items()}  # wall time per task, of the median rate
    cpu_us = {name: med(v) * 1000 for name, v in cpu.items()}
    lines = ["### Concurrency 4: what a microsecond of the runner's CPU costs", "",
             f"N = {n:,} × `true`, {rounds} round(s) taken in turns; median (min–max) tasks/s, and wall and CPU"
             " time per task (CPU: of the process and every child it waited for, `true` included) of the"
             " medians. The durable floor as above, and the same floor spending a fixed CPU time once a turn (a"
             " turn per command's end; busy on its thread's CPU clock, `bench/floor_commands.py ... BURN_US AT`):"
             " at `exit`, between a command's end and the next one's start; at `start`, just after the turn's"
             " commands started, while they run.", "",
             "| system | tasks/s | wall µs per task | CPU µs per task |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {spread(v, ',.0f')} | {wall_us[name]:.0f} | {cpu_us[name]:.0f} |"
              for name, v in rates.items()]
    lines.append("")
    slopes = []  # wall µs per CPU µs, of each burn whose CPU showed up at all
    for (us, at), name in burned.items():
        added_wall, added_cpu = wall_us[name] - wall_us[floor], cpu_us[name] - cpu_us[floor]
        ratio = added_wall / added_cpu if added_cpu > 0 else float("nan")
        if added_cpu > 0:
            slopes.append(ratio)
        lines.append(f"- {us} µs at {at}: {added_cpu:+.0f} µs of CPU per task measured, {added_wall:+.0f} µs of"
                     f" wall: {ratio:.2f} µs of wall per µs of CPU")
    slope = med(slopes) if slopes else float("nan")
    gap = wall_us["onward c4"] - wall_us["xargs -P4"]
    beyond = cpu_us["onward c4"] - cpu_us[floor]
    lines += [f"- onward c4 takes {gap:+.0f} µs of wall per task against `xargs -P4` and spends {beyond:+.0f} µs"
              f" of CPU per task beyond the floor. At {slope:.2f} µs of wall per µs of CPU (the median of the"
              f" four above), matching `xargs -P4` would take about **{gap / slope:.0f} µs less CPU per task**"
              f" ({gap / slope / beyond:.0%} of what it spends beyond the floor)." if beyond > 0 and slope > 0
              else "- (no estimate: the figures above are too noisy for one)", "",
              "```sh", "python bench/floor_commands.py tasks.txt 4 floor.db 8 300 exit -- true     # and 150, start",
              "```", ""]
    return lines


# --- the Python API and the WAL ---------------------------------------------------------------------------
def worker_wal(folder: str, kind: str, n: int) -> None:
    """WAL bytes per task: a reader holds a snapshot taken before the run, so no checkpoint can rewind the
    log, and the log's growth over the run is what the run wrote to it."""
    db = os.path.join(folder, f"{kind}.db")
    if kind == "onward":
        import onward.log
        from onward import Job

        job = Job(db, log_level=onward.log.QUIET)
        job.add(task_name(i) for i in range(n))
        job.close()
    else:
        con = sqlite3.connect(db, isolation_level=None)
        con.execute("PRAGMA journal_mode = WAL")
        con.execute("CREATE TABLE tasks (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,"
                    " state TEXT NOT NULL DEFAULT 'pending')")
        con.execute("BEGIN")
        con.executemany("INSERT INTO tasks (name) VALUES (?)", ((task_name(i),) for i in range(n)))
        con.execute("COMMIT")
        con.close()
    reader = sqlite3.connect(db, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM sqlite_master").fetchone()
    before = os.path.getsize(db + "-wal")
    if kind == "onward":
        job = Job(db, concurrency=1, log_level=onward.log.QUIET)

        @job.task
        def noop(task: str, ctx: Any) -> str:
            return task

        os.getppid()  # marks in the system-call trace: the syncs between the two are the run's (part_api)
        done = job.run().done
        os.getppid()
        after = os.path.getsize(db + "-wal")
        job.close()
    else:
        con = sqlite3.connect(db, isolation_level=None)
        con.execute("PRAGMA synchronous = FULL")
        os.getppid()
        for task_id in range(1, n + 1):
            con.execute("BEGIN IMMEDIATE")
            con.execute("UPDATE tasks SET state = 'done' WHERE id = ?", (task_id,))
            con.execute("COMMIT")
        os.getppid()
        done = n
        after = os.path.getsize(db + "-wal")
        con.close()
    reader.execute("COMMIT")
    reader.close()
    print(json.dumps({"bytes_per_task": (after - before) / done, "done": done}))


def call(kind: str, *args: Any, scratch: Path, wrapper: Sequence[str] = ()) -> dict[str, Any]:
    proc = run_process([*wrapper, sys.executable, str(THIS), "--worker", kind, *map(str, args)], scratch)
    if proc.code != 0:
        raise SystemExit(f"worker {kind} exited {proc.code}: {proc.stderr[-800:]}")
    values: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return values


def call_core(kind: str, *args: Any, scratch: Path) -> dict[str, Any]:
    proc = run_process([sys.executable, str(THIS.parent / "bench_core.py"), "--worker", kind, *map(str, args)],
                       scratch)
    if proc.code != 0:
        raise SystemExit(f"bench_core worker {kind} exited {proc.code}: {proc.stderr[-800:]}")
    values: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return values


def wal_and_syncs(scratch: Path, kind: str) -> dict[str, Any]:
    """``worker_wal``'s figures, and the sync calls per task of its run (fsync and fdatasync, any thread)."""
    strace = shutil.which("strace")
    if strace is None:
        raise SystemExit("strace is needed to count the sync calls (make bench installs it)")
    trace = scratch / f"{kind}.strace"
    values = call("wal", scratch, kind, WAL_N, scratch=scratch,
                  wrapper=[strace, "-f", "-qq", "-o", str(trace), "-e", "trace=fsync,fdatasync,getppid"])
    calls = [line for line in trace.read_text().splitlines() if "(" in line]
    marks = [i for i, line in enumerate(calls) if "getppid(" in line]
    between = calls[marks[0] + 1:marks[-1]]
    values["syncs_per_task"] = sum(1 for line in between if "sync(" in line) / values["done"]
    return values


def part_api(quick: bool, root: Path) -> list[str]:
    lines = ["### Python API: no-op tasks at concurrency 1 beside the raw sqlite3 floor", "",
             "The same two worker processes as the core section (bench/bench_core.py `--worker api-add`,"
             " `api-run`, `floor`): onward's `job.run()` of a function returning its task text, and the floor's"
             " `BEGIN IMMEDIATE; UPDATE tasks SET state = 'done' WHERE id = ?; COMMIT` per task (WAL,"
             " synchronous=FULL) on a table of N rows; onward then the floor in each round.", "",
             "| N | rounds | onward tasks/s | floor commits/s | ratio (of medians) | per-round ratios |",
             "|---:|---:|---:|---:|---:|---|"]
    worst = None
    for n, rounds in API_ROUNDS[quick].items():
        ours, floor, ratios = [], [], []
        for r in range(rounds):
            scratch = Path(tempfile.mkdtemp(prefix="api-", dir=root))
            db = scratch / "s.db"
            call_core("api-add", db, n, scratch=scratch)
            run = call_core("api-run", db, 1, n, scratch=scratch)
            fl = call_core("floor", scratch / "floor.db", n, n, scratch=scratch)
            shutil.rmtree(scratch)
            ours.append(n / run["seconds"])
            floor.append(fl["commits"] / fl["seconds"])
            ratios.append(ours[-1] / floor[-1])
            log(f"API N={n} round {r + 1}: onward {ours[-1]:,.0f}/s floor {floor[-1]:,.0f}/s")
        ratio = med(ours) / med(floor)
        worst = ratio if worst is None else min(worst, ratio)
        lines.append(f"| {size_label(n)} | {rounds} | {spread(ours, ',.0f')} | {spread(floor, ',.0f')} |"
                     f" **{ratio:.2f}×** | {', '.join(f'{x:.2f}' for x in ratios)} |")
    lines += ["", f"Target ≥ {TARGET_API}× of the floor: worst ratio here {worst:.2f}×"
              f" ({'met' if worst is not None and worst >= TARGET_API else 'not met'}).", ""]
    scratch = Path(tempfile.mkdtemp(prefix="wal-", dir=root))
    ours_wal = wal_and_syncs(scratch, "onward")
    floor_wal = wal_and_syncs(scratch, "floor")
    shutil.rmtree(scratch)
    lines += [f"WAL bytes per task over a run of {WAL_N:,} no-op tasks (a reader holds a snapshot from before the"
              " run, so that no checkpoint rewinds the log; a WAL frame is one 4,096-byte page plus a 24-byte"
              " header):", "",
              "| | WAL bytes per task | pages per task | fsync + fdatasync calls per task |", "|---|---:|---:|---:|",
              f"| onward, concurrency 1 | {ours_wal['bytes_per_task']:,.0f} | {ours_wal['bytes_per_task'] / 4120:.2f} |"
              f" {ours_wal['syncs_per_task']:.2f} |",
              f"| the floor | {floor_wal['bytes_per_task']:,.0f} | {floor_wal['bytes_per_task'] / 4120:.2f} |"
              f" {floor_wal['syncs_per_task']:.2f} |", "",
              "The sync calls are the worker process's own system calls, on every thread and file, counted by"
              " `strace -f -e trace=fsync,fdatasync,getppid` between two `getppid` calls the worker makes around"
              " its run (strace slows each turn, so a sync covers fewer of them than in the timed runs above)."
              " onward commits each task's completion (with the next claim) in a transaction of its own,"
              " crash-safe, starts the next task, and leaves the log's fdatasync to a thread of its own while the"
              " next tasks run: a sync starts 5 ms after the first commit it covers, so the commits of that"
              " moment share it; a completion is reported once a sync that started after its commit returned.",
              ""]
    return lines


# --- start-up -------------------------------------------------------------------------------------------
def part_startup(quick: bool, root: Path) -> list[str]:
    db = root / "fresh.db"
    subprocess.run(onward_argv("add", "--db", str(db), "one"), check=True, env=child_env(), capture_output=True)
    console = shutil.which("onward", path=str(Path(sys.executable).parent)) or ""
    systems = {"python -c pass": [sys.executable, "-c", "pass"],
               "python -c 'import sqlite3'": [sys.executable, "-c", "import sqlite3"],
               "onward status": [console, "status", "--db", str(db)],
               "onward status --json": [console, "status", "--json", "--db", str(db)]}
    times: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(STARTUP_ROUNDS[quick]):
        for name, argv in systems.items():
            started = time.perf_counter()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env())
            times[name].append(time.perf_counter() - started)
    base = med(times["python -c 'import sqlite3'"])
    lines = ["### Start-up", "",
             f"Whole process, wall time, median (min–max) of {STARTUP_ROUNDS[quick]} rounds, the four taking turns;"
             f" `onward` is the installed console script ({console}), its modules compiled to bytecode first (as"
             " an install does), the store a fresh one with one task.", "",
             "| command | ms | / `import sqlite3` |", "|---|---:|---:|"]
    for name, v in times.items():
        lines.append(f"| `{name}` | {spread([x * 1000 for x in v], '.1f')} | {med(v) / base:.2f}× |")
    ratio = med(times["onward status"]) / base
    lines += ["", f"Target: `onward status` within {TARGET_STARTUP}× of `python -c 'import sqlite3'`: {ratio:.2f}×"
              f" ({'met' if ratio <= TARGET_STARTUP else 'not met'}).", ""]
    # Does `onward run` of a command load asyncio?
    tasks = root / "one.txt"
    write_tasks(tasks, iter(["one"]))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "onward", "run", "--db", str(root / "imp.db"),
                           "--tasks", str(tasks), "-q", "--", "true", "{task}"], capture_output=True, text=True,
                          env=child_env())
    loaded = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    lines += [f"`onward run -- true {{task}}` imports asyncio: {'yes' if 'asyncio' in loaded else 'no'}"
              f" ({len(loaded)} modules in all; `python -X importtime -m onward run ...`).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        sys.path.insert(0, str(SRC))
        worker_wal(argv[2], argv[3], int(argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: small N, one round")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders")
    parser.add_argument("--parts", default="cli,bound,api,startup", help="which parts, comma-separated")
    args = parser.parse_args(argv)
    base = Path(os.environ.get("ONWARD_BENCH_DIR") or REPO / "bench" / "out")
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="fast-", dir=base))
    parts = {"cli": part_cli, "bound": part_bound, "api": part_api, "startup": part_startup}
    lines = ["## Fast paths (issue 12; bench/bench_fast.py)", "",
             f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. This machine (2 cores) is shared with"
             " other agents' work while it runs: figures are noisy, hence medians of rounds taken in turns and"
             " their spread.", ""]
    failed = False
    # As an installed package has them (pip compiles on install), for every part: onward's modules in
    # bytecode, not compiled again by every run of `onward` (PYTHONDONTWRITEBYTECODE, where the environment
    # sets it, stops only the writing). Until 2026-12-07 only the start-up part did this, after the others:
    # in a fresh clone each `onward run` of the commands part compiled some 40 modules first, about 50 ms.
    if not compile_onward():
        raise SystemExit(f"cannot compile onward's modules in {SRC / 'onward'} to bytecode")
    try:
        for name in args.parts.split(","):
            log(f"part {name}")
            try:
                lines += parts[name](args.quick, root)
            except (Exception, SystemExit) as e:
                failed = True
                lines += [f"**{name}: failed**: {e}", ""]
                log(f"{name} FAILED: {e}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
