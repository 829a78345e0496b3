"""Fixtures that start real things: real SQLite files, a real PostgreSQL database, real processes.

The store fixtures are parametrized over every backend, so one suite checks the same contract everywhere.
PostgreSQL tests skip with a reason when no server answers, except in CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from onward.proc import children, stat_fields
from tests import pgutil

if TYPE_CHECKING:
    from onward.store.base import RunningTask, Store

BACKENDS = ["sqlite", "postgres"]


# `make test` runs the suite in three processes (pytest-xdist, --dist loadgroup); what runs at once must not
# interfere. The tests of one file stay together, in file order, as with --dist loadfile. The files below
# share one group, so they run one after another: some make mount namespaces (systemd-nspawn, ip netns,
# unshare --mount), each holding a copy of every mount the host had when it started, and the power-cut
# tests unmount a loop disk and mount it afresh: while a copy held it, its superblock (read-only after the
# fault) would be reused instead.
MOUNT_NAMESPACE_FILES = frozenset({"test_power_cut.py", "test_systemd_e2e.py", "test_no_orphans_systemd.py",
                                   "test_multihost.py", "test_no_orphans.py"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        group = "mount-namespaces" if Path(path).name in MOUNT_NAMESPACE_FILES else path
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_configure(config: pytest.Config) -> None:
    os.environ.pop("ONWARD_DB", None)
    os.environ.pop("ONWARD_JOB", None)
    os.environ.pop("ONWARD_KEEP_AWAKE", None)
    os.environ.pop("NOTIFY_SOCKET", None)
    # Started in the background by a shell without job control (`make test &` in a script), the suite
    # inherits SIGINT ignored, and so would every onward it starts: a Ctrl-C test would wait for an exit
    # that never comes. A handled SIGINT is reset to the default at a child's exec; an ignored one is not.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store location on each backend."""
    if request.param == "sqlite":
        yield str(tmp_path / "store" / "onward.db")
    else:
        with pgutil.fresh_database() as url:
            yield url


@pytest.fixture(params=BACKENDS)
def v2_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A copy of the version 2 store (written by that version's code, tests/data) on each backend."""
    data = Path(__file__).resolve().parent / "data"
    if request.param == "sqlite":
        path = tmp_path / "v2.db"
        shutil.copyfile(data / "store_v2.db", path)
        yield str(path)
        return
    with pgutil.fresh_database() as url:
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute((data / "store_v2_postgres.sql").read_text())
        yield url


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    """An open store on each backend (see ``store_url``), closed afterwards."""
    from onward.store import open_store

    opened = open_store(store_url)
    yield opened
    opened.close()


def worker(store: Store) -> int:
    """A worker registered in ``store`` as this process, for tests that claim tasks by hand."""
    from onward.proc import current_owner

    return store.register_worker(current_owner(), "test")


def cgroup_writable() -> bool:
    """Whether this process's cgroup v2 can be written (root, or a delegated subtree): then onward runs each
    attempt in a cgroup of its own."""
    from onward.cgroups import own_cgroup

    own = own_cgroup()
    return own is not None and os.access(os.path.join(own, "cgroup.procs"), os.W_OK)


CGROUP_WRITABLE = cgroup_writable()
# Under CI (CI=true) a test that needs cgroup v2 must not skip: there it fails instead.
needs_cgroup2 = pytest.mark.skipif(
    not CGROUP_WRITABLE and os.environ.get("CI") != "true",
    reason="cgroup v2 is not mounted or our cgroup is not writable (needs root or a delegated subtree)")


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return str(tmp_path / "store" / "onward.db")


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """Seeded randomness for crash tests: the seed is printed so a failure can be replayed
    (ONWARD_TEST_SEED=<seed>)."""
    value = int(os.environ.get("ONWARD_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
    print(f"\n[{request.node.name}] seed={value} (replay with ONWARD_TEST_SEED={value})")
    return value


ONWARD_SCRIPT = Path(sys.executable).with_name("onward")


def onward_argv(*args: str) -> list[str]:
    """The installed console script, as users run it (its entry point is what maps errors to exit codes);
    ``python -m onward`` only where no script is installed beside the interpreter."""
    if ONWARD_SCRIPT.exists():
        return [str(ONWARD_SCRIPT), *args]
    return [sys.executable, "-m", "onward", *args]


def run_onward(*args: str, input: bytes | None = None, timeout: float = 120, env: dict[str, str] | None = None,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess[bytes]:
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    if env:
        full_env.update(env)
    return subprocess.run(onward_argv(*args), input=input, capture_output=True, timeout=timeout, env=full_env,
                          cwd=cwd)


def task_result(url: str, task: str) -> Any:
    """A task's result as ``onward result`` prints it (JSON decoded; a str result as printed), or None
    while it has none."""
    r = run_onward("result", "--db", url, task)
    if r.returncode != 0:
        return None
    try:
        return json.loads(r.stdout)
    except ValueError:
        return r.stdout.decode()


def cgroup_v1(controller: str) -> Path:
    """The cgroup v1 hierarchy of ``controller`` (``freezer``, ``memory``), where the test runs as root and
    it is mounted; a skip elsewhere, and under CI (CI=true), whose machines have both, a failure instead."""
    hierarchy = Path("/sys/fs/cgroup") / controller
    if os.geteuid() != 0 or not (hierarchy / "cgroup.procs").exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs root and the cgroup v1 {controller} controller at {hierarchy}")
        pytest.skip(f"needs root and the cgroup v1 {controller} controller at {hierarchy}")
    return hierarchy


@contextlib.contextmanager
def own_cgroup_v1(controller: str) -> Iterator[Path]:
    """A cgroup of the test's own in the cgroup v1 hierarchy of ``controller`` (see ``cgroup_v1``), without a
    limit until the test writes one; whatever is left in it is killed and the cgroup removed afterwards."""
    cgroup = cgroup_v1(controller) / f"onward-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    cgroup.mkdir()
    try:
        yield cgroup
    finally:
        def emptied() -> bool:
            for pid in (cgroup / "cgroup.procs").read_text().split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return not (cgroup / "cgroup.procs").read_text().strip()
        wait_for(emptied, 10, f"{cgroup} to be empty")
        cgroup.rmdir()


def in_cgroup(cgroup: Path, argv: list[str]) -> list[str]:
    """``argv`` run in ``cgroup``: it moves itself there, then execs (the same pid: a supervisor's worker
    stays its child and speaks for itself, while the supervisor stays outside)."""
    return ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh", *argv]


def require_tool(name: str) -> str:
    """The path of a fault-injection tool (``strace``), or a skip where it is missing; under CI (CI=true),
    where .ci/run installs it, a failure instead."""
    import shutil

    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is needed")
        pytest.skip(f"needs {name}")
    return path


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (proc(5): "T" stopped, "Z" a zombie, ...); ProcessLookupError if
    there is no such process."""
    fields = stat_fields(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return fields[0].decode()


def keepers_of(marker: Path, parent: int | None = None) -> list[int]:
    """The pids of the marker keepers (``onward.markerkeeper``) watching over ``marker``; only the children
    of ``parent``, if given. A keeper is told its marker in its environment (not on its command line)."""
    pids = children(parent) if parent is not None else [int(e) for e in os.listdir("/proc") if e.isdigit()]
    found = []
    for pid in pids:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"KEEPER_MARKER=" + os.fsencode(str(marker)) in environ:
            found.append(pid)
    return found


def keeper_of(marker: Path, parent: int) -> int:
    """The pid of the one marker keeper of ``parent`` (a worker or a supervisor) for ``marker``, once it runs."""
    wait_for(lambda: keepers_of(marker, parent), 20, f"the marker keeper of {parent}")
    (keeper,) = keepers_of(marker, parent)
    return keeper


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> object:
    """Poll ``condition`` until it is truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def result_bytes(store: Store, name: str) -> bytes:
    """A task's stored result; fails the test when the task has none."""
    stored = store.result(name)
    assert stored is not None, f"task {name!r} has no result"
    return stored.data


def because(reason: str) -> Callable[[RunningTask], str]:
    """For ``Store.reclaim``: take the task over, whatever its read says, for ``reason``."""
    return lambda _task: reason
