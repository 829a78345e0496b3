"""The core guarantees under SIGKILL at random moments, some of them inside a commit.

A restart loop runs `onward run` on 600 tasks and SIGKILLs it at seeded random moments; a second kind of
kill is delivered by strace at the N-th fdatasync of the store, i.e. inside a commit, after SQLite wrote
its log frames and before they reached the disk. After every kill the store must pass integrity_check; at
the end every task is done with its result, none ran again after its completion was committed (each
execution appends to a side-effect log), and no temporary file is left in the output folder.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import onward_argv

SRC = str(Path(__file__).resolve().parents[2] / "src")
N_TASKS = 600  # enough work that 62 kills happen before the job could finish
RANDOM_KILLS = 50
COMMIT_KILLS = 12


def integrity(db: Path) -> str:
    c = sqlite3.connect(db)
    try:
        return str(c.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        c.close()


def test_sigkill_at_random_moments_loses_nothing_and_redoes_nothing(tmp_path: Path, seed: int) -> None:
    crash_loop(tmp_path, seed, n_tasks=N_TASKS, random_kills=RANDOM_KILLS, commit_kills=COMMIT_KILLS, concurrency=2)


@pytest.mark.torture
def test_torture_many_kills_many_slots(tmp_path: Path, seed: int) -> None:
    crash_loop(tmp_path, seed, n_tasks=6000, random_kills=300, commit_kills=60, concurrency=4)


def crash_loop(tmp_path: Path, seed: int, *, n_tasks: int, random_kills: int, commit_kills: int,
               concurrency: int) -> None:
    rng = random.Random(seed)
    db = tmp_path / "store.db"
    out = tmp_path / "out"
    log = tmp_path / "executions.log"
    tasks = tmp_path / "tasks.txt"
    names = [f"task-{i:04d}" for i in range(n_tasks)]
    tasks.write_text("".join(n + "\n" for n in names))
    # Each execution appends "<task> <attempt>" first, works ~60 ms, then prints its result.
    worker = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--out", str(out), "--concurrency", str(concurrency),
                         "--max-attempts", "1000", "--retry-delay", "0", "-q", "--",
                         "sh", "-c", f'echo "$1 $ONWARD_ATTEMPT" >> {log}; sleep 0.06; echo "result of $1"',
                         "x", "{task}")
    env = dict(os.environ, PYTHONPATH=SRC)
    strace = shutil.which("strace")
    if strace is None and os.environ.get("CI") == "true":
        pytest.fail("strace is needed for the kills inside commits")
    plan = ["random"] * random_kills + (["commit"] * commit_kills if strace else [])
    rng.shuffle(plan)
    kills = {"random": 0, "commit": 0}
    for kind in plan:
        if kind == "random":
            p = subprocess.Popen(worker, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(rng.uniform(0.05, 0.6))
            finished = p.poll() is not None
            if not finished:
                p.send_signal(signal.SIGKILL)
            p.wait()
        else:
            # strace kills the worker as it enters its N-th fdatasync: inside a commit.
            assert strace is not None  # the plan has commit kills only with strace
            nth = rng.randint(2, 10)
            p = subprocess.Popen(
                [strace, "-f", "-qq", "-o", "/dev/null", "-e", "trace=fdatasync",
                 "-e", f"inject=fdatasync:signal=KILL:when={nth}", *worker],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            p.wait(timeout=120)
            finished = False
        if p.returncode == 0 and kind == "random":
            finished = True
        if not finished:
            kills[kind] += 1
        assert integrity(db) == "ok", f"store damaged after a {kind} kill (seed {seed})"
        if finished:
            break
    print(f"kills: {kills}")
    assert kills["random"] >= random_kills, (
        f"the job finished after {kills} kills: too little work for this machine (seed {seed})")
    if strace:
        assert kills["commit"] >= commit_kills * 0.8
    final = subprocess.run(worker, env=env, capture_output=True, timeout=300)
    assert final.returncode == 0, final.stderr.decode()
    assert integrity(db) == "ok"

    c = sqlite3.connect(db)
    rows = {name: (state, attempts, result) for name, state, attempts, result in
            c.execute("SELECT name, state, attempts, result FROM tasks")}
    c.close()
    assert sorted(rows) == names
    executed: dict[str, list[int]] = defaultdict(list)
    for line in log.read_text().splitlines():
        name, attempt = line.split()
        executed[name].append(int(attempt))
    for name in names:
        state, attempts, result = rows[name]
        assert state == "done", (name, state)
        assert bytes(result) == f"result of {name}\n".encode()
        assert (out / f"{name}.txt").read_bytes() == bytes(result)
        runs = executed[name]
        # No attempt ran twice, and the committed attempt was the last one ever run: nothing re-ran a
        # task after its completion was committed (a re-run would need a new claim, a higher attempt).
        assert len(runs) == len(set(runs)), (name, runs, seed)
        assert max(runs) == attempts, (name, runs, attempts, seed)
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "temporary files left in --out"
    redone = sum(len(v) - 1 for v in executed.values())
    print(f"seed={seed} kills={kills} executions={sum(len(v) for v in executed.values())} re-executions={redone}")
