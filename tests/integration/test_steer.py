"""Steering a running job from the outside: pause, resume and cancel obeyed by every worker process of the
job, and named jobs sharing one store without seeing each other. Real worker processes (the installed
console script, and a Python worker through ``Job``) on each backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from onward.proc import process_alive
from onward.store import open_store
from onward.store.base import CANCELLED, DONE, PENDING, RUNNING
from tests.conftest import onward_argv, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")

# A command task: says it started (with its pid), then waits for the file "go" unless its name says "quick".
TASK_SCRIPT = textwrap.dedent('''
    import os, sys, time
    task, side = sys.argv[1], sys.argv[2]
    with open(os.path.join(side, task + ".pid"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(side, task + ".pid"), os.path.join(side, task + ".cmd.start"))  # appears whole
    while not task.startswith("quick") and not os.path.exists(os.path.join(side, "go")):
        time.sleep(0.02)
    print("done " + task)
''')

# A Python worker (the Job API) whose task says it started, then checks for cancellation until "go" exists.
PY_WORKER = textwrap.dedent('''
    import os, sys, time
    from onward import Job
    from onward.attempt import Cancelled
    url, side = sys.argv[1], sys.argv[2]
    job = Job(url, heartbeat=0.3)

    @job.task
    def handle(task, ctx):
        open(os.path.join(side, task + ".py.start"), "w").close()
        try:
            while not os.path.exists(os.path.join(side, "go")):
                ctx.check()
                time.sleep(0.02)
        except Cancelled:
            open(os.path.join(side, task + ".py.cancelled"), "w").close()
            raise
        return "py " + task

    sys.exit(job.run().exit_code)
''')


class Worker:
    """One worker process, its stderr kept in a file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log_path = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(argv, stderr=err, stdout=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONPATH": SRC}, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@contextmanager
def workers(*argvs: list[str], logs: Path) -> Iterator[list[Worker]]:
    started = [Worker(argv, logs / f"worker{i}.log") for i, argv in enumerate(argvs)]
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def command_worker(url: str, side: Path, *extra: str) -> list[str]:
    script = side.parent / "task.py"
    script.write_text(TASK_SCRIPT)
    return onward_argv("run", "--db", url, "--heartbeat", "0.3", *extra, "--", sys.executable, str(script), "{task}",
                       str(side))


def status(url: str, *extra: str) -> dict[str, Any]:
    r = run_onward("status", "--db", url, "--json", *extra)
    assert r.returncode == 0, r.stderr
    report: dict[str, Any] = json.loads(r.stdout)
    return report


def started(side: Path, suffix: str) -> set[str]:
    return {p.name[: -len(suffix)] for p in side.glob(f"*{suffix}")}


def test_pause_stops_claims_on_every_worker_and_resume_finishes_the_job(store_url: str, tmp_path: Path) -> None:
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", store_url, *[f"t{i}" for i in range(8)]).returncode == 0
    marker = tmp_path / "keep-awake"
    awake = ("--keep-awake", str(marker))
    with workers(command_worker(store_url, side, *awake), command_worker(store_url, side, *awake),
                 logs=tmp_path) as (a, b):
        wait_for(lambda: len(started(side, ".cmd.start")) == 2, 30, "each worker to start a task")
        assert marker.exists()
        r = run_onward("pause", "--db", store_url)
        assert r.returncode == 0 and "paused" in r.stderr.decode(), r.stderr
        assert "paused" in run_onward("pause", "--db", store_url).stderr.decode()  # again: already paused
        (side / "go").touch()  # the two running tasks finish: they are committed, nothing new is claimed
        wait_for(lambda: status(store_url)[DONE] == 2, 30, "the two held tasks to be committed")
        wait_for(lambda: "job paused" in a.log and "job paused" in b.log, 30, "both workers to see the pause")
        # Each worker's claim that came with its commit, and every one since, found the job paused.
        report = status(store_url)
        assert report["paused"] is True and report[RUNNING] == 0 and report[PENDING] == 6, report
        assert len(started(side, ".cmd.start")) == 2
        assert a.proc.poll() is None and b.proc.poll() is None, "paused workers stay up"
        # Nothing running and nothing to be claimed: a paused job keeps nobody awake.
        wait_for(lambda: not marker.exists(), 30, "the keep-awake marker to go while paused")
        text = run_onward("status", "--db", store_url).stdout.decode()
        assert "paused" in text
        r = run_onward("resume", "--db", store_url)
        assert r.returncode == 0 and "resumed" in r.stderr.decode(), r.stderr
        assert a.proc.wait(timeout=60) == 0 and b.proc.wait(timeout=60) == 0
    report = status(store_url)
    assert report[DONE] == 8 and report["paused"] is False
    assert len(started(side, ".cmd.start")) == 8
    kinds = [line.split()[2] for line in run_onward("logs", "--db", store_url).stdout.decode().splitlines()]
    assert kinds.count("paused") == 1 and kinds.count("resumed") == 1


def test_cancel_stops_a_running_command_and_a_running_python_task(store_url: str, tmp_path: Path) -> None:
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", store_url, "long-1", "long-2", "never").returncode == 0
    (tmp_path / "pyworker.py").write_text(PY_WORKER)
    py_worker = [sys.executable, str(tmp_path / "pyworker.py"), store_url, str(side)]
    with workers(command_worker(store_url, side), py_worker, logs=tmp_path) as (cmd, py):
        wait_for(lambda: len(started(side, ".cmd.start")) == 1 and len(started(side, ".py.start")) == 1, 30,
                 "a task running in each worker")
        (on_cmd,), (on_py,) = started(side, ".cmd.start"), started(side, ".py.start")
        child = int((side / f"{on_cmd}.cmd.start").read_text())
        r = run_onward("cancel", "--db", store_url, "long-1", "long-2", "never")
        assert r.returncode == 0, r.stderr
        lines = sorted(r.stderr.decode().splitlines())
        assert lines == ["cancelled 'never'",
                         "cancelling 'long-1': its worker stops it at its next heartbeat",
                         "cancelling 'long-2': its worker stops it at its next heartbeat"], lines
        # Cancelled is final, not a failure: both workers find nothing left and exit 0.
        assert cmd.proc.wait(timeout=60) == 0, cmd.log
        assert py.proc.wait(timeout=60) == 0, py.log
    assert not process_alive(child, None), "the cancelled command's process must be killed"
    assert (side / f"{on_py}.py.cancelled").exists(), "ctx.check() must raise in the cancelled Python task"
    assert not (side / "never.cmd.start").exists() and not (side / "never.py.start").exists()
    store = open_store(store_url, create=False)
    try:
        rows = {t.name: t for t in store.iter_tasks()}
        assert {n: (t.state, t.attempts) for n, t in rows.items()} == {
            "long-1": (CANCELLED, 1), "long-2": (CANCELLED, 1), "never": (CANCELLED, 0)}
        counts = store.counts()
        assert counts[CANCELLED] == 3 and counts["failed"] == 0
        kinds = [e.kind for e in store.events()]
        assert kinds.count("cancel requested") == 2 and kinds.count("cancelled") == 3
        assert "retrying" not in kinds and "failed" not in kinds
        assert store.totals().failed_attempts == 0
    finally:
        store.close()
    # retry brings a cancelled task back; it then runs and completes.
    (side / "go").touch()
    assert run_onward("retry", "--db", store_url, "long-1").returncode == 0
    with workers(command_worker(store_url, side), logs=tmp_path) as (again,):
        assert again.proc.wait(timeout=60) == 0, again.log
    assert run_onward("result", "--db", store_url, "long-1").stdout == b"done long-1\n"


def test_named_jobs_in_one_store_are_isolated(store_url: str, tmp_path: Path) -> None:
    side = tmp_path / "side"
    side.mkdir()
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("quick-1\nquick-2\nquick-3\n")
    script = tmp_path / "task.py"
    script.write_text(TASK_SCRIPT)
    for job, word in (("alpha", "A"), ("beta", "B")):
        r = run_onward("run", "--db", store_url, "--job", job, "--tasks", str(tasks), "--", sys.executable, "-c",
                       f"import os, sys; print('{word}-' + sys.argv[1] + '@' + os.environ['ONWARD_JOB'])", "{task}")
        assert r.returncode == 0, r.stderr
    r = run_onward("add", "--db", store_url, "--job", "beta", "only-beta")
    assert r.returncode == 0
    assert run_onward("result", "--db", store_url, "--job", "alpha", "quick-1").stdout == b"A-quick-1@alpha\n"
    assert run_onward("result", "--db", store_url, "--job", "beta", "quick-1").stdout == b"B-quick-1@beta\n"
    env_result = run_onward("result", "--db", store_url, "quick-2", env={"ONWARD_JOB": "beta"})
    assert env_result.stdout == b"B-quick-2@beta\n"
    r = run_onward("result", "--db", store_url, "--job", "alpha", "only-beta")
    assert r.returncode == 1 and r.stderr.decode().count("\n") == 1
    assert run_onward("pause", "--db", store_url, "--job", "beta").returncode == 0
    alpha, beta = status(store_url, "--job", "alpha"), status(store_url, "--job", "beta")
    assert (alpha["job"], alpha[DONE], alpha[PENDING], alpha["paused"]) == ("alpha", 3, 0, False)
    assert (beta["job"], beta[DONE], beta[PENDING], beta["paused"]) == ("beta", 3, 1, True)
    listed = run_onward("list", "--db", store_url, "--job", "beta").stdout.decode().splitlines()
    assert listed == ["quick-1", "quick-2", "quick-3", "only-beta"]
    r = run_onward("jobs", "--db", store_url, "--json")
    assert r.returncode == 0, r.stderr
    jobs = {j["job"]: j for j in map(json.loads, r.stdout.decode().splitlines())}
    assert set(jobs) == {"alpha", "beta"}  # no job "default": nothing made it
    assert (jobs["alpha"]["done"], jobs["alpha"]["paused"]) == (3, False)
    assert (jobs["beta"]["done"], jobs["beta"]["pending"], jobs["beta"]["paused"]) == (3, 1, True)
    table = run_onward("jobs", "--db", store_url).stdout.decode().splitlines()
    assert table[0].split() == ["job", "paused", "total", "pending", "running", "waiting", "done", "failed", "cancelled"]
    assert [line.split()[:3] for line in table[1:]] == [["alpha", "no", "3"], ["beta", "yes", "4"]]
    # A paused job's worker claims nothing: it waits (here, stopped by SIGTERM once it said so).
    with workers(command_worker(store_url, side, "--job", "beta"), logs=tmp_path) as (w,):
        wait_for(lambda: "job paused" in w.log, 30, "the worker to see its job paused")
        os.killpg(w.proc.pid, signal.SIGTERM)
        assert w.proc.wait(timeout=30) == 0
    assert not started(side, ".cmd.start")
    logs_alpha = run_onward("logs", "--db", store_url, "--job", "alpha").stdout.decode()
    assert "only-beta" not in logs_alpha and "paused" not in logs_alpha


@pytest.mark.parametrize("name", ["", "../x", "x" * 200, "%", "a/b", "<script>"])
def test_bad_job_names_are_refused_as_bad_input(tmp_path: Path, name: str) -> None:
    db = tmp_path / "store.db"
    for args in (("add", "--db", str(db), "--job", name, "a"), ("status", "--db", str(db), "--job", name),
                 ("pause", "--db", str(db), "--job", name)):
        r = run_onward(*args)
        assert r.returncode == 2, (args, r.stderr)
        err = r.stderr.decode()
        assert err.startswith("onward: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    r = run_onward("add", "--db", str(db), "a", env={"ONWARD_JOB": name} if name else {"ONWARD_JOB": "../y"})
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1, r.stderr
    assert not db.exists(), "bad input must create nothing"


def test_a_job_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "store.db"
    r = run_onward("add", "--db", str(db), "--job", os.fsdecode(b"bad\xff"), "a")
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1 and "Traceback" not in r.stderr.decode()
    assert not db.exists()


def test_cancel_of_finished_unknown_and_no_tasks(tmp_path: Path) -> None:
    db = str(tmp_path / "store.db")
    assert run_onward("run", "--db", db, "--tasks", "-", "--", "true", input=b"done-1\n").returncode == 0
    assert run_onward("add", "--db", db, "waiting").returncode == 0
    r = run_onward("cancel", "--db", db, "done-1")
    assert r.returncode == 0 and r.stderr == b"task 'done-1' is already done: left as it is\n"
    r = run_onward("cancel", "--db", db, "waiting", "nosuch", "nosuch2")
    assert r.returncode == 1
    assert r.stderr.decode() == (f"onward: error: no task 'nosuch' in {db} (and 1 more unknown);"
                                 " nothing was cancelled\n")
    r = run_onward("cancel", "--db", db)
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1
    r = run_onward("cancel", "--db", db, os.fsdecode(b"bad\xff"))
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1
    listed = run_onward("list", "--db", db, "--long").stdout.decode().splitlines()
    assert [line.split("\t")[0] for line in listed] == [DONE, PENDING]
    r = run_onward("cancel", "--db", db, "waiting")
    assert r.returncode == 0 and r.stderr == b"cancelled 'waiting'\n"
    # A job whose only unfinished task was cancelled is finished: exit 0 (cancelled is not a failure).
    assert run_onward("run", "--db", db, "--", "true").returncode == 0


def test_supervise_passes_its_job_on_to_the_worker(tmp_path: Path) -> None:
    db = str(tmp_path / "store.db")
    r = run_onward("supervise", "--job", "nightly", "--", *onward_argv("run", "--db", db, "--tasks", "-", "--",
                                                                        "true"), input=b"a\nb\n")
    assert r.returncode == 0, r.stderr
    jobs = {j["job"]: j for j in map(json.loads, run_onward("jobs", "--db", db, "--json").stdout.splitlines())}
    assert jobs["nightly"]["done"] == 2 and "default" not in jobs
    r = run_onward("supervise", "--job", "../x", "--", "true")
    assert r.returncode == 2 and r.stderr.decode().count("\n") == 1


def test_supervise_records_restarts_in_its_job(tmp_path: Path) -> None:
    db = str(tmp_path / "store.db")
    assert run_onward("add", "--db", db, "--job", "nightly", "x").returncode == 0
    seen = tmp_path / "seen"
    crash = ("import os, sys; open(sys.argv[1], 'a').write(os.environ['ONWARD_JOB'] + chr(10)); sys.exit(1)")
    r = run_onward("supervise", "--db", db, "--job", "nightly", "--max-restarts", "1", "--restart-delay", "0", "--",
                   sys.executable, "-c", crash, str(seen))
    assert r.returncode == 1, r.stderr
    assert seen.read_text().splitlines() == ["nightly", "nightly"]
    assert status(db, "--job", "nightly")["restarts"] == 1
    # None in the job "default": supervise did not even make that job to journal one there.
    r = run_onward("status", "--db", db, "--json")
    assert r.returncode == 2 and b"no job 'default'" in r.stderr, r.stderr


def test_a_cancel_pending_when_the_worker_dies_ends_the_tasks_cancelled_and_says_so_plainly(tmp_path: Path) -> None:
    """Two running tasks are cancelled, and their worker is killed before its heartbeat acts on it: the reclaim
    ends both cancelled, as the README says, but its line said "attempt not counted (one more given), now
    cancelled, to run alone", which it was not."""
    db = str(tmp_path / "s.db")
    side = tmp_path / "side"
    side.mkdir()
    assert run_onward("add", "--db", db, "c1", "c2").returncode == 0
    with workers(onward_argv("run", "--db", db, "--heartbeat", "30", "--concurrency", "2", "--", "sleep", "60"),
                 logs=tmp_path) as (worker,):
        wait_for(lambda: status(db)["running"] == 2, 30, "both tasks running")
        assert run_onward("cancel", "--db", db, "c1", "c2").returncode == 0
        worker.stop()  # SIGKILL, long before its next heartbeat
    taker = run_onward("run", "--db", db, "--", "true")
    assert taker.returncode == 0, taker.stderr
    said = [line for line in taker.stderr.decode().splitlines() if "interrupted task=" in line]
    assert len(said) == 2 and all(line.endswith("a cancel was pending: now cancelled") for line in said), said
    assert {k: v for k, v in status(db).items() if k in ("cancelled", "pending", "running")} == {
        "cancelled": 2, "pending": 0, "running": 0}


def test_a_paused_job_shows_no_eta(tmp_path: Path) -> None:
    """A paused job with a worker alive and a rate over the last minute showed an ETA that never came and only
    grew (in status, --json, --watch and the dashboard): a paused job claims nothing until someone resumes it."""
    db = str(tmp_path / "s.db")
    (tmp_path / "t.txt").write_text("".join(f"t{i}\n" for i in range(400)))
    assert run_onward("add", "--db", db, "--tasks", str(tmp_path / "t.txt")).returncode == 0
    worker = subprocess.Popen(onward_argv("run", "--db", db, "--heartbeat", "0.5", "--concurrency", "2", "-q", "--",
                                          "sleep", "0.05"), env=dict(os.environ, PYTHONPATH=SRC),
                              stderr=subprocess.DEVNULL)
    try:
        def report() -> dict[str, Any]:
            done = run_onward("status", "--db", db, "--json")
            assert done.returncode == 0, done.stderr
            return dict(json.loads(done.stdout))

        wait_for(lambda: report()["done"] >= 10, 60, "ten tasks done")
        running = report()
        assert running["eta_seconds"] is not None and running["eta_seconds"] > 0, running
        assert run_onward("pause", "--db", db).returncode == 0
        wait_for(lambda: report()["running"] == 0, 30, "the running tasks to end")
        paused = report()
        assert paused["paused"] and paused["workers_alive"] == 1 and paused["rate_per_second"] > 0, paused
        assert paused["pending"] > 0 and paused["eta_seconds"] is None, paused
        text = run_onward("status", "--db", db).stdout.decode()
        assert "eta -" in text and "paused" in text, text
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
