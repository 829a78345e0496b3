"""A store deleted or replaced under a running worker: the worker stops with one line and exit status 2
instead of committing into a file nobody will read, and nothing recreates the store behind the user's back
(not the worker, not `onward supervise`, which does not restart a worker that exited with status 2)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from onward.errors import StoreError
from onward.store import is_postgres_url, open_store, postgres
from tests import pgutil
from tests.conftest import onward_argv, wait_for

TASKS = 40


def tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "tasks.txt"
    path.write_text("".join(f"t{i}\n" for i in range(TASKS)))
    return path


def start_worker(db: str, tasks: Path, *, supervised: bool = False) -> subprocess.Popen[bytes]:
    run = ["run", "--db", db, "--tasks", str(tasks), "--heartbeat", "0.2", "--", "sleep", "0.5"]
    argv = onward_argv("supervise", "--restart-delay", "0.1", "--", *onward_argv(*run)) if supervised \
        else onward_argv(*run)
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_until_running(db: str, worker: subprocess.Popen[bytes]) -> None:
    def running() -> bool:
        assert worker.poll() is None, worker.communicate()
        if not is_postgres_url(db) and not os.path.exists(db):
            return False
        try:
            store = open_store(db, create=False)
        except StoreError:
            return False  # not created yet
        try:
            return bool(store.running_tasks())
        finally:
            store.close()
    wait_for(running, 30, "the worker to run a task")


def finish(worker: subprocess.Popen[bytes]) -> tuple[int, list[str]]:
    try:
        _, err = worker.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        _, err = worker.communicate()
        pytest.fail(f"the worker went on with its store gone: {err.decode()[-2000:]}")
    return worker.returncode, err.decode().splitlines()


def remove_file(db: Path) -> None:
    db.unlink()


def remove_folder(db: Path) -> None:
    shutil.rmtree(db.parent)


def rename_another_store_over_it(db: Path) -> None:
    other = db.with_name("other.db")
    s = open_store(str(other))
    s.add(["something else"])
    s.close()
    os.replace(other, db)


@pytest.mark.parametrize("fault, said", [
    (remove_file, "was deleted"),
    (remove_folder, "was deleted"),
    (rename_another_store_over_it, "was replaced by another file"),
])
def test_a_store_deleted_under_a_running_worker_stops_it_with_exit_2(tmp_path: Path, fault: Callable[[Path], None],
                                                                     said: str) -> None:
    db = tmp_path / "store" / "onward.db"
    worker = start_worker(str(db), tasks_file(tmp_path))
    wait_until_running(str(db), worker)
    fault(db)
    code, lines = finish(worker)
    assert code == 2, lines
    errors = [line for line in lines if line.startswith("onward: error:")]
    assert errors == [lines[-1]] and said in errors[0] and str(db) in errors[0], lines
    if fault is not rename_another_store_over_it:
        assert not db.exists()  # not recreated


def test_a_worker_that_finishes_after_its_store_was_deleted_does_not_exit_0(tmp_path: Path) -> None:
    """The last task completes between two heartbeats, into the deleted file: still exit 2, not "done"."""
    db = tmp_path / "store" / "onward.db"
    go = tmp_path / "go"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("only\n")
    worker = subprocess.Popen(
        onward_argv("run", "--db", str(db), "--tasks", str(tasks), "--heartbeat", "60", "--",
                    "sh", "-c", f"while [ ! -e {go} ]; do sleep 0.02; done"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    wait_until_running(str(db), worker)
    db.unlink()
    go.touch()
    code, lines = finish(worker)
    assert code == 2 and "was deleted" in lines[-1], lines
    assert not db.exists()


def test_the_supervisor_does_not_restart_a_worker_whose_store_was_deleted(tmp_path: Path) -> None:
    """A restart would run `onward run` again, which creates a new, empty store and runs every task again."""
    db = tmp_path / "store" / "onward.db"
    supervisor = start_worker(str(db), tasks_file(tmp_path), supervised=True)
    wait_until_running(str(db), supervisor)
    db.unlink()
    _, lines = finish(supervisor)
    assert any("exited with status 2" in line and "not restarting" in line for line in lines), lines
    assert not any("restarting worker" in line for line in lines), lines
    assert any(line.startswith("onward: error:") and "was deleted" in line for line in lines), lines
    assert not db.exists()  # no new, empty store in its place


@pytest.mark.postgres
@pytest.mark.parametrize("recreated", [False, True])
def test_a_postgres_store_dropped_under_a_running_worker_stops_it_with_exit_2(tmp_path: Path,
                                                                              recreated: bool) -> None:
    with pgutil.fresh_database() as url:
        worker = start_worker(url, tasks_file(tmp_path))
        wait_until_running(url, worker)
        admin = pgutil.admin_connection(dbname=url.rsplit("/", 1)[1])
        try:
            with admin.transaction():  # dropped and, when recreated, created again at once by onward's own code
                admin.execute("DROP SCHEMA onward CASCADE")
                if recreated:
                    postgres._migrate(admin, url, create=True)
        finally:
            admin.close()
        code, lines = finish(worker)
        assert code == 2, lines
        errors = [line for line in lines if line.startswith("onward: error:")]
        said = "was replaced" if recreated else "was dropped"
        assert errors == [lines[-1]] and said in errors[0], lines


@pytest.mark.postgres
def test_a_postgres_store_whose_tables_are_changed_by_hand_stops_its_worker_with_exit_2(tmp_path: Path) -> None:
    """A column of onward.tasks renamed by hand under a running worker: every settling commit failed, and the
    worker retried for good ("store error, will retry", still at it after 10 minutes), its renewals keeping
    its tasks from every other worker. It now stops at its next heartbeat, one line, exit 2."""
    with pgutil.fresh_database() as url:
        worker = start_worker(url, tasks_file(tmp_path))
        wait_until_running(url, worker)
        with pgutil.admin_connection(dbname=url.rsplit("/", 1)[1]) as admin:
            admin.execute("ALTER TABLE onward.tasks RENAME COLUMN result TO result_x")
        code, lines = finish(worker)
        assert code == 2, lines
        errors = [line for line in lines if line.startswith("onward: error:")]
        assert errors == [lines[-1]] and "its tables were changed while this process was using it" in errors[0], lines
        assert 'column "result"' in errors[0], errors


@pytest.mark.postgres
def test_a_postgres_database_dropped_under_a_running_worker_stops_it_with_exit_2(tmp_path: Path) -> None:
    """`DROP DATABASE … WITH (FORCE)` takes the store away with its database: every reconnection is then
    refused with 'database "…" does not exist'. The worker took that for a server out of reach and went on
    retrying for good (still at it 54 s later, when it was stopped; its tasks stopped as their leases ran out),
    where a dropped schema stops it at once."""
    with pgutil.fresh_database() as url:
        worker = start_worker(url, tasks_file(tmp_path), supervised=True)
        wait_until_running(url, worker)
        with pgutil.admin_connection() as admin:
            admin.execute(f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
        code, lines = finish(worker)
        assert code == 2, lines
        errors = [line for line in lines if line.startswith("onward: error:")]
        assert len(errors) == 1 and "its database was dropped" in errors[0], lines
        assert lines[-1].endswith("not restarting"), lines  # the supervisor did not start it again
