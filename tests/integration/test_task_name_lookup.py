"""Every command that takes a task name looks it up as ``onward add`` stored it: ``add ' a '`` stores ``a``
(surrounding whitespace stripped, as from a tasks file's lines), and ``result ' a '``, ``retry``, ``cancel``,
``send``, ``steps`` and ``logs --task`` find it, where they said "no task ' a '" before. Through the
installed console script, on a real SQLite file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onward import Job, TaskContext
from onward.log import QUIET
from tests.conftest import run_onward

# The ways a name may come padded: spaces; a tab, and a line end from a pasted line (CR LF); Unicode
# whitespace (an ideographic space, a no-break space), which str.strip removes from what add stores too.
PADDED = ["  {}  ", "\t{}\r\n", "\u3000{}\u00a0"]


@pytest.fixture
def db(tmp_path: Path) -> str:
    """A store with "a" done (one recorded step "fetch", result "A") and "b" failed, run through Job, and
    "c" and "d" pending, added through `onward add` with padding."""
    path = str(tmp_path / "s.db")
    job = Job(path, max_attempts=1, log_level=QUIET)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        if task == "b":
            raise RuntimeError("boom")
        return str(ctx.step("fetch", lambda: "A"))

    job.add(["a", "b"])
    assert job.run(install_signal_handlers=False).exit_code == 3
    job.close()
    added = run_onward("add", "--db", path, " c ", "\td\r\n")
    assert (added.returncode, added.stdout, added.stderr) == (0, b"", b"added 2 new tasks\n")
    listed = run_onward("list", "--db", path)
    assert (listed.returncode, listed.stdout) == (0, b"a\nb\nc\nd\n"), listed.stderr
    return path


def test_every_command_finds_a_task_by_its_name_padded_as_add_takes_it(db: str) -> None:
    for padding in PADDED:
        a = padding.format("a")
        r = run_onward("result", "--db", db, a)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"A", b""), (a, r.stderr)

        r = run_onward("steps", "--db", db, "--json", a)
        assert (r.returncode, r.stderr) == (0, b""), (a, r.stderr)
        assert [json.loads(line)["step"] for line in r.stdout.splitlines()] == ["fetch#1"], (a, r.stdout)

        r = run_onward("logs", "--db", db, "--task", a)
        lines = r.stdout.decode().splitlines()
        assert (r.returncode, r.stderr) == (0, b""), (a, r.stderr)
        assert lines and all('task="a"' in line for line in lines), (a, lines)
        assert any(" done " in line for line in lines), (a, lines)

    r = run_onward("retry", "--db", db, PADDED[1].format("b"))
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"1 task back to pending\n"), r.stderr
    r = run_onward("send", "--db", db, PADDED[2].format("c"), "approval", "true")
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"sent 'approval' to task 'c': kept until it waits for it\n")
    r = run_onward("cancel", "--db", db, PADDED[0].format("d"))
    assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"cancelled 'd'\n"), r.stderr

    r = run_onward("list", "--db", db, "--json")
    states = {row["name"]: row["state"] for row in map(json.loads, r.stdout.splitlines())}
    assert states == {"a": "done", "b": "pending", "c": "pending", "d": "cancelled"}


@pytest.mark.parametrize("command", [["result"], ["retry"], ["cancel"], ["steps"], ["send", "{}", "k", "1"]])
def test_a_name_unknown_once_stripped_is_one_line_and_exit_1(db: str, command: list[str]) -> None:
    """Stripping finds what add stored, and nothing else: a padded name of no task is still refused."""
    args = [word.format(" zz ") for word in command] if len(command) > 1 else [*command, " zz "]
    r = run_onward(args[0], "--db", db, *args[1:])
    assert r.returncode == 1 and r.stdout == b"", r.stderr
    assert r.stderr.startswith(b"onward: error: no task 'zz' in ") and r.stderr.count(b"\n") == 1, r.stderr


def test_a_byte_order_mark_in_an_argument_is_kept_by_add_and_by_every_lookup(db: str) -> None:
    """Only a tasks file's first line loses a byte order mark (it marks the file's encoding); in an
    argument it is part of the name, for add and for the lookups alike."""
    r = run_onward("add", "--db", db, "\ufeffe")
    assert (r.returncode, r.stderr) == (0, b"added 1 new task\n"), r.stderr
    r = run_onward("result", "--db", db, " \ufeffe ")
    assert (r.returncode, r.stdout, r.stderr) == (1, b"", b"onward: error: task '\\ufeffe' is pending, it has no result\n")
    r = run_onward("result", "--db", db, "e")
    assert r.returncode == 1 and r.stderr.startswith(b"onward: error: no task 'e' in "), r.stderr
