"""A running task's lease is renewed while a good part of it is left, whatever `--heartbeat` and `--lease`
say: the installed script runs a real worker on a real SQLite store, and the test reads the task's lease
from the store as it runs, noting how much of the old lease was left when each renewal appeared."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import onward_argv, run_onward, wait_for

RENEWALS = 4


def lease_left_at_renewals(tmp_path: Path, heartbeat: str, lease: str | None) -> list[float]:
    """Seconds left of the task's lease each time a renewal replaced it, as seen by a reader polling the
    store every 10 ms (which sees a renewal up to that much late: the figures can only come out lower)."""
    db = str(tmp_path / "store.db")
    assert run_onward("add", "--db", db, "t").returncode == 0
    flags = ["--heartbeat", heartbeat, "--grace", "0"] + (["--lease", lease] if lease is not None else [])
    worker = subprocess.Popen(onward_argv("run", "--db", db, *flags, "-q", "--", "sleep", "60"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    left: list[float] = []
    try:
        reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True, isolation_level=None)
        try:
            last: float | None = None  # the lease's end as last read

            def renewals_seen() -> bool:
                nonlocal last
                row = reader.execute("SELECT lease_until FROM tasks WHERE state = 'running'").fetchone()
                now = time.time()
                if row is not None and row[0] != last:
                    if last is not None:
                        left.append(last - now)
                    last = row[0]
                assert worker.poll() is None, worker.stderr.read().decode() if worker.stderr else ""
                return len(left) >= RENEWALS

            wait_for(renewals_seen, 30, f"{RENEWALS} renewals of the task's lease", interval=0.01)
        finally:
            reader.close()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    return left


@pytest.mark.parametrize(("heartbeat", "lease"), [("1", "1.0000001"), ("1", "1.5")])
def test_a_lease_barely_longer_than_the_heartbeat_is_renewed_well_before_it_runs_out(
        tmp_path: Path, heartbeat: str, lease: str) -> None:
    # Renewed every heartbeat (1 s), such a lease ran out before each renewal came, by the moment the loop woke
    # late (read here 4 to 10 ms before it, to within the 10 ms of a poll): another worker could take the task
    # over then.
    left = lease_left_at_renewals(tmp_path, heartbeat, lease)
    assert min(left) >= float(lease) / 3, f"lease left at each renewal (s): {left}"


def test_the_default_lease_is_renewed_every_heartbeat_as_before(tmp_path: Path) -> None:
    # Three heartbeats (1.5 s): renewed every 0.5 s, with about 1 s of it left; not more often than that.
    left = lease_left_at_renewals(tmp_path, "0.5", None)
    assert min(left) >= 0.5, f"lease left at each renewal (s): {left}"
    assert max(left) < 1.3, f"lease left at each renewal (s): {left}"
