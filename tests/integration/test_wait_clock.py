"""Parked waits and sleeps when the sandbox sleeps and when the wall clock moves. Frozen (the cgroup freezer)
past the lease and every deadline, its clock set forward meanwhile: each timed-out wait raises once, a value
sent meanwhile is received, nothing runs twice. Set back (a VM resumed from an older snapshot, an NTP step):
deadlines are kept in wall-clock time (SQLite: this machine's clock), so a clock an hour behind made a parked
3 s sleep last an hour and 3 s; now a deadline never lies further ahead than its wait's or sleep's whole
length: the task parks again for at most that, and it never ends early."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from onward.store import open_store
from tests.conftest import run_onward, wait_for
from tests.integration.test_cli_run import frozen_by_cgroup, wall_clock_shifter

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

    def note(path, text):  # whole or absent: the test reads a note as soon as it exists
        with open(os.path.join(side, path + ".tmp"), "w") as f:
            f.write(text)
        os.rename(os.path.join(side, path + ".tmp"), os.path.join(side, path))

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


# "to" waits for "k" at most 4 s, "send" waits for it with no timeout, "nap" sleeps 5 s (parked). Each notes its
# step's runs, its timeouts and its results beside. The test sees all three parked at once only until "to" times
# out: 4 s leaves the polls of `onward status` on a loaded machine time to see it (1 s did not, once).
SANDBOX_WORKER = textwrap.dedent('''
    import os, sys
    from onward import Job
    from onward.errors import WaitTimeout
    url, side, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    job = Job(url, heartbeat=0.3, concurrency=2, keep_awake=marker, park_sleeps_over=0.5)

    def note(task, what):
        with open(os.path.join(side, task + "." + what), "a") as f:
            f.write("x")

    @job.task
    def handle(task, ctx):
        ctx.step("before", lambda: note(task, "before"))
        if task == "nap":
            ctx.sleep(5)
            return ["rested"]
        try:
            return [ctx.wait("k", timeout=4 if task == "to" else None)]
        except WaitTimeout:
            note(task, "timeouts")
            return ["timed out"]

    sys.exit(job.run(lease=2).exit_code)
''')


def test_a_sandbox_frozen_past_every_deadline_with_its_clock_set_forward(store_url: str, tmp_path: Path) -> None:
    side, marker = tmp_path / "side", tmp_path / "keep-awake"
    side.mkdir()
    (tmp_path / "worker.py").write_text(SANDBOX_WORKER)
    clock_env, offset = wall_clock_shifter(tmp_path)
    tasks = ["to", "send", "nap"]
    assert run_onward("add", "--db", store_url, *tasks).returncode == 0
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), store_url, str(side), str(marker)],
                                  stderr=log, stdout=subprocess.DEVNULL,
                                  env={**os.environ, "PYTHONPATH": SRC, **clock_env})
    try:
        wait_for(lambda: b"waiting 3" in run_onward("status", "--db", store_url).stdout, 30, "every task to park")
        wait_for(lambda: not marker.exists(), 30, "the keep-awake marker to go while every task waits")
        with frozen_by_cgroup(worker.pid, worker.pid):
            sent = run_onward("send", "--db", store_url, "send", "k", '"during"')
            assert sent.returncode == 0 and b"runs again" in sent.stderr, sent.stderr
            time.sleep(6)  # the pause itself: past the lease (2 s), the timeout (4 s) and the sleep (5 s)
            offset.write_text("3600\n")  # then the sandbox's wall clock is set (an hour later)
        store = open_store(store_url, create=False)
        try:
            wait_for(lambda: all((row := store.task(t)) is not None and row.state == "done" for t in tasks), 30,
                     f"every task to finish; log:\n{(tmp_path / 'worker.log').read_text()}")
            got = {t: json.loads(r.data) for t in tasks if (r := store.result(t)) is not None}
            attempts = {t: row.attempts for t in tasks if (row := store.task(t)) is not None}
        finally:
            store.close()
        assert got == {"to": ["timed out"], "send": ["during"], "nap": ["rested"]}
        assert attempts == {"to": 1, "send": 1, "nap": 1}
        assert all((side / f"{t}.before").read_text() == "x" for t in tasks)  # each step ran once
        assert (side / "to.timeouts").read_text() == "x"  # the timeout raised once
        wait_for(lambda: not marker.exists(), 30, "the keep-awake marker to go once everything is done")
    finally:
        worker.kill()
        worker.wait(timeout=30)
