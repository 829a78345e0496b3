"""A store that is down when a worker starts is a fault of the machine, not a usage error.

Before, onward exited 2 when its PostgreSQL server did not answer at start-up, or when the disk under its
SQLite file failed: the status of a usage error, which `onward supervise` and the systemd unit
(`RestartPreventExitStatus=2`) never restart. A worker started during a database outage so stayed down
after the database came back. It now exits 75 (EX_TEMPFAIL), which both restart, and the supervisor does
not count those restarts as a crash loop. A server that refuses the database or the role is still 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onward.store import open_store
from onward.store.base import DONE
from tests import pgutil
from tests.conftest import onward_argv, require_tool, run_onward, wait_for

SRC = str(Path(__file__).resolve().parents[2] / "src")


# README's worker script for `onward supervise`: onward.Unavailable ends it with status 75, as `onward run`.
SUPERVISED_SCRIPT = """\
import sys
import onward

def handle(task, ctx):
    return task

try:
    job = onward.Job(sys.argv[1])
    job.task(handle)
    status = job.run().exit_code
except onward.Unavailable as e:
    print(f"onward: error: {e}", file=sys.stderr)
    status = 75
sys.exit(status)
"""


@pytest.mark.postgres
@pytest.mark.parametrize("worker", ["cli", "python"])
def test_a_postgres_server_down_at_start_exits_75_and_supervise_resumes_when_it_is_back(
        tmp_path: Path, worker: str) -> None:
    script = tmp_path / "worker.py"
    script.write_text(SUPERVISED_SCRIPT)
    with pgutil.private_cluster() as cluster:
        url = cluster.url(cluster.create_database("onward"))
        store = open_store(url)
        store.add([f"t{i}" for i in range(20)])
        store.close()
        cluster.ctl("stop")

        argv = onward_argv("run", "--db", url, "--", "true") if worker == "cli" else [sys.executable, str(script), url]
        alone = subprocess.run(argv, env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=60)
        assert alone.returncode == 75, alone.stderr
        lines = alone.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("onward: error: ") and "Connection refused" in lines[0]

        log = tmp_path / "supervise.log"
        with open(log, "wb") as out:
            supervisor = subprocess.Popen(
                onward_argv("supervise", "--restart-delay", "0.1", "--max-restarts", "2", "--", *argv),
                env=dict(os.environ, PYTHONPATH=SRC), stdout=out, stderr=subprocess.STDOUT)
        try:
            # More restarts than --max-restarts allows for a crash loop: an outage is not one.
            wait_for(lambda: log.read_text().count("store or output unavailable") >= 4, 120,
                     "the supervisor to restart the worker through the outage")
            assert supervisor.poll() is None, log.read_text()
            cluster.ctl("start")
            assert supervisor.wait(timeout=120) == 0, log.read_text()
        finally:
            if supervisor.poll() is None:
                supervisor.kill()
                supervisor.wait()
        store = open_store(url, create=False)
        assert store.counts()[DONE] == 20
        store.close()


@pytest.mark.postgres
def test_a_server_whose_only_free_slots_are_for_superusers_is_busy_not_misconfigured(tmp_path: Path) -> None:
    """A role that is not a superuser, on a server whose free connections are all reserved for superusers,
    is refused with "remaining connection slots are reserved …" (SQLSTATE 53300, as "too many clients"):
    the server is full, so exit 75 and a restart, not exit 2 (a usage error nobody restarts). It exited 2."""
    with pgutil.private_cluster() as cluster:
        with cluster.admin() as admin:
            admin.execute("CREATE ROLE worker LOGIN")
            admin.execute("CREATE DATABASE onward OWNER worker")
            admin.execute("ALTER SYSTEM SET superuser_reserved_connections = 97")  # of max_connections = 100
        cluster.restart()
        url = cluster.url("onward").replace(f"{pgutil.PG_USER}@", "worker@")
        tasks = tmp_path / "tasks.txt"
        tasks.write_text("a\nb\n")
        import psycopg

        held = [psycopg.connect(url) for _ in range(3)]  # every slot a role like this one may have
        try:
            full = run_onward("run", "--db", url, "--tasks", str(tasks), "--", "true")
        finally:
            for conn in held:
                conn.close()
        assert full.returncode == 75, full.stderr
        lines = full.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("onward: error: ") and "reserved" in lines[0], lines
        # The slots free again, the same command runs the job.
        again = run_onward("run", "--db", url, "--tasks", str(tasks), "--", "true")
        assert again.returncode == 0, again.stderr
        store = open_store(url, create=False)
        assert store.counts()[DONE] == 2
        store.close()


@pytest.mark.postgres
def test_a_database_that_does_not_exist_is_still_a_configuration_error() -> None:
    with pgutil.private_cluster() as cluster:
        done = run_onward("status", "--db", cluster.url("no_such_database"))
    assert done.returncode == 2, done.stderr
    assert b"does not exist" in done.stderr


def test_a_store_folder_that_cannot_be_created_for_an_io_error_exits_75(tmp_path: Path) -> None:
    strace = require_tool("strace")
    store_dir = tmp_path / "store"
    tasks = tmp_path / "tasks.txt"
    tasks.write_text("a\nb\n")
    done = subprocess.run(
        [strace, "-f", "-qq", "-o", "/dev/null", "-P", str(store_dir), "-e", "inject=mkdir:error=EIO",
         *onward_argv("run", "--db", str(store_dir / "onward.db"), "--tasks", str(tasks), "--", "true")],
        env=dict(os.environ, PYTHONPATH=SRC), capture_output=True, timeout=60)
    assert done.returncode == 75, done.stderr
    assert done.stderr.decode().strip().splitlines() == [
        f"onward: error: cannot create folder {store_dir}: Input/output error"]
    assert not store_dir.exists()


@pytest.mark.postgres
def test_a_worker_stopped_while_its_server_is_unreachable_says_why_its_counts_are_unknown(tmp_path: Path) -> None:
    # SIGTERM while the server is out of reach (the worker's connections cut, its port closed): the worker
    # cannot read the store's counts on its way out. Its last line said "store: " and nothing more.
    from tests.integration.test_supervise import SlowServer  # a relay to the local server; nothing held

    log, started = tmp_path / "worker.log", tmp_path / "started"
    with pgutil.fresh_database() as direct:
        relay = SlowServer(direct, held=0, hold=0)
        store = open_store(relay.url)
        store.add(["a"])
        store.close()
        with open(log, "wb") as out:
            worker = subprocess.Popen(onward_argv("run", "--db", relay.url, "--grace", "0.5", "--", "sh", "-c",
                                                  f"touch {started}; exec sleep 60"),
                                      stderr=out, env=dict(os.environ, PYTHONPATH=SRC))
        try:
            wait_for(started.exists, 20, f"the task to start; log:\n{log.read_text()}")
            relay.close()
            with pgutil.admin_connection() as admin:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                              (direct.rsplit("/", 1)[1],))
            os.kill(worker.pid, signal.SIGTERM)
            assert worker.wait(60) == 0, log.read_text()
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    last = log.read_text().strip().splitlines()[-1]
    assert "worker stopped: stopped by SIGTERM" in last, last
    assert "; store: counts unknown (" in last and "Connection refused" in last, last


PYTHON_WORKER = "import sys\nfrom onward import Job\nJob(sys.argv[1])\n"


def test_a_worker_that_is_a_systemd_services_main_process_ends_unavailable_after_12_s(tmp_path: Path) -> None:
    """systemd counts every start toward the unit's start limit (6 in 60 s): a worker whose store is down
    ends at once, is restarted 0.1 s later, and used the limit up within seconds of an outage, the unit
    then failed for good. As the main process of a service (SYSTEMD_EXEC_PID is its pid, as systemd sets
    it, kept across the exec) `onward run` exits 75, and a Python worker script raises StoreUnavailable,
    once the process has lived 12 s; SIGTERM (a stop) ends the wait at once. Any other process ends at
    once. (The same under a real systemd, through a whole start limit: make torture.)"""
    script = tmp_path / "worker.py"
    script.write_text(PYTHON_WORKER)
    url = "postgresql://postgres@127.0.0.1:1/test"  # nothing listens on port 1: connection refused
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    env.pop("SYSTEMD_EXEC_PID", None)
    python_worker = [sys.executable, str(script), url]
    cli_worker = onward_argv("run", "--db", url, "--", "true")

    def start(argv: list[str], as_main_process: bool) -> subprocess.Popen[bytes]:
        shell = 'SYSTEMD_EXEC_PID=$$ exec "$0" "$@"' if as_main_process else 'exec "$0" "$@"'
        return subprocess.Popen(["sh", "-c", shell, *argv], env=env, stderr=subprocess.PIPE)

    began = time.monotonic()
    spaced, stopped, plain = start(python_worker, True), start(python_worker, True), start(python_worker, False)
    cli_spaced, cli_plain = start(cli_worker, True), start(cli_worker, False)
    everyone = (spaced, stopped, plain, cli_spaced, cli_plain)
    try:
        err = plain.communicate(timeout=30)[1]
        assert plain.returncode == 1 and b"onward.errors.StoreUnavailable" in err, err[-2000:]
        err = cli_plain.communicate(timeout=30)[1]
        assert cli_plain.returncode == 75 and err.count(b"\n") == 1, err[-2000:]
        # The same failure, met as fast: the main processes of a service are still waiting.
        assert spaced.poll() is None and stopped.poll() is None and cli_spaced.poll() is None, \
            time.monotonic() - began
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(timeout=10) == -signal.SIGTERM
        err = spaced.communicate(timeout=60)[1]
        lived = time.monotonic() - began
        assert spaced.returncode == 1 and b"onward.errors.StoreUnavailable" in err, err[-2000:]
        assert lived >= 11.5, lived
        err = cli_spaced.communicate(timeout=60)[1]
        assert cli_spaced.returncode == 75 and err.count(b"\n") == 1, err[-2000:]
        assert time.monotonic() - began >= 11.5
    finally:
        for p in everyone:
            p.kill()
            p.wait()


def _error_line(done: subprocess.CompletedProcess[bytes]) -> str:
    """The one error line (a worker's log lines may come before it), without a traceback."""
    text = done.stderr.decode()
    errors = [line for line in text.splitlines() if line.startswith("onward: error: ")]
    assert len(errors) == 1 and "Traceback" not in text and text.strip().endswith(errors[0]), text
    return errors[0]


@pytest.mark.postgres
def test_a_lock_held_on_the_store_past_lock_timeout_is_busy_not_misconfigured(tmp_path: Path) -> None:
    """Someone holds a lock on onward's tables (a `LOCK TABLE`, a long migration, a stuck session) longer
    than onward's lock_timeout: the server cancels onward's statement (55P03). That passes once the lock is
    let go, so it is exit 75 and a restart, not exit 2: a worker started meanwhile exited 2 (a usage error)
    and `onward supervise` gave up on it for good ("not restarting")."""
    with pgutil.fresh_database() as url:
        store = open_store(url)
        store.add(["a", "b"])
        store.close()
        import psycopg

        with psycopg.connect(url) as holder:
            holder.execute("LOCK TABLE onward.tasks IN ACCESS EXCLUSIVE MODE")  # held until the rollback
            run = run_onward("run", "--db", url, "--", "true")
            status = run_onward("status", "--db", url)
            holder.rollback()
        for done in (run, status):
            assert done.returncode == 75, done.stderr
            assert "lock timeout" in _error_line(done)
        again = run_onward("run", "--db", url, "--", "true")
        assert again.returncode == 0, again.stderr
        store = open_store(url, create=False)
        assert store.counts()[DONE] == 2
        store.close()


@pytest.mark.postgres
def test_a_server_that_takes_no_writes_is_unavailable_not_misconfigured(tmp_path: Path) -> None:
    """A server that refuses writes (25006: a hot standby during a failover, default_transaction_read_only)
    is a store that cannot be written right now, as a read-only disk is for SQLite: the commands that write
    change nothing and exit 75, the reading ones work. They exited 2, which supervisors never restart."""
    with pgutil.fresh_database() as url:
        store = open_store(url)
        store.add(["a", "b"])
        store.close()
        database = url.rsplit("/", 1)[1]
        with pgutil.admin_connection() as admin:
            admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
            for args in (("run", "--db", url, "--", "true"), ("add", "--db", url, "c"), ("cancel", "--db", url, "a"),
                         ("send", "--db", url, "a", "k", "1")):
                done = run_onward(*args)
                assert done.returncode == 75, (args, done.stderr)
                assert "read-only transaction" in _error_line(done), args
            status = run_onward("status", "--db", url)
            assert status.returncode == 0, status.stderr
            assert b"pending 2" in status.stdout, status.stdout
            admin.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        again = run_onward("run", "--db", url, "--", "true")
        assert again.returncode == 0, again.stderr
        store = open_store(url, create=False)
        assert store.counts()[DONE] == 2 and sum(store.counts().values()) == 2
        store.close()


@pytest.mark.postgres
def test_db_upgrade_with_the_server_down_exits_75_and_with_no_such_database_2() -> None:
    """`onward db upgrade` opens its own connection: a server that does not answer made it exit 2, as if the
    URL were wrong, where every other command exits 75 (unavailable, try again)."""
    down = run_onward("db", "upgrade", "--db", f"postgresql://{pgutil.PG_USER}@127.0.0.1:{pgutil._free_port()}/x")
    assert down.returncode == 75, down.stderr
    assert "Connection refused" in _error_line(down)
    with pgutil.fresh_database() as url:
        missing = run_onward("db", "upgrade", "--db", url + "_not_there")
    assert missing.returncode == 2, missing.stderr
    assert "does not exist" in _error_line(missing)


@pytest.mark.postgres
def test_logs_follow_rides_out_a_dropped_connection(tmp_path: Path) -> None:
    """`onward logs -f` on PostgreSQL exited 75 when its connection was dropped (a server restart, a
    pg_terminate_backend), where `status --watch` rides the same out: a follower died with every restart. It
    says so once, and follows on: an event added meanwhile is shown once the server answers again."""
    out, err = tmp_path / "out", tmp_path / "err"
    with pgutil.fresh_database() as url:
        assert run_onward("add", "--db", url, "first").returncode == 0
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            follower = subprocess.Popen(onward_argv("logs", "-f", "--db", url), stdout=stdout, stderr=stderr,
                                        env=dict(os.environ, PYTHONPATH=SRC))
        try:
            wait_for(lambda: "added 1 new task" in out.read_text(), 20, "the first event")
            with pgutil.admin_connection() as admin:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s"
                              " AND pid <> pg_backend_pid()", (url.rsplit("/", 1)[1],))
            wait_for(lambda: "store unavailable, following again once it is back" in err.read_text(), 20,
                     f"the follower to notice; stderr: {err.read_text()}")
            assert run_onward("add", "--db", url, "second").returncode == 0
            wait_for(lambda: out.read_text().count("added 1 new task") == 2, 20,
                     f"the second event; stderr: {err.read_text()}")
            assert follower.poll() is None, err.read_text()
            assert "store back; following" in err.read_text()
        finally:
            follower.send_signal(signal.SIGINT)
            follower.wait(30)
    assert follower.returncode == 0, err.read_text()


@pytest.mark.postgres
def test_a_password_changed_under_a_running_worker_is_waited_out_and_the_new_one_taken_from_the_password_file(
        tmp_path: Path) -> None:
    """A worker whose connection is cut after its role's password changed is refused at every reconnection
    ("password authentication failed"). Refused at start, that is configuration (exit 2); refused while it
    runs, it is waited out as an outage, saying why every few seconds, and libpq reads the password file
    again at each try: once it holds the new password, the worker goes on and finishes the job. Neither
    password ever shows in the log."""
    old, new = "old-secret-3f9a1c", "new-secret-7d2e4b"
    with pgutil.private_cluster() as cluster:
        hba = pgutil.PG_CONF / cluster.version / cluster.name / "pg_hba.conf"
        hba.write_text(f"host all pw_worker 127.0.0.1/32 scram-sha-256\n{hba.read_text()}")  # first match wins
        cluster.ctl("reload")
        with cluster.admin() as admin:
            admin.execute(f"CREATE ROLE pw_worker LOGIN PASSWORD '{old}'")
            admin.execute("CREATE DATABASE onward OWNER pw_worker")
        url = cluster.url("onward").replace(f"{pgutil.PG_USER}@", "pw_worker@")
        passfile = tmp_path / "pgpass"
        passfile.write_text(f"127.0.0.1:{cluster.port}:onward:pw_worker:{old}\n")
        passfile.chmod(0o600)
        env = {**os.environ, "PGPASSFILE": str(passfile), "PYTHONPATH": SRC}
        assert run_onward("add", "--db", url, "a", "b", "c", env=env).returncode == 0
        log = tmp_path / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(onward_argv("run", "--db", url, "--heartbeat", "0.5", "--", "sleep", "0.5"),
                                      stderr=out, env=env)
        try:
            wait_for(lambda: ' done task="a"' in log.read_text(), 30, "the first task to end")
            with cluster.admin() as admin:
                admin.execute(f"ALTER ROLE pw_worker PASSWORD '{new}'")
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'pw_worker'")
            wait_for(lambda: "password authentication failed" in log.read_text(), 30,
                     "a reconnection to be refused for its password")
            assert worker.poll() is None, log.read_text()
            passfile.write_text(f"127.0.0.1:{cluster.port}:onward:pw_worker:{new}\n")
            assert worker.wait(timeout=60) == 0, log.read_text()
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        text = log.read_text()
        assert old not in text and new not in text
        store = open_store(url.replace("pw_worker@", f"{pgutil.PG_USER}@"), create=False)
        try:
            assert store.counts()[DONE] == 3
        finally:
            store.close()
