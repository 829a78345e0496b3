"""``POST /api/send``: a value for a task's durable wait, through the real dashboard server, with the
refusals that store nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from onward.proc import current_owner
from onward.store import open_store
from tests.conftest import run_onward
from tests.dashboard.conftest import Served, status_of


def test_send_wakes_a_waiting_task_and_refusals_store_nothing(tmp_path: Path, dashboard: Any) -> None:
    db = str(tmp_path / "store" / "onward.db")
    assert run_onward("add", "--db", db, "waits", "later", "<script>alert(1)</script>").returncode == 0
    store = open_store(db, create=False)
    try:
        (claim,) = store.claim(store.register_worker(current_owner(), "test"), 1, 30, 3)
        assert claim.name == "waits" and store.park(claim.task_id, claim.fence, "approval", None) == "waiting"
    finally:
        store.close()
    served: Served = dashboard(db)
    assert served.get("/api/tasks?state=waiting").json()["tasks"][0]["task"] == "waits"
    bad = [b"{}", b'{"task": "waits", "key": "approval"}', b'{"task": "waits", "key": "", "value": 1}',
           b'{"task": "waits", "key": "a\\nb", "value": 1}', b'{"task": 1, "key": "k", "value": 1}',
           b'{"task": "waits", "key": "approval", "value": NaN}', b'{"task": "waits", "key": "k", "value": 1, "x": 2}',
           json.dumps({"task": "waits", "key": "approval", "value": "x" * 70_000}).encode(),
           b'{"task": "waits", "key": "approval", "value": "\\ud800"}']
    for body in bad:
        answer = served.request("POST", "/api/send", body=body, headers={"Content-Type": "application/json"})
        assert answer.status == 400 and set(answer.json()) == {"error"}, (body[:60], answer.body)
    answer = served.post("/api/send", {"task": "nobody", "key": "approval", "value": 1})
    assert answer.status == 404, answer.body
    assert status_of(db)["waiting"] == 1  # nothing was stored by the refusals
    answer = served.post("/api/send", {"task": "waits", "key": "approval", "value": {"ok": True}})
    assert answer.status == 200 and answer.json() == {"sent": "delivered"}, answer.body
    assert status_of(db)["waiting"] == 0 and status_of(db)["pending"] == 3
    name = "<script>alert(1)</script>"
    assert served.post("/api/send", {"task": name, "key": "k", "value": "<b>"}).json() == {"sent": "stored"}
    again = served.post("/api/send", {"task": name, "key": "k", "value": 2})
    assert again.status == 409 and "never replaced" in again.json()["error"], again.body
