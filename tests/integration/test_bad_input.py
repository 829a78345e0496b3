"""Hostile input on the command line and through the Python API: one line on stderr, exit status 2, and
nothing created or changed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_onward


def files_under(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def assert_one_line_exit_2(r, needle: str = "") -> str:  # type: ignore[no-untyped-def]
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
def test_non_utf8_task_arguments_are_one_line_exit_2(tmp_path: Path, argv: list) -> None:  # type: ignore[type-arg]
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

    with pytest.raises(UsageError, match="finite"):
        Job(str(tmp_path / "s.db"), **{field: value})
    job = Job(str(tmp_path / "s.db"))

    @job.task
    def handle(task: str, ctx: object) -> str:
        return task

    job.add(["a"])
    with pytest.raises(UsageError, match="finite"):
        job.run(**{field: value})
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
