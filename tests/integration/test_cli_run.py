"""`onward run` and friends, as a user runs them: real processes, a real store, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    cgroup_v1,
    keeper_of,
    keepers_of,
    onward_argv,
    process_state,
    require_tool,
    run_onward,
    wait_for,
)
from tests.crash.test_disk_faults import small_disk  # noqa: F401  (a fixture: a 1 MiB tmpfs)

SRC = str(Path(__file__).resolve().parents[2] / "src")


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ, PYTHONPATH=SRC)
    e.update(extra)
    return e


def popen_onward(*args: str, cwd: Path | None = None, **extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(onward_argv(*args), env=env(**extra), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def write_tasks(path: Path, tasks: list[str]) -> Path:
    path.write_text("".join(t + "\n" for t in tasks))
    return path


def status(db: str) -> dict[str, Any]:
    r = run_onward("status", "--db", db, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_run_substitutes_without_a_shell_and_records_results(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    hostile = "a; touch pwned #"
    tasks = write_tasks(tmp_path / "tasks.txt", ["one", "two", hostile, "$(touch pwned2)"])
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--out", str(tmp_path / "out"), "--",
                   sys.executable, "-c",
                   "import os,sys; print(sys.argv[1], os.environ['ONWARD_TASK'], os.environ['ONWARD_ATTEMPT'],"
                   " bool(os.environ['ONWARD_DB']), os.getpgrp() == os.getpid(), end='')",
                   "{task}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    out = run_onward("result", "--db", db, hostile)
    assert out.stdout == f"{hostile} {hostile} 1 True True".encode()
    assert (tmp_path / "out" / "one.txt").read_bytes() == b"one one 1 True True"
    assert run_onward("list", "--db", db).stdout.decode().splitlines() == ["one", "two", hostile, "$(touch pwned2)"]
    st = status(db)
    assert (st["total"], st["done"], st["pending"], st["failed"], st["running"]) == (4, 4, 0, 0, 0)
    assert {"workers", "tasks_running", "restarts"} <= st.keys()
    logs = run_onward("logs", "--db", db).stdout.decode().splitlines()
    assert sum(" done " in line for line in logs) == 4
    assert all("pid=" in line for line in logs)


def test_each_command_gets_its_own_attempt_variables_over_the_workers(tmp_path: Path) -> None:
    """The worker's own environment may hold the variables an attempt sets (an `onward run` started from a
    task of another): every command sees its attempt's values, each name once, and the rest of the
    environment as the worker has it, however many commands were started before it."""
    db = str(tmp_path / "s.db")
    names = [f"t{i}" for i in range(5)]
    tasks = write_tasks(tmp_path / "tasks.txt", names)
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--out", str(tmp_path / "out"), "--",
                   sys.executable, "-c",
                   "import os,sys; e=os.environb; names=[l.split(b'=',1)[0] for l in open('/proc/self/environ','rb')"
                   ".read().split(b'\\0') if l]; print(sys.argv[1], e[b'ONWARD_TASK'].decode(), e[b'ONWARD_ATTEMPT']"
                   ".decode(), e[b'KEPT'].decode(), names.count(b'ONWARD_TASK'), names.count(b'ONWARD_ATTEMPT'),"
                   " names.count(b'ONWARD_HEARTBEAT_FILE'), end='')",
                   "{task}", cwd=tmp_path,
                   env={"ONWARD_TASK": "stale", "ONWARD_ATTEMPT": "99", "ONWARD_HEARTBEAT_FILE": "/nowhere",
                        "KEPT": "a=b c"})
    assert r.returncode == 0, r.stderr
    for name in names:
        assert (tmp_path / "out" / f"{name}.txt").read_text() == f"{name} {name} 1 a=b c 1 1 1"


def test_failed_task_never_blocks_others_and_exit_3(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    tasks = write_tasks(tmp_path / "tasks.txt", ["ok1", "bad", "ok2"])
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--retry-delay", "0.01", "--max-attempts", "2", "--",
                   "sh", "-c", 'if [ "$1" = bad ]; then echo "bad things happened" >&2; exit 7; fi; echo done',
                   "x", "{task}")
    assert r.returncode == 3, r.stderr
    st = status(db)
    assert (st["done"], st["failed"]) == (2, 1)
    assert "exit status 7" in st["errors"][0]["error"] and "bad things" in st["errors"][0]["error"]
    long = run_onward("list", "--db", db, "--state", "failed", "--long").stdout.decode()
    assert long.startswith("failed\t2\t") and long.rstrip().endswith("\tbad")
    nope = run_onward("result", "--db", db, "bad")
    assert nope.returncode == 1 and b"failed" in nope.stderr
    assert run_onward("retry", "--db", db, "--failed").returncode == 0
    assert status(db)["pending"] == 1
    r = run_onward("run", "--db", db, "--", "sh", "-c", "echo fixed")
    assert r.returncode == 0
    assert run_onward("result", "--db", db, "bad").stdout == b"fixed\n"


@pytest.mark.parametrize("concurrency", ["1", "3"])
def test_a_retry_starts_when_its_backoff_runs_out_not_at_the_idle_poll_after(tmp_path: Path,
                                                                           concurrency: str) -> None:
    """An idle worker's polls double from 10 ms to 1 s: a retry due 1.3 s after its failure ran at the poll
    after, 2.27 s (the polls' sum), nearly a second late. The worker now wakes when it is due. The bound
    leaves 0.6 s for a loaded machine; the old way's lateness was 0.97 s."""
    db = str(tmp_path / "s.db")
    tasks = write_tasks(tmp_path / "tasks.txt", ["flaky"])
    first, second = tmp_path / "first", tmp_path / "second"
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--retry-delay", "1.3", "--max-attempts", "2",
                   "--concurrency", concurrency, "--",
                   "sh", "-c", f'if [ -e {first} ]; then date +%s.%N > {second}; else date +%s.%N > {first}; exit 1; fi')
    assert r.returncode == 0, r.stderr
    late = float(second.read_text()) - float(first.read_text()) - 1.3
    assert -0.05 < late < 0.6, late


def test_add_is_idempotent_and_run_imports_only_new_lines(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    assert run_onward("add", "--db", db, "b", "c").stderr.decode().strip() == "added 1 new task"
    tasks = write_tasks(tmp_path / "t.txt", ["c", "d"])
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--", "true")
    assert r.returncode == 0
    assert status(db)["done"] == 4
    with tasks.open("a") as f:
        f.write("e\n")
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--", "true")
    assert status(db)["total"] == 5 and status(db)["done"] == 5


def test_result_bytes_are_exact_and_big_output_fails(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "bin", "big")
    r = run_onward("run", "--db", db, "--max-result-bytes", "1000", "--max-attempts", "1", "--", sys.executable, "-c",
                   "import sys; t=sys.argv[1]; sys.stdout.buffer.write(bytes(range(256)) if t=='bin' else b'x'*5000)",
                   "{task}")
    assert r.returncode == 3
    assert run_onward("result", "--db", db, "bin").stdout == bytes(range(256))
    st = status(db)
    assert "exceeds the limit of 1000 bytes" in st["errors"][0]["error"]


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "hang")
    pidfile = tmp_path / "grandchild.pid"
    r = run_onward("run", "--db", db, "--timeout", "0.5", "--max-attempts", "1", "--", "sh", "-c",
                   f"sleep 60 & echo $! > {pidfile}; wait")
    assert r.returncode == 3
    assert "timed out after 0.5s" in status(db)["errors"][0]["error"]
    grandchild = int(pidfile.read_text())
    wait_for(lambda: not _alive(grandchild), 5, "the timed-out task's grandchild to be gone")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_lets_running_tasks_finish(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a", "b", "c")
    started = tmp_path / "started"
    p = popen_onward("run", "--db", db, "--grace", "10", "--", "sh", "-c", f"touch {started}; sleep 0.5; echo ok")
    wait_for(started.exists, 20, "the first task to start")
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    st = status(db)
    assert st["done"] == 1 and st["pending"] == 2 and st["running"] == 0
    assert b"stopped by SIGTERM" in err


def test_a_task_claimed_in_the_instant_before_a_sigterm_is_given_back_unstarted(tmp_path: Path) -> None:
    """The worker freezes itself (SIGSTOP) once its claim committed, before the command starts; a SIGTERM
    comes meanwhile, and it goes on (SIGCONT). The command is never run (before: it ran, to the end of its
    grace), and the claim is given back uncounted."""
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a")
    ran = tmp_path / "ran"
    p = popen_onward("run", "--db", db, "--grace", "30", "--", "sh", "-c", f"touch {ran}; sleep 60",
                     ONWARD_TEST_HOOKS="1", ONWARD_FREEZE_AT="claim_committed:1")
    try:
        wait_for(lambda: process_state(p.pid) == "T", 30, "the worker to freeze itself after its claim")
        p.send_signal(signal.SIGTERM)
        p.send_signal(signal.SIGCONT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert not ran.exists()
    rows = run_onward("list", "--db", db, "--long").stdout.decode()
    assert rows.startswith("pending\t0\t"), rows  # given back, the attempt not counted
    assert b"stopped by SIGTERM before it started" in err, err


def test_sigterm_past_grace_kills_and_does_not_count_the_attempt(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "long")
    pidfile = tmp_path / "child.pid"
    p = popen_onward("run", "--db", db, "--grace", "0.3", "--", "sh", "-c", f"echo $$ > {pidfile}; exec sleep 60")
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the task to start")
    child = int(pidfile.read_text())
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 0, err
    wait_for(lambda: not _alive(child), 5, "the child to be gone")
    rows = run_onward("list", "--db", db, "--long").stdout.decode()
    assert rows.startswith("pending\t0\t")  # released, the attempt not counted
    assert "released" in run_onward("logs", "--db", db).stdout.decode()


def test_children_die_with_a_killed_worker_and_the_task_is_reclaimed_at_once(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    pidfile = tmp_path / "child.pid"
    marks = tmp_path / "marks"
    # heartbeat 5 s: the lease is 15 s, so a reclaim that waited for it would be far too slow for this test
    p = popen_onward("run", "--db", db, "--heartbeat", "5", "--", "sh", "-c",
                     f"echo $ONWARD_ATTEMPT >> {marks}; echo $$ > {pidfile}; "
                     f'if [ "$ONWARD_ATTEMPT" = 1 ]; then exec sleep 60; fi; echo second')
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the task to start")
    child = int(pidfile.read_text())
    p.kill()
    p.wait()
    wait_for(lambda: not _alive(child), 5, "the child to die with its worker (PDEATHSIG)")
    r = run_onward("run", "--db", db, "--heartbeat", "5", "--", "sh", "-c",
                   f"echo $ONWARD_ATTEMPT >> {marks}; echo second", timeout=10)
    assert r.returncode == 0, r.stderr
    assert marks.read_text().split() == ["1", "2"]
    assert b"owner died" in r.stderr
    assert run_onward("result", "--db", db, "t").stdout == b"second\n"


def test_poison_task_that_kills_its_worker_ends_failed(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    tasks = write_tasks(tmp_path / "t.txt", ["fine-1", "poison", "fine-2", "fine-3"])
    argv = ["run", "--db", db, "--tasks", str(tasks), "--max-attempts", "3", "--", "sh", "-c",
            'if [ "$1" = poison ]; then kill -9 $PPID; sleep 5; fi; echo ok', "x", "{task}"]
    runs = 0
    while True:
        runs += 1
        assert runs <= 6, "the poison task made the worker crash-loop"
        r = run_onward(*argv)
        if r.returncode in (0, 3):
            break
        assert r.returncode == -signal.SIGKILL
    assert r.returncode == 3
    st = status(db)
    assert (st["done"], st["failed"]) == (3, 1)
    assert run_onward("list", "--db", db, "--state", "failed").stdout == b"poison\n"
    assert runs == 4  # three attempts that each killed the worker, then one run that found them used up


@pytest.mark.parametrize("case", [
    "missing-tasks-file", "non-utf8", "long-line", "empty-command", "unwritable-out", "not-a-store",
    "newer-schema", "corrupt", "negative-concurrency", "zero-heartbeat", "negative-retry-delay", "zero-attempts",
    "lease-shorter-than-heartbeat",
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(tmp_path: Path, case: str) -> None:
    db = tmp_path / "s.db"
    good = write_tasks(tmp_path / "good.txt", ["a"])
    args = ["run", "--db", str(db), "--tasks", str(good)]
    cmd = ["--", "true"]
    if case == "missing-tasks-file":
        args[-1] = str(tmp_path / "missing.txt")
    elif case == "non-utf8":
        (tmp_path / "bad.txt").write_bytes(b"fine\n\xc3\x28\n")
        args[-1] = str(tmp_path / "bad.txt")
    elif case == "long-line":
        (tmp_path / "bad.txt").write_bytes(b"fine\n" + b"y" * 5000 + b"\n")
        args[-1] = str(tmp_path / "bad.txt")
    elif case == "empty-command":
        cmd = []
    elif case == "unwritable-out":
        (tmp_path / "afile").write_text("x")
        args += ["--out", str(tmp_path / "afile" / "out")]
    elif case == "not-a-store":
        db.write_text("this is my thesis, do not touch\n")
    elif case in ("newer-schema", "corrupt"):
        assert run_onward("add", "--db", str(db), "x").returncode == 0
        if case == "newer-schema":
            c = sqlite3.connect(db)
            c.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
            c.commit()
            c.close()
        else:
            data = bytearray(db.read_bytes())
            for i in range(100, len(data), 501):
                data[i] ^= 0x5A
            db.write_bytes(bytes(data))
    elif case == "negative-concurrency":
        args += ["--concurrency", "-1"]
    elif case == "zero-heartbeat":
        args += ["--heartbeat", "0"]
    elif case == "negative-retry-delay":
        args += ["--retry-delay", "-1"]
    elif case == "zero-attempts":
        args += ["--max-attempts", "0"]
    elif case == "lease-shorter-than-heartbeat":
        args += ["--heartbeat", "5", "--lease", "2"]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r = run_onward(*args, *cmd)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error:"), r.stderr
    assert "Traceback" not in r.stderr.decode()
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_status_on_a_missing_store_is_an_error_not_a_new_store(tmp_path: Path) -> None:
    r = run_onward("status", "--db", str(tmp_path / "none.db"))
    assert r.returncode == 2 and b"no onward store" in r.stderr
    assert not (tmp_path / "none.db").exists()


def test_out_dir_is_the_source_of_truth_export_and_hostile_names(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    names = ["../escape", "/etc/passwd-x", ".hidden", "ok", "a/b", "x" * 300]
    tasks = write_tasks(tmp_path / "t.txt", names)
    out = tmp_path / "out"
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--out", str(out), "--", "printf", "%s", "{task}")
    assert r.returncode == 0, r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == len(names)
    assert all(p.parent == out for p in out.iterdir())
    assert not (tmp_path / "escape.txt").exists()
    contents = sorted(p.read_text() for p in out.iterdir())
    assert contents == sorted(names)
    (out / "ok.txt").unlink()
    r = run_onward("run", "--db", db, "--out", str(out), "--", "false")
    assert r.returncode == 0
    assert (out / "ok.txt").read_text() == "ok"
    assert not [p for p in out.iterdir() if p.name.startswith(".onward-tmp")]


def test_keep_awake_marker_lives_while_work_remains(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    marker = tmp_path / "awake" / "keep-awake"
    run_onward("add", "--db", db, "a", "b")
    gate = tmp_path / "gate"
    started = tmp_path / "started"
    p = popen_onward("run", "--db", db, "--keep-awake", str(marker), "--", "sh", "-c",
                     f"touch {started}; while [ ! -e {gate} ]; do sleep 0.02; done")
    wait_for(started.exists, 20, "a task to start")
    assert marker.exists()
    gate.touch()
    p.communicate(timeout=20)
    assert p.returncode == 0
    assert not marker.exists()


def test_keep_awake_from_sandbox_convention(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".sandboxer").mkdir(parents=True)
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a")
    started = tmp_path / "started"
    gate = tmp_path / "gate"
    p = popen_onward("run", "--db", db, "--", "sh", "-c",
                     f"touch {started}; while [ ! -e {gate} ]; do sleep 0.02; done", HOME=str(home))
    wait_for(started.exists, 20, "a task to start")
    assert (home / ".sandboxer" / "keep-awake").exists()
    gate.touch()
    p.communicate(timeout=20)
    assert not (home / ".sandboxer" / "keep-awake").exists()


def test_keep_awake_stays_while_another_worker_has_work(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    marker = tmp_path / "keep-awake"
    run_onward("add", "--db", db, "quick", "slow")
    gate = tmp_path / "gate"
    slow_started = tmp_path / "slow-started"
    script = (f'if [ "$1" = slow ]; then touch {slow_started}; while [ ! -e {gate} ]; do sleep 0.02; done; fi')
    common = ["--db", db, "--keep-awake", str(marker), "--heartbeat", "0.2"]
    a = popen_onward("run", *common, "--", "sh", "-c", script, "x", "{task}")
    wait_for(slow_started.exists, 20, "the slow task to start in worker A")
    # worker B finds nothing pending, waits for A's running task ... and would leave if asked to stop
    b = popen_onward("run", *common, "--", "sh", "-c", script, "x", "{task}")
    wait_for(lambda: len(status(db)["workers"]) == 2, 20, "both workers to be registered")
    b.send_signal(signal.SIGTERM)
    b.communicate(timeout=20)
    assert marker.exists(), "one worker leaving must not remove the marker while another works"
    gate.touch()
    a.communicate(timeout=20)
    assert a.returncode == 0
    assert not marker.exists()


def lone_worker(db: str, marker: Path, started: Path, *args: str,
                log: Path | None = None) -> subprocess.Popen[bytes]:
    """``onward run --keep-awake marker`` with no supervisor (no ``NOTIFY_SOCKET``), in a session of its
    own, its one task touching ``started`` and then sleeping; returned once that task runs. Its stderr goes
    to ``log``, if given."""
    lone = env()
    lone.pop("NOTIFY_SOCKET", None)
    with log.open("wb") if log is not None else contextlib.nullcontext(subprocess.DEVNULL) as stderr:
        worker = subprocess.Popen(
            onward_argv("run", "--db", db, *args, "--keep-awake", str(marker), "--", "sh", "-c",
                        f"touch {started}; sleep 60"),
            env=lone, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    wait_for(started.exists, 20, "the task to start")
    assert marker.exists()
    return worker


@pytest.mark.parametrize("target", ["worker", "process group"])
def test_a_lone_worker_killed_outright_leaves_no_keep_awake_marker(tmp_path: Path, target: str) -> None:
    """No supervisor is there to let a killed worker's marker go (``onward supervise`` does when it gives
    up): the worker's marker keeper does, so that a sandbox is not kept awake, and paid for, with no worker
    left. Before, the marker stayed until a worker ran the job again. The keeper is in a session of its
    own: a SIGKILL to the worker's whole process group does not reach it."""
    db = str(tmp_path / "s.db")
    marker = tmp_path / "awake" / "keep-awake"
    run_onward("add", "--db", db, "a")
    worker = lone_worker(db, marker, tmp_path / "started")
    os.kill(worker.pid, signal.SIGKILL) if target == "worker" else os.killpg(worker.pid, signal.SIGKILL)
    worker.wait(timeout=20)
    wait_for(lambda: not marker.exists(), 20, "the killed worker's marker to be removed")
    wait_for(lambda: not keepers_of(marker), 20, "the keeper to exit")
    # The work is still there: the next run takes it, and the marker while it works.
    r = run_onward("run", "--db", db, "--keep-awake", str(marker), "--", "true")
    assert r.returncode == 0, r.stderr
    assert status(db)["done"] == 1 and not marker.exists()


def test_pkill_of_every_process_of_the_job_named_onward_leaves_no_keep_awake_marker(tmp_path: Path) -> None:
    """``pkill -9 -f onward`` is how a user (or a sandbox's tooling) kills a worker outright; here with the
    job's folder in the pattern, so that only this test's processes match. The keeper was started with the
    package's path and the marker's on its command line, so the pattern matched it too: it died with the
    worker, and the marker it was there to remove stayed. Its command line now holds neither."""
    folder = tmp_path / f"job-{os.getpid()}-{time.monotonic_ns()}"
    folder.mkdir()
    db = str(folder / "s.db")
    marker = folder / "awake" / "keep-awake"
    run_onward("add", "--db", db, "a")
    worker = lone_worker(db, marker, folder / "started")
    keeper = keeper_of(marker, worker.pid)
    pkill = subprocess.run(["pkill", "-9", "-f", f"onward.*{folder.name}"], capture_output=True, text=True)
    assert pkill.returncode == 0, pkill.stderr  # (0: it matched a process: the worker, at least)
    assert worker.wait(timeout=20) == -signal.SIGKILL
    wait_for(lambda: not marker.exists(), 20, "the killed worker's marker to be removed by its keeper")
    wait_for(lambda: keeper not in keepers_of(marker), 20, "the keeper to exit")


def test_a_keeper_killed_on_its_own_is_replaced_and_the_new_one_removes_the_marker(tmp_path: Path) -> None:
    """A keeper killed while its worker lives (a ``pkill`` meant for something else, the OOM killer) would
    leave the marker after a later ``kill -9`` of the worker: the worker starts another at its next
    heartbeat, says so, and that one removes the marker."""
    db = str(tmp_path / "s.db")
    marker = tmp_path / "awake" / "keep-awake"
    run_onward("add", "--db", db, "a")
    log = tmp_path / "worker.log"
    worker = lone_worker(db, marker, tmp_path / "started", "--heartbeat", "0.2", log=log)
    try:
        first = keeper_of(marker, worker.pid)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: [k for k in keepers_of(marker, worker.pid) if k != first], 20, "another keeper")
        said = f"(pid {first}) ended first (signal SIGKILL); started another"
        wait_for(lambda: said in log.read_text(), 20, "the worker's warning")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=20)
        wait_for(lambda: not marker.exists(), 20, "the killed worker's marker to be removed by the new keeper")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_killed_workers_keeper_leaves_a_marker_another_worker_holds(tmp_path: Path) -> None:
    """The keeper removes the marker by a leaving worker's rule: not while a worker of another job sharing
    it still works (it holds a lock on it)."""
    db = str(tmp_path / "s.db")
    marker = tmp_path / "keep-awake"
    run_onward("add", "--db", db, "--job", "a", "a1")
    run_onward("add", "--db", db, "--job", "b", "b1")
    a = lone_worker(db, marker, tmp_path / "a-started", "--job", "a")
    b = lone_worker(db, marker, tmp_path / "b-started", "--job", "b")
    try:
        a_keeper = keeper_of(marker, a.pid)
        os.kill(a.pid, signal.SIGKILL)
        a.wait(timeout=20)
        wait_for(lambda: a_keeper not in keepers_of(marker), 20, "worker a's keeper to exit")
        assert marker.exists(), "job b's worker still holds the marker"
        os.kill(b.pid, signal.SIGKILL)
        b.wait(timeout=20)
        wait_for(lambda: not marker.exists(), 20, "the last killed worker's marker to be removed")
    finally:
        for worker in (a, b):
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def test_a_killed_workers_keeper_leaves_a_file_that_is_not_a_marker(tmp_path: Path) -> None:
    """Something put in the marker's place while the worker ran (not a marker onward wrote, nor an empty
    file) is not the keeper's to remove, as it is not a leaving worker's."""
    db = str(tmp_path / "s.db")
    marker = tmp_path / "keep-awake"
    run_onward("add", "--db", db, "a")
    worker = lone_worker(db, marker, tmp_path / "started")
    keeper = keeper_of(marker, worker.pid)
    mine = tmp_path / "mine"
    mine.write_text("my notes\n")
    os.replace(mine, marker)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(timeout=20)
    wait_for(lambda: keeper not in keepers_of(marker), 20, "the keeper to exit")
    assert marker.read_text() == "my notes\n"


def test_keep_awake_shared_by_two_jobs_stays_until_both_are_done(tmp_path: Path) -> None:
    """One marker for two jobs (the sandbox's conventional path is shared by every job and store): the job
    that finishes first must not remove it while the other still works, not even for a heartbeat."""
    db = str(tmp_path / "s.db")
    marker = tmp_path / "keep-awake"
    gate, started = tmp_path / "gate", tmp_path / "started"
    run_onward("add", "--db", db, "--job", "a", "quick")
    run_onward("add", "--db", db, "--job", "b", "slow")
    b = popen_onward("run", "--db", db, "--job", "b", "--keep-awake", str(marker), "--", "sh", "-c",
                     f"touch {started}; while [ ! -e {gate} ]; do sleep 0.02; done")
    try:
        wait_for(started.exists, 20, "job b's task to start")
        assert marker.exists()
        a = run_onward("run", "--db", db, "--job", "a", "--keep-awake", str(marker), "--", "true")
        assert a.returncode == 0, a.stderr
        assert marker.exists(), "job a finished and removed the marker while job b still works"
        gate.touch()
        _, err = b.communicate(timeout=30)
        assert b.returncode == 0, err
    finally:
        gate.touch()
        if b.poll() is None:
            b.kill()
            b.wait()
    assert not marker.exists(), "the last job to finish removes the marker"


def test_two_workers_share_one_store(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    n = 200
    tasks = write_tasks(tmp_path / "t.txt", [f"t{i}" for i in range(n)])
    log = tmp_path / "executions.log"
    run_onward("add", "--db", db, "--tasks", str(tasks))
    cmd = ["--", "sh", "-c", f'echo "$1" >> {log}; echo "r-$1"', "x", "{task}"]
    workers = [popen_onward("run", "--db", db, "--concurrency", "2", *cmd) for _ in range(2)]
    for w in workers:
        w.communicate(timeout=120)
        assert w.returncode == 0
    lines = log.read_text().split()
    assert sorted(lines) == sorted(f"t{i}" for i in range(n))  # each exactly once
    st = status(db)
    assert st["done"] == n
    done_by = [e for e in run_onward("logs", "--db", db).stdout.decode().splitlines() if "worker stopped" in e]
    assert len(done_by) == 2
    c = sqlite3.connect(db)
    assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_journald_lines_have_no_second_timestamp(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a")
    r = run_onward("run", "--db", db, "--", "true", env={"JOURNAL_STREAM": "8:1234"})
    lines = r.stderr.decode().splitlines()
    assert lines and all(line.startswith("onward pid=") for line in lines)
    r = run_onward("run", "--db", db, "-q", "--", "true")
    assert r.stderr == b""




@contextmanager
def stopped_with_sigstop(worker: int, child: int) -> Iterator[None]:
    """SIGSTOP the worker alone: its command runs on, as when a debugger or a shell stops a process."""
    os.kill(worker, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(worker, signal.SIGCONT)


FREEZE_ASK_AGAIN = 5.0


def freeze(group: Path) -> None:
    """Freeze a cgroup v1 freezer group and wait until every member is frozen. A member in an uninterruptible
    wait (a page fault or a write behind a disk the suite's other tests keep busy) holds the group in FREEZING
    until that wait ends: 10 s was once too little under the full suite. The freeze is the tests' setting, not
    what they check; if it does not come, the failure says where each member waits. The request is written
    again every 5 s meanwhile: a process forked while the group was freezing (a member seen in kernel_clone)
    may miss the first one, and the group then stayed FREEZING for the whole 60 s, once in a full run."""
    state = group / "freezer.state"
    asked_at = [time.monotonic() - FREEZE_ASK_AGAIN]

    def frozen() -> bool:
        if state.read_text().strip() == "FROZEN":
            return True
        if time.monotonic() - asked_at[0] >= FREEZE_ASK_AGAIN:
            state.write_text("FROZEN")
            asked_at[0] = time.monotonic()
        return False
    try:
        wait_for(frozen, 60, "the freeze")
    except AssertionError as e:
        raise AssertionError(f"{e}; the group's members: {_member_states(group)}") from None


def _member_states(group: Path) -> str:
    """Each process of a freezer group: its name, state and where in the kernel it waits."""
    states = []
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):  # gone meanwhile (ProcessLookupError is one)
            name, wchan = (Path(f"/proc/{pid}/{entry}").read_text().strip() for entry in ("comm", "wchan"))
            states.append(f"{pid} {name} {process_state(int(pid))} {wchan or '-'}")
    return ", ".join(states)


@contextmanager
def frozen_by_cgroup(worker: int, child: int) -> Iterator[None]:
    """Freeze worker and command with the cgroup v1 freezer: a sandbox pause, no signal delivered."""
    freezer = cgroup_v1("freezer")
    group = freezer / f"onward-test-{os.getpid()}-{worker}"
    group.mkdir()
    try:
        for pid in (worker, child):
            (group / "cgroup.procs").write_text(str(pid))
        freeze(group)
        yield
    finally:
        (group / "freezer.state").write_text("THAWED")
        for member in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):
                (freezer / "cgroup.procs").write_text(member)
        group.rmdir()


@pytest.mark.parametrize("pause", [stopped_with_sigstop, frozen_by_cgroup], ids=["sigstop", "freezer"])
def test_paused_worker_loses_its_lease_and_cannot_commit(
        tmp_path: Path, pause: Callable[[int, int], AbstractContextManager[None]]) -> None:
    """Pause a worker past its lease: another takes the task over (killing the paused worker's command
    first, so two executions never overlap); after the thaw the paused worker notices the gap and its
    outcome is fenced."""
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    marks = tmp_path / "marks"
    pidfile = tmp_path / "child.pid"
    script = (f'echo "start $ONWARD_ATTEMPT" >> {marks}; echo $$ > {pidfile}; '
              f'if [ "$ONWARD_ATTEMPT" = 1 ]; then sleep 60; fi; echo "end $ONWARD_ATTEMPT" >> {marks}')
    a = popen_onward("run", "--db", db, "--heartbeat", "0.2", "--lease", "0.6", "--", "sh", "-c", script)
    wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "A's task to start")
    child = int(pidfile.read_text())
    with pause(a.pid, child):
        paused_at = time.monotonic()
        b = run_onward("run", "--db", db, "--heartbeat", "0.2", "--lease", "0.6", "--", "sh", "-c", script)
        assert b.returncode == 0, b.stderr
        assert b"lease expired" in b.stderr
        if pause is stopped_with_sigstop:
            assert not _alive(child), "the paused owner's child must be killed before the task runs again"
        # a pause lasts a while: at least twice the lease in all
        time.sleep(max(0.0, 1.2 - (time.monotonic() - paused_at)))
    _, err = a.communicate(timeout=30)
    # a frozen command got its SIGKILL while frozen: it dies as soon as it thaws, before running on
    wait_for(lambda: not _alive(child), 5, "the paused worker's command to be gone")
    assert a.returncode == 0, err
    assert b"resumed after" in err and b"fenced" in err
    assert marks.read_text().split("\n")[:-1] == ["start 1", "start 2", "end 2"]
    assert run_onward("result", "--db", db, "t").returncode == 0
    assert status(db)["done"] == 1


def _descendants(pid: int) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


@contextmanager
def all_frozen(workers: list[int]) -> Iterator[None]:
    """Freeze workers and everything below them with the cgroup v1 freezer, as a sandbox pause freezes the
    whole job. Each worker goes in first, so that whatever it starts meanwhile is born inside."""
    freezer = cgroup_v1("freezer")
    group = freezer / f"onward-test-{os.getpid()}-all"
    group.mkdir()
    try:
        todo = list(workers)
        while todo:
            pid = todo.pop()
            with contextlib.suppress(ProcessLookupError, OSError):
                (group / "cgroup.procs").write_text(str(pid))
            todo += _descendants(pid)
        freeze(group)
        yield
    finally:
        (group / "freezer.state").write_text("THAWED")

        def moved_out() -> bool:  # the commands go on forking inside until each of them is moved out
            members = (group / "cgroup.procs").read_text().split()
            for member in members:
                with contextlib.suppress(ProcessLookupError, OSError):
                    (freezer / "cgroup.procs").write_text(member)
            return not members

        wait_for(moved_out, 10, "every process to leave the freezer's group")
        group.rmdir()


def test_a_whole_job_frozen_past_its_leases_goes_on_without_taking_its_own_tasks_over(store_url: str,
                                                                                      tmp_path: Path) -> None:
    """A sandbox pause freezes every worker of the job at once. After the thaw every lease has run out, but
    every owner is alive and renews at once: no worker may take another's task over in the moment before
    (that killed live commands, counted attempts for nothing and ran tasks twice). Each task runs once."""
    n = 4
    marks, gate = tmp_path / "marks", tmp_path / "gate"
    run_onward("add", "--db", store_url, *[f"t{i}" for i in range(n)])
    script = (f'echo "start $ONWARD_TASK $ONWARD_ATTEMPT" >> {marks}; '
              f'while [ ! -e {gate} ]; do sleep 0.05; done; echo "end $ONWARD_TASK $ONWARD_ATTEMPT" >> {marks}')
    lease = 2.0
    workers = [popen_onward("run", "--db", store_url, "--concurrency", "2", "--heartbeat", "0.5", "--lease",
                            str(lease), "--", "sh", "-c", script) for _ in range(2)]
    try:
        wait_for(lambda: marks.exists() and len(marks.read_text().splitlines()) == n, 30, "every task to start")
        with all_frozen([w.pid for w in workers]):
            wait_for(lambda: all(t["heartbeat_age"] > lease + 0.5 for t in status(store_url)["tasks_running"]),
                     30, "every lease to run out while the job is frozen")
        gate.touch()
        results = [w.communicate(timeout=60) for w in workers]
    finally:
        gate.touch()
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for w, (_, err) in zip(workers, results, strict=True):
        assert w.returncode == 0, err
        assert b"resumed after" in err, err
        assert b"reclaimed" not in err and b"fenced" not in err and b"attempt failed" not in err, err
    assert sorted(marks.read_text().splitlines()) == sorted(
        [f"start t{i} 1" for i in range(n)] + [f"end t{i} 1" for i in range(n)])
    st = status(store_url)
    assert (st["done"], st["total"]) == (n, n)


def wall_clock_shifter(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment that moves a process's wall clock (CLOCK_REALTIME only) forward by the seconds written
    in the returned file, as a VM resumed from a snapshot sees it: its monotonic clock counted none of the
    pause, then its wall clock is set. A small LD_PRELOAD library (tests/data/walljump.c), built here."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        if os.environ.get("CI") == "true":
            pytest.fail("a C compiler is needed in CI")
        pytest.skip("needs a C compiler")
    lib, offset = tmp_path / "walljump.so", tmp_path / "wall-offset"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(Path(__file__).parents[1] / "data" /
                                                                       "walljump.c"), "-ldl"], check=True)
    offset.write_text("0\n")
    return {"LD_PRELOAD": str(lib), "WALLJUMP_FILE": str(offset)}, offset


def test_a_wall_clock_jump_after_a_resume_is_a_pause_and_takes_no_live_task_over(tmp_path: Path) -> None:
    """The whole job resumed, its wall clock set a minute forward and its monotonic clock not: every SQLite
    lease (kept in wall-clock time) ran out at once. Each worker must notice the jump as a pause and renew at
    once, and none may take the others' live tasks over meanwhile. Each task runs once."""
    db = str(tmp_path / "s.db")
    n = 4
    marks, gate = tmp_path / "marks", tmp_path / "gate"
    clock_env, offset = wall_clock_shifter(tmp_path)
    run_onward("add", "--db", db, *[f"t{i}" for i in range(n)])
    script = (f'echo "start $ONWARD_TASK $ONWARD_ATTEMPT" >> {marks}; '
              f'while [ ! -e {gate} ]; do sleep 0.05; done; echo "end $ONWARD_TASK $ONWARD_ATTEMPT" >> {marks}')
    workers = [subprocess.Popen(onward_argv("run", "--db", db, "--concurrency", "2", "--heartbeat", "0.5", "--lease",
                                            "2", "--", "sh", "-c", script), env=env(**clock_env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        wait_for(lambda: marks.exists() and len(marks.read_text().splitlines()) == n, 30, "every task to start")
        offset.write_text("60\n")
        for w in workers:
            assert w.stderr is not None
            os.set_blocking(w.stderr.fileno(), False)
        seen = [b"", b""]

        def both_resumed() -> bool:
            for i, w in enumerate(workers):
                assert w.stderr is not None
                seen[i] += w.stderr.read() or b""
            return all(b"resumed after" in err for err in seen)

        wait_for(both_resumed, 30, "both workers to notice the jump")

        def renewed() -> bool:  # seen on the shifted clock, as the workers keep it
            r = run_onward("status", "--db", db, "--json", env=clock_env)
            return r.returncode == 0 and all(t["heartbeat_age"] < 2 for t in json.loads(r.stdout)["tasks_running"])

        wait_for(renewed, 30, "every lease to be renewed after the jump")
        gate.touch()
        for i, w in enumerate(workers):
            w.wait(60)
            assert w.stderr is not None
            seen[i] += w.stderr.read() or b""
    finally:
        gate.touch()
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for w, err in zip(workers, seen, strict=True):
        assert w.returncode == 0, err
        assert b"reclaimed" not in err and b"fenced" not in err and b"attempt failed" not in err, err
    assert sorted(marks.read_text().splitlines()) == sorted(
        [f"start t{i} 1" for i in range(n)] + [f"end t{i} 1" for i in range(n)])
    assert (status(db)["done"], status(db)["total"]) == (n, n)


def test_status_shows_a_running_task(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "slow", "later")
    gate = tmp_path / "gate"
    started = tmp_path / "started"
    p = popen_onward("run", "--db", db, "--heartbeat", "0.2", "--", "sh", "-c",
                     f"touch {started}; while [ ! -e {gate} ]; do sleep 0.02; done")
    try:
        wait_for(started.exists, 20, "the task to start")
        wait_for(lambda: status(db)["tasks_running"], 10, "status to show the running task")
        st = status(db)
        (running,) = st["tasks_running"]
        assert running["task"] == "slow" and running["attempt"] == 1 and running["worker_pid"] == p.pid
        assert 0 <= running["heartbeat_age"] < 5
        (worker,) = st["workers"]
        assert worker["pid"] == p.pid and worker["running"] == 1 and worker["alive"] is True
        text = run_onward("status", "--db", db).stdout.decode()
        assert "slow" in text and str(p.pid) in text
    finally:
        gate.touch()
        p.communicate(timeout=20)


def test_retry_of_a_task_that_is_not_failed_says_why_nothing_changed(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "x").returncode == 0
    assert run_onward("run", "--db", db, "--", "true").returncode == 0
    r = run_onward("retry", "--db", db, "x")
    assert r.returncode == 0, r.stderr
    assert r.stderr.decode().splitlines() == ["task 'x' is done, not failed: left as it is",
                                              "0 tasks back to pending"]


def test_logs_follow_waits_for_the_store_to_be_created(tmp_path: Path) -> None:
    db = tmp_path / "later" / "s.db"
    r = run_onward("logs", "--db", str(db))  # without -f a missing store stays an error
    assert r.returncode == 2 and b"no onward store" in r.stderr
    out = tmp_path / "follow.out"
    with out.open("wb") as sink:
        follower = subprocess.Popen(onward_argv("logs", "--db", str(db), "-f"), env=env(), stdout=sink,
                                    stderr=subprocess.PIPE)
    try:
        time.sleep(1.0)  # long enough to have given up, had it not been waiting
        assert follower.poll() is None, follower.stderr.read() if follower.stderr else b""
        assert not db.exists()  # waiting creates nothing
        assert run_onward("add", "--db", str(db), "a").returncode == 0
        wait_for(lambda: b"added" in out.read_bytes(), 30, "the follower to print the new store's events")
    finally:
        follower.terminate()
        follower.wait(10)


@pytest.mark.parametrize("where", ["a-directory", "under-a-file", "env-a-directory"])
def test_keep_awake_path_that_cannot_be_a_file_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                    where: str) -> None:
    tasks = write_tasks(tmp_path / "tasks.txt", ["a"])
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    marker = str(tmp_path / ("afile/keep-awake" if where == "under-a-file" else "adir"))
    flag = [] if where.startswith("env") else ["--keep-awake", marker]
    before = sorted(tmp_path.rglob("*"))
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), *flag, "--", "true",
                   env={"ONWARD_KEEP_AWAKE": marker} if where.startswith("env") else None)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error:") and "keep-awake" in lines[0], r.stderr
    assert sorted(tmp_path.rglob("*")) == before  # no store, no *.tmp


@pytest.mark.parametrize("what", ["a file of the user's", "a FIFO", "a symbolic link"])
def test_keep_awake_path_holding_something_else_is_refused_and_left_untouched(tmp_path: Path, what: str) -> None:
    """A marker path where something other than a marker is (a typo such as ``--keep-awake tasks.txt``): the
    marker would replace it and then delete it. Refused before anything is written, and left as it was. A
    marker onward left behind (a killed worker's), and an empty file (``touch``), are taken over as ever."""
    tasks = write_tasks(tmp_path / "tasks.txt", ["a"])
    marker = tmp_path / "keep-awake"
    if what == "a FIFO":
        os.mkfifo(marker)
    elif what == "a symbolic link":
        (tmp_path / "target").write_text("precious\n")
        marker.symlink_to(tmp_path / "target")
    else:
        marker.write_text("precious\n")
    before = {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
              for p in tmp_path.rglob("*")}
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--keep-awake", str(marker),
                   "--", "true")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error: keep-awake marker"), r.stderr
    after = {p: (p.lstat().st_mode, p.read_bytes() if p.is_file() and not p.is_symlink() else b"")
             for p in tmp_path.rglob("*")}
    assert after == before  # no store, the file as it was
    for left in (b"onward pid=1 store=old.db\n", b""):
        marker.unlink(missing_ok=True)
        marker.write_bytes(left)
        r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--keep-awake", str(marker),
                       "--", "true")
        assert r.returncode == 0, r.stderr
        assert not marker.exists()  # taken over, then let go: the job is done


def test_keep_awake_marker_on_a_full_disk_is_a_warning_not_a_crash(small_disk: Path, tmp_path: Path) -> None:  # noqa: F811
    filler = small_disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    with contextlib.suppress(OSError):  # fill the 1 MiB tmpfs to the last byte
        while True:
            os.write(fd, b"x" * 4096)
    os.close(fd)
    tasks = write_tasks(tmp_path / "tasks.txt", ["a", "b"])
    db = str(tmp_path / "s.db")
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--keep-awake", str(small_disk / "keep-awake"),
                   "--", "true")
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert "Traceback" not in err
    assert "keep-awake" in err and "No space left on device" in err, err
    assert status(db)["done"] == 2
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no marker, no stray *.tmp


def test_sighup_stops_like_sigterm_and_lets_running_tasks_finish(tmp_path: Path) -> None:
    # A worker started from a terminal that closes gets SIGHUP: a graceful stop, its running task finishes.
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "a", "b", "c")
    started, go, finished = tmp_path / "started", tmp_path / "go", tmp_path / "finished"
    p = popen_onward("run", "--db", db, "--grace", "30", "--", "sh", "-c",
                     f"touch {started}; while [ ! -e {go} ]; do sleep 0.02; done; touch {finished}")
    wait_for(started.exists, 20, "the first task to start")
    p.send_signal(signal.SIGHUP)
    go.touch()
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    assert finished.exists() and b"stopped by SIGHUP" in err
    st = status(db)
    assert st["done"] == 1 and st["pending"] == 2 and st["running"] == 0


@pytest.mark.parametrize("how", ["run", "supervise"])
def test_under_nohup_sighup_stops_nothing_and_the_tasks_inherit_the_ignore(tmp_path: Path, how: str) -> None:
    """`nohup onward run …` (or `nohup onward supervise -- onward run …`) and a logout: SIGHUP stopped the
    worker all the same, since onward put its own handler over the ignore nohup set. Now the ignore stays: the
    job runs on to its end, and its tasks inherit the ignore, as children of nohup do."""
    require_tool("nohup")
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b", "c").returncode == 0
    started, go = tmp_path / "started", tmp_path / "go"
    # Each task notes whether SIGHUP is ignored in it (bit 0 of SigIgn), then waits for GO.
    task = (f"grep ^SigIgn: /proc/self/status >> {tmp_path}/ignored; touch {started};"
            f" while [ ! -e {go} ]; do sleep 0.02; done")
    worker = onward_argv("run", "--db", db, "--grace", "30", "--", "sh", "-c", task)
    argv = ["nohup", *worker] if how == "run" else ["nohup", *onward_argv("supervise", "--"), *worker]
    p = subprocess.Popen(argv, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(started.exists, 20, "the first task to start")
        p.send_signal(signal.SIGHUP)  # the terminal closed; under supervise, the worker gets none
        go.touch()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err.decode()[-2000:]
    assert b"SIGHUP" not in err, err.decode()[-2000:]
    st = status(db)
    assert st["done"] == 3 and st["pending"] == 0, st
    masks = [int(line.split()[1], 16) for line in (tmp_path / "ignored").read_text().splitlines()]
    assert len(masks) == 3 and all(mask & 1 for mask in masks), masks


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_while_the_tasks_file_is_added_stops_there_and_the_next_run_adds_the_rest(
        tmp_path: Path, sig: signal.Signals) -> None:
    """A million lines take a minute to add, before the worker takes over the signals: SIGTERM killed the
    run there (exit 143), SIGHUP too, SIGINT said "aborted" (exit 130), and none was the recorded stop, exit
    0, that the README promises. Now each stops the run there, exit 0, with what was added kept."""
    db = str(tmp_path / "s.db")
    lines = 600_000
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(f"t{i}\n" for i in range(lines)))
    p = popen_onward("run", "--db", db, "--tasks", str(tasks), "--", "true")
    def some_added() -> bool:
        r = run_onward("status", "--db", db, "--json")  # exit 2 while the store is still being made
        return r.returncode == 0 and json.loads(r.stdout)["pending"] > 0
    wait_for(some_added, 60, "the first chunk of the import")
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()[-2000:]
    assert f"worker stopped: {sig.name} before its first task".encode() in err, err.decode()[-2000:]
    assert b"Traceback" not in err
    st = status(db)
    assert 0 < st["pending"] < lines and st["done"] == 0, st  # stopped mid-way, nothing run
    added = run_onward("add", "--db", db, "--tasks", str(tasks))
    assert added.returncode == 0, added.stderr
    assert status(db)["pending"] == lines  # the rest, once each


@pytest.mark.parametrize("closed", [">&-", "2>&-", "<&-"])
def test_a_run_started_with_a_standard_stream_closed_finishes_its_job(closed: str, tmp_path: Path) -> None:
    """`onward run ... >&-`: Python leaves sys.stdout None, and the job finished, then a traceback and exit 1
    (counted as a crash under a supervisor); with stderr closed the worker never started. A closed stream
    now gets /dev/null, as a daemon's does: the job runs, its lines go nowhere, as asked."""
    (tmp_path / "t.txt").write_text("a\nb\n")
    argv = onward_argv("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tmp_path / "t.txt"), "--",
                       sys.executable, "-c", "import sys; print(sys.argv[1])", "{task}")
    env = dict(os.environ, PYTHONPATH=SRC)
    done = subprocess.run(["sh", "-c", f'exec "$@" {closed}', "sh", *argv], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr, done.stderr
    status = run_onward("status", "--db", str(tmp_path / "s.db"), "--json")
    assert json.loads(status.stdout)["done"] == 2
    shown = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *onward_argv("status", "--db", str(tmp_path / "s.db"))],
                           stderr=subprocess.PIPE, timeout=60, env=env)
    assert shown.returncode == 0 and shown.stderr == b"", shown.stderr


@pytest.mark.parametrize("concurrency", ["1", "4"])
def test_a_store_reached_through_a_symlink_reports_every_completion(tmp_path: Path, concurrency: str) -> None:
    """SQLite keeps a store's log beside the file a symlink leads to; onward looked for it beside the link: every
    run began with "store error, will retry: ... its write-ahead log cur.db-wal is gone", and a completion
    went unreported (199 done lines for 200 tasks; a result file written only by the sweep)."""
    (tmp_path / "real").mkdir()
    tasks = tmp_path / "t.txt"
    tasks.write_text("".join(f"k{i}\n" for i in range(60)))
    assert run_onward("add", "--db", str(tmp_path / "real" / "a.db"), "--tasks", str(tasks)).returncode == 0
    (tmp_path / "cur.db").symlink_to(tmp_path / "real" / "a.db")
    done = run_onward("run", "--db", str(tmp_path / "cur.db"), "--concurrency", concurrency, "--out",
                      str(tmp_path / "out"), "--", "sh", "-c", "sleep 0.001; echo {task}")
    err = done.stderr.decode()
    assert done.returncode == 0, err
    assert "store error" not in err and "exported" not in err, err
    assert err.count(" done task=") == 60, err
    assert not (tmp_path / "cur.db-wal").exists() and not (tmp_path / "cur.db-shm").exists()


def test_a_command_that_changes_folder_still_finds_its_store(tmp_path: Path) -> None:
    """ONWARD_DB was the store's path as given (.onward/onward.db by default): a command that changed folder and
    ran `onward status` (or `onward send` for another task) found no store there, exit 2. It is absolute."""
    (tmp_path / "t.txt").write_text("a\n")
    onward = " ".join(shlex.quote(word) for word in onward_argv("status", "--json"))
    done = run_onward("run", "--tasks", "t.txt", "--max-attempts", "1", "--", "sh", "-c",
                      f'cd / && {onward} > /dev/null && echo "$ONWARD_DB"', cwd=tmp_path)
    assert done.returncode == 0, done.stderr.decode()
    shown = run_onward("result", "a", cwd=tmp_path)
    assert shown.stdout.decode().strip() == str(tmp_path / ".onward" / "onward.db"), shown


def test_a_stop_signal_is_said_at_once_with_the_grace_the_running_tasks_get(tmp_path: Path) -> None:
    """Ctrl-C printed nothing until the grace was over (10 s by default): a user at a terminal could not tell it
    was received. The loop says it at once."""
    (tmp_path / "t.txt").write_text("a\nb\n")
    started = tmp_path / "started"
    worker = subprocess.Popen(onward_argv("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tmp_path / "t.txt"),
                                          "--concurrency", "2", "--grace", "30", "--", "sh", "-c",
                                          f'echo >> {started}; exec sleep 60'),
                              stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=SRC))
    assert worker.stderr is not None
    try:
        wait_for(lambda: started.exists() and len(started.read_text().splitlines()) == 2, 30, "both tasks to start")
        worker.send_signal(signal.SIGINT)
        line = worker.stderr.readline().decode()
        while "stopping on" not in line and line:
            line = worker.stderr.readline().decode()
        assert "stopping on SIGINT: claiming nothing new; 2 running tasks get up to 30 s (--grace) to finish" in line
    finally:
        worker.kill()  # its commands die with it (PR_SET_PDEATHSIG)
        worker.wait(30)


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f)
    except OSError:
        return False
    return bool(int(fields["SigCgt"], 16) & (1 << (signum - 1)))


def test_a_stop_at_any_moment_of_the_start_ends_the_run_quietly_with_exit_0(tmp_path: Path) -> None:
    """SIGINT in the first tenths of a second of `onward run` (the CLI loading and reading its options, before
    the run took the signals over) gave a KeyboardInterrupt traceback, or "onward: aborted" and exit 130,
    where the README promises a stop before the first task ends the run there with exit 0. Seeded moments from
    the one onward's first module took the stop signals (SIGTERM caught, in /proc/PID/status): before that the
    interpreter itself starts, and no code of onward's runs yet to take the signal (README). The moments were
    counted from the process's start, from 50 ms on; under a full suite's load Python's own start outlasted
    that once, and the stop fell in its import of `site`."""
    import random

    seed = 12071738
    print(f"seed {seed}")
    pace = random.Random(seed)
    (tmp_path / "t.txt").write_text("a\nb\nc\n")
    for trial in range(12):
        db = tmp_path / f"s{trial}.db"
        worker = subprocess.Popen(onward_argv("run", "--db", str(db), "--tasks", str(tmp_path / "t.txt"),
                                              "--grace", "0.2", "--", "sleep", "0.3"),
                                  stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=SRC))
        wait_for(lambda: worker.poll() is not None or catches(worker.pid, signal.SIGTERM), 60,
                 "onward's code to take the stop signals")
        time.sleep(pace.uniform(0.0, 0.45))  # the moment of the stop (what the test varies), not a wait for a state
        worker.send_signal(signal.SIGINT)
        _, err = worker.communicate(timeout=60)
        text = err.decode(errors="replace")
        assert worker.returncode == 0, (trial, worker.returncode, text[-1500:])
        assert "Traceback" not in text and "aborted" not in text, (trial, text[-1500:])
