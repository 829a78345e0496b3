"""Durable waits in the Store contract (mailbox, parking, deadlines), on every backend."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from onward import waits
from onward.config import RunConfig
from onward.errors import UsageError
from onward.proc import current_owner
from onward.store import open_store
from onward.store.base import CANCELLED, PENDING, RUNNING, WAITING, StepRecord, Store


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    yield s
    s.close()


def claim_one(store: Store) -> tuple[int, int]:
    w = store.register_worker(current_owner(), "test")
    (c,) = store.claim(w, 1, 30, 3)
    return c.task_id, c.fence


def test_park_holds_no_attempt_and_send_delivers(store: Store) -> None:
    store.add(["t"])
    task_id, fence = claim_one(store)
    assert store.mail(task_id, "ok") == (None, None)
    assert store.park(task_id, fence, "ok", None) == WAITING
    row = store.task("t")
    assert row is not None and row.state == WAITING and row.attempts == 0
    assert store.counts()[WAITING] == 1 and store.counts()[RUNNING] == 0
    assert [(w.name, w.key, w.until) for w in store.waits()] == [("t", "ok", None)]
    assert store.claim(store.register_worker(current_owner(), "t2"), 5, 30, 3) == []
    assert store.send("t", "ok", '{"yes": true}') == "delivered"
    assert store.counts()[PENDING] == 1 and store.counts()[WAITING] == 0
    task_id, fence = claim_one(store)
    assert store.mail(task_id, "ok") == ('{"yes": true}', None)
    step = StepRecord(1, "ok", "wait", b"json 0 1 1\n{}", store.now())
    assert store.record_wait(task_id, fence, step, "ok")
    assert store.mail(task_id, "ok") == (None, None)
    assert store.send("t", "ok", "2") == "stored"  # a later wait on the same key gets a new value


def test_value_sent_before_the_wait_is_kept_and_not_replaced(store: Store) -> None:
    store.add(["t"])
    assert store.send("t", "k", "1") == "stored"
    assert store.send("t", "k", "2") == "already sent"
    task_id, fence = claim_one(store)
    assert store.mail(task_id, "k") == ("1", None)
    # Parking while the value is there does not wait: the task is pending again at once.
    assert store.park(task_id, fence, "k", None) == PENDING


def test_send_refusals_store_nothing(store: Store) -> None:
    store.add(["t", "u"])
    assert store.send("nope", "k", "1") == "unknown"
    store.cancel(["u"])
    assert store.send("u", "k", "1") == "already cancelled"
    task_id, fence = claim_one(store)
    store.complete(task_id, fence, b"", "bytes")
    assert store.send("t", "k", "1") == "already done"
    assert [e for e in store.events() if e.kind == "sent"] == []


def test_deadline_wakes_and_is_kept(store: Store) -> None:
    store.add(["t"])
    task_id, fence = claim_one(store)
    until = store.now() - 1  # already due
    assert store.park(task_id, fence, "k", until) == WAITING
    assert store.wake_due() == 1
    task_id, fence = claim_one(store)
    value, deadline = store.mail(task_id, "k")
    assert value is None and deadline == pytest.approx(until)
    assert store.mail(task_id, "other") == (None, None)


def test_cancel_a_waiting_task(store: Store) -> None:
    store.add(["t"])
    task_id, fence = claim_one(store)
    store.park(task_id, fence, "k", None)
    assert store.cancel(["t"]) == {"t": CANCELLED}
    assert store.counts()[WAITING] == 0 and store.counts()[CANCELLED] == 1


def test_jobs_keep_their_mail_apart(store_url: str) -> None:
    a = open_store(store_url, job="a")
    b = open_store(store_url, job="b")
    try:
        a.add(["t"])
        assert b.send("t", "k", "1") == "unknown"
        assert a.send("t", "k", "1") == "stored"
        assert b.jobs()[0].counts[WAITING] == 0
    finally:
        a.close()
        b.close()


def test_task_page_finds_waiting_tasks_from_their_index(store: Store) -> None:
    store.add([f"t{i}" for i in range(5)])
    w = store.register_worker(current_owner(), "test")
    claims = store.claim(w, 3, 30, 3)
    for c in claims[:2]:
        store.park(c.task_id, c.fence, "k", None)
    assert [r.name for r in store.task_page(WAITING, None, 0, 10)] == ["t0", "t1"]
    assert [r.name for r in store.task_page(WAITING, "T1", 0, 10)] == ["t1"]
    first = store.task_page(WAITING, None, 0, 1)
    assert [r.name for r in store.task_page(WAITING, None, first[0].task_id, 10)] == ["t1"]


def test_a_retried_task_starts_its_wait_afresh(store: Store) -> None:
    store.add(["t"])
    task_id, fence = claim_one(store)
    store.park(task_id, fence, "k", store.now() - 1)  # a deadline long gone
    store.cancel(["t"])
    assert store.retry(["t"]) == 1
    task_id, fence = claim_one(store)
    assert store.mail(task_id, "k") == (None, None)  # no old deadline: the wait's timeout starts again


def test_reserved_keys_cannot_be_sent_to_and_store_nothing(store: Store) -> None:
    # A long ctx.sleep parks on waits.SLEEP_KEY: a value sent there from outside would end it early.
    store.add(["t"])
    for key in (waits.SLEEP_KEY, waits.RESERVED_PREFIX + "other"):
        with pytest.raises(UsageError, match="onward's own"):
            waits.send(store, "t", key, "1")
    task_id, _ = claim_one(store)
    assert store.mail(task_id, waits.SLEEP_KEY) == (None, None)
    assert waits.send(store, "t", "onward", "1") == "stored"  # the prefix is "onward:", not any "onward"


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf"), 2_000_000.0])
def test_park_sleeps_over_refuses_nonsense(seconds: float) -> None:
    with pytest.raises(UsageError, match="park sleeps over"):
        RunConfig(park_sleeps_over=seconds)
    assert RunConfig(park_sleeps_over=0).park_sleeps_over == 0
