"""A command that cannot run: refused at start with its name (exit 2, nothing written), and named in the
attempt's error when it vanishes while the job runs."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest

from tests.conftest import run_onward


def nothing_written(store_url: str) -> bool:
    """No store (SQLite: no file, no folder; PostgreSQL: no onward schema) was created."""
    if "://" not in store_url:
        return not Path(store_url).parent.exists()
    import psycopg

    with psycopg.connect(store_url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'onward'"
                            ).fetchone() == (0,)


def executable(path: Path, text: str = "#!/bin/sh\necho ok\n") -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("case", ["absolute", "on-path", "not-executable", "directory", "off-the-child-path"])
def test_a_command_that_cannot_run_is_refused_at_start_naming_it(store_url: str, tmp_path: Path,
                                                                  case: str) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    env = None
    if case == "absolute":
        program = "/no/such/cmd"
    elif case == "on-path":
        program = "onward-no-such-cmd"
    elif case == "not-executable":
        program = str(tmp_path / "script.sh")
        executable(Path(program)).chmod(0o644)
    elif case == "directory":
        program = str(tmp_path)
    else:
        # Executable, but in a folder that is not on the PATH the command will get.
        executable(tmp_path / "elsewhere-cmd")
        program = "elsewhere-cmd"
        env = {"PATH": "/usr/bin:/bin"}
    r = run_onward("run", "--db", store_url, "--tasks", str(tasks), "--", program, "{task}", env=env)
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("onward: error: "), err
    assert program in err, err
    assert "Traceback" not in err
    assert nothing_written(store_url)


def test_a_command_found_on_the_path_the_child_gets_runs(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "my-cmd", '#!/bin/sh\nprintf "got %s" "$1"\n')
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "x").returncode == 0
    r = run_onward("run", "--db", db, "--", "my-cmd", "{task}", env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    assert run_onward("result", "--db", db, "x").stdout == b"got x"


def test_a_command_made_of_the_task_text_is_checked_per_attempt(tmp_path: Path) -> None:
    """`-- {task}`: which program runs depends on the task, so nothing can be checked at start; a task
    naming a missing program fails with that name."""
    db = str(tmp_path / "s.db")
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("true\n/no/such/prog\n")
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--max-attempts", "1", "--", "{task}")
    assert r.returncode == 3, r.stderr
    assert "cannot run /no/such/prog: No such file or directory" in r.stderr.decode()


def test_a_command_that_vanishes_mid_job_fails_its_attempts_with_its_name(store_url: str, tmp_path: Path) -> None:
    program = executable(tmp_path / "once.sh", '#!/bin/sh\nrm -f "$0"\necho "ran $1"\n')
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("first\nsecond\n")
    r = run_onward("run", "--db", store_url, "--tasks", str(tasks), "--max-attempts", "1", "--", str(program),
                   "{task}")
    err = r.stderr.decode()
    assert r.returncode == 3, err
    expected = f"cannot run {program}: No such file or directory"
    assert expected in err, err
    errors = json.loads(run_onward("status", "--db", store_url, "--json").stdout)["errors"]
    assert [e["error"] for e in errors] == [expected], errors
    assert run_onward("result", "--db", store_url, "first").stdout == b"ran first\n"
    if "://" not in store_url:
        c = sqlite3.connect(store_url)
        assert c.execute("SELECT state, error FROM tasks WHERE name = 'second'").fetchone() == ("failed", expected)
        c.close()


@pytest.mark.parametrize("spawn", ["clone", "spawner", "fork"])
def test_a_script_whose_interpreter_is_missing_fails_naming_the_interpreter(tmp_path: Path, spawn: str) -> None:
    """A script whose `#!` line names an interpreter that is not there: `execve` says ENOENT, and the
    attempt said `cannot run SCRIPT: No such file or directory` of a script that is plainly there. It now
    names the missing interpreter too, on every way a command is started; a script that is really gone
    keeps the plain words."""
    script = executable(tmp_path / "job.sh", "#!/no/such/interpreter -x\necho ok\n")
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    db = str(tmp_path / "s.db")
    r = run_onward("run", "--db", db, "--tasks", str(tasks), "--max-attempts", "1", "--", str(script),
                   env={"ONWARD_SPAWN": spawn})
    err = r.stderr.decode()
    assert r.returncode == 3, err
    expected = (f"cannot run {script}: No such file or directory (its interpreter /no/such/interpreter was not"
                " found)")
    c = sqlite3.connect(db)
    assert c.execute("SELECT state, error FROM tasks").fetchall() == [("failed", expected)], err
    c.close()
