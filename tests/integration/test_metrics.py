"""`onward metrics` (and ``metrics_text``, which the dashboard serves at /metrics): parsed with
prometheus_client's own parser, its values equal to `onward status --json` on the same store, on every
backend, through the installed console script."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from onward.store import open_store
from onward.store.base import Store
from tests.conftest import onward_argv, run_onward, wait_for

COUNTERS = ("onward_task_completions", "onward_task_failed_attempts", "onward_task_failures",
            "onward_task_cancellations", "onward_worker_restarts", "onward_step_replays")


@contextmanager
def opened(db: str) -> Iterator[Store]:
    store = open_store(db, create=False)
    try:
        yield store
    finally:
        store.close()


def scrape(db: str, job: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """`onward metrics`, parsed: each sample name -> its (labels, value) pairs."""
    r = run_onward("metrics", "--db", db, env=None if job is None else {"ONWARD_JOB": job})
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(r.stdout.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def status_json(db: str) -> dict[str, Any]:
    r = run_onward("status", "--db", db, "--json")
    assert r.returncode == 0, r.stderr
    report: dict[str, Any] = json.loads(r.stdout)
    return report


def one(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    (labels, value), = samples[name]
    assert labels == {"job": "default"}, (name, labels)
    return value


def test_metrics_equal_status_json_on_the_same_store(store_url: str, tmp_path: Path) -> None:
    db = store_url
    gate = tmp_path / "gate"
    names = ["ok-1", "ok-2", "flaky", "broken", "hangs", "cancel-me", "<script>alert(1)</script>"]
    assert run_onward("add", "--db", db, *names).returncode == 0
    with opened(db) as store:
        assert store.cancel(["cancel-me"]) == {"cancel-me": "cancelled"}
    script = (f'case "$0" in broken) exit 1;; hangs) while [ ! -e {gate} ]; do sleep 0.05; done;; '
              f'flaky) [ -e {tmp_path}/flaked ] || {{ touch {tmp_path}/flaked; exit 1; }};; esac')
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--concurrency", "3", "--max-attempts", "2", "--retry-delay", "0", "--", "sh", "-c", script,
                    "{task}"),
        env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: status_json(db)["running"] == 1 and status_json(db)["pending"] == 0, 60,
                 "everything but 'hangs' to be finished")
        before = status_json(db)
        samples = scrape(db)
        after = status_json(db)
    finally:
        gate.touch()
        worker.wait(60)
    assert before["done"] == after["done"] == 4 and before["failed"] == 1 and before["cancelled"] == 1

    tasks = {labels["state"]: value for labels, value in samples["onward_tasks"]}
    assert all(labels["job"] == "default" for labels, _ in samples["onward_tasks"])
    assert tasks == {state: before[state] for state in ("pending", "running", "waiting", "done", "failed", "cancelled")}
    assert one(samples, "onward_task_completions_total") == before["done"]
    assert one(samples, "onward_task_failures_total") == before["failed"]
    assert one(samples, "onward_task_cancellations_total") == before["cancelled"]
    assert one(samples, "onward_task_failed_attempts_total") == 3  # flaky once, broken twice
    assert one(samples, "onward_worker_restarts_total") == before["restarts"] == 0
    assert one(samples, "onward_step_replays_total") == 0
    assert one(samples, "onward_paused") == 0 and before["paused"] is False
    assert one(samples, "onward_workers_alive") == before["workers_alive"] == 1
    # Times move on between two reads: each is between what status said before and after.
    (task,) = before["tasks_running"]
    oldest = one(samples, "onward_running_task_oldest_age_seconds")
    assert task["age"] <= oldest <= after["tasks_running"][0]["age"]
    ((labels, beat),) = samples["onward_worker_heartbeat_age_seconds"]
    (w,) = before["workers"]
    assert labels == {"job": "default", "worker": str(w["id"]), "host": w["host"], "pid": str(w["pid"])}
    assert beat >= 0

    # Every family has HELP and TYPE lines and follows the naming rules (counters end in _total).
    text = run_onward("metrics", "--db", db).stdout.decode()
    for name in COUNTERS:
        # (prometheus-client names the family with or without _total in TYPE, by version)
        assert f"# TYPE {name}_total counter" in text or f"# TYPE {name} counter" in text, name
        assert f"\n{name}_total{{" in text, name
    assert "# TYPE onward_tasks gauge" in text and "_created" not in text


def test_metrics_counters_survive_a_new_worker_and_pause_shows(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    assert run_onward("run", "--db", db, "--max-attempts", "1", "--", "sh", "-c",
                      '[ "$0" = a ]', "{task}").returncode == 3
    first = scrape(db)
    assert one(first, "onward_task_completions_total") == 1 and one(first, "onward_task_failures_total") == 1
    assert run_onward("add", "--db", db, "c").returncode == 0
    assert run_onward("run", "--db", db, "--", "true").returncode == 3  # b stays failed
    second = scrape(db)
    assert one(second, "onward_task_completions_total") == 2
    assert one(second, "onward_task_failed_attempts_total") == 1
    assert "onward_worker_heartbeat_age_seconds" not in second  # no live worker: no series
    assert one(second, "onward_running_task_oldest_age_seconds") == 0
    with opened(db) as store:
        assert store.set_paused(True)
    assert one(scrape(db), "onward_paused") == 1 and status_json(db)["paused"] is True


def test_metrics_label_each_job_and_refuse_a_missing_store(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "x", "y", env={"ONWARD_JOB": "nightly"}).returncode == 0
    samples = scrape(db, "nightly")
    assert {labels["job"] for labels, _ in samples["onward_tasks"]} == {"nightly"}
    assert {labels["state"]: v for labels, v in samples["onward_tasks"]}["pending"] == 2
    by_option = run_onward("metrics", "--db", db, "--job", "nightly")
    assert by_option.returncode == 0 and 'onward_tasks{job="nightly",state="pending"} 2.0' in by_option.stdout.decode()
    for bad in ("../x", "", "<script>", "a/b", "x" * 300):
        refused = run_onward("metrics", "--db", db, "--job", bad)
        assert refused.returncode == 2 and refused.stdout == b"" and refused.stderr.count(b"\n") == 1, bad
    missing = run_onward("metrics", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and missing.stdout == b"" and missing.stderr.count(b"\n") == 1
    assert not (tmp_path / "none.db").exists()


def test_a_worker_on_another_host_silent_for_long_is_no_live_worker_in_the_metrics(tmp_path: Path) -> None:
    """A worker that died on another host without a word stayed in onward_worker_heartbeat_age_seconds
    ("each live worker") for ever, its age growing, one new series per death, while workers_alive said 0.
    Live is what workers_alive counts: by pid here, by a heartbeat under a minute elsewhere."""
    import sqlite3
    import time

    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a").returncode == 0
    now = time.time()
    with sqlite3.connect(db) as c:  # two workers of another host, as their rows would be: one silent for 2 h
        for pid, heartbeat_at in ((1001, now - 7200), (1002, now)):
            c.execute("INSERT INTO workers (host, host_key, pid, pid_start, started_at, heartbeat_at, job_id)"
                      " VALUES ('otherhost', 'otherhost-key', ?, 1, ?, ?, 1)", (pid, now - 8000, heartbeat_at))
    c.close()
    samples = scrape(db)
    shown = {labels["pid"] for labels, _ in samples["onward_worker_heartbeat_age_seconds"]}
    assert shown == {"1002"}, samples["onward_worker_heartbeat_age_seconds"]
    assert samples["onward_workers_alive"][0][1] == 1
