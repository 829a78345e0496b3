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
