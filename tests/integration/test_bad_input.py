"""Hostile input on the command line and through the Python API: one line on stderr, exit status 2, and
nothing created or changed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_onward


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def assert_one_line_exit_2(r: subprocess.CompletedProcess[bytes], needle: str = "") -> str:
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, (r.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error:"), err
    assert needle in lines[0], err
    return lines[0]


@pytest.mark.parametrize("argv", [
    ["add", b"bad\xff"],
    ["result", b"bad\xff"],
    ["retry", b"bad\xff"],
    ["logs", "--task", b"bad\xff"],
    ["steps", b"bad\xff"],
])
def test_non_utf8_task_arguments_are_one_line_exit_2(tmp_path: Path, argv: list[str | bytes]) -> None:
    db = tmp_path / "s.db"
    assert run_onward("add", "--db", str(db), "x").returncode == 0
    before = files_under(tmp_path)
    args = [os.fsdecode(a) if isinstance(a, bytes) else a for a in argv]
    r = run_onward(args[0], "--db", str(db), *args[1:])
    assert_one_line_exit_2(r, "UTF-8")
    assert files_under(tmp_path) == before


RUN_FLOATS = ["--retry-delay", "--timeout", "--heartbeat", "--lease", "--grace", "--stall-timeout"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "Infinity"])
@pytest.mark.parametrize("argv", [
    *(["run", flag] for flag in RUN_FLOATS),
    ["supervise", "--restart-delay"], ["supervise", "--window"], ["supervise", "--watchdog"],
    ["service", "install", "--name", "x", "--dry-run", "--watchdog"],
])
def test_nan_and_infinity_are_refused_by_every_float_flag(tmp_path: Path, argv: list[str], value: str) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    extra = ["--db", str(tmp_path / "s.db"), "--tasks", str(tasks)] if argv[0] == "run" else []
    before = files_under(tmp_path)
    r = run_onward(*argv, value, *extra, "--", "true", timeout=30)
    assert_one_line_exit_2(r, "finite")
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("field", ["retry_delay", "timeout", "heartbeat", "grace", "stall_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_the_python_api_refuses_nan_and_infinity(tmp_path: Path, field: str, value: float) -> None:
    from onward import Job, UsageError

    setting: dict[str, Any] = {field: value}
    with pytest.raises(UsageError, match="finite"):
        Job(str(tmp_path / "s.db"), **setting)
    job = Job(str(tmp_path / "s.db"))

    @job.task
    def handle(task: str, ctx: object) -> str:
        return task

    job.add(["a"])
    with pytest.raises(UsageError, match="finite"):
        job.run(**setting)
    assert job.store.counts()["pending"] == 1
    job.close()


def test_max_result_bytes_zero_is_refused(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    before = files_under(tmp_path)
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--max-result-bytes", "0",
                   "--", "true")
    assert_one_line_exit_2(r, "--max-result-bytes")
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("url", [
    "mysql://user:hunter2@db.example/jobs", "https://example.com/store", "file:x.db", "sqlite:relative.db",
    "sqlite://host/x.db", "redis:x", "my.db:v2",
])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_unknown_store_url_forms_are_refused_and_create_nothing(tmp_path: Path, url: str, how: str) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    before = files_under(tmp_path)
    for argv in (["add", "a"], ["run", "--tasks", str(tasks), "--", "true"], ["status"], ["list"]):
        if how == "flag":
            r = run_onward(argv[0], "--db", url, *argv[1:], cwd=tmp_path)
        else:
            r = run_onward(*argv, cwd=tmp_path, env={"ONWARD_DB": url})
        line = assert_one_line_exit_2(r, "store")
        assert "hunter2" not in line
        assert sorted(tmp_path.rglob("*")) == sorted(before), argv  # no folder named "mysql:", no x.db
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("url", ["file:x.db", "mysql://u@h/db", "POSTGRES:nothing"])
def test_job_refuses_unknown_store_url_forms(tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from onward import Job
    from onward.errors import StoreError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError, match="store"):
        Job(url)
    monkeypatch.setenv("ONWARD_DB", url)
    with pytest.raises(StoreError, match="store"):
        Job()
    assert list(tmp_path.iterdir()) == []


def test_store_url_schemes_are_case_insensitive(tmp_path: Path) -> None:
    from tests import pgutil

    r = run_onward("add", "--db", "SQLite:///rel/s.db", "a", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rel" / "s.db").is_file()
    r = run_onward("add", "--db", f"sqlite:///{tmp_path}/abs.db", "a", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "abs.db").is_file()
    with pgutil.fresh_database() as url:
        shouted = "POSTGRESQL" + url[len("postgresql"):]
        r = run_onward("add", "--db", shouted, "a")
        assert r.returncode == 0, r.stderr
        r = run_onward("list", "--db", "Postgres" + url[len("postgresql"):])
        assert r.returncode == 0 and r.stdout == b"a\n", r.stderr


@pytest.mark.parametrize("kind", ["fifo", "chardev", "socket"])
@pytest.mark.parametrize("command", [["run", "--", "true"], ["status"], ["list"], ["add", "a"], ["logs"]])
def test_a_store_that_is_not_a_regular_file_is_refused_before_opening(tmp_path: Path, kind: str,
                                                                      command: list[str]) -> None:
    import socket
    import stat

    db = tmp_path / "s.db"
    if kind == "fifo":
        os.mkfifo(db)
    elif kind == "chardev":
        os.mknod(db, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # what /dev/null is
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(db))
    before = sorted(tmp_path.iterdir())
    r = run_onward(command[0], "--db", str(db), *command[1:], timeout=30)
    assert_one_line_exit_2(r, "not a regular file")
    assert sorted(tmp_path.iterdir()) == before  # no -journal, -wal or -shm beside it


@pytest.mark.parametrize("argv", [
    ["run", "--tasks", "MISSING", "--", "true"],
    ["run", "--tasks", "BAD", "--", "true"],
    ["add", "--tasks", "MISSING"],
    ["add", "--tasks", "BAD"],
    ["run", "--", "true"],
])
def test_refused_input_creates_no_postgres_schema(tmp_path: Path, argv: list[str]) -> None:
    from tests import pgutil

    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff\n")
    argv = [str(tmp_path / "missing.txt") if a == "MISSING" else str(tmp_path / "bad.txt") if a == "BAD" else a
            for a in argv]
    with pgutil.fresh_database() as url:
        r = run_onward(argv[0], "--db", url, *argv[1:])
        assert_one_line_exit_2(r)
        import psycopg

        with psycopg.connect(url) as conn:
            schemas = [row[0] for row in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname = 'onward'")]
        assert schemas == []


@pytest.mark.parametrize("prepare", ["new", "empty"])
def test_run_without_tasks_on_an_empty_store_says_so(tmp_path: Path, prepare: str) -> None:
    db = tmp_path / "store" / "s.db"
    if prepare == "empty":
        assert run_onward("db", "upgrade", "--db", str(db)).returncode == 0
    before = files_under(tmp_path)
    r = run_onward("run", "--db", str(db), "--", "true", cwd=tmp_path)
    assert_one_line_exit_2(r, "no tasks: give --tasks FILE or onward add")
    assert files_under(tmp_path) == before
    assert not (tmp_path / ".onward").exists()
    r = run_onward("run", "--", "true", cwd=tmp_path)  # the default store
    assert_one_line_exit_2(r, "no tasks")
    assert not (tmp_path / ".onward").exists()
