"""`--stall-timeout`: a task with no sign of progress is cancelled and retried while the worker lives on;
a long task that shows progress (output, a touch of $ONWARD_HEARTBEAT_FILE, ctx.beat) is left alone."""

from __future__ import annotations

import json
import time
from pathlib import Path

from onward import Job, TaskContext
from onward.log import QUIET
from tests.conftest import run_onward


def test_silent_command_is_cancelled_and_retried_while_the_worker_lives(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "silent")
    r = run_onward("run", "--db", db, "--stall-timeout", "0.5", "--retry-delay", "0", "--", "sh", "-c",
                   'if [ "$ONWARD_ATTEMPT" = 1 ]; then sleep 30; fi; echo second try')
    assert r.returncode == 0, r.stderr
    assert b"stalled: no progress for 0.5s" in r.stderr
    assert run_onward("result", "--db", db, "silent").stdout == b"second try\n"
    worker_starts = [line for line in run_onward("logs", "--db", db).stdout.decode().splitlines()
                     if "worker started" in line]
    assert len(worker_starts) == 1  # the same worker went on


def test_long_commands_that_show_progress_are_left_alone(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "touches", "prints")
    # each runs 2 s, four times the stall timeout, showing progress every 0.1 s
    script = ('if [ "$1" = touches ]; then for i in $(seq 20); do touch "$ONWARD_HEARTBEAT_FILE"; sleep 0.1; done;'
              ' else for i in $(seq 20); do echo tick; sleep 0.1; done; fi')
    started = time.monotonic()
    r = run_onward("run", "--db", db, "--stall-timeout", "0.5", "--concurrency", "2", "--max-attempts", "1", "--",
                   "sh", "-c", script, "x", "{task}")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - started > 2.0
    st = json.loads(run_onward("status", "--db", db, "--json").stdout)
    assert st["done"] == 2 and st["failed"] == 0


def test_python_task_that_beats_survives_and_one_that_does_not_is_cancelled(store_url: str) -> None:
    job = Job(store_url, log_level=QUIET, stall_timeout=0.4, max_attempts=1, heartbeat=0.2)

    @job.task
    def handle(task: str, ctx: TaskContext) -> str:
        for _ in range(15):  # 1.5 s in all, well past the stall timeout
            if task == "beats":
                ctx.beat("working")
            ctx.check()
            time.sleep(0.1)
        return "finished"

    job.add(["beats", "silent"])
    summary = job.run(concurrency=2)
    assert summary.done == 1 and summary.failed == 1
    assert job.result("beats") == "finished"
    row = job.store.task("silent")
    assert row is not None and "stalled: no progress for 0.4s" in (row.error or "")
    job.close()


def test_a_heartbeat_file_is_removed_within_a_second_of_its_attempts_end_and_its_folder_at_the_workers(
        tmp_path: Path) -> None:
    """The file a command touched is removed once its attempt ended: not at once (most commands never make
    theirs, and looking cost a system call a command), but by the next look at most a second later. Here the
    commands after the one that touched it run 1.6 s in all before the last one looks for it. Once the worker
    ends, its private folder is gone too."""
    db, seen = str(tmp_path / "s.db"), tmp_path / "seen"
    run_onward("add", "--db", db, "touch", "b1", "b2", "b3", "b4", "look")
    script = ('case "$1" in touch) touch "$ONWARD_HEARTBEAT_FILE"; echo "$ONWARD_HEARTBEAT_FILE" > "$0.path";;'
              ' look) p=$(cat "$0.path"); if [ -e "$p" ]; then echo there; else echo gone; fi > "$0";'
              ' [ -d "$(dirname "$p")" ] && echo folder >> "$0";; *) sleep 0.4;; esac')
    r = run_onward("run", "--db", db, "--", "sh", "-c", script, str(seen), "{task}")
    assert r.returncode == 0, r.stderr
    assert seen.read_text() == "gone\nfolder\n"  # removed, and the folder still there while the worker ran
    touched = Path((tmp_path / "seen.path").read_text().strip())
    assert touched.name.startswith("task-") and not touched.parent.exists()
