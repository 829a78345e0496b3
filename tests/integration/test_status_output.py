"""What `onward status`, `onward logs` and the worker's log print, as a user reads them: through the installed
console script, on a real store, with real workers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from tests.conftest import onward_argv, run_onward

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

    # The stored error is data: --json keeps it (JSON-escaped), and so does the task's name.
    report = json.loads(run_onward("status", "--db", db, "--json").stdout)
    (error,) = [e for e in report["errors"] if e["kind"] == "failed"]
    assert "\x1b[2J\x1b]0;pwned\x07" in error["error"] and error["task"] == hostile_name
