"""What a command's attempt reports: a success its stdout, whatever it wrote to stderr; a failure its exit
status and the redacted end of its stderr, however long that was."""

from __future__ import annotations

import json
import sqlite3
import sys
from pathlib import Path

from tests.conftest import run_onward

# "ok": writes a URL with a password to stderr, and succeeds. "bad": the same, then enough to push its
# beginning out of the 4 KiB kept, then the URL again, and fails with 5.
TASK = """
import sys
url = "postgresql://bob:hunter2@db.example/x"
sys.stderr.write(f"cannot reach {url}\\n")
if sys.argv[1] == "bad":
    sys.stderr.write("x" * 10000 + f"\\nstill cannot reach {url}\\n")
    sys.exit(5)
print("fine")
"""


def test_a_success_ignores_its_stderr_and_a_failure_reports_its_redacted_tail(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "ok", "bad").returncode == 0
    r = run_onward("run", "--db", db, "--max-attempts", "1", "--", sys.executable, "-c", TASK, "{task}")
    assert r.returncode == 3, r.stderr
    assert run_onward("result", "--db", db, "ok").stdout == b"fine\n"
    st = json.loads(run_onward("status", "--db", db, "--json").stdout)
    assert (st["done"], st["failed"]) == (1, 1)
    assert [e["task"] for e in st["errors"]] == ["bad"]
    with sqlite3.connect(db) as conn:
        error = conn.execute("SELECT error FROM tasks WHERE name = 'bad'").fetchone()[0]
        assert conn.execute("SELECT error FROM tasks WHERE name = 'ok'").fetchone()[0] in (None, "")
    assert error.startswith("exit status 5\n"), error
    assert error.rstrip().endswith("still cannot reach postgresql://bob:***@db.example/x"), error
    assert "cannot reach postgresql://bob:***@db.example/x\nxxx" not in error, "only the tail is kept"
    assert "hunter2" not in error
