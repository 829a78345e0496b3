"""A store holds the jobs that were made (by a run or an add naming them), and no other: a new store used
only for named jobs has no job "default", so `onward jobs` lists nothing nobody made and a command that
names no job says there is no such job, instead of reporting (or exporting as metrics) an empty "default".
A store from before named jobs keeps its "default" job (its tasks are there); one that held nothing at all
upgrades like a new store, and its count rows do not leak into the first job made in it."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import run_onward

V2_TABLES = ("tasks", "events", "workers", "sources", "steps")


def jobs_of(db: str) -> dict[str, dict[str, object]]:
    r = run_onward("jobs", "--db", db, "--json")
    assert r.returncode == 0, r.stderr
    return {j["job"]: j for j in map(json.loads, r.stdout.decode().splitlines())}


def assert_no_default_job(r: subprocess.CompletedProcess[bytes]) -> None:
    err = r.stderr.decode()
    assert r.returncode == 2, err
    assert err.startswith("onward: error: no job 'default' in store") and err.count("\n") == 1, err


def test_a_new_store_holds_only_the_jobs_that_were_made(store_url: str) -> None:
    r = run_onward("run", "--db", store_url, "--job", "nightly", "--tasks", "-", "--", "true", input=b"a\nb\n")
    assert r.returncode == 0, r.stderr
    assert list(jobs_of(store_url)) == ["nightly"]
    table = run_onward("jobs", "--db", store_url).stdout.decode().splitlines()
    assert [line.split()[:3] for line in table[1:]] == [["nightly", "no", "2"]]
    for args in (("status",), ("status", "--json"), ("metrics",), ("list",), ("pause",)):
        assert_no_default_job(run_onward(*args, "--db", store_url))
    assert list(jobs_of(store_url)) == ["nightly"], "a command that failed made the job"
    r = run_onward("metrics", "--db", store_url, "--job", "nightly")
    assert r.returncode == 0 and b'onward_tasks{job="nightly",state="done"} 2.0' in r.stdout, r.stdout
    # The job "default" is made like any other: by the first add (or run) that names no job.
    assert run_onward("add", "--db", store_url, "x").returncode == 0
    jobs = jobs_of(store_url)
    assert sorted(jobs) == ["default", "nightly"] and jobs["default"]["pending"] == 1 and jobs["nightly"]["done"] == 2


def test_a_store_made_by_db_upgrade_has_no_job(store_url: str) -> None:
    r = run_onward("db", "upgrade", "--db", store_url)
    assert r.returncode == 0 and "created" in r.stderr.decode(), r.stderr
    assert jobs_of(store_url) == {}
    r = run_onward("jobs", "--db", store_url)
    assert r.returncode == 0 and r.stdout.decode().split() == [
        "job", "paused", "total", "pending", "running", "waiting", "done", "failed", "cancelled"], r.stdout
    assert_no_default_job(run_onward("status", "--db", store_url))


def _empty_but(db: str, keep: str | None) -> None:
    """Empty the version 2 store's tables but ``keep`` (as a version 2 store that held only that was), and
    bring its counts back to none."""
    statements = [f"DELETE FROM {{s}}{table}" for table in V2_TABLES if table != keep]
    if keep != "tasks":
        statements.append("UPDATE {s}counts SET n = 0")
    if db.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(db, autocommit=True) as pg:
            for statement in statements:
                pg.execute(statement.format(s="onward."))
        return
    import sqlite3

    with sqlite3.connect(db) as c:
        for statement in statements:
            c.execute(statement.format(s=""))
    c.close()


def test_an_old_store_that_held_nothing_upgrades_like_a_new_one(v2_store: str) -> None:
    _empty_but(v2_store, keep=None)
    r = run_onward("db", "upgrade", "--db", v2_store)
    assert r.returncode == 0 and "upgraded from schema version 2" in r.stderr.decode(), r.stderr
    assert jobs_of(v2_store) == {}
    # The first job made in it counts its own tasks only (no count row of the old store is taken for its).
    assert run_onward("add", "--db", v2_store, "--job", "first", "a", "b", "c").returncode == 0
    r = run_onward("run", "--db", v2_store, "--job", "first", "--", "true")
    assert r.returncode == 0, r.stderr
    (first,) = jobs_of(v2_store).values()
    assert first == {"job": "first", "paused": False, "total": 3, "pending": 0, "running": 0, "waiting": 0,
                     "done": 3, "failed": 0, "cancelled": 0}
    r = run_onward("status", "--db", v2_store, "--job", "first", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["done"] == 3, r.stdout


@pytest.mark.parametrize("keep", ["events", "sources", "workers"])
def test_an_old_store_that_held_anything_keeps_its_default_job(v2_store: str, keep: str) -> None:
    """What a version 2 store held belongs to its job, "default", even with no task left: the journal of a
    run with nothing to do, an import mark, a worker."""
    _empty_but(v2_store, keep=keep)
    assert run_onward("db", "upgrade", "--db", v2_store).returncode == 0
    jobs = jobs_of(v2_store)
    assert list(jobs) == ["default"] and jobs["default"]["total"] == 0
    if keep == "events":
        r = run_onward("logs", "--db", v2_store)
        assert r.returncode == 0 and "restart" in r.stdout.decode(), r.stdout
    # A job made afterwards is another one, with none of the old rows.
    assert run_onward("add", "--db", v2_store, "--job", "next", "a").returncode == 0
    assert run_onward("logs", "--db", v2_store, "--job", "next").stdout.decode().count("\n") == 1
