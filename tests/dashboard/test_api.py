"""The dashboard's JSON API and its security rules, over HTTP (no browser), against the installed
``onward dashboard`` serving a real store that a real ``onward run`` worked on."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.conftest import onward_argv, run_onward, wait_for
from tests.dashboard.conftest import Job, Served, make_job, status_of

XSS_NAME = "<img src=x onerror=alert(1)>"
SLASHED_NAME = "a/../b"
OK_TASKS = [f"ok-{i}" for i in range(1, 6)]


@pytest.fixture(scope="module")
def finished_template(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """A store whose job ran to its end: five tasks done, three failed for good (flaky-1, flaky-2 and
    the one named like HTML), one done whose name holds "/" and "..", and one still pending. Built once;
    each test gets a copy (``finished``)."""
    job = make_job(tmp_path_factory.mktemp("template"), [*OK_TASKS, "flaky-1", "flaky-2", XSS_NAME, SLASHED_NAME])
    (job.folder / "broken").touch()
    (job.folder / "release").touch()
    ran = subprocess.run(onward_argv("run", "--db", job.db, "--max-attempts", "1", "--concurrency", "4", "--",
                                     "python3", str(job.folder / "work.py"), "{task}", str(job.folder)),
                         capture_output=True, timeout=120)
    assert ran.returncode == 3, ran.stderr
    assert run_onward("add", "--db", job.db, "later").returncode == 0
    return job


@pytest.fixture
def finished(finished_template: Job, tmp_path: Path) -> Job:
    """A copy of the template store (the store file with its WAL: nobody writes to it), for one test."""
    store = Path(finished_template.db).parent
    shutil.copytree(store, tmp_path / "store")
    return Job(str(tmp_path / "store" / store.joinpath(finished_template.db).name), finished_template.folder)


def counts(db: str) -> dict[str, Any]:
    report = status_of(db)
    return {key: report.get(key) for key in ("pending", "running", "done", "failed", "cancelled", "paused")}


# --- the API's answers ------------------------------------------------------------------------------------
def test_status_is_the_object_of_status_json(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    answer = served.get("/api/status")
    assert answer.status == 200 and answer.headers["Content-Type"] == "application/json"
    got = answer.json()
    expected = status_of(finished.db)
    assert set(got) == set(expected)
    for key in ("store", "total", "pending", "done", "failed", "workers", "tasks_running", "errors", "restarts"):
        assert got[key] == expected[key], key
    assert got["failed"] == 3 and got["done"] == 6 and got["pending"] == 1


def test_task_pages_search_and_filter(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    first = served.get("/api/tasks?limit=4").json()
    assert [t["task"] for t in first["tasks"]] == OK_TASKS[:4]
    line = first["tasks"][0]
    assert set(line) == {"id", "task", "state", "attempts", "added_at", "started_at", "finished_at", "seconds",
                         "error"}
    assert line["state"] == "done" and line["attempts"] == 1 and line["seconds"] >= 0
    assert first["next_after"] == first["tasks"][-1]["id"]
    second = served.get(f"/api/tasks?limit=4&after={first['next_after']}").json()
    assert [t["task"] for t in second["tasks"]] == ["ok-5", "flaky-1", "flaky-2", XSS_NAME]
    last = served.get(f"/api/tasks?limit=4&after={second['next_after']}").json()
    assert [t["task"] for t in last["tasks"]] == [SLASHED_NAME, "later"] and last["next_after"] is None

    failed = served.get("/api/tasks?state=failed").json()["tasks"]
    assert [t["task"] for t in failed] == ["flaky-1", "flaky-2", XSS_NAME]
    assert "broken: flaky-1" in failed[0]["error"]
    # Case-insensitive substring; % and _ are plain characters, not patterns.
    assert [t["task"] for t in served.get("/api/tasks?q=FLAKY").json()["tasks"]] == ["flaky-1", "flaky-2"]
    assert [t["task"] for t in served.get(f"/api/tasks?q={quote('<img')}").json()["tasks"]] == [XSS_NAME]
    assert served.get("/api/tasks?q=%25").json()["tasks"] == []
    assert served.get("/api/tasks?q=ok_").json()["tasks"] == []
    assert [t["task"] for t in served.get("/api/tasks?q=flaky&state=done").json()["tasks"]] == []


def test_task_detail_returns_raw_texts_steps_attempts_and_journal(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    detail = served.get("/api/tasks/" + quote(XSS_NAME, safe="")).json()
    assert detail["task"] == XSS_NAME and detail["state"] == "failed" and detail["result"] is None
    # Raw text: escaping is the page's job, where it is shown.
    assert "<script>alert(2)</script>" in detail["error"]
    (attempt,) = detail["attempt_history"]
    assert attempt["attempt"] == 1 and attempt["outcome"] == "failed" and attempt["seconds"] >= 0
    assert {"claimed", "failed"} <= {e["kind"] for e in detail["events"]}
    assert detail["steps"] == []

    slashed = served.get("/api/tasks/" + quote(SLASHED_NAME, safe=""))
    assert slashed.status == 200
    assert slashed.json()["result"] == {"kind": "bytes", "bytes": len(b"result of a/../b\n"), "truncated": False,
                                        "preview": "result of a/../b\n"}
    for missing in ("nope", quote("a/../nope", safe=""), "%ff%fe", quote("x" * 5000)):
        answer = served.get("/api/tasks/" + missing)
        assert answer.status == 404 and answer.json() == {"error": "no such task"}


def test_activity_counts_completions_and_failures(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    activity = served.get("/api/activity?bucket=60").json()
    assert activity["bucket_seconds"] == 60
    assert sum(b[1] for b in activity["buckets"]) == 6 and sum(b[2] for b in activity["buckets"]) == 3


def test_actions_retry_cancel_pause_and_resume(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    answer = served.post("/api/retry", {"tasks": ["flaky-1", "ok-1", "nope"]})
    assert answer.status == 200, answer.body
    assert answer.json() == {"retried": 1, "tasks": {"flaky-1": "retried", "ok-1": "already done", "nope": "unknown"}}
    assert counts(finished.db)["failed"] == 2
    assert served.post("/api/retry", {"failed": True}).json()["retried"] == 2

    cancelled = served.post("/api/cancel", {"tasks": ["later", "ok-2", "nope"]}).json()
    assert cancelled == {"tasks": {"later": "cancelled", "ok-2": "already done", "nope": "unknown"}}
    assert counts(finished.db)["cancelled"] == 1
    assert served.post("/api/retry", {"tasks": ["later"]}).json()["tasks"] == {"later": "retried"}

    assert served.post("/api/pause", {}).json() == {"paused": True, "changed": True}
    assert counts(finished.db)["paused"] is True and served.get("/api/status").json()["paused"] is True
    assert served.post("/api/pause", {}).json() == {"paused": True, "changed": False}
    assert served.post("/api/resume", {}).json() == {"paused": False, "changed": True}
    assert counts(finished.db)["paused"] is False


def test_the_event_stream_sends_the_status_at_once(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db, "--token", "s3cret-token")
    host, port = served.url.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer s3cret-token\r\n\r\n")
        received = b""
        while b"\n\n" not in received.partition(b"\r\n\r\n")[2]:
            chunk = conn.recv(65536)
            assert chunk, received
            received += chunk
    head, _, events = received.partition(b"\r\n\r\n")
    assert b"200 OK" in head.split(b"\r\n")[0] and b"text/event-stream" in head
    event, data = events.split(b"\n")[:2]
    assert event == b"event: status"
    sent, now = json.loads(data.removeprefix(b"data: ")), served.get("/api/status").json()
    assert set(sent) == set(now) and sent["total"] == now["total"] and sent["failed"] == now["failed"]


# --- security ---------------------------------------------------------------------------------------------
def test_with_a_token_every_data_request_needs_it_and_nothing_changes_without(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db, env={"ONWARD_DASHBOARD_TOKEN": "s3cret-token"})
    before = counts(finished.db)
    for path in ("/api/status", "/api/tasks", "/api/tasks/ok-1", "/api/activity", "/api/events", "/metrics"):
        for token in ("", "wrong", "s3cret-token-but-longer", "s3cret-tokeN"):
            answer = served.get(path, token=token)
            assert answer.status == 401, (path, token)
            assert answer.headers["WWW-Authenticate"].startswith("Bearer") and "error" in answer.json()
    for path, value in (("/api/retry", {"failed": True}), ("/api/pause", {}), ("/api/cancel", {"tasks": ["later"]})):
        assert served.post(path, value, token="").status == 401
        assert served.post(path, value, token="wrong").status == 401
        assert served.post(path, value, headers={"Authorization": "Basic czNjcmV0LXRva2Vu"}, token="").status == 401
    assert counts(finished.db) == before
    # The page's own files hold no data and load without it (the page then sends the token it was given).
    page = served.get("/?token=s3cret-token", token="")
    assert page.status == 200 and b"s3cret" not in page.body and b"ok-1" not in page.body
    assert served.get("/api/status").status == 200
    assert served.post("/api/pause", {}).status == 200 and counts(finished.db)["paused"] is True
    # A malformed request line is logged by the server, but not the token in it.
    host, port = served.url.split("//")[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(b"GET /?token=s3cret-token HTTP/1.1 extra\r\n\r\n")
        assert b" 400 " in conn.recv(65536).split(b"\r\n")[0]
    served.stop()
    log = served.process.communicate()[1]
    assert b"Bad request" in log and b"s3cret" not in log


def test_cross_site_posts_are_refused_and_change_nothing(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    before = counts(finished.db)
    own = served.url.rstrip("/")
    for origin in ("http://evil.example", "null", own.replace("127.0.0.1", "localhost"), own + ".evil.example"):
        answer = served.post("/api/retry", {"failed": True}, headers={"Origin": origin})
        assert answer.status == 403 and answer.json() == {"error": "cross-origin request refused"}
    # What a form of another site can send: no JSON content type.
    for content_type in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        answer = served.request("POST", "/api/pause", body=b'{"failed": true}', headers=headers)
        assert answer.status == 415, content_type
    # A page that resolves its own name to 127.0.0.1 (DNS rebinding) reads nothing either.
    rebound = served.get("/api/status", headers={"Host": "evil.example:" + own.rsplit(":", 1)[1]})
    assert rebound.status == 403
    assert counts(finished.db) == before
    assert served.post("/api/pause", {}, headers={"Origin": own}).status == 200


def test_no_get_changes_anything(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    before = counts(finished.db)
    for path in ("/api/retry", "/api/retry?failed=true", "/api/pause", "/api/cancel?tasks=later", "/api/resume"):
        assert served.get(path).status == 404
    for method in ("PUT", "DELETE", "PATCH"):
        assert served.request(method, "/api/pause", body=b"{}", headers={"Content-Type": "application/json"}
                              ).status == 405
    assert counts(finished.db) == before


BAD_QUERIES = [
    "limit=nan", "limit=-1", "limit=0", "limit=501", "limit=1e3", "limit=%EF%BC%91", "after=-5", "after=x",
    "after=99999999999999999999999", "state=bogus", "state=done&state=failed", "q=%00", "q=%ff", "bogus=1",
    "q=" + "x" * 4097,
]


def test_bad_query_values_are_400(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    for query in BAD_QUERIES:
        answer = served.get("/api/tasks?" + query)
        assert answer.status == 400 and set(answer.json()) == {"error"}, (query, answer.body)
    assert served.get("/api/activity?bucket=0").status == 400
    assert served.get("/api/activity?bucket=nan").status == 400


def test_bad_bodies_are_400_and_change_nothing(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db)
    before = counts(finished.db)
    bad: list[tuple[str, bytes]] = [
        ("/api/retry", b"{"), ("/api/retry", b""), ("/api/retry", b"[]"), ("/api/retry", b'"failed"'),
        ("/api/retry", b'{"failed": false}'), ("/api/retry", b'{"failed": 1}'),
        ("/api/retry", b'{"failed": true, "tasks": ["flaky-1"]}'), ("/api/retry", b'{"tasks": "flaky-1"}'),
        ("/api/retry", b'{"tasks": []}'), ("/api/retry", b'{"tasks": [1]}'), ("/api/retry", b'{"tasks": [""]}'),
        ("/api/retry", b'{"tasks": ["a\\u0000b"]}'), ("/api/retry", b'{"tasks": ["\\ud800"]}'),
        ("/api/retry", json.dumps({"tasks": ["x" * 5000]}).encode()),
        ("/api/retry", json.dumps({"tasks": [f"t{i}" for i in range(1001)]}).encode()),
        ("/api/retry", b'{"failed": NaN}'), ("/api/retry", b"\xff\xfe"), ("/api/retry", b"[" * 100_000),
        ("/api/cancel", b"{}"), ("/api/cancel", b'{"tasks": ["later"], "also": 1}'),
        ("/api/pause", b'{"paused": false}'), ("/api/pause", b"null"), ("/api/resume", b"1"),
        ("/api/retry", b'{"failed": true}' + b" " * (1 << 20)),
    ]
    for path, body in bad:
        answer = served.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        assert answer.status == 400, (path, body[:60], answer.body)
        assert set(answer.json()) == {"error"}
    assert counts(finished.db) == before


# --- the command ------------------------------------------------------------------------------------------
BAD_FLAGS = [
    (["--host", "0.0.0.0"], "needs a token"),
    (["--host", "::"], "needs a token"),
    (["--host", "no-such-host.invalid"], "cannot use host"),
    (["--host", ""], "host"),
    (["--port", "70000"], "70000"),
    (["--port", "-1"], "-1"),
    (["--port", "nan"], "nan"),
    (["--token", ""], "token is empty"),
    (["--token", "two words"], "printable ASCII"),
    (["--token", "t\u00e9"], "printable ASCII"),
    (["--token", "x" * 513], "printable ASCII"),
]


def test_bad_flags_are_one_line_exit_2(finished: Job) -> None:
    for args, message in BAD_FLAGS:
        shown = run_onward("dashboard", "--db", finished.db, *args, timeout=30)
        assert shown.returncode == 2, (args, shown)
        lines = shown.stderr.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith("onward: error:") and message in lines[0], (args, lines)
        assert shown.stdout == b""


def test_a_busy_port_and_a_missing_store_are_one_line_exit_2(finished: Job, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        shown = run_onward("dashboard", "--db", finished.db, "--port", str(busy.getsockname()[1]), timeout=30)
    assert shown.returncode == 2 and shown.stderr.decode().count("\n") == 1 and "cannot listen" in shown.stderr.decode()
    missing = tmp_path / "none" / "onward.db"
    shown = run_onward("dashboard", "--db", str(missing), timeout=30)
    expected = run_onward("status", "--db", str(missing))
    assert shown.returncode == expected.returncode == 2
    assert shown.stderr == expected.stderr and not missing.parent.exists()


def test_a_non_loopback_bind_with_a_token_serves_and_sigint_stops_it(finished: Job, dashboard: Any) -> None:
    served: Served = dashboard(finished.db, "--host", "0.0.0.0", "--token", "s3cret-token")
    port = served.url.rstrip("/").rsplit(":", 1)[1]
    local = Served(f"http://127.0.0.1:{port}/", served.process, "s3cret-token")
    assert local.get("/api/status").status == 200
    assert local.get("/api/status", token="").status == 401
    # The token given on the command line is not left for `ps` to show.
    cmdline = Path(f"/proc/{served.process.pid}/cmdline").read_bytes()
    assert b"s3cret-token" not in cmdline and b"--token" in cmdline
    served.process.send_signal(signal.SIGINT)
    assert served.process.wait(timeout=30) == 0
    wait_for(lambda: served.process.poll() is not None, 30, "the dashboard to exit")


def test_the_api_on_each_backend(store_url: str, dashboard: Any) -> None:
    names = ["alpha", "Beta/1", "beta_2", XSS_NAME]
    assert run_onward("add", "--db", store_url, *names).returncode == 0
    served: Served = dashboard(store_url)
    assert served.get("/api/status").json()["pending"] == 4
    assert [t["task"] for t in served.get("/api/tasks?q=BETA").json()["tasks"]] == ["Beta/1", "beta_2"]
    assert [t["task"] for t in served.get("/api/tasks?q=a_").json()["tasks"]] == ["beta_2"]
    assert served.get("/api/tasks/" + quote("Beta/1", safe="")).json()["state"] == "pending"
    assert served.post("/api/cancel", {"tasks": [XSS_NAME]}).json() == {"tasks": {XSS_NAME: "cancelled"}}
    assert [t["task"] for t in served.get("/api/tasks?state=cancelled").json()["tasks"]] == [XSS_NAME]
    assert served.post("/api/retry", {"tasks": [XSS_NAME]}).json()["retried"] == 1
    assert served.post("/api/pause", {}).json()["changed"] is True
    assert status_of(store_url)["paused"] is True
    assert served.post("/api/resume", {}).json()["changed"] is True
    assert served.get("/api/status").json()["paused"] is False


def test_job_picks_one_job_of_the_store(finished: Job, dashboard: Any) -> None:
    assert run_onward("add", "--db", finished.db, "--job", "other", "only-here").returncode == 0
    served: Served = dashboard(finished.db, "--job", "other")
    status = served.get("/api/status").json()
    assert status["job"] == "other" and status["total"] == 1
    assert [t["task"] for t in served.get("/api/tasks").json()["tasks"]] == ["only-here"]
    assert served.get("/api/tasks/ok-1").status == 404
    assert served.post("/api/pause", {}).json()["changed"] is True
    assert status_of(finished.db)["paused"] is False  # the default job is not paused
    for job_name, message in (("../x", "bad job name"), ("", "bad job name"), ("missing", "")):
        shown = run_onward("dashboard", "--db", finished.db, "--job", job_name, timeout=30)
        assert shown.returncode == 2 and shown.stderr.decode().count("\n") == 1, (job_name, shown)
        assert message in shown.stderr.decode()


def test_a_search_reads_one_window_of_ids_per_request_and_goes_on_from_there(tmp_path: Path) -> None:
    """A rare name on a big store: each request reads at most the window, says how far it looked, and the
    pages put together find exactly what one unbounded search finds."""
    from onward.dashboard.api import tasks
    from onward.store import open_store

    store = open_store(str(tmp_path / "s.db"))
    names = [f"task-{i:04d}" for i in range(1, 301)]
    store.add(names)
    wanted = {"task-0007", "task-0150", "task-0299"}
    found: list[str] = []
    after, requests = 0, 0
    while True:
        page = tasks(store, {"q": "TASK-0", "limit": "2", "after": str(after)}, search_window=40)
        found += [t["task"] for t in page["tasks"] if t["task"] in wanted]
        assert all("task-0" in t["task"] for t in page["tasks"])
        assert page["searched_to"] <= after + 40
        requests += 1
        if page["next_after"] is None:
            break
        assert page["next_after"] > after
        after = page["next_after"]
    assert found == sorted(wanted)
    rare = [tasks(store, {"q": "0150", "after": str(a)}, search_window=40) for a in (0, 120, 160)]
    assert [len(p["tasks"]) for p in rare] == [0, 1, 0]
    assert rare[0]["next_after"] == 40 and rare[0]["searched_to"] == 40  # nothing here: go on at 40
    assert rare[2]["next_after"] == 200
    last = tasks(store, {"q": "0150", "after": "280"}, search_window=40)
    assert last["tasks"] == [] and last["next_after"] is None  # nothing beyond: the search is over
    store.close()


def test_metrics_route_serves_the_text_of_onward_metrics_with_the_values_of_status(finished: Job,
                                                                                    dashboard: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    served: Served = dashboard(finished.db, "--token", "metrics-token")
    assert served.get("/metrics", token="").status == 401  # the token guards the scrape too
    answer = served.get("/metrics")
    assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(answer.body.decode()) for s in family.samples}
    expected = status_of(finished.db)
    for state in ("pending", "running", "waiting", "done", "failed", "cancelled"):
        assert samples[("onward_tasks", (("job", "default"), ("state", state)))] == expected[state], state
    assert samples[("onward_paused", (("job", "default"),))] == 0
    once = run_onward("metrics", "--db", finished.db)
    assert once.returncode == 0, once.stderr
    printed = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(once.stdout.decode()) for s in family.samples}
    assert printed == samples  # the same text, from the same store


def test_a_store_deleted_and_made_again_under_the_dashboard_is_503_and_the_new_one_untouched(
        finished: Job, dashboard: Any, tmp_path: Path) -> None:
    """Was: after the store was deleted and another made at its path, the dashboard went on showing the
    dead one as live, and a pause or a cancel answered 200 "changed" into the deleted file while the real
    store's workers went on. Now every request says the store is gone (503), and nothing is changed."""
    served: Served = dashboard(finished.db)
    assert served.get("/api/status").status == 200
    db = Path(finished.db)
    for leftover in db.parent.glob(db.name + "*"):
        leftover.unlink()
    gone = served.get("/api/status")
    assert gone.status == 503 and "deleted or replaced" in gone.json()["error"], gone.body
    assert run_onward("add", "--db", str(db), "x", "y", "z").returncode == 0  # another store at that path
    for answer in (served.get("/api/status"), served.get("/metrics"), served.post("/api/pause", {}),
                   served.post("/api/cancel", {"tasks": ["x"]})):
        assert answer.status == 503 and "deleted or replaced" in answer.json()["error"], answer.body
    now = counts(str(db))
    assert now["paused"] is False and now["pending"] == 3 and now["cancelled"] == 0
    assert served.process.poll() is None  # still serving, saying so


def test_hostile_requests_get_answers_and_leave_no_traceback(finished: Job, dashboard: Any) -> None:
    """A number of 5000 digits (int() refuses more than 4300: was a 500), an HTTP/2.0 request line (was no
    answer at all, and a traceback), clients that reset the connection mid-answer (a traceback each)."""
    import struct

    served: Served = dashboard(finished.db)
    digits = "1" * 5000
    for path in (f"/api/tasks?limit={digits}", f"/api/tasks?after={digits}", f"/api/activity?bucket={digits}"):
        answer = served.get(path)
        assert answer.status == 400 and set(answer.json()) == {"error"}, (path, answer.body)
    host, port = served.url.split("//")[1].rstrip("/").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /api/status HTTP/2.0\r\n\r\n")
        refusal = b""
        while chunk := s.recv(4096):
            refusal += chunk
        assert b"505" in refusal, "no answer to a request of another HTTP version"  # the stdlib's error page
    for _ in range(3):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(f"GET /api/tasks?limit=500 HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        s.recv(10)  # the answer has begun
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset
    with socket.create_connection((host, int(port)), timeout=10) as s:  # control sequences in the method
        s.sendall(f"FOO\x1b[2J\x1b]0;pwned\x07 /x\x1b[H HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        s.recv(100)
    assert served.get("/api/status").status == 200
    assert served.stop() == 0
    _, err = served.process.communicate(timeout=30)
    assert b"Traceback" not in err, err.decode(errors="replace")
    assert b"\x1b" not in err and b"\x07" not in err, err  # nothing a client sends reaches the terminal raw
