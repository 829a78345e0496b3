"""A worker writes the result file of every done task that has none in --out (a write failed, the folder is
new or was emptied), as it goes, a slice at a time beside its tasks, and all of them before it says
"finished": done tasks spread over many pages and windows of ids, among pending tasks and other jobs'.
Temp files of writers that died mid-write are removed the same way."""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
from pathlib import Path

from onward import Job
from onward.log import QUIET

from ..conftest import run_onward


def build_job(db: str, out: Path, job: str, names: list[str]) -> None:
    with Job(db, name=job, out=out, log_level=QUIET) as runner:
        @runner.task
        def echo(task: str, ctx: object) -> str:
            return f"result of {task}"

        runner.add(names)
        runner.run()


def test_missing_result_files_are_all_written_across_pages_windows_and_other_jobs(store_url: str,
                                                                                 tmp_path: Path) -> None:
    seed = random.randrange(1 << 32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    db = store_url
    out = tmp_path / "out"
    # Ids of the job "main": 400, then a gap of 5,000 ids (another job's tasks, wider than a window of the
    # sweep), then 400 more.
    build_job(db, out, "main", [f"a{i}" for i in range(400)])
    r = run_onward("add", "--db", db, "--job", "other", *[f"o{i}" for i in range(5000)])
    assert r.returncode == 0, r.stderr
    build_job(db, out, "main", [f"b{i}" for i in range(400)])
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 800
    contents = {p.name: p.read_bytes() for p in out.iterdir()}

    # Some files lost: scattered, a whole run of them, and the very first and last.
    lost = set(rng.sample(files, 60)) | set(files[:1]) | set(files[-1:]) | set(files[300:600])
    for name in lost:
        (out / name).unlink()
    # And what a writer killed mid-write leaves (removed), beside a live writer's file (kept).
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale, live = f".onward-tmp-{gone.pid}-00ff", f".onward-tmp-{os.getpid()}-00ff"
    (out / stale).write_bytes(b"partial")
    (out / live).write_bytes(b"partial")
    # And new work beside the sweep: pending tasks the worker runs while it restores the lost files.
    r = run_onward("add", "--db", db, "--job", "main", *[f"new{i}" for i in range(20)])
    assert r.returncode == 0, r.stderr

    r = run_onward("run", "--db", db, "--job", "main", "--out", str(out), "--", "printf", "%s", "{task}")
    assert r.returncode == 0, r.stderr
    assert f"exported {len(lost)} missing result files" in r.stderr.decode(), r.stderr
    assert not (out / stale).exists() and (out / live).exists()
    (out / live).unlink()
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {name: data for name, data in after.items() if name in contents} == contents
    assert sorted(set(after) - set(contents)) == sorted(f"new{i}.txt" for i in range(20))

    # Every file there: a run writes none again, and the other job's tasks are still pending.
    r = run_onward("run", "--db", db, "--job", "main", "--out", str(out), "--", "false")
    assert r.returncode == 0, r.stderr
    assert "missing result files" not in r.stderr.decode()
    r = run_onward("status", "--db", db, "--job", "other", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["pending"] == 5000, r.stdout


def test_the_sweep_goes_on_beside_a_busy_worker_at_concurrency_4(tmp_path: Path) -> None:
    """At --concurrency 4 on SQLite the loop leaves a sync running at almost every turn (Runner._report_settled,
    pipelined), and the sweep may only look at durable commits: the sweep waits for those syncs rather than
    for a turn without one, so the missing files are written early in the run, not after its last task."""
    db = str(tmp_path / "s.db")
    build_job(db, tmp_path / "first-out", "default", [f"old{i}" for i in range(1000)])
    r = run_onward("add", "--db", db, *[f"new{i}" for i in range(1500)])
    assert r.returncode == 0, r.stderr
    out = tmp_path / "out"  # a new folder: every old task's result file is missing
    r = run_onward("run", "--db", db, "--out", str(out), "--concurrency", "4", "--", "true", "{task}")
    assert r.returncode == 0, r.stderr
    assert "exported 1000 missing result files" in r.stderr.decode(), r.stderr
    swept_by = max(os.stat(out / f"old{i}.txt").st_mtime for i in range(1000))
    c = sqlite3.connect(db)
    finished = [at for (at,) in c.execute("SELECT finished_at FROM tasks WHERE name LIKE 'new%'")]
    c.close()
    after = sum(at > swept_by for at in finished)
    assert after > 750, f"the sweep ended after {1500 - after} of the 1,500 new tasks were done"
