"""Real PostgreSQL servers for tests: a fresh database per test on the local server (127.0.0.1:5432, user
postgres, trust auth), and, for fault tests, a throwaway cluster of the test's own that it may restart or
expose on other addresses without disturbing anyone else using the local server.

Without a server (or without root, for a private cluster) the tests skip with the reason; under CI
(CI=true) that is a failure instead: the PostgreSQL half of the suite must run there.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

PG_HOST = os.environ.get("ONWARD_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("ONWARD_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("ONWARD_TEST_PG_USER", "postgres")
ADMIN_DB = os.environ.get("ONWARD_TEST_PG_DB", "test")
CLUSTER_PREFIX = "onwardtest_"  # private clusters are named onwardtest_<pid of the test process>_<random>
PG_CONF = Path("/etc/postgresql")


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def unavailable(reason: str) -> None:
    """Skip the test, or fail it under CI, where every PostgreSQL test must run."""
    if in_ci():
        pytest.fail(f"{reason}, and CI needs the PostgreSQL tests")
    pytest.skip(reason)


def admin_connection(host: str = PG_HOST, port: int = PG_PORT, dbname: str = ADMIN_DB):
    """An autocommit connection as the superuser, or a skip (a failure under CI) when there is none."""
    try:
        import psycopg
    except ImportError:
        unavailable("psycopg is not installed (pip install 'onward[postgres]')")
        raise
    try:
        return psycopg.connect(host=host, port=port, user=PG_USER, dbname=dbname, autocommit=True,
                               connect_timeout=3)
    except psycopg.OperationalError as e:
        unavailable(f"no PostgreSQL server at {host}:{port} ({str(e).strip().splitlines()[0]})")
        raise


@contextmanager
def fresh_database(host: str = PG_HOST, port: int = PG_PORT, url_host: str | None = None) -> Iterator[str]:
    """A new, empty database, dropped afterwards (with any session still connected to it)."""
    admin = admin_connection(host, port)
    name = f"onward_t_{uuid.uuid4().hex[:12]}"
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        yield f"postgresql://{PG_USER}@{url_host or host}:{port}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


# --- private clusters ----------------------------------------------------------------------------------
def _cluster_tools() -> str:
    """The installed PostgreSQL major version, after checking what a private cluster needs."""
    if os.geteuid() != 0:
        unavailable("a private PostgreSQL cluster needs root (to run initdb as the postgres user)")
    for tool in ("pg_createcluster", "pg_ctlcluster", "pg_dropcluster"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (package postgresql-common)")
    versions = sorted((p.name for p in PG_CONF.iterdir() if p.name.isdigit()), key=int) if PG_CONF.is_dir() else []
    if not versions:
        unavailable("no PostgreSQL server package installed (/etc/postgresql is empty)")
    return versions[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _drop_stale_clusters(version: str) -> None:
    """Remove private clusters left behind by test processes that died before cleaning up."""
    for conf in (PG_CONF / version).glob(f"{CLUSTER_PREFIX}*"):
        try:
            owner = int(conf.name[len(CLUSTER_PREFIX):].split("_")[0])
        except ValueError:
            continue
        if Path(f"/proc/{owner}").exists():
            continue
        data = _data_directory(conf)
        subprocess.run(["pg_dropcluster", "--stop", version, conf.name], capture_output=True)
        if data is not None and data.parent.name.startswith("onward-pg-"):
            shutil.rmtree(data.parent, ignore_errors=True)


def _data_directory(conf: Path) -> Path | None:
    try:
        for line in (conf / "postgresql.conf").read_text().splitlines():
            if line.startswith("data_directory"):
                return Path(line.split("=", 1)[1].split("#")[0].strip().strip("'"))
    except OSError:
        pass
    return None


class PrivateCluster:
    """A PostgreSQL cluster that belongs to one test: its own port, data folder and configuration."""

    def __init__(self, version: str, name: str, port: int) -> None:
        self.version = version
        self.name = name
        self.port = port

    def url(self, db: str, host: str = "127.0.0.1", password: str | None = None) -> str:
        auth = f"{PG_USER}:{password}" if password else PG_USER
        return f"postgresql://{auth}@{host}:{self.port}/{db}"

    def ctl(self, action: str) -> None:
        """``pg_ctlcluster`` on this cluster: start, stop, restart (waits until done)."""
        done = subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", self.version, self.name, action],
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"pg_ctlcluster {action} {self.name} failed: {done.stderr.strip()[-2000:]}")

    def restart(self) -> None:
        self.ctl("restart")

    def admin(self, dbname: str = "postgres"):
        return admin_connection("127.0.0.1", self.port, dbname)

    def create_database(self, name: str) -> str:
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def server_pids(self) -> list[int]:
        """The postmaster, then every process it started (backends, checkpointer, WAL writer...)."""
        data = _data_directory(PG_CONF / self.version / self.name)
        if data is None:
            raise RuntimeError(f"no data_directory in the configuration of cluster {self.name}")
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_bytes().rsplit(b")", 1)[1].split()  # fields[1] is the parent's pid
            except OSError:
                continue  # the process ended meanwhile
            if int(fields[1]) == postmaster:
                children.append(int(stat.parent.name))
        return [postmaster, *children]

    @contextmanager
    def paused(self) -> Iterator[list[int]]:
        """The whole server stopped with SIGSTOP (as a frozen VM or a stalled host would be: connections
        stay open, the kernel still acknowledges what clients send, nothing answers), and resumed with
        SIGCONT on leaving. The postmaster is stopped first, so it starts no process that would escape."""
        stopped: list[int] = []
        try:
            for _ in range(2):  # again: a process forked just before the postmaster stopped
                for pid in self.server_pids():
                    if pid not in stopped:
                        try:
                            os.kill(pid, signal.SIGSTOP)
                        except ProcessLookupError:
                            continue  # a backend that ended meanwhile
                        stopped.append(pid)
            yield stopped
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    def started_at(self) -> float:
        """When the server (postmaster) last started: changes with every restart."""
        with self.admin() as conn:
            return float(conn.execute("SELECT extract(epoch FROM pg_postmaster_start_time())").fetchone()[0])


@contextmanager
def private_cluster(listen: Sequence[str] = ("127.0.0.1",), trust: Sequence[str] = ()) -> Iterator[PrivateCluster]:
    """A new cluster listening on ``listen`` (addresses that must exist already), trusting connections from
    127.0.0.1 and the ``trust`` networks (CIDR); stopped and removed afterwards, data and configuration."""
    version = _cluster_tools()
    _drop_stale_clusters(version)
    name = f"{CLUSTER_PREFIX}{os.getpid()}_{uuid.uuid4().hex[:6]}"
    postgres = pwd.getpwnam("postgres")
    root = Path(tempfile.mkdtemp(prefix="onward-pg-"))
    os.chown(root, postgres.pw_uid, postgres.pw_gid)
    cluster = PrivateCluster(version, name, _free_port())
    created = False
    try:
        subprocess.run(
            ["pg_createcluster", version, name, "-d", str(root / "data"), "-p", str(cluster.port),
             "--start-conf", "manual", "--", "--auth-local=trust", "--auth-host=trust", "--no-sync"],
            check=True, capture_output=True, timeout=120)
        created = True
        with open(PG_CONF / version / name / "postgresql.conf", "a") as conf:  # later lines win
            conf.write(f"listen_addresses = '{','.join(listen)}'\nssl = off\nmax_connections = 100\n"
                       "shared_buffers = 16MB\n")
        with open(PG_CONF / version / name / "pg_hba.conf", "a") as hba:
            for network in trust:
                hba.write(f"host all all {network} trust\n")
        cluster.ctl("start")
        deadline = time.monotonic() + 30
        while True:
            try:
                cluster.admin().close()
                break
            except BaseException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield cluster
    finally:
        if created:
            subprocess.run(["pg_dropcluster", "--stop", version, name], capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
