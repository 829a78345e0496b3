"""Every command's exit statuses, through the installed console script as a user or a shell script sees them
(its entry point is where error types become exit codes): 0 success, 1 a task asked for is unknown or not
done (and the supervisor giving up), 2 bad input, 3 finished with failed tasks; the supervisor passes its
worker's 0, 2 and 3 on."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import onward_argv, run_onward


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A folder with a store at the default place: task "a" done, "b" failed for good, "c" pending."""
    (tmp_path / "t.txt").write_text("a\nb\n")
    done = run_onward("run", "--tasks", "t.txt", "--max-attempts", "1", "-q", "--", "sh", "-c",
                      'test "$ONWARD_TASK" = a', cwd=tmp_path)
    assert done.returncode == 3, done.stderr
    assert run_onward("add", "c", cwd=tmp_path).returncode == 0
    return tmp_path


def error_line(stderr: bytes) -> str:
    lines = stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error: "), lines
    return lines[0]


@pytest.mark.parametrize(("args", "code", "says"), [
    (["result", "a"], 0, None),
    (["result", "zz"], 1, "no task 'zz'"),
    (["result", "c"], 1, "task 'c' is pending"),
    (["result"], 2, "Missing argument"),
    (["status"], 0, None),
    (["status", "--db", "missing.db"], 2, "no onward store"),
    (["list"], 0, None),
    (["list", "--state", "bogus"], 2, "Invalid value for '--state'"),
    (["logs", "-n", "0"], 2, "Invalid value for '-n'"),
    (["add", "d"], 0, None),
    (["add"], 2, "give tasks as arguments or --tasks FILE"),
    (["retry", "zz"], 1, "no task 'zz'"),
    (["retry"], 2, "give --failed or task names"),
    (["steps", "zz"], 1, "no task 'zz'"),
    (["steps", "a", "--db", "missing.db"], 2, "no onward store"),
    (["run", "--concurrency", "0", "--", "true"], 2, "concurrency must be at least 1"),
    (["send", "c", "approval", '{"ok": true}'], 0, None),
    (["send", "zz", "approval", "1"], 1, "no task 'zz'"),
    (["send", "a", "approval", "1"], 1, "task 'a' is done"),
    (["send", "b", "approval", "1"], 1, "task 'b' is failed"),
    (["send", "c", "approval", "nan"], 2, "not valid JSON"),
    (["send", "c", "", "1"], 2, "key"),
    (["send", "c", "approval"], 2, "Missing argument"),
    (["list", "--state", "waiting"], 0, None),
    (["db", "upgrade"], 0, None),
    (["nosuch"], 2, "No such command"),
    (["--version"], 0, None),
])
def test_every_command_exits_with_its_documented_status(job: Path, args: list[str], code: int,
                                                        says: str | None) -> None:
    done = run_onward(*args, cwd=job)
    assert done.returncode == code, done.stderr
    if says is not None:
        assert says in error_line(done.stderr)


def test_run_exits_3_when_tasks_failed_and_0_when_all_are_done(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("a\n")
    failed = run_onward("run", "--db", "f.db", "--tasks", "t.txt", "--max-attempts", "1", "--", "false",
                        cwd=tmp_path)
    assert failed.returncode == 3, failed.stderr
    done = run_onward("run", "--db", "d.db", "--tasks", "t.txt", "--", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


# --- onward supervise passes its worker's status on ------------------------------------------------------
@pytest.mark.parametrize("status", [0, 2, 3])
def test_supervise_exits_with_the_workers_0_2_3(tmp_path: Path, status: int) -> None:
    done = run_onward("supervise", "--", "sh", "-c", f"exit {status}", cwd=tmp_path)
    assert done.returncode == status, done.stderr
    assert b"not restarting" in done.stderr


def test_supervise_exits_1_when_it_gives_up_on_a_crash_loop(tmp_path: Path) -> None:
    done = run_onward("supervise", "--max-restarts", "2", "--restart-delay", "0.01", "--", "sh", "-c", "exit 1",
                      cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert b"giving up after 2 restarts" in done.stderr


def test_supervise_passes_on_a_real_workers_3_and_usage_error_2(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("a\n")
    failed = run_onward("supervise", "--", *onward_argv("run", "--tasks", "t.txt", "--max-attempts", "1", "--",
                                                        "false"), cwd=tmp_path)
    assert failed.returncode == 3, failed.stderr
    misused = run_onward("supervise", "--", *onward_argv("run", "--tasks", "t.txt", "--concurrency", "0", "--",
                                                         "true"), cwd=tmp_path)
    assert misused.returncode == 2, misused.stderr
    assert b"onward: error: concurrency must be at least 1" in misused.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--max-restarts", "-1", "--", "true"], "--max-restarts must be 0 or more"),
    (["--window", "0", "--", "true"], "--window must be more than 0"),
    (["--watchdog", "-1", "--", "true"], "--watchdog must be"),
    (["--restart-delay", "-1", "--", "true"], "--restart-delay must be 0 or more"),
    (["--restart-delay", "inf", "--", "true"], "inf is not a finite number"),
    (["--watchdog", "inf", "--", "true"], "inf is not a finite number"),
    (["--watchdog", "nan", "--", "true"], "nan is not a finite number"),
    # Faster than the worker's loop can heartbeat: it was killed as wedged at once, again and again.
    (["--watchdog", "0.0005", "--", "true"], "--watchdog must be at least 0.1 seconds"),
    (["--watchdog", "1e-300", "--", "true"], "--watchdog must be at least 0.1 seconds"),
    (["--watchdog", "-0", "--", "true"], "--watchdog must be at least 0.1 seconds"),
    (["--watchdog", "0x10", "--", "true"], "is not a valid float"),
    (["--window", "inf", "--", "true"], "inf is not a finite number"),
    (["--"], "no command given"),
    (["--", "/no/such/program"], "cannot start /no/such/program"),
])
def test_supervise_bad_input_is_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    done = run_onward("supervise", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert says in error_line(done.stderr)
    assert list(tmp_path.iterdir()) == []


# --- onward service --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "says"), [
    (["install", "--name", "a b", "--dry-run", "--", "true"], "not a valid service name"),
    (["install", "--name", "j", "--env", "NOEQUALS", "--dry-run", "--", "true"], "--env wants NAME=VALUE"),
    (["install", "--name", "j", "--watchdog", "-1", "--dry-run", "--", "true"], "--watchdog must be"),
    (["install", "--name", "j", "--watchdog", "inf", "--dry-run", "--", "true"], "inf is not a finite number"),
    (["install", "--name", "j", "--watchdog", "0.0005", "--dry-run", "--", "true"], "or at least 0.1 seconds"),
    (["install", "--name", "j", "--watchdog", "1e-300", "--dry-run", "--", "true"], "or at least 0.1 seconds"),
    # Shorter than the wait of a worker whose store is down: the start limit would fail the unit.
    (["install", "--name", "j", "--start-timeout", "5", "--dry-run", "--", "true"], "or at least 12 seconds"),
    (["install", "--name", "j", "--start-timeout", "inf", "--dry-run", "--", "true"], "inf is not a finite"),
    (["install", "--name", "j", "--dry-run", "--", "no-such-program-anywhere"], "not found on PATH"),
    (["install", "--name", "j", "--dry-run"], "no command given"),
    (["uninstall", "no-such-unit-here"], "no unit file"),
])
def test_service_bad_input_is_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    done = run_onward("service", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert says in error_line(done.stderr)
    assert list(tmp_path.iterdir()) == []


def test_service_install_dry_run_exits_0(tmp_path: Path) -> None:
    done = run_onward("service", "install", "--name", "j", "--dry-run", "--", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert b"[Service]" in done.stdout


@pytest.mark.parametrize("args", [["jobs"], ["metrics"], ["status", "--json"], ["status", "--watch"], ["list"],
                                  ["logs"]])
def test_a_reader_that_goes_away_early_is_exit_0_and_says_nothing(job: Path, args: list[str]) -> None:
    """`onward metrics | head -1` under `set -o pipefail`: the reader closing its end is no error. click
    answers it itself, even outside standalone mode, with exit 1 (a task unknown or not done) for every
    command that did not catch it first (jobs, metrics, status on a store with a worker, --watch)."""
    import subprocess

    p = subprocess.Popen(onward_argv(*args), cwd=job, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before anything is written: its first write meets a closed pipe
    err = p.stderr.read()
    assert p.wait(timeout=60) == 0, err
    assert err == b""
