"""`onward status` through the installed console script answers a plain SQLite store without click or rich
(onward.entry, status.print_plain_status), and must print exactly what the full command prints: the same
stdout, stderr and exit status, whatever the store, the options and the environment.

The reference is the click command itself (``onward.cli``), run with FORCE_COLOR set to "": rich then takes
stdout for what it is (not a terminal), and the text goes through rich as it always did, while the console
script's plain path writes the same lines itself. Whether the quick path answered is read from Python's
import profile (``-X importtime``): click loaded or not."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onward.store import open_store
from tests.conftest import ONWARD_SCRIPT, onward_argv, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")
CLICK_CLI = [sys.executable, "-c", "from onward.cli import cli_main; cli_main()"]


def env_with(extra: dict[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ONWARD_DB", "ONWARD_JOB", "FORCE_COLOR",
                                                             "TTY_COMPATIBLE")}
    env.setdefault("PYTHONPATH", SRC)
    env.update(extra or {})
    return env


def console_script(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
                   ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(onward_argv(*args), capture_output=True, env=env_with(env), cwd=cwd, timeout=120)


def click_command(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None
                  ) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*CLICK_CLI, *args], capture_output=True, env=env_with({"FORCE_COLOR": "", **(env or {})}),
                          cwd=cwd, timeout=120)


def quick_path_answered(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> bool:
    r = console_script(*args, env={**(env or {}), "PYTHONPROFILEIMPORTTIME": "1"}, cwd=cwd)
    loaded = {line.rsplit("|", 1)[1].strip() for line in r.stderr.decode().splitlines()
              if line.startswith("import time:") and "|" in line}
    assert "onward.entry" in loaded  # the profile is there, and the console script is the new entry point
    return "click" not in loaded


def assert_same(*args: str, quick: bool, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    """The console script and the click command print the same for ``args``; the quick path answered or not,
    as ``quick`` says. Returns the console script's stdout and stderr."""
    ours, reference = console_script(*args, env=env, cwd=cwd), click_command(*args, env=env, cwd=cwd)
    assert (ours.stdout.decode(errors="replace"), ours.stderr.decode(errors="replace"), ours.returncode) == (
        reference.stdout.decode(errors="replace"), reference.stderr.decode(errors="replace"), reference.returncode)
    assert ours.stdout == reference.stdout and ours.stderr == reference.stderr  # byte for byte
    assert quick_path_answered(*args, env=env, cwd=cwd) is quick, args
    return (ours.stdout + ours.stderr).decode()


def add(db: str, *tasks: str, job: str | None = None) -> None:
    r = run_onward("add", "--db", db, *(["--job", job] if job else []), *tasks)
    assert r.returncode == 0, r.stderr


def age_completions(db: str, seconds: float) -> None:
    """Move every finish time ``seconds`` back: completions older than the rate's minute, so the report is
    the same whenever it is read (a job done within the minute has a rate that changes from read to read)."""
    with sqlite3.connect(db) as con:
        con.execute("UPDATE tasks SET finished_at = finished_at - ? WHERE finished_at IS NOT NULL", (seconds,))
    con.close()


def test_the_console_script_is_the_new_entry_point() -> None:
    if not ONWARD_SCRIPT.exists():
        pytest.skip("no console script installed beside this interpreter")
    assert "from onward.entry import main" in ONWARD_SCRIPT.read_text()


def test_a_fresh_store(tmp_path: Path) -> None:
    db = str(tmp_path / "fresh.db")
    add(db, "one")
    text = assert_same("status", "--db", db, quick=True)
    assert "total 1   pending 1" in text and "no worker running" in text
    assert_same("status", "--json", "--db", db, quick=True)
    assert_same("status", f"--db={db}", "--json", quick=True)


def test_the_default_store_and_onward_db(tmp_path: Path) -> None:
    add(str(tmp_path / ".onward" / "onward.db"), "a", "b")
    assert ".onward/onward.db" in assert_same("status", quick=True, cwd=tmp_path)
    other = str(tmp_path / "other.db")
    add(other, "x")
    assert other in assert_same("status", quick=True, env={"ONWARD_DB": other}, cwd=tmp_path)
    assert_same("status", "--json", quick=True, env={"ONWARD_DB": other}, cwd=tmp_path)
    # --db wins over ONWARD_DB, as in the full command.
    assert other in assert_same("status", "--db", other, quick=True, env={"ONWARD_DB": "elsewhere.db"})


def test_jobs_by_option_and_by_onward_job(tmp_path: Path) -> None:
    db = str(tmp_path / "jobs.db")
    add(db, "x", "y", job="nightly")
    assert "job nightly" in assert_same("status", "--db", db, "--job", "nightly", quick=True)
    assert_same("status", "--db", db, "--job=nightly", "--json", quick=True)
    assert "job nightly" in assert_same("status", "--db", db, quick=True, env={"ONWARD_JOB": "nightly"})
    add(db, "z")  # makes the job "default" (a store holds it only once something made it)
    assert_same("status", "--db", db, quick=True, env={"ONWARD_JOB": ""})  # empty: the default job
    # A job that is not there, and a name that breaks the rule: the full command's errors.
    assert "no job 'other'" in assert_same("status", "--db", db, "--job", "other", quick=False)
    assert "bad job name" in assert_same("status", "--db", db, "--job", "a/b", quick=False)
    assert "bad job name" in assert_same("status", "--db", db, quick=False, env={"ONWARD_JOB": "a b"})


def test_finished_cancelled_paused_and_restarted_jobs(tmp_path: Path) -> None:
    db = str(tmp_path / "done.db")
    add(db, "t1", "t2", "t3")
    assert run_onward("run", "--db", db, "-q", "--", "true").returncode == 0
    # Done within the minute: a rate to show (over a window that grows from read to read), read by the full
    # command.
    assert not quick_path_answered("status", "--db", db)
    assert not quick_path_answered("status", "--db", db, "--json")
    age_completions(db, 3600)
    assert "eta 0s" in assert_same("status", "--db", db, quick=True)
    assert_same("status", "--db", db, "--json", quick=True)

    mixed = str(tmp_path / "mixed.db")
    add(mixed, "p1", "p2", "c1")
    assert run_onward("cancel", "--db", mixed, "c1").returncode == 0
    assert run_onward("pause", "--db", mixed).returncode == 0
    store = open_store(mixed)
    store.log_event("restart", detail="exit status 1", durable=True)
    store.close()
    text = assert_same("status", "--db", mixed, quick=True)
    assert "paused" in text and "cancelled 1" in text and "restarts 1" in text
    assert_same("status", "--db", mixed, "--json", quick=True)


def test_texts_that_need_escaping_or_are_wide(tmp_path: Path) -> None:
    for name in ("ev\x1b[2Jil\u202e.db", "漢字🎉é [bold]x[/bold] :smile:.db", "tab\tand  spaces .db"):
        db = str(tmp_path / name)
        add(db, "h")
        text = assert_same("status", "--db", db, quick=True)
        assert "\x1b" not in text and "\u202e" not in text
        assert_same("status", "--db", db, "--json", quick=True)


# A worker that leaves a task in each state: "ok" done, "bad" failed, "wait-me" waiting for a value, "hold"
# running until the file "go" exists; "later" stays pending behind it (concurrency 1), "drop" is cancelled.
WORKER = textwrap.dedent('''
    import os, sys, time
    from onward import Job
    db, side = sys.argv[1], sys.argv[2]
    job = Job(db, concurrency=1, max_attempts=1, heartbeat=0.3)

    @job.task
    def handle(task, ctx):
        if task == "bad":
            raise RuntimeError("broken on purpose")
        if task == "wait-me":
            return ctx.wait("approval")
        if task == "hold":
            open(os.path.join(side, "holding"), "w").close()
            while not os.path.exists(os.path.join(side, "go")):
                time.sleep(0.02)
        return "fine"

    sys.exit(job.run().exit_code)
''')

# What changes from one read to the next while a worker runs: ages, and the rate and ETA they lead to.
VOLATILE = ("heartbeat_age", "age", "progress_age", "rate_per_second", "eta_seconds")


def without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_volatile(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [without_volatile(v) for v in value]
    return value


@pytest.fixture
def every_state(tmp_path: Path) -> Iterator[str]:
    db = str(tmp_path / "states.db")
    add(db, "ok", "bad", "wait-me", "hold")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    worker = subprocess.Popen([sys.executable, str(script), db, str(tmp_path)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": SRC})
    try:
        wait_for(lambda: (tmp_path / "holding").exists(), 60, "the task 'hold' to run")
        add(db, "later", "drop")
        assert run_onward("cancel", "--db", db, "drop").returncode == 0
        yield db
    finally:
        (tmp_path / "go").touch()
        run_onward("send", "--db", db, "wait-me", "approval", '"yes"')
        try:
            worker.wait(timeout=60)
        finally:
            worker.kill()


def test_a_store_with_tasks_in_every_state_is_left_to_the_full_command(every_state: str) -> None:
    db = every_state
    assert not quick_path_answered("status", "--db", db)
    assert not quick_path_answered("status", "--db", db, "--json")
    ours = json.loads(console_script("status", "--db", db, "--json").stdout)
    reference = json.loads(click_command("status", "--db", db, "--json").stdout)
    assert {ours[s] for s in ("pending", "running", "waiting", "done", "failed", "cancelled")} == {1}
    assert without_volatile(ours) == without_volatile(reference)
    text, reference_text = (r.stdout.decode() for r in (console_script("status", "--db", db),
                                                        click_command("status", "--db", db)))
    numbers = re.compile(r"\d+(\.\d+)?")  # ages, rate and ETA move between the two reads; counts are above
    assert numbers.sub("#", text) == numbers.sub("#", reference_text)
    assert "latest errors" in text and "broken on purpose" in text and "waiting" in text


def test_stores_that_are_missing_or_not_plain_get_the_full_commands_answer(tmp_path: Path) -> None:
    fresh = str(tmp_path / "fresh.db")
    add(fresh, "one")
    assert "no onward store" in assert_same("status", "--db", str(tmp_path / "missing.db"), quick=False)
    assert "no onward store" in assert_same("status", "--json", "--db", str(tmp_path / "missing.db"), quick=False)
    (tmp_path / "adir").mkdir()
    assert "is a directory" in assert_same("status", "--db", str(tmp_path / "adir"), quick=False)
    (tmp_path / "notes.txt").write_text("not a database\n")
    assert "not an SQLite database" in assert_same("status", "--db", str(tmp_path / "notes.txt"), quick=False)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE things (a)")
    con.close()
    assert "another SQLite database" in assert_same("status", "--db", str(other), quick=False)
    for version, words in (("4", "older than"), ("99", "newer than")):
        copy = tmp_path / f"v{version}.db"
        shutil.copy(fresh, copy)
        with sqlite3.connect(copy) as con:
            con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
        con.close()
        assert words in assert_same("status", "--db", str(copy), quick=False)
    corrupt = tmp_path / "corrupt.db"
    data = bytearray(Path(fresh).read_bytes())
    data[100:4096] = bytes(range(256)) * 15 + bytes(range(156))
    corrupt.write_bytes(bytes(data))
    assert "corrupt" in assert_same("status", "--db", str(corrupt), quick=False)


def test_an_unreadable_store(tmp_path: Path) -> None:
    db = tmp_path / "locked.db"
    add(str(db), "one")
    db.chmod(0)
    try:
        # As root the file is still readable (and the quick path answers); otherwise the full command says
        # it cannot be read. Either way, both print the same.
        assert_same("status", "--db", str(db), quick=os.geteuid() == 0)
    finally:
        db.chmod(0o600)


def test_a_store_not_in_wal_mode_is_opened_by_the_full_command(tmp_path: Path) -> None:
    db = str(tmp_path / "rollback.db")
    add(db, "one")
    con = sqlite3.connect(db)
    con.execute("PRAGMA journal_mode = DELETE")
    con.close()
    assert not quick_path_answered("status", "--db", db)  # which switches it to WAL, as it always did
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()
    assert_same("status", "--db", db, quick=True)


def test_other_options_urls_and_environments_go_to_the_full_command(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    add(db, "one")
    for args in (("status", "--db", db, "--watch", "--json"), ("status", "--db", db, "--interval", "1"),
                 ("status", "--help"), ("status", "--db", db, "extra"), ("status", "--db", db, "--db", db),
                 ("status", "--json=1", "--db", db), ("status", "--db"), ("status", "--db", f"sqlite:///{db}"),
                 ("status", "--db", "mysql://u:secret@host/db"), ("status", "--db", "mysql:db")):
        assert_same(*args, quick=False)
    # A location in no accepted form that reaches the quick path (no "://" in it) is the full command's too.
    assert "unsupported store location" in assert_same("status", quick=False, env={"ONWARD_DB": "mysql:db"})
    assert "\x1b[" in assert_same("status", "--db", db, quick=False, env={"FORCE_COLOR": "1"})
    assert_same("status", "--db", db, quick=False, env={"PYTHONIOENCODING": "latin-1"})


def test_each_backend(store_url: str) -> None:
    # A PostgreSQL store (its URL holds "://") is the full command's; a SQLite one the quick path's.
    quick = not store_url.startswith("postgresql://")
    add(store_url, "one")
    assert_same("status", "--db", store_url, quick=quick)
    assert_same("status", "--db", store_url, "--json", quick=quick)


def test_a_reader_that_goes_away_early_is_no_error(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    add(db, "one")
    for args in (("status", "--db", db), ("status", "--db", db, "--json")):
        # stdout closed before anything is written: the write fails with EPIPE, quietly, status 0.
        read, write = os.pipe()
        os.close(read)
        proc = subprocess.run(onward_argv(*args), stdout=write, stderr=subprocess.PIPE, env=env_with(None),
                              timeout=120)
        os.close(write)
        assert (proc.returncode, proc.stderr) == (0, b""), args
