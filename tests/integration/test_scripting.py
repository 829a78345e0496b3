"""The commands a script reads: `onward list --json`, `onward logs --json`, `logs --since`, `logs -f`
started before the store exists, and the README's list of `status --json` keys, through the installed
console script on real stores."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from onward.proc import current_owner
from onward.store import open_store
from tests.conftest import onward_argv, run_onward, wait_for

README = Path(__file__).resolve().parents[2] / "README.md"
ISO_MS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def lines_of(r: subprocess.CompletedProcess[bytes]) -> list[dict[str, object]]:
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.decode().splitlines()]


def test_list_json_gives_one_object_per_task_with_raw_texts_and_iso_times(store_url: str, tmp_path: Path) -> None:
    db = store_url
    hostile = "<script>alert(1)</script>\t\x1b[2J \u202e"
    assert run_onward("add", "--db", db, "ok", "bad", hostile).returncode == 0
    done = run_onward("run", "--db", db, "--max-attempts", "1", "--", "sh", "-c",
                      'if [ "$0" = bad ]; then echo "broke: $0" >&2; exit 1; fi', "{task}")
    assert done.returncode == 3, done.stderr
    rows = lines_of(run_onward("list", "--db", db, "--json"))
    assert [r["name"] for r in rows] == ["ok", "bad", hostile]
    by_name = {r["name"]: r for r in rows}
    assert set(by_name["ok"]) == {"name", "state", "attempts", "added_at", "started_at", "finished_at", "error"}
    assert by_name["ok"]["state"] == "done" and by_name["ok"]["error"] is None and by_name["ok"]["attempts"] == 1
    assert by_name["bad"]["state"] == "failed" and "broke: bad" in str(by_name["bad"]["error"])
    for row in rows:
        for key in ("added_at", "started_at", "finished_at"):
            assert ISO_MS.fullmatch(str(row[key])), row
    assert lines_of(run_onward("list", "--db", db, "--json", "--state", "failed")) == [by_name["bad"]]
    both = run_onward("list", "--db", db, "--json", "--long")
    assert both.returncode == 2 and both.stdout == b"" and both.stderr.count(b"\n") == 1


def test_logs_json_and_since_pick_events_by_time(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a", "b").returncode == 0
    assert run_onward("run", "--db", db, "--", "true").returncode == 0
    events = lines_of(run_onward("logs", "--db", db, "--json"))
    assert [e["kind"] for e in events][:2] == ["added", "worker started"]
    assert set(events[0]) == {"id", "at", "kind", "pid", "host", "task", "attempt", "detail"}
    assert all(ISO_MS.fullmatch(str(e["at"])) for e in events)
    assert [e["task"] for e in events if e["kind"] == "done"] == ["a", "b"]
    assert lines_of(run_onward("logs", "--db", db, "--json", "--since", "1h")) == events
    assert lines_of(run_onward("logs", "--db", db, "--json", "--task", "b", "--since", "10m")) == \
        [e for e in events if e["task"] == "b"]

    # A time between two events: exactly the events from it on, whatever form the time takes.
    cut = events[len(events) // 2]
    assert run_onward("add", "--db", db, "c").returncode == 0  # a later event, after the cut
    later = [e for e in lines_of(run_onward("logs", "--db", db, "--json")) if str(e["at"]) >= str(cut["at"])]
    at = datetime.fromisoformat(str(cut["at"]).replace("Z", "+00:00"))
    for form in (str(cut["at"]), at.isoformat(), at.astimezone().isoformat()):
        assert lines_of(run_onward("logs", "--db", db, "--json", "--since", form)) == later, form
    assert lines_of(run_onward("logs", "--db", db, "--json", "--since", "2999-01-01")) == []
    text = run_onward("logs", "--db", db, "--since", str(cut["at"]))
    assert text.returncode == 0 and len(text.stdout.decode().splitlines()) == len(later)


def test_logs_since_refuses_what_is_not_a_time(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a").returncode == 0
    for bad in ("", "nan", "-5m", "10x", "5 m", "99999999999d", "1e9s", "2026-13-01", "<script>", "\udcff",
                "../../etc/passwd", "٣m", "x" * 10_000):
        r = run_onward("logs", "--db", db, "--since", bad)
        assert r.returncode == 2 and r.stdout == b"", (bad, r)
        assert r.stderr.startswith(b"onward: error: ") and r.stderr.count(b"\n") == 1, (bad, r.stderr)
        assert b"Traceback" not in r.stderr and len(r.stderr) < 400
    assert b"\\xff" in run_onward("logs", "--db", db, "--since", "\udcff").stderr  # shown escaped


def follow_then_add(follow: list[str], add: list[str], before_add: Callable[[], None] = lambda: None
                    ) -> tuple[str, str]:
    """Start ``onward logs -f`` with ``follow``, read what it says on stderr, call ``before_add``, run ``onward
    add`` with ``add``: that stderr line and the first event line printed after it. The follower is then
    stopped with SIGINT, and must exit 0."""
    follower = subprocess.Popen(onward_argv("logs", "-f", *follow), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=os.environ)
    assert follower.stdout is not None and follower.stderr is not None
    try:
        said = follower.stderr.readline().decode()
        assert follower.poll() is None, said  # waiting
        before_add()
        assert run_onward("add", *add).returncode == 0
        got: list[str] = []
        out = follower.stdout
        reader = threading.Thread(target=lambda: got.append(out.readline().decode()), daemon=True)
        reader.start()
        wait_for(lambda: got, 30, "the event line")
    finally:
        follower.send_signal(signal.SIGINT)
        follower.wait(30)
    assert follower.returncode == 0
    return said, got[0]


def test_logs_follow_waits_for_the_store_to_be_created(tmp_path: Path) -> None:
    db = str(tmp_path / "later" / "s.db")

    def creating_nothing() -> None:
        assert not Path(db).exists()
    said, event = follow_then_add(["--db", db], ["--db", db, "first-task"], creating_nothing)
    assert said.startswith("onward: waiting for a store at ") and db in said, said
    assert " added 1 new task" in event, event


def test_logs_follow_on_a_job_not_there_says_it_waits_for_that_job(tmp_path: Path) -> None:
    """``logs -f --job typo`` on a store that exists said "waiting for a store at …": the user looked for a
    missing store. It waits for the job (a job not started yet), and says so; the job's first add ends it."""
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "x").returncode == 0
    said, event = follow_then_add(["--db", db, "--job", "later"], ["--db", db, "--job", "later", "y"])
    assert said == f"onward: waiting for job 'later' in {db} (there is no such job yet)\n", said
    assert " added 1 new task" in event, event


def test_logs_follow_quits_quietly_on_ctrl_c_while_waiting(tmp_path: Path) -> None:
    db = str(tmp_path / "never" / "s.db")
    follower = subprocess.Popen(onward_argv("logs", "--db", db, "-f"), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=os.environ)
    assert follower.stderr is not None
    assert follower.stderr.readline().startswith(b"onward: waiting for a store at ")
    follower.send_signal(signal.SIGINT)
    out, err = follower.communicate(timeout=30)
    assert follower.returncode == 0 and out == b"" and b"Traceback" not in err, err
    assert not Path(db).parent.exists()
    bad = run_onward("logs", "--db", "mysql://u:secret@h/db", "-f", timeout=30)
    assert bad.returncode == 2 and b"secret" not in bad.stderr  # a location no backend takes: not waited for


def documented_status_keys() -> dict[str, set[str]]:
    """The keys the README's "status --json" table documents, by where they appear: the top level, and each
    element of ``workers``, ``tasks_running`` and ``errors``."""
    section = README.read_text().split("### `onward status --json`", 1)[1].split("\n#", 1)[0]
    keys: dict[str, set[str]] = {}
    for match in re.finditer(r"^\| `([a-z_]+)(?:\[\]\.([a-z_]+))?` \|", section, re.M):
        where, key = (match[1], match[2]) if match[2] else ("", match[1])
        keys.setdefault(where, set()).add(key)
    return keys


def test_status_json_keys_are_the_documented_ones(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    gate = tmp_path / "gate"
    # A task parked in a durable wait (as ctx.wait leaves it), for the tasks_waiting entries.
    assert run_onward("add", "--db", db, "waits").returncode == 0
    store = open_store(db, create=False)
    try:
        (claim,) = store.claim(store.register_worker(current_owner(), "test"), 1, 30, 3)
        assert store.park(claim.task_id, claim.fence, "approval", None) == "waiting"
    finally:
        store.close()
    assert run_onward("add", "--db", db, "fails", "runs").returncode == 0
    worker = subprocess.Popen(
        onward_argv("run", "--db", db, "--max-attempts", "1", "--", "sh", "-c",
                    f'if [ "$0" = fails ]; then exit 1; fi; while [ ! -e {gate} ]; do sleep 0.05; done', "{task}"),
        env=os.environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def report() -> dict[str, object] | None:
            r = json.loads(run_onward("status", "--db", db, "--json").stdout)
            return r if r["tasks_running"] and r["errors"] else None
        real = wait_for(report, 30, "a running task and an error")
    finally:
        gate.touch()
        worker.send_signal(signal.SIGTERM)  # it would wait on, with the waiting task
        worker.wait(60)
    assert isinstance(real, dict)
    documented = documented_status_keys()
    assert documented.pop("") == set(real)
    for where, keys in documented.items():
        elements = real[where]
        assert isinstance(elements, list) and elements, where
        assert keys == set(elements[0]), where


def test_logs_since_finds_its_place_among_another_jobs_events(store_url: str) -> None:
    """Two jobs' events interleave in one journal, so each job's event ids have gaps: --since still starts
    at the first of this job's events from that time on."""
    db = store_url
    for i in range(6):
        for job in ("a", "b"):
            assert run_onward("add", "--db", db, f"{job}{i}", env={"ONWARD_JOB": job}).returncode == 0
    events = lines_of(run_onward("logs", "--db", db, "--json", env={"ONWARD_JOB": "a"}))
    assert [e["kind"] for e in events] == ["added"] * 6
    ids = [int(str(e["id"])) for e in events]
    assert all(b - a >= 2 for a, b in zip(ids, ids[1:], strict=False))  # the other job's events lie between
    for cut in (0, 3, 5):
        since = str(events[cut]["at"])
        got = lines_of(run_onward("logs", "--db", db, "--json", "--since", since, env={"ONWARD_JOB": "a"}))
        assert got == [e for e in events if str(e["at"]) >= since], cut
