"""What `onward status`, `onward logs` and the worker's log print, as a user reads them: through the installed
console script, on a real store, with real workers."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path
from typing import Any

from tests.conftest import onward_argv, run_onward, wait_for

# A screen clear, a window-title change ended by BEL, an 8-bit CSI, a right-to-left override, a carriage
# return: what a hostile or careless task can write to move a terminal's cursor or rewrite what it shows.
HOSTILE_STDERR = "\x1b[2J\x1b]0;pwned\x07 \u009b31m \u202eevil\r"
RAW_CONTROLS = ("\x1b", "\x07", "\u009b", "\u202e", "\r")


def assert_no_raw_controls(text: str) -> None:
    for char in RAW_CONTROLS:
        assert char not in text, f"raw {char!r} in {text!r}"


def test_escape_sequences_in_a_task_stderr_are_printed_escaped_but_stored_raw(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    hostile_name = "t\x1b[31m\u202e[bold]x[/bold]"
    assert run_onward("add", "--db", db, hostile_name).returncode == 0
    script = f"import sys; sys.stderr.write({HOSTILE_STDERR!r}); sys.exit(1)"
    worker = subprocess.run(
        onward_argv("run", "--db", db, "--max-attempts", "1", "-v", "--", "python3", "-c", script),
        capture_output=True, env=os.environ, timeout=120)
    log = worker.stderr.decode()
    assert worker.returncode == 3, log
    assert_no_raw_controls(log)
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in log  # shown escaped, not dropped

    shown = run_onward("status", "--db", db)
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout.decode()
    assert_no_raw_controls(text)
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in text and "[bold]x[/bold]" in text, text

    journal = run_onward("logs", "--db", db)
    assert journal.returncode == 0, journal.stderr
    assert_no_raw_controls(journal.stdout.decode())
    assert "\\x1b[2J\\x1b]0;pwned\\x07" in journal.stdout.decode()

    # The stored error is data: --json keeps it (JSON-escaped), and so does the task's name. Every --json
    # output escapes what `printable` escapes, U+202E included (json.dumps wrote it raw: a terminal showing
    # the line reordered it).
    outputs = {args: run_onward(*args[:1], "--db", db, *args[1:]) for args in (
        ("status", "--json"), ("logs", "--json"), ("list", "--json"))}
    for args, r in outputs.items():
        assert r.returncode == 0, (args, r.stderr)
        assert_no_raw_controls(r.stdout.decode())
        assert "\\u202e" in r.stdout.decode(), args
    report = json.loads(outputs[("status", "--json")].stdout)
    (error,) = [e for e in report["errors"] if e["kind"] == "failed"]
    assert "\x1b[2J\x1b]0;pwned\x07" in error["error"] and error["task"] == hostile_name
    (listed,) = [json.loads(line) for line in outputs[("list", "--json")].stdout.splitlines()]
    assert listed["name"] == hostile_name, listed


def status_json(db: str) -> dict[str, Any]:
    r = run_onward("status", "--db", db, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_status_shows_no_eta_when_no_worker_is_running(store_url: str, tmp_path: Path) -> None:
    db = store_url
    block = tmp_path / "block"
    started = tmp_path / "started"
    command = ["sh", "-c", f"if [ -e {block} ]; then touch {started}; exec sleep 60; fi"]
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    finished = run_onward("run", "--db", db, "--", *command)
    assert finished.returncode == 0, finished.stderr
    assert run_onward("add", "--db", db, *[f"t{i}" for i in range(10)]).returncode == 0

    # The worker stopped with 10 tasks pending and 2 done within the minute: nobody is working on them.
    report = status_json(db)
    assert report["pending"] == 10 and report["rate_per_second"] > 0
    assert report["eta_seconds"] is None and report["workers_alive"] == 0
    text = run_onward("status", "--db", db).stdout.decode()
    assert "no worker running" in text and "   eta " not in text, text

    # While a worker is alive the ETA is shown, and never 0 with work left.
    block.touch()
    worker = subprocess.Popen(onward_argv("run", "--db", db, "--", *command), env=os.environ,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(started.exists, 30, "the worker to start a task")
        report = status_json(db)
        assert report["workers_alive"] == 1 and report["eta_seconds"] is not None and report["eta_seconds"] >= 1
        assert "   eta " in run_onward("status", "--db", db).stdout.decode()
    finally:
        worker.kill()  # kill -9: the worker never says it stopped; its task stays running under a dead owner
        worker.wait()
    report = status_json(db)
    assert report["running"] == 1 and report["workers"][0]["alive"] is False
    assert report["eta_seconds"] is None and report["workers_alive"] == 0
    assert "no worker running" in run_onward("status", "--db", db).stdout.decode()


def status_on_a_terminal(db: str, columns: int) -> str:
    """`onward status` with its stdout on a pseudo-terminal ``columns`` wide, as a person sees it."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    with subprocess.Popen(onward_argv("status", "--db", db), stdout=follower, stderr=subprocess.PIPE,
                          env=dict(env, TERM="xterm")) as p:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the terminal's other side closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert p.wait(60) == 0, p.stderr.read() if p.stderr else ""
    os.close(leader)
    return re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode()).replace("\r\n", "\n")


def test_long_running_task_texts_are_cut_in_the_middle_and_a_pipe_gets_them_whole(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    base = "https://example.com/archive/" + "x" * 120
    urls = [f"{base}/page-1", f"{base}/page-2"]
    assert run_onward("add", "--db", db, *urls).returncode == 0
    gate = tmp_path / "gate"
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--concurrency", "2", "--", "sh", "-c",
                    f"while [ ! -e {gate} ]; do sleep 0.05; done"),
        env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(status_json(db)["tasks_running"]) == 2, 30, "both tasks to run")
        shown = status_on_a_terminal(db, 100)
        lines = shown.splitlines()
        assert all(len(line) <= 100 for line in lines), shown
        for url in urls:  # each keeps its start and its end, so the two stay apart
            (line,) = [line for line in lines if line.startswith("https://example.com/") and url[-6:] in line]
            assert "…" in line, shown
        piped = run_onward("status", "--db", db)
        assert piped.returncode == 0, piped.stderr
        text = piped.stdout.decode()
        for url in urls:  # not cut, not wrapped at 80 columns
            assert any(line.startswith(url + " ") for line in text.splitlines()), text
    finally:
        gate.touch()
        worker.wait(30)
