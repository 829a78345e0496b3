"""`onward db upgrade` refuses a store that records a live worker, and changes nothing. This onward refuses a
store that is not upgraded, so such a worker runs an older onward, whose code would meet the new schema:
upgraded from 4 to 5 under it, a version 4 worker retried "no such index: tasks_ready" for minutes holding
its task; a version 2 one would have claimed every job's tasks. Live as `onward status` counts workers: its
process running on this host, or a heartbeat under a minute old from another host.

The workers are real: the older onward itself, run from this repository's history, and rows written into
the old stores of tests/data as that version's worker writes them, for a real process of this host."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

from onward.proc import SILENT_WORKER_SECONDS, host_key, hostname, pid_start_time
from onward.store.sqlbase import SCHEMA_VERSION
from tests import pgutil
from tests.conftest import run_onward, wait_for

DATA = Path(__file__).resolve().parents[1] / "data"
REPO = Path(__file__).resolve().parents[2]
# The last commit of each older schema version: the parent of the one that brought the next version.
LAST_COMMIT_OF = {2: "31c0829fa7408102977d7e3c303349086a1f7656^", 3: "e31e266ee1830a6ef898651e14ea21462906380d^",
                  4: "fd828442b882d4c9fa4ed866d67a5667eb4d7500^"}


def old_onward(version: int, into: Path) -> Path:
    """The ``src`` folder of the onward that wrote schema ``version``, taken from the repository's history;
    a skip where that history is not there (an sdist, a shallow clone)."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    found = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", LAST_COMMIT_OF[version], "src"],
                           capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"the repository's history holds no onward of schema version {version}")
    with tarfile.open(fileobj=BytesIO(found.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def store_state(db: Path) -> dict[str, Any]:
    """What an upgrade would change in a SQLite store: its schema and recorded version."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        return {"schema": sorted(c.execute("SELECT type, name, sql FROM sqlite_master").fetchall()),
                "meta": sorted(c.execute("SELECT key, value FROM meta").fetchall())}


@pytest.mark.parametrize("version", [2, 3, 4])
def test_a_running_worker_of_an_older_onward_stops_the_upgrade(version: int, tmp_path: Path) -> None:
    src = old_onward(version, tmp_path / "old")
    db = tmp_path / "s.db"
    (tmp_path / "tasks.txt").write_text("600\n")
    worker = subprocess.Popen(
        [sys.executable, "-m", "onward", "run", "--db", str(db), "--tasks", str(tmp_path / "tasks.txt"),
         "--heartbeat", "0.5", "--", "sleep", "{task}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(src)}, stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "worker.err", "wb"))
    try:
        def running() -> bool:
            if not db.exists():
                return False
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
                    return c.execute("SELECT count(*) FROM tasks WHERE state = 'running'").fetchone() == (1,)
            except sqlite3.OperationalError:  # not made yet
                return False

        wait_for(running, 60, f"the onward of schema version {version} running its task")
        before = store_state(db)
        assert ("schema_version", str(version)) in before["meta"]

        r = run_onward("db", "upgrade", "--db", str(db))
        err = r.stderr.decode()
        assert r.returncode == 2 and err.count("\n") == 1, err
        assert f"1 worker of an older onward still running ({hostname()} pid {worker.pid})" in err, err
        assert "nothing was changed" in err, err
        assert store_state(db) == before
        assert worker.poll() is None and running()
        # The old worker goes on undisturbed: no error from queries meeting a schema it does not know.
        assert b"error" not in (tmp_path / "worker.err").read_bytes().lower()
    finally:
        worker.kill()  # a crash: its row stays, not stopped, with a pid that is gone
        worker.wait()

    r = run_onward("db", "upgrade", "--db", str(db))
    assert r.returncode == 0 and f"upgraded from schema version {version} to {SCHEMA_VERSION}" in r.stderr.decode(), \
        r.stderr


def live_process() -> subprocess.Popen[bytes]:
    """A real process of this host for a worker row to name, running until killed."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    wait_for(lambda: pid_start_time(proc.pid) is not None, 30, "the process to start")
    return proc


class OldStore:
    """A copy of an old store of tests/data on one backend, and how that version's worker registers."""

    def __init__(self, backend: str, version: int, location: str, tmp_path: Path) -> None:
        self.backend, self.version, self.location, self.tmp_path = backend, version, location, tmp_path

    def register(self, host: str, key: str, pid: int, pid_start: int, heartbeat_age: float = 0.0) -> None:
        """Insert the worker row as the onward of this schema version does (its register_worker), with
        its heartbeat ``heartbeat_age`` seconds old."""
        columns = "host, host_key, pid, pid_start, started_at, heartbeat_at, detail"
        values = [host, key, pid, pid_start]
        if self.version >= 3:  # named jobs: a worker belongs to one
            columns = "job_id, " + columns
            values = [1, *values]
        if self.backend == "sqlite":
            now = time.time() - heartbeat_age
            with sqlite3.connect(self.location) as c:
                c.execute(f"INSERT INTO workers ({columns}) VALUES ({', '.join('?' * (len(values) + 3))})",
                          [*values, now, now, "concurrency=1"])
            c.close()
            return
        import psycopg

        marks = ", ".join(["%s"] * len(values))
        with psycopg.connect(self.location, autocommit=True) as pg:
            pg.execute(f"INSERT INTO onward.workers ({columns}) VALUES ({marks}, onward.epoch() - %s,"
                       " onward.epoch() - %s, 'concurrency=1')", [*values, heartbeat_age, heartbeat_age])

    def delete_worker(self, pid: int) -> None:
        if self.backend == "sqlite":
            with sqlite3.connect(self.location) as c:
                c.execute("DELETE FROM workers WHERE pid = ?", [pid])
            c.close()
            return
        import psycopg

        with psycopg.connect(self.location, autocommit=True) as pg:
            pg.execute("DELETE FROM onward.workers WHERE pid = %s", [pid])

    def state(self) -> object:
        """Every byte of a SQLite store's files; a PostgreSQL store's schema (tables, columns, indexes,
        recorded version)."""
        if self.backend == "sqlite":
            return {p.name: p.read_bytes() for p in sorted(self.tmp_path.glob("old.db*"))}
        import psycopg

        with psycopg.connect(self.location, autocommit=True) as pg:
            return (pg.execute("SELECT table_name, column_name, data_type FROM information_schema.columns"
                               " WHERE table_schema = 'onward' ORDER BY 1, 2").fetchall(),
                    pg.execute("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'onward'"
                               " ORDER BY 1").fetchall(),
                    pg.execute("SELECT key, value FROM onward.meta ORDER BY 1").fetchall())


@pytest.fixture(params=["sqlite-2", "sqlite-3", "postgres-2"])
def old_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[OldStore]:
    """A copy of each old store in tests/data (each holds a row of a worker of another boot, long silent)."""
    backend, version = request.param.split("-")
    if backend == "sqlite":
        path = tmp_path / "old.db"
        shutil.copyfile(DATA / f"store_v{version}.db", path)
        yield OldStore(backend, int(version), str(path), tmp_path)
        return
    with pgutil.fresh_database() as url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute((DATA / f"store_v{version}_postgres.sql").read_text())
        yield OldStore(backend, int(version), url, tmp_path)


def refused(store: OldStore, named: str) -> None:
    before = store.state()
    r = run_onward("db", "upgrade", "--db", store.location)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert f"1 worker of an older onward still running ({named}); stop it before `onward db upgrade`" in err, err
    assert store.state() == before


def upgrades(store: OldStore) -> None:
    r = run_onward("db", "upgrade", "--db", store.location)
    assert r.returncode == 0, r.stderr
    assert f"upgraded from schema version {store.version} to {SCHEMA_VERSION}" in r.stderr.decode(), r.stderr


def test_an_old_store_recording_a_live_worker_is_refused_untouched_until_it_exits(old_store: OldStore) -> None:
    proc = live_process()
    try:
        old_store.register(hostname(), host_key(), proc.pid, pid_start_time(proc.pid) or 0)
        refused(old_store, f"{hostname()} pid {proc.pid}")
    finally:
        proc.kill()
        proc.wait()
    upgrades(old_store)


def test_a_dead_workers_row_does_not_stop_the_upgrade(old_store: OldStore) -> None:
    proc = live_process()
    start = pid_start_time(proc.pid) or 0
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    old_store.register(hostname(), host_key(), proc.pid, start)
    upgrades(old_store)


def test_a_worker_of_another_host_is_live_while_its_heartbeat_is_recent(old_store: OldStore) -> None:
    """Its pid cannot be checked from here: a heartbeat under SILENT_WORKER_SECONDS old counts it live, an
    older one counts it gone (a machine that died without a word)."""
    old_store.register("elsewhere", "elsewhere/boot/1", 4242, 99, heartbeat_age=SILENT_WORKER_SECONDS - 20)
    refused(old_store, "elsewhere pid 4242")
    old_store.register("elsewhere", "elsewhere/boot/1", 4343, 99, heartbeat_age=SILENT_WORKER_SECONDS + 5)
    old_store.delete_worker(4242)
    upgrades(old_store)
