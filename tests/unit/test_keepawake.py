"""The keep-awake marker's rules on a real file, with real locks held by other processes."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from onward import keepawake
from onward.keepawake import KeepAwake
from onward.log import Log
from onward.markerkeeper import remove_unheld

HOLD = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH);"
        " print('held', flush=True); sys.stdin.read()")


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "keep-awake"
    path.write_bytes(b"onward pid=1 store=s.db\n")
    return path


def holder(marker: Path) -> subprocess.Popen[str]:
    """Another process holding a shared lock on ``marker`` until its stdin is closed."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(marker)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def test_remove_unheld_waits_its_patience_for_a_lock_to_go(marker: Path) -> None:
    """A killed worker's keeper meets a lock that goes a moment later: a process the worker made ahead
    shares it until it dies with the worker, and may close the pipe the keeper watches first. A lock that
    stays (a worker alive and holding the marker) keeps the marker."""
    process = holder(marker)
    try:
        assert not remove_unheld(str(marker)) and marker.exists()
        assert not remove_unheld(str(marker), patience=0.1) and marker.exists()
        assert process.stdin is not None
        threading.Timer(0.2, process.stdin.close).start()  # the holder dies a moment later
        assert remove_unheld(str(marker), patience=30.0)
        assert not marker.exists()
    finally:
        process.kill()
        process.wait()


def test_a_keeper_that_cannot_be_started_is_a_warning_and_the_marker_is_held(
        marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No process can be started (here: no interpreter where there was one): the worker says so once, holds
    the marker, and goes on."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setattr(sys, "executable", str(marker.parent / "no-such-python"))
    monkeypatch.setattr(keepawake, "_keepers", {})
    said = io.StringIO()
    awake = KeepAwake(str(marker), Log(stream=said))
    awake.hold("s.db")
    try:
        assert "cannot start the process that removes the keep-awake marker" in said.getvalue()
        assert said.getvalue().count("\n") == 1 and marker.exists()
        assert not remove_unheld(str(marker)), "held by this worker"
    finally:
        awake.release()
    assert not marker.exists()


def test_a_keeper_that_ends_by_itself_is_told_once_and_not_started_again(
        marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A keeper that ends without being killed (here: it cannot run its code) could not do its work, and
    another would fail alike: the worker says so once, at its next heartbeat, and does not start a process
    at every heartbeat after."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setattr(keepawake, "_BOOT", "raise SystemExit(3)")
    monkeypatch.setattr(keepawake, "_keepers", {})
    said = io.StringIO()
    awake = KeepAwake(str(marker), Log(stream=said))
    awake.hold("s.db")
    try:
        ((keeper, _),) = keepawake._keepers.values()
        os.waitid(os.P_PID, keeper.pid, os.WEXITED | os.WNOWAIT)  # ended, left for the worker to reap
        for _ in range(3):  # three heartbeats
            awake.hold("s.db")
        assert said.getvalue().count("\n") == 1, said.getvalue()
        assert f"(pid {keeper.pid}) ended first (exit status 3); not started again" in said.getvalue()
        assert [k for k, _ in keepawake._keepers.values()] == [keeper]
    finally:
        awake.release()
    assert not marker.exists()
