"""Hostile input on the command line and through the Python API: one line on stderr, exit status 2, and
nothing created or changed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from onward import Job, UsageError
from onward.log import QUIET
from tests.conftest import onward_argv, run_onward


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


# --- the hostile twins found by an audit of every input -------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["run", "--heartbeat", "0.001"], ["run", "--heartbeat", "1e-300"],
    ["run", "--timeout", "1e10"], ["run", "--heartbeat", "99999999999999999999999"],
    ["run", "--heartbeat", "999999"],  # within the bound, but its default lease (3 heartbeats) was not
    ["supervise", "--restart-delay", "1e10"], ["supervise", "--window", "1e300"],
    ["supervise", "--watchdog", "1e10"], ["status", "--watch", "--interval", "1e10"],
    ["logs", "-n", "9223372036854775808"], ["logs", "-n", "99999999999999999999999"],
])
def test_numbers_too_small_or_too_large_for_what_they_set_are_refused(tmp_path: Path, argv: list[str]) -> None:
    """A heartbeat of a millisecond (workers then take each other's tasks until all have failed), a
    duration past what a timer holds (the supervisor crashed at its first restart, ``status --watch``
    after its first report), a line count past what SQLite's integers hold: one line, exit 2."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a").returncode == 0
    before = files_under(tmp_path)
    extra = {"run": ["--db", db, "--tasks", str(tasks), "--", "true"], "supervise": ["--", "true"],
             "status": ["--db", db], "logs": ["--db", db]}[argv[0]]
    r = run_onward(*argv, *extra, timeout=30)
    assert_one_line_exit_2(r)
    assert files_under(tmp_path) == before


def test_a_send_nested_too_deeply_is_one_line_exit_2(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "b").returncode == 0
    before = files_under(tmp_path)
    r = run_onward("send", "--db", db, "b", "k", "[" * 10_000 + "]" * 10_000)
    assert_one_line_exit_2(r, "nested too deeply")
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("option", ["--out", "--db", "--tasks", "--keep-awake"])
def test_an_empty_path_option_is_one_line_exit_2(tmp_path: Path, option: str) -> None:
    """An empty value was taken for the option not given: ``--out ""`` ran and wrote no result file without
    a word, ``--db ""`` used the default store, ``--tasks ""`` said there were no tasks."""
    (tmp_path / "t").write_text("a\n")
    before = files_under(tmp_path)
    argv = ["run", "--tasks", "t", option, "", "--", "true"]
    r = run_onward(*argv, cwd=tmp_path)
    assert_one_line_exit_2(r, f"'{option}': must not be empty")
    assert files_under(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["t"]


@pytest.mark.parametrize("location", ["nd/x/", "x/", "sqlite:///nd/y/"])
def test_a_store_location_ending_with_a_slash_is_refused_before_any_folder_is_made(tmp_path: Path,
                                                                                  location: str) -> None:
    """``--db nd/x/`` made the folders nd/x and the output folder, then failed to create the store in them."""
    (tmp_path / "t").write_text("a\n")
    r = run_onward("run", "--tasks", "t", "--db", location, "--out", "o", "--", "true", cwd=tmp_path)
    assert_one_line_exit_2(r, "names a folder: give a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


def test_a_send_with_a_name_twice_in_one_object_is_one_line_exit_2(tmp_path: Path) -> None:
    """JSON text naming one key twice: json.loads kept the last value, and the first was lost without a word."""
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "b").returncode == 0
    before = files_under(tmp_path)
    r = run_onward("send", "--db", db, "b", "k", '{"answer": {"ok": true, "ok": false}}')
    assert_one_line_exit_2(r, "the name 'ok' appears twice in one object")
    assert files_under(tmp_path) == before


def test_job_send_refuses_an_object_key_that_is_not_a_string(tmp_path: Path) -> None:
    """``Job.send`` stored ``{1: "a", "1": "b"}`` as ``{"1": "a", "1": "b"}``: the task received ``{"1": "b"}``,
    "a" lost without a word (results and step values refuse such keys already)."""
    db = str(tmp_path / "s.db")
    job = Job(db, log_level=QUIET)
    job.add(["b"])
    with pytest.raises(UsageError, match="the object key 1 is not a string"):
        job.send("b", "k", {1: "a", "1": "b"})
    assert job.send("b", "k", {"1": "b"}) == "stored"  # nothing was stored by the refused one
    job.close()


@pytest.mark.parametrize("name", [":memory:", "sqlite:///:memory:"])
def test_a_store_in_memory_is_refused_and_leaves_no_file(tmp_path: Path, name: str) -> None:
    r = run_onward("add", "--db", name, "a", cwd=tmp_path)
    assert_one_line_exit_2(r, "in memory")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("what", ["an empty file", "a database of another program's with no table"])
@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["list"], ["logs"], ["jobs"], ["pause"],
                                     ["retry", "--failed"], ["cancel", "a"], ["result", "a"], ["metrics"]])
def test_reading_commands_leave_a_file_with_no_store_in_it_alone(tmp_path: Path, what: str,
                                                                  command: list[str]) -> None:
    """What is no store yet (a zero-byte file; an SQLite database of another program's, with no table) is
    "no onward store" to every command but run and add: nothing written, not even WAL mode."""
    db = tmp_path / "s.db"
    if what == "an empty file":
        db.write_bytes(b"")
    else:
        import sqlite3

        c = sqlite3.connect(db)
        c.execute("PRAGMA user_version = 7")
        c.commit()
        c.close()
    os.chmod(db, 0o644)
    before = {p: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.iterdir()}
    r = run_onward(command[0], "--db", str(db), *command[1:])
    assert_one_line_exit_2(r, "no onward store")
    assert {p: (p.read_bytes(), p.stat().st_mode) for p in tmp_path.iterdir()} == before


def test_add_takes_an_empty_file_over_as_a_private_store(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    db.write_bytes(b"")
    os.chmod(db, 0o644)
    assert run_onward("add", "--db", str(db), "a").returncode == 0
    assert db.stat().st_mode & 0o777 == 0o600 and db.stat().st_size > 0


def test_state_folders_are_private_at_every_level_whatever_the_umask(tmp_path: Path) -> None:
    """The store's missing parents, the output folder's and the keep-awake marker's: 0700 each, also under
    ``umask 000`` (os.makedirs gave the parents it made the umask's mode)."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    r = subprocess.run(["sh", "-c", 'umask 000; exec "$@"', "sh", *onward_argv(
        "run", "--db", "p/q/s.db", "--tasks", str(tasks), "--out", "o1/o2", "--keep-awake", "k1/k2/m", "--",
        "echo", "hi")], cwd=tmp_path, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for folder in ("p", "p/q", "o1", "o1/o2", "k1", "k1/k2"):
        assert (tmp_path / folder).stat().st_mode & 0o777 == 0o700, folder
    assert (tmp_path / "p/q/s.db").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("flag", ["--out", "--keep-awake"])
def test_a_path_refused_for_a_name_too_long_leaves_no_folder_behind(tmp_path: Path, flag: str) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    before = sorted(tmp_path.rglob("*"))
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), flag,
                   str(tmp_path / "new1" / "new2" / ("b" * 300)), "--", "true")
    assert_one_line_exit_2(r)
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("marker", ["/sys/onward-marker", "/proc/onward-marker"])
def test_a_keep_awake_marker_where_no_file_can_be_made_is_refused_even_as_root(tmp_path: Path, marker: str) -> None:
    """access() says yes to root everywhere, so a marker in /sys or /proc was taken, the store made, and a
    warning given at every heartbeat: the folder takes no new file whoever asks. A file made and removed at
    once tells."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\n")
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--keep-awake", marker, "--", "true")
    assert_one_line_exit_2(r, f"keep-awake marker {marker} cannot be created")
    # Not "/proc: No such file or directory" (what /proc answers for a file it does not know), as if it
    # did not exist.
    assert "No such file" not in r.stderr.decode(), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tasks.txt"]


@pytest.mark.parametrize("sibling", ["-wal", "-shm"])
@pytest.mark.parametrize("command", [["run", "--", "true"], ["status"]])
def test_a_fifo_where_sqlite_keeps_its_log_is_bad_input_not_a_passing_fault(tmp_path: Path, sibling: str,
                                                                          command: list[str]) -> None:
    """A FIFO at STORE-shm made every open a "disk I/O error", exit 75, which a supervisor restarts for good
    (and left an empty -wal behind); it is bad input, and it stays."""
    db = tmp_path / "s.db"
    assert run_onward("add", "--db", str(db), "a").returncode == 0
    for leftover in (tmp_path / "s.db-wal", tmp_path / "s.db-shm"):
        leftover.unlink(missing_ok=True)
    os.mkfifo(str(db) + sibling)
    before = files_under(tmp_path)
    r = run_onward(command[0], "--db", str(db), *command[1:])
    assert_one_line_exit_2(r, f"s.db{sibling} is not a regular file")
    assert files_under(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.db", f"s.db{sibling}"]


@pytest.mark.parametrize("sibling", ["-wal", "-shm"])
@pytest.mark.parametrize("leads_to", ["a file", "nothing"])
@pytest.mark.parametrize("command", [["run", "--", "true"], ["status"]])
def test_a_symbolic_link_where_sqlite_keeps_its_log_is_bad_input_named_as_such(
        tmp_path: Path, sibling: str, leads_to: str, command: list[str]) -> None:
    """SQLite opens no symbolic link for its log or the log's index, whether it leads to a file or not:
    every open was "unable to open database file", naming no cause. It is named, exit 2, nothing changed."""
    db = tmp_path / "s.db"
    assert run_onward("add", "--db", str(db), "a").returncode == 0
    for leftover in (tmp_path / "s.db-wal", tmp_path / "s.db-shm"):
        leftover.unlink(missing_ok=True)
    target = tmp_path / "elsewhere"
    if leads_to == "a file":
        target.write_bytes(b"")
    os.symlink(target, str(db) + sibling)
    before = files_under(tmp_path)
    r = run_onward(command[0], "--db", str(db), *command[1:])
    assert_one_line_exit_2(r, f"s.db{sibling} is a symbolic link")
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("source", ["/dev/zero", "a pipe of zeros", "stdin of zeros"])
def test_an_endless_line_from_a_device_or_pipe_is_refused_without_reading_it_all(tmp_path: Path,
                                                                                source: str) -> None:
    """A tasks "file" that is a device or a pipe is read line by line like a file: its first line, longer
    than any task may be, is refused at once. It was read whole first: /dev/zero took all the memory there
    was. The memory limit makes a whole read fail (MemoryError) instead of taking the machine's."""
    feeder = None
    if source == "/dev/zero":
        argv, stdin = ["--tasks", "/dev/zero"], None
    elif source == "a pipe of zeros":
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        feeder = subprocess.Popen(["sh", "-c", f"exec cat /dev/zero > {fifo}"])
        argv, stdin = ["--tasks", str(fifo)], None
    else:
        argv, stdin = ["--tasks", "-"], subprocess.Popen(["cat", "/dev/zero"], stdout=subprocess.PIPE).stdout
    try:
        r = subprocess.run(["sh", "-c", 'ulimit -v 1000000; exec "$@"', "sh",
                            *onward_argv("add", "--db", str(tmp_path / "s.db"), *argv)],
                           stdin=stdin, capture_output=True, timeout=60)
    finally:
        if feeder is not None:
            feeder.kill()
            feeder.wait()
    assert_one_line_exit_2(r, "longer than 4096 bytes")
    assert not (tmp_path / "s.db").exists()


def test_tasks_from_a_closed_stdin_is_one_line_exit_2(tmp_path: Path) -> None:
    r = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh",
                        *onward_argv("add", "--db", str(tmp_path / "s.db"), "--tasks", "-")],
                       capture_output=True, timeout=60)
    assert_one_line_exit_2(r, "stdin is closed")
    assert not (tmp_path / "s.db").exists()


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["list"], ["logs"], ["jobs"], ["metrics"]])
def test_a_report_written_to_a_full_disk_is_one_line_exit_75(tmp_path: Path, command: list[str]) -> None:
    """stdout on a full disk (/dev/full): the machine's fault, not the input's; no traceback."""
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    with open("/dev/full", "wb") as full:
        r = subprocess.run(onward_argv(command[0], "--db", db, *command[1:]), stdout=full,
                           stderr=subprocess.PIPE, timeout=60)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 75, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error:") and "No space left" in lines[0], err


@pytest.mark.parametrize("limit", [6, 8, 10, 12])
def test_no_descriptor_left_is_exit_75_without_a_traceback(tmp_path: Path, limit: int) -> None:
    """An exhausted ``ulimit -n`` at start-up, wherever it strikes (the store, the tasks file, the worker's
    own descriptors): one error line, exit 75 (try again later), never a traceback nor exit 2."""
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    r = subprocess.run(["sh", "-c", f'ulimit -n {limit}; exec "$@"', "sh",
                        *onward_argv("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tasks), "--",
                                     "echo", "hi")], capture_output=True, timeout=60)
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 75, err
    assert "Traceback" not in err
    errors = [line for line in err.strip().splitlines() if "onward: error:" in line]
    assert len(errors) == 1 and "Too many open files" in errors[0], err


def test_no_descriptor_left_for_an_existing_store_or_output_folder_is_exit_75_not_2(tmp_path: Path) -> None:
    """The same on a store that exists, at each limit from the first SQLite open up: SQLite's open failed
    with "unable to open database file" (no cause given), the header check with EMFILE, and the output
    folder's check with EMFILE, and each was taken for a bad location, exit 2 (which neither systemd nor
    `onward supervise` restarts); without --out, tempfile's search for the heartbeat files' folder failed
    with its "no usable temporary directory" traceback, exit 1. Each is exit 75 now, in one line, and the
    store is left as it was."""
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    before = (tmp_path / "s.db").read_bytes()
    seen = []
    for limit, out in [(limit, out) for limit in range(5, 10) for out in (["--out", str(tmp_path / "out")], [])]:
        r = subprocess.run(["sh", "-c", f'ulimit -n {limit}; exec "$@"', "sh",
                            *onward_argv("run", "-q", "--db", db, *out, "--", "echo")],
                           capture_output=True, timeout=60)
        err = r.stderr.decode(errors="replace")
        seen.append((limit, r.returncode, err.strip()))
        assert r.returncode == 75, seen
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, seen
        assert "Too many open files" in err, seen
    assert (tmp_path / "s.db").read_bytes() == before
    assert any("unable to open database file" in err for _, _, err in seen), seen  # each place was met
    assert any("output folder" in err for _, _, err in seen), seen
    # A command that writes (pause, resume) whose journal probe found no descriptor treats that sync as
    # failed and guards the log with a lock taken through fcntl, which it imported only then: loading that
    # C extension took a descriptor too, and the command died with an ImportError traceback (exit 1).
    for limit, command in [(limit, command) for limit in range(5, 10) for command in ("pause", "resume")]:
        r = subprocess.run(["sh", "-c", f'ulimit -n {limit}; exec "$@"', "sh", *onward_argv(command, "--db", db)],
                           capture_output=True, timeout=60)
        err = r.stderr.decode(errors="replace")
        assert r.returncode in (0, 75) and "Traceback" not in err, (limit, command, r.returncode, err)
        assert r.returncode == 0 or len(err.strip().splitlines()) == 1, (limit, command, err)


@pytest.mark.parametrize("command", [
    ["send", "zz", "k", "1"], ["send", "a", "k", "1"], ["retry", "a"], ["retry", "zz"], ["retry", "--failed"],
    ["cancel", "a"], ["pause"], ["resume"],
])
def test_a_refused_or_no_op_command_leaves_the_store_file_untouched(tmp_path: Path, command: list[str]) -> None:
    """Not its bytes and not its mtime either: a backup or a make-style tool that goes by the mtime must not
    see a change where none was made (the journal probe after a durable commit that wrote nothing touched it)."""
    db = tmp_path / "s.db"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    assert run_onward("run", "--db", str(db), "--tasks", str(tasks), "-q", "--", "true").returncode == 0
    if command == ["resume"]:
        assert run_onward("resume", "--db", str(db)).returncode == 0  # resuming a running job: nothing to do
    else:
        assert run_onward("pause", "--db", str(db)).returncode == 0
    os.utime(db, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    r = run_onward(command[0], "--db", str(db), *command[1:])
    assert r.returncode in (0, 1), r.stderr
    assert b"Traceback" not in r.stderr
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == before, r.stdout + r.stderr


ESCAPE = "\x1b]0;pwned\x07\x1b[2J"  # retitles the terminal, then clears it


@pytest.mark.parametrize("args", [
    ["add", "--tasks", f"nofile{ESCAPE}"],
    ["logs", "--since", ESCAPE],
    ["status", "--db", f"x{ESCAPE}"],
    ["run", "--tasks", "t.txt", "--", f"/bin/nope{ESCAPE}"],
    ["result", f"ok\udcff{ESCAPE}"],  # bytes that are not UTF-8 as well (\xff)
])
def test_an_error_line_quoting_the_users_input_shows_control_characters_escaped(args: list[str],
                                                                             tmp_path: Path) -> None:
    """The error line quoted what the user gave raw: a file name, a time, a store path or a command holding an
    escape sequence reached the terminal, which it could retitle or clear (the status, logs and watch of a
    task's text escaped them already)."""
    (tmp_path / "t.txt").write_text("a\n")
    done = run_onward(*args, "--db", str(tmp_path / "s.db")) if "--db" not in args else run_onward(*args)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert err.count("\n") == 1 and "\x1b" not in err and "\x07" not in err, err
    assert "\\x1b]0;pwned\\x07" in err, err
    assert not (tmp_path / "s.db").exists()


def test_a_store_found_corrupt_by_a_running_worker_ends_it_with_one_line_exit_2(tmp_path: Path) -> None:
    """A damaged page in the middle of the tasks, met by a worker's claim: it retried every few seconds for good
    ("store error, will retry: ... is corrupt ...; it was left untouched", though it went on writing), its
    finished task uncommitted and leased, and nothing flagged under a supervisor. It stops: exit 2, one line."""
    db = tmp_path / "s.db"
    (tmp_path / "t.txt").write_text("".join(f"k{i}\n" for i in range(3000)))
    assert run_onward("add", "--db", str(db), "--tasks", str(tmp_path / "t.txt")).returncode == 0
    import sqlite3

    with sqlite3.connect(db) as c:
        pages, size = c.execute("PRAGMA page_count").fetchone()[0], c.execute("PRAGMA page_size").fetchone()[0]
    with open(db, "r+b") as f:  # a page about halfway through the file: the tasks' rows and their index
        f.seek(pages // 2 * size + 100)
        f.write(b"\xff" * 2000)
    done = run_onward("run", "--db", str(db), "-q", "--", "true", timeout=120)
    err = assert_one_line_exit_2(done, "is corrupt (database disk image is malformed)")
    assert "onward writes nothing more to it" in err, err
