"""A worker that dies with several tasks running does not blame each of them.

`onward run --concurrency 3` of commands, one of which (``poison``) SIGKILLs its worker as it starts, as the
OOM killer does to a worker whose task takes the memory: the run is started again each time, as a
supervisor would. Which of the tasks running at a crash caused it is not known, so none of their attempts
counts; each of them runs alone from then on, with nothing beside it, so that the crash it causes (if any)
is its own and counts. The poison task ends failed after its attempts, every other task done, no task
marked to run alone ever shared its worker, and those tasks ran before the rest. Both on SQLite and on
PostgreSQL.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.conftest import run_onward

FINE = [f"fine-{i}" for i in range(1, 7)]
# The poison task second: claimed along with fine-1 and fine-2 in the first turn.
TASKS = [FINE[0], "poison", *FINE[1:]]
# Each run of a command notes its start and its end in the log (appends of one short line each, in order).
COMMAND = ('echo "start $1" >> "$2"; if [ "$1" = poison ]; then kill -9 $PPID; sleep 5; fi; sleep 0.2;'
           ' echo "end $1" >> "$2"')


def test_a_crash_with_several_tasks_running_counts_none_of_them_and_finds_the_culprit_alone(
        store_url: str, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("".join(f"{name}\n" for name in TASKS))
    log = tmp_path / "runs.log"
    argv = ["run", "-q", "--db", store_url, "--tasks", str(tasks), "--concurrency", "3", "--max-attempts", "3",
            "--retry-delay", "0", "--", "sh", "-c", COMMAND, "sh", "{task}", str(log)]
    crashes = 0
    while True:
        r = run_onward(*argv)
        if r.returncode != -signal.SIGKILL:
            break
        crashes += 1
        assert crashes <= 8, "the worker crash-loops"
    assert r.returncode == 3, r.stderr  # some task failed for good
    listed = run_onward("list", "--db", store_url, "--state", "failed")
    assert listed.stdout.decode().split() == ["poison"], "a task that only ran beside the culprit was failed"
    status = json.loads(run_onward("status", "--db", store_url, "--json").stdout)
    assert (status["done"], status["failed"]) == (len(FINE), 1)
    # The first crash counted nothing (three tasks ran); then the poison task ran alone three times, each
    # crash counted: its attempts used up.
    assert crashes == 4

    lines = log.read_text().split("\n")[:-1]
    logs = run_onward("logs", "--db", store_url, "-n", "1000").stdout.decode()
    marked = {name for name in TASKS if f'task="{name}"' in logs and "to run alone" in _lines_of(logs, name)}
    assert marked == {"fine-1", "poison", "fine-2"}, logs
    # From its last start on, a task marked to run alone had nothing beside it: the next line of the log
    # is its own end (or, for the poison task, the next run's first start, after the crash).
    for name in marked - {"poison"}:
        last = max(i for i, line in enumerate(lines) if line == f"start {name}")
        assert lines[last + 1] == f"end {name}", lines
    # They ran first, in their order, before the tasks that were never in a crash: a worker that knows of
    # a task to run alone ready claims nothing more until it runs nothing, then runs those tasks (they are
    # not left until nothing else is, which is never while tasks keep coming).
    later = min(i for i, line in enumerate(lines) if line in {f"start {name}" for name in FINE[2:]})
    assert all(i < later for i, line in enumerate(lines) if line in ("start fine-1", "start fine-2", "start poison")), \
        lines
    poison_starts = [i for i, line in enumerate(lines) if line == "start poison"]
    assert len(poison_starts) == 4, lines
    for i in poison_starts[1:]:
        # Nothing was left running at its start (the line before is an end, or its own crashed run's start)
        # and nothing ran beside it (the line after is the next run's first start, if any).
        assert lines[i - 1].startswith("end ") or lines[i - 1] == "start poison", lines
        assert i + 1 == len(lines) or lines[i + 1].startswith("start "), lines


def _lines_of(logs: str, name: str) -> str:
    return "\n".join(line for line in logs.splitlines() if f'task="{name}"' in line)


def test_once_the_tasks_to_run_alone_have_run_the_others_run_side_by_side_again(tmp_path: Path) -> None:
    """A task to run alone, ready at the worker's start: it ran alone, and then every ordinary task after it
    ran alone as well, one at a time, until the next heartbeat looked again (here never: 30 s). Once none of
    them is first in line the worker claims as many as it may again."""
    import sqlite3

    db = str(tmp_path / "s.db")
    names = ["alone-1"] + [f"fine-{i}" for i in range(1, 7)]
    assert run_onward("add", "--db", db, *names).returncode == 0
    with sqlite3.connect(db) as c:  # as a reclaim after a crash shared with others leaves it (migrate_to_6)
        c.execute("UPDATE tasks SET shared_crashes = 1 WHERE name = 'alone-1'")
    c.close()
    log = tmp_path / "runs.log"
    r = run_onward("run", "-q", "--db", db, "--concurrency", "3", "--heartbeat", "30", "--", "sh", "-c",
                   'echo "start $1" >> "$2"; sleep 0.3; echo "end $1" >> "$2"', "sh", "{task}", str(log))
    assert r.returncode == 0, r.stderr
    lines = log.read_text().split("\n")[:-1]
    assert lines[:2] == ["start alone-1", "end alone-1"], lines  # alone, and first
    running, most = 0, 0
    for line in lines[2:]:
        running += 1 if line.startswith("start ") else -1
        most = max(most, running)
    assert most >= 2, lines  # the ordinary tasks side by side again, not one by one
