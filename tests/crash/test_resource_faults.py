"""Faults of the worker's own resources: a store that cannot commit (a full disk), and running out of file
descriptors. Neither may burn a task's attempts, spin the CPU, flood the log or keep a stopping worker
alive."""

from __future__ import annotations

import os
import random
import resource
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import pgutil
from tests.conftest import onward_argv, require_tool, run_onward, wait_for
from tests.crash.test_disk_faults import small_disk  # noqa: F401  (a fixture: a 1 MiB tmpfs)
from tests.reliability import record

SRC = str(Path(__file__).resolve().parents[2] / "src")
TICKS = os.sysconf("SC_CLK_TCK")
STOP_BOUND = 10.0  # seconds past --grace a worker may take to leave when its store keeps failing


def cpu_seconds(pid: int) -> float:
    """CPU time of a process and of the children it reaped, from /proc/PID/stat (utime, stime, cutime,
    cstime): what os.wait4's rusage reports at its end, so the two can be subtracted."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    fields = stat[stat.rindex(b")") + 2:].split()  # fields[0] is field 3 of proc(5)
    return sum(int(f) for f in fields[11:15]) / TICKS


def wait_exit(pid: int, timeout: float) -> tuple[int, float, float]:
    """Reap ``pid`` within ``timeout`` s: (exit status, seconds waited, its total CPU time)."""
    started = time.monotonic()
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), time.monotonic() - started, usage.ru_utime + usage.ru_stime
        if time.monotonic() - started > timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"worker {pid} still running {timeout} s after SIGTERM")
        time.sleep(0.05)


def assert_no_spin(worker: subprocess.Popen[bytes], log: Path, what: str, window: float = 4.0) -> None:
    """Over ``window`` seconds the worker, whose store keeps failing, stays alive, uses well under a core
    and writes few log lines: a spin or a flood cannot meet either bound."""
    cpu_before, lines_before, started = cpu_seconds(worker.pid), _lines(log), time.monotonic()
    time.sleep(window)  # a measuring window, not a wait for a condition
    cpu_used = cpu_seconds(worker.pid) - cpu_before
    wall = time.monotonic() - started
    lines = _lines(log) - lines_before
    assert worker.poll() is None, f"{what} must not end the worker"
    assert cpu_used < 0.3 * wall, f"{cpu_used:.2f} s of CPU in {wall:.1f} s: the worker spins"
    assert lines < 40, f"{lines} log lines in {wall:.1f} s:\n{_tail(log)}"


def stop_and_assert_bounded(worker: subprocess.Popen[bytes], log: Path, grace: float) -> None:
    """SIGTERM: the worker leaves within ``grace`` plus STOP_BOUND though nothing can be committed, with
    exit 0 (a requested stop), without spinning, flooding the log or a traceback."""
    cpu_before, lines_before = cpu_seconds(worker.pid), _lines(log)
    worker.send_signal(signal.SIGTERM)
    status, waited, cpu_total = wait_exit(worker.pid, grace + 60)
    assert waited < grace + STOP_BOUND, f"left {waited:.1f} s after SIGTERM:\n{_tail(log)}"
    assert cpu_total - cpu_before < 0.3 * waited + 0.5, \
        f"{cpu_total - cpu_before:.2f} s of CPU in {waited:.1f} s after SIGTERM: it spins\n{_tail(log)}"
    assert _lines(log) - lines_before < 200, f"log lines after SIGTERM:\n{_tail(log)}"
    assert status == 0, _tail(log)
    assert "Traceback" not in log.read_text()


def test_a_store_that_cannot_commit_neither_spins_nor_floods_the_log_and_sigterm_still_ends_the_worker(
        small_disk: Path, tmp_path: Path, seed: int) -> None:  # noqa: F811
    """The store is on a full 1 MiB tmpfs: outcomes cannot be committed. Before SIGTERM (tasks past their
    --timeout waiting to be committed) and after it (past --grace), the worker retries with a backoff, logs
    a few lines, and leaves within --grace plus a bound; what it could not commit stays claimed, and the
    next worker reclaims it and finishes the job."""
    rng = random.Random(seed)
    concurrency = rng.randint(1, 3)
    grace = 1.0
    db = small_disk / "s.db"
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i:03d}" for i in range(60)]
    tasks.write_text("".join(n + "\n" for n in names))
    log = tmp_path / "worker.log"
    # Each result is 40 KB: 60 of them cannot fit on a 1 MB disk. Renewals fail every 0.5 s too, but the
    # long lease keeps the tasks' claims valid throughout: their outcomes are what waits for the store.
    run = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--heartbeat", "0.5", "--lease", "60",
                      "--grace", str(grace),
                      "--timeout", "2", "--concurrency", str(concurrency), "--", "sh", "-c",
                      'head -c 40000 /dev/zero | tr "\\0" x')
    with open(log, "wb") as err:
        worker = subprocess.Popen(run, env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: b"disk is full" in log.read_bytes(), 60, "the store to report a full disk")
        # Running, with outcomes that cannot be committed and deadlines that pass meanwhile.
        assert_no_spin(worker, log, "a full disk")
        stop_and_assert_bounded(worker, log, grace)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "stay claimed" in log.read_text(), _tail(log)

    # Room again: the next worker reclaims what the stopped one could not commit, and finishes the job.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = subprocess.run(run, env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=120)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert dict(c.execute("SELECT name, state FROM tasks")) == {n: "done" for n in names}
    c.close()



@pytest.mark.postgres
def test_a_stopped_database_server_neither_spins_nor_floods_the_log_and_sigterm_still_ends_the_worker(
        tmp_path: Path, seed: int) -> None:
    """The same on PostgreSQL: the server stops mid-job (a private cluster of this test), every store call
    fails; the worker backs off, logs a few lines, leaves within --grace plus a bound after SIGTERM, and the
    next worker finishes the job once the server is back."""
    rng = random.Random(seed)
    grace = 1.0
    names = [f"t{i:03d}" for i in range(40)]
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(n + "\n" for n in names))
    log = tmp_path / "worker.log"
    with pgutil.private_cluster() as cluster:
        url = cluster.url(cluster.create_database("job"))
        run = onward_argv("run", "--db", url, "--tasks", str(tasks), "--heartbeat", "0.5", "--lease", "60",
                          "--grace", str(grace), "--timeout", "2", "--concurrency", str(rng.randint(1, 3)), "--",
                          "sh", "-c", "sleep 0.2; echo ok")
        with open(log, "wb") as err:
            worker = subprocess.Popen(run, env=dict(os.environ, PYTHONPATH=SRC), stdout=subprocess.DEVNULL,
                                      stderr=err)
        try:
            wait_for(lambda: log.read_text().count(" done task=") >= 3, 60, "a few tasks done")
            cluster.ctl("stop")
            wait_for(lambda: "store error" in log.read_text() or "could not renew" in log.read_text(), 30,
                     "the worker to notice the server is gone")
            assert_no_spin(worker, log, "a stopped server")
            stop_and_assert_bounded(worker, log, grace)
        finally:
            if worker.poll() is None:
                worker.kill()
        cluster.ctl("start")
        again = subprocess.run(run, env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=120)
        with cluster.admin("job") as conn:
            states = dict(conn.execute("SELECT name, state FROM onward.tasks").fetchall())
            doubled = conn.execute("SELECT count(*) FROM (SELECT task_id FROM onward.events WHERE kind = 'done'"
                                   " GROUP BY task_id HAVING count(*) > 1) AS d").fetchone()[0]
        record("fault matrix", backend="postgres", case="server stopped (pg_ctlcluster stop) mid-job, SIGTERM, restart",
               seed=seed, tasks=len(names), exit_status_on_sigterm=worker.returncode,
               exit_status_after_restart=again.returncode, lost=sum(states.get(n) != "done" for n in names),
               doubled=doubled, recovered=again.returncode == 0)
        assert again.returncode == 0, again.stderr.decode()[-3000:]
        assert states == {n: "done" for n in names}
        assert doubled == 0


def _lines(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def _tail(path: Path) -> str:
    return "\n".join(path.read_text().splitlines()[-30:])


def test_running_out_of_file_descriptors_gives_attempts_back_instead_of_failing_tasks(store_url: str,
                                                                                       tmp_path: Path,
                                                                                       seed: int) -> None:
    """`--concurrency 100` under `ulimit -n 128`: the worker cannot open pipes for all its commands. That is
    not the tasks' fault: each attempt that could not start is given back uncounted (journaled `released`),
    the worker lowers its concurrency with one warning, and every task ends done."""
    rng = random.Random(seed)
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i:03d}" for i in range(200)]
    tasks.write_text("".join(n + "\n" for n in names))
    pause = rng.choice(["0.2", "0.3", "0.5"])
    run = onward_argv("run", "--db", store_url, "--tasks", str(tasks), "--concurrency", "100", "-q", "--",
                      "sh", "-c", f"sleep {pause}; echo ok")

    def limit_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    r = subprocess.run(run, env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=300,
                       preexec_fn=limit_descriptors)
    err = r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1, err[-3000:]  # -q: warnings only, and there is exactly one
    assert "Too many open files" in lines[0] and "concurrency" in lines[0], lines[0]
    listed = run_onward("list", "--db", store_url, "--long")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split("\t") for line in listed.stdout.decode().splitlines()]  # state, attempts, ..., text
    assert {row[-1]: (row[0], row[1]) for row in rows} == {n: ("done", "1") for n in names}  # none counted twice
    journal = run_onward("logs", "--db", store_url, "-n", "100000").stdout.decode()
    assert "worker out of resources: Too many open files" in journal, "the limit was never reached"


@pytest.mark.parametrize(("fault", "spawn"), [
    ("clone:error=EAGAIN", "fork"),  # the worker forks each command itself (ONWARD_SPAWN=fork)
    ("clone3:error=EAGAIN", "clone"),  # the worker's loop thread clones each command (the default)
    ("clone3:error=EAGAIN", "spawner"),  # the spawner process makes each command with clone3
    ("pidfd_open:error=EMFILE", "spawner"),
])
def test_a_start_that_runs_out_of_resources_leaves_no_stray_command_and_burns_no_attempt(tmp_path: Path,
                                                                                          fault: str,
                                                                                          spawn: str) -> None:
    """The process of a command cannot be made (EAGAIN, in the worker when it forks, in the spawner when
    it starts commands), or the descriptor that watches a command is refused after it was spawned: the
    attempt is given back uncounted, and a command already spawned is killed at once, so no task runs
    twice at the same time."""
    strace = require_tool("strace")
    db = tmp_path / "s.db"
    side_effects = tmp_path / "ran.log"
    tasks = tmp_path / "tasks.txt"
    names = [f"t{i}" for i in range(6)]
    tasks.write_text("".join(n + "\n" for n in names))
    run = onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--max-attempts", "1", "-q", "--", "sh", "-c",
                      f'sleep 0.5; echo "$1" >> {side_effects}', "x", "{task}")
    # Without -f only the worker's main thread is traced: the loop that starts commands. The spawner is
    # another process: -f follows it (clone3 is the spawner's alone; the worker's threads use clone).
    follow = ["-f"] if fault.startswith("clone3") and spawn == "spawner" else []
    r = subprocess.run([strace, *follow, "-qq", "-o", "/dev/null", "-e", f"inject={fault}:when=2", *run],
                       env=dict(os.environ, PYTHONPATH=SRC, ONWARD_SPAWN=spawn), capture_output=True,
                       timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    assert err.count("\n") == 1 and "out of resources" in err, err
    c = sqlite3.connect(db)
    assert dict(c.execute("SELECT name, state FROM tasks")) == {n: "done" for n in names}
    c.close()
    time.sleep(1.0)  # a stray command of the failed start would finish its sleep by now
    assert sorted(side_effects.read_text().split()) == names  # each task ran once


PYTHON_WORKER = """
import sys, time
from onward import Job

job = Job(sys.argv[1])

@job.task(max_attempts=1)
def work(task, ctx):
    time.sleep(0.3)
    with open(sys.argv[2], "a") as f:
        f.write(task + "\\n")
    return "ok"

job.add([f"t{i}" for i in range(6)])
sys.exit(job.run(concurrency=3).exit_code)
"""


def run_with_a_thread_start_failing(worker: str, when: int, db: Path, side_effects: Path) -> str:
    """Run the Python ``worker`` script (arguments: the store, a file for its tasks' side effects) with its
    main thread's ``when``-th clone3 failing with EAGAIN (strace injects it: pthread_create of a task
    thread fails). It must exit 0; its stderr."""
    strace = require_tool("strace")
    script = db.parent / "worker.py"
    script.write_text(worker)
    r = subprocess.run([strace, "-qq", "-o", "/dev/null", "-e", f"inject=clone3:error=EAGAIN:when={when}",
                        sys.executable, str(script), str(db), str(side_effects)],
                       env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 0, err[-3000:]
    return err


def test_a_python_worker_that_cannot_start_a_thread_gives_the_attempt_back(tmp_path: Path) -> None:
    """pthread_create failing with EAGAIN (strace injects it into clone3 of the worker's main thread, which
    starts the task threads): the attempt is given back uncounted, not failed, and the worker goes on with
    fewer tasks at once."""
    db, side_effects = tmp_path / "s.db", tmp_path / "ran.log"
    err = run_with_a_thread_start_failing(PYTHON_WORKER, 2, db, side_effects)
    assert err.count("lowering concurrency") == 1 and "Traceback" not in err, err
    c = sqlite3.connect(db)
    assert dict(c.execute("SELECT name, state FROM tasks")) == {f"t{i}": "done" for i in range(6)}
    assert c.execute("SELECT max(attempts) FROM tasks").fetchone() == (1,)
    c.close()
    assert sorted(side_effects.read_text().split()) == [f"t{i}" for i in range(6)]


RAISING_WORKER = """
import sys, time
import onward.runner
from onward import Job

onward.runner.CONCURRENCY_RAISE_AFTER = 1.0  # (10 s in a worker of a user's)
job = Job(sys.argv[1], heartbeat=0.25)

@job.task(max_attempts=1)
def work(task, ctx):
    with open(sys.argv[2], "a") as f:
        f.write(f"start {time.monotonic()}\\n")
    time.sleep(0.2)
    with open(sys.argv[2], "a") as f:
        f.write(f"end {time.monotonic()}\\n")
    return "ok"

job.add([f"t{i}" for i in range(40)])
sys.exit(job.run(concurrency=4).exit_code)
"""


def most_at_once(side_effects: Path) -> int:
    running = most = 0
    events = sorted((float(at), kind) for kind, at in (line.split() for line in side_effects.read_text().splitlines()))
    for _, kind in events:  # ("end" sorts before "start" at the same moment: not counted as overlapping)
        running += 1 if kind == "start" else -1
        most = max(most, running)
    return most


def test_a_worker_that_lowered_its_concurrency_raises_it_again_once_the_shortage_is_over(tmp_path: Path) -> None:
    """A thread that could not be started once (EAGAIN injected into one clone3) lowers the concurrency; it
    stayed lowered for the rest of the worker's life. Once no start has failed for a while, it comes back."""
    db, side_effects = tmp_path / "s.db", tmp_path / "ran.log"
    err = run_with_a_thread_start_failing(RAISING_WORKER, 3, db, side_effects)
    assert "Traceback" not in err, err[-3000:]
    assert err.count("lowering concurrency") == 1, err
    assert "raising concurrency" in err and "to 4:" in err, err
    # Four at once again after the raise: the tasks' own record, not the worker's word.
    raised_at = err.index("to 4:")
    assert raised_at > err.index("lowering concurrency")
    assert most_at_once(side_effects) == 4
    c = sqlite3.connect(db)
    assert dict(c.execute("SELECT name, state || ' ' || attempts FROM tasks")) == {
        f"t{i}": "done 1" for i in range(40)}
    c.close()


def worker_log_under_sixteen_descriptors(tmp_path: Path, python: list[str], flags: list[str],
                                         done: Callable[[str], bool], what: str) -> str:
    """Run ``python`` (the interpreter's arguments that start onward) ``run`` with ``flags`` on two tasks under
    `ulimit -n 16`, where not even one command can start, until ``done(its log)``; stop it with SIGTERM; its
    log."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    log = tmp_path / "worker.log"

    def limit_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))

    with log.open("wb") as out:
        worker = subprocess.Popen([sys.executable, *python, "run", "--db", str(tmp_path / "s.db"),
                                   "--tasks", str(tasks), *flags, "--", "true"],
                                  env=dict(os.environ, PYTHONPATH=SRC), stdout=out, stderr=out,
                                  preexec_fn=limit_descriptors)
    try:
        wait_for(lambda: done(log.read_text()), 30, what)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=30)
    return log.read_text()


def test_a_limit_that_lets_no_task_start_is_warned_of_again_while_it_lasts(tmp_path: Path) -> None:
    """Under `ulimit -n 16` not even one command can start: the worker gives each attempt back and tries
    again every second, for as long as it runs. It said so once, and then looked idle for good (an hour,
    in one user's run); the warning now comes again while the shortfall lasts (every minute; here every
    2.2 s, set from the launcher), counting the tries in between."""
    launcher = ("import sys; import onward.runner as r; r.RESOURCE_WARN_EVERY = 2.2; "
                "from onward.entry import main; sys.argv[0] = 'onward'; main()")
    said = worker_log_under_sixteen_descriptors(
        tmp_path, ["-c", launcher], ["-q"], lambda log: log.count("out of resources starting") >= 2,
        "the warning to come again")
    warnings = [line for line in said.splitlines() if "out of resources starting" in line]
    assert all("Too many open files" in line for line in warnings), warnings
    assert "more since the last warning" in warnings[1], warnings  # a try a second: one or two between


def test_the_tries_between_two_warnings_are_not_logged_at_the_default_level(tmp_path: Path) -> None:
    """Between two warnings the tries were logged at the default level too: one more "out of resources"
    line about every 1.3 s for as long as the shortage lasted, where the README promises one warning,
    again once a minute. They are for -v now; the attempts given back are still logged, one line each."""
    said = worker_log_under_sixteen_descriptors(
        tmp_path, ["-m", "onward"], [], lambda log: log.count("released task=") >= 3, "three tries given back")
    assert said.count("out of resources starting") == 1, said


@pytest.mark.parametrize("spawn", ["clone", "spawner"])
def test_an_exec_that_fails_for_want_of_memory_is_paused_on_not_retried_at_once(tmp_path: Path, spawn: str) -> None:
    """Every ``execve`` of the command fails with ENOMEM (strace injects it; ``-P`` keeps it to that program).
    On these paths the error is known only once the process has exited: the attempt was given back, but
    without the pause and the warning of a start that could not make its process, so the task was claimed
    and failed again at once, about 200 times a second, a commit and a journal row each (601 in 3 s here).
    It now gets the same answer: one warning, and a try a second."""
    strace = require_tool("strace")
    program = tmp_path / "prog"
    program.write_text("#!/bin/sh\nexit 0\n")
    program.chmod(0o755)
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    db = tmp_path / "s.db"
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [strace, "-f", "-qq", "-o", "/dev/null", "-P", str(program), "-e", "trace=execve", "-e",
             "inject=execve:error=ENOMEM", *onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--",
                                                        str(program))],
            env=dict(os.environ, PYTHONPATH=SRC, ONWARD_SPAWN=spawn), stdout=out, stderr=out)
    try:
        wait_for(lambda: "out of resources starting" in log.read_text(), 30, "the shortfall to be warned of")
        before = log.read_text().count("released task=")
        time.sleep(3.0)  # a measuring window, not a wait for a condition
        during = log.read_text().count("released task=") - before
    finally:
        # The worker itself (strace's child) is stopped: strace, sent SIGTERM, can hang detaching a tracee.
        children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text().split()
        os.kill(int(children[0]) if children else worker.pid, signal.SIGTERM)
        worker.wait(timeout=30)
    text = log.read_text()
    assert during <= 6, f"{during} attempts given back in 3 s: the task is retried without a pause\n{text[-3000:]}"
    assert "Cannot allocate memory" in text and "Traceback" not in text, text[-3000:]
    c = sqlite3.connect(db)
    assert {state for (state,) in c.execute("SELECT state FROM tasks")} == {"pending"}  # none failed
    c.close()
