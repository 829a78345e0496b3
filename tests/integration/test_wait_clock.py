"""Parked waits and sleeps when the wall clock is set back (a VM resumed from an older snapshot, an NTP step):
their deadlines are kept in wall-clock time (SQLite: this machine's clock), so a clock an hour behind made a
parked 3 s sleep last an hour and 3 s. Now a deadline never lies further ahead than its wait's or sleep's
whole length: the task parks again for at most that, and it never ends early."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import run_onward, wait_for
from tests.integration.test_cli_run import wall_clock_shifter

SRC = str(Path(__file__).resolve().parents[2] / "src")
LENGTH = 3.0  # each task's sleep or wait timeout, in seconds

# "nap" sleeps LENGTH s, "wait" waits for "k" at most LENGTH s; each notes the monotonic clock (which no
# jump of the wall clock moves, and which every process shares) when it first got there and when it went on.
WORKER = textwrap.dedent(f'''
    import os, sys, time
    from onward import Job
    from onward.errors import WaitTimeout
    url, side = sys.argv[1], sys.argv[2]
    job = Job(url, heartbeat=0.3, park_sleeps_over=0.5)

    def note(path, text):
        with open(os.path.join(side, path), "a") as f:
            f.write(text)

    @job.task
    def handle(task, ctx):
        ctx.step("start", lambda: note(task + ".start", repr(time.monotonic())))
        if task == "nap":
            ctx.sleep({LENGTH})
        else:
            try:
                ctx.wait("k", timeout={LENGTH})
            except WaitTimeout:
                pass
        note(task + ".end", repr(time.monotonic()))
        return "ok"

    sys.exit(job.run().exit_code)
''')


def test_a_wall_clock_set_back_neither_stretches_nor_shortens_a_parked_sleep_or_wait(tmp_path: Path) -> None:
    db, side = str(tmp_path / "s.db"), tmp_path / "side"
    side.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    clock_env, offset = wall_clock_shifter(tmp_path)
    assert run_onward("add", "--db", db, "nap", "wait").returncode == 0
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), db, str(side)], stderr=log,
                                  stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": SRC, **clock_env})
    try:
        def parked() -> bool:
            r = run_onward("status", "--db", db, env=clock_env)
            return b"waiting 2" in r.stdout

        wait_for(parked, 30, "both tasks to park")
        offset.write_text("-3600\n")  # the worker's wall clock, and so the store's, goes back an hour
        wait_for(lambda: (side / "nap.end").exists() and (side / "wait.end").exists(), 2 * LENGTH + 10,
                 f"both tasks to go on; log:\n{(tmp_path / 'worker.log').read_text()}")
        for task in ("nap", "wait"):
            took = float((side / f"{task}.end").read_text()) - float((side / f"{task}.start").read_text())
            assert LENGTH - 0.1 <= took <= 2 * LENGTH + 3, (task, took)
    finally:
        worker.kill()
        worker.wait(timeout=30)
