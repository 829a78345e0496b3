"""The fault matrix: a system call failing with EIO, ENOSPC, EROFS or EDQUOT, injected by strace into a
real worker, on the store's files or on the ``--out`` folder, for a few calls at a seeded moment.

Each cell checks what a user relies on: the worker says what happened in lines without a traceback and
ends with a status that gets the job going again (0: it rode the fault out; 75: it could not go on, says
why in one line, and supervisors and systemd restart it);
a second run, once the fault is gone, finishes the job; nothing is lost (every task done, every result file
present and right, ``integrity_check`` passes, no temporary file left) and nothing is done twice (a task a
worker reported done never runs again).

Not in the matrix, and why: ``rename`` on the store (SQLite never renames its files); ``write``/``fsync``
of a result's temporary file (strace's path filter cannot name a file whose name is random; a full disk
under ``--out`` is tested for real in test_disk_faults.py, and a failing fsync of the folder is here).
"""

from __future__ import annotations

import json
import os
import random
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from onward.outdir import TEMP_PREFIX, file_name
from tests.conftest import onward_argv, require_tool
from tests.reliability import record

SRC = str(Path(__file__).resolve().parents[2] / "src")
ERRNOS = ["EIO", "ENOSPC", "EROFS", "EDQUOT"]
# What the error line may say for each errno: the system's words, or SQLite's (which reports a failed
# write or sync of any kind as a disk I/O error, and ENOSPC as a full disk).
ERROR_WORDS = {
    "EIO": ("Input/output error", "disk I/O error"),
    "ENOSPC": ("No space left on device", "database or disk is full", "disk I/O error"),
    "EROFS": ("Read-only file system", "disk I/O error"),
    "EDQUOT": ("Disk quota exceeded", "disk I/O error"),
}
DONE_LINE = re.compile(rb'done task=("[^"]*") attempt=')
N_TASKS = 24

# (target, system calls as strace names them, when the fault strikes). "early": the first calls, so the
# worker meets it while opening things; "later": a seeded few calls into the run.
CELLS = [
    ("store", "pwrite64", "later"),
    ("store", "fdatasync", "later"),
    ("store", "openat", "early"),
    ("store", "mkdir", "early"),
    ("out", "openat", "later"),
    ("out", "renameat,rename,renameat2", "later"),
    ("out", "fsync", "later"),
    ("out", "mkdir,mkdirat", "early"),
]
# Every cell, every errno, in the normal suite: a cell is one traced worker on 24 tasks and one clean
# finish, about a second each (the whole matrix, 32 cells, takes ~30 s on a 2-core machine).
MATRIX = [(cell, errno_name) for cell in CELLS for errno_name in ERRNOS]


@pytest.mark.parametrize(("target", "syscalls", "moment", "errno_name"), [(*cell, e) for cell, e in MATRIX],
                         ids=[f"{t}-{s.split(',')[0]}-{e}" for (t, s, _), e in MATRIX])
def test_fault_cell(tmp_path: Path, seed: int, target: str, syscalls: str, moment: str, errno_name: str) -> None:
    strace = require_tool("strace")
    rng = random.Random(seed)
    names = [f"t{i:02d}" for i in range(N_TASKS)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    store_dir, out = tmp_path / "store", tmp_path / "out"
    db = store_dir / "onward.db"
    if target == "store" and syscalls != "mkdir":
        # The store exists, so the fault hits a worker using it rather than the one creating it.
        assert subprocess.run(onward_argv("add", "--db", str(db), "--tasks", str(tasks)), env=_env(),
                              capture_output=True).returncode == 0
    paths = [str(store_dir), str(db), f"{db}-wal", f"{db}-shm"] if target == "store" else [str(out)]
    first = 1 if moment == "early" else rng.randrange(2, 12)
    when = f"{first}..{first + rng.randrange(0, 3)}"
    executions = [tmp_path / "executions-1.log", tmp_path / "executions-2.log"]

    def worker(run: int) -> list[str]:
        return onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "--heartbeat",
                           "0.5", "--retry-delay", "0.1", "--", "sh", "-c",
                           f'echo "$1" >> {executions[run - 1]}; echo "result of $1"', "x", "{task}")

    trace = tmp_path / "strace.log"
    injected = [strace, "-f", "-qq", "-o", str(trace), *[a for p in paths for a in ("-P", p)],
                "-e", f"trace={syscalls}", "-e", f"inject={syscalls}:error={errno_name}:when={when}", *worker(1)]
    print(f"cell {target} {syscalls} {errno_name} when={when}")
    faulty = subprocess.run(injected, env=_env(), capture_output=True, timeout=180)
    stderr = faulty.stderr.decode(errors="replace")
    print(f"exit {faulty.returncode}\n{stderr[-1500:]}")
    assert "Traceback" not in stderr, "a fault must be reported in a line, not a traceback"
    # 0: it rode the fault out. 75: it could not go on and says so; supervisors and systemd restart it
    # (2, a usage error, would leave the job stopped for good: the bug these cells first found).
    assert faulty.returncode in (0, 75), f"exit {faulty.returncode}: not a status that gets the job restarted"
    if faulty.returncode == 75:
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("onward: error: ") and any(w in last for w in ERROR_WORDS[errno_name]), last
    assert "(INJECTED)" in trace.read_text(), "the fault was never injected: the cell tests nothing"
    reported = {json.loads(m) for m in DONE_LINE.findall(faulty.stderr)}

    clean = subprocess.run(worker(2), env=_env(), capture_output=True, timeout=180)
    assert clean.returncode == 0, clean.stderr.decode(errors="replace")[-2000:]

    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        integrity = c.execute("PRAGMA integrity_check").fetchone()[0]
        states = dict(c.execute("SELECT name, state FROM tasks").fetchall())
    finally:
        c.close()
    lost = [n for n in names if states.get(n) != "done"]
    wrong_files = [n for n in names if not (out / file_name(n)).is_file()
                   or (out / file_name(n)).read_bytes() != f"result of {n}\n".encode()]
    temporary = [p.name for p in out.iterdir() if p.name.startswith(TEMP_PREFIX)]
    again = reported & _lines(executions[1])
    record("fault matrix", backend="sqlite", case=f"{errno_name} on {target} {syscalls} ({moment}, calls {when})",
           seed=seed, tasks=N_TASKS, exit_status=faulty.returncode, reported_under_fault=len(reported),
           lost=len(lost), doubled=len(again), wrong_or_missing_files=len(wrong_files),
           temporary_files_left=len(temporary), integrity=integrity, recovered=clean.returncode == 0 and not lost)
    assert integrity == "ok"
    assert not lost, f"not done once the fault is gone: {lost[:5]}"
    assert not wrong_files, f"result files missing or wrong: {wrong_files[:5]}"
    assert not temporary, f"temporary files left in --out: {temporary}"
    assert not again, f"reported done under the fault, yet run again: {sorted(again)} (seed {seed})"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=SRC)


def _lines(path: Path) -> set[str]:
    return set(path.read_text().split()) if path.exists() else set()


def test_a_failed_sync_reports_nothing_it_settled_and_loses_nothing(tmp_path: Path, seed: int) -> None:
    """A worker commits what a task settled crash-safe, starts the next task, then syncs the log before it
    tells anyone (runner ``_report_settled``). Past start-up every fdatasync of the log is that sync, so an
    EIO injected there hits it: the task it settled is done in the store but never reported, the worker
    says so in a line and rides the fault out (exit 0), commits durably from then on, and writes the result
    file it owed after its next good commit. Nothing runs twice; every result file is there and right."""
    strace = require_tool("strace")
    rng = random.Random(seed)
    names = [f"t{i:02d}" for i in range(N_TASKS)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    db, out, executions = tmp_path / "store" / "onward.db", tmp_path / "out", tmp_path / "executions.log"
    assert subprocess.run(onward_argv("add", "--db", str(db), "--tasks", str(tasks)), env=_env(),
                          capture_output=True).returncode == 0
    when = rng.randrange(8, 16)
    print(f"EIO on the log's fdatasync number {when}")
    faulty = subprocess.run(
        [strace, "-f", "-qq", "-o", str(tmp_path / "strace.log"), "-P", f"{db}-wal", "-e", "trace=fdatasync",
         "-e", f"inject=fdatasync:error=EIO:when={when}",
         *onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "--", "sh", "-c",
                      f'echo "$1" >> {executions}; echo "result of $1"', "x", "{task}")],
        env=_env(), capture_output=True, timeout=180)
    stderr = faulty.stderr.decode(errors="replace")
    print(stderr[-1500:])
    assert faulty.returncode == 0 and "Traceback" not in stderr
    assert "cannot make the last commit durable: Input/output error" in stderr
    reported = {json.loads(m) for m in DONE_LINE.findall(faulty.stderr)}
    c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        states = dict(c.execute("SELECT name, state FROM tasks").fetchall())
    finally:
        c.close()
    assert all(states[n] == "done" for n in names)
    unreported = set(names) - reported
    assert unreported, "the task settled by the failed sync was reported anyway"
    runs = executions.read_text().split()
    assert sorted(runs) == sorted(set(runs)) == sorted(names), "a task ran twice, or not at all"
    wrong_files = [n for n in names if not (out / file_name(n)).is_file()
                   or (out / file_name(n)).read_bytes() != f"result of {n}\n".encode()]
    assert not wrong_files, f"result files missing or wrong: {wrong_files[:5]}"
