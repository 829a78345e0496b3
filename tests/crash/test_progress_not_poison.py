"""An agent whose worker is killed again and again is not failed as poison while each run gets further.

Real worker processes (the Python API, ``@job.task`` with durable steps) SIGKILL themselves: one agent
after recording two new steps in every run, so it needs six runs with ``max_attempts=3`` and must end done;
another before recording anything, so it is a true poison task and must end failed after three attempts.
Both on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from onward.store import open_store
from onward.store.base import DONE, FAILED
from tests.conftest import run_onward

SRC = str(Path(__file__).resolve().parents[2] / "src")
STEPS = 10  # two new ones per run: five runs killed after new steps, the sixth replays them all and finishes
NEW_STEPS_PER_RUN = 2

WORKER = r'''
import os, signal, sys
from onward import Job, step

db, mode = sys.argv[1], sys.argv[2]
job = Job(db, max_attempts=3, retry_delay=0, heartbeat=0.5, log_level=0)
ran = []  # step bodies this process ran for real (replayed steps do not run)

@step(name="think")
def think(i):
    ran.append(i)
    return i * i

@job.task
def agent(task, ctx):
    if mode == "poison":
        os.kill(os.getpid(), signal.SIGKILL)  # before any step: no progress at all
    total = 0
    for i in range(%(steps)d):
        total += think(i)  # returns once its record is durable
        if len(ran) == %(new)d:
            os.kill(os.getpid(), signal.SIGKILL)  # after this run's new steps were committed
    return total

job.add([mode])
sys.exit(job.run().exit_code)
'''


def run_worker(script: Path, db: str, mode: str) -> int:
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, str(script), db, mode], env=env, timeout=120,
                          capture_output=True).returncode


def journal(db: str, task: str) -> list[str]:
    r = run_onward("logs", "--db", db, "--task", task, "-n", "1000")
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().splitlines()


def test_a_worker_killed_after_new_steps_every_run_is_not_poison(store_url: str, tmp_path: Path,
                                                                 seed: int) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER % {"steps": STEPS, "new": NEW_STEPS_PER_RUN}))
    codes = [run_worker(script, store_url, "agent") for _ in range(STEPS // NEW_STEPS_PER_RUN + 1)]
    # Five runs killed, each after two new steps (more than max_attempts=3), then one that finishes.
    assert codes == [-9] * (STEPS // NEW_STEPS_PER_RUN) + [0]
    store = open_store(store_url, create=False)
    try:
        row = store.task("agent")
        assert row is not None and row.state == DONE
        assert row.attempts == 1  # five uncounted attempts, then the one that finished
        assert [s.index for s in store.steps(store.task_id("agent"))] == list(range(1, STEPS + 1))  # type: ignore[arg-type]
    finally:
        store.close()
    lines = journal(store_url, "agent")
    interrupted = [line for line in lines if " interrupted " in line]
    assert len(interrupted) == STEPS // NEW_STEPS_PER_RUN, lines
    assert all("owner died" in line and "not counted" in line for line in interrupted), interrupted
    assert not any(" failed " in line or " reclaimed " in line for line in lines), lines


def test_a_worker_killed_before_any_step_is_still_poison(store_url: str, tmp_path: Path, seed: int) -> None:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER % {"steps": STEPS, "new": NEW_STEPS_PER_RUN}))
    codes = [run_worker(script, store_url, "poison") for _ in range(4)]
    # Three attempts kill their worker; the fourth worker reclaims the task with no attempts left: failed.
    assert codes == [-9, -9, -9, 3]
    store = open_store(store_url, create=False)
    try:
        row = store.task("poison")
        assert row is not None and row.state == FAILED and row.attempts == 3 and row.error == "owner died"
    finally:
        store.close()
    lines = journal(store_url, "poison")
    assert not any(" interrupted " in line for line in lines), lines
    assert sum(" reclaimed " in line for line in lines) == 3, lines
