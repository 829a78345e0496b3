"""onward.cgroups on the real cgroup v2 hierarchy: real cgroups, real processes, real SIGKILLs."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward import cgroups
from onward.attempts import _spawn
from onward.cgroups import (
    AttemptCgroup,
    WorkerCgroups,
    kill_listed_until_empty,
    own_cgroup,
    populated,
    remove,
)
from tests.conftest import needs_cgroup2, wait_for

OWN = own_cgroup()


@pytest.fixture
def scratch() -> Iterator[str]:
    """An empty cgroup of this test's own, killed and removed afterwards."""
    assert OWN is not None
    path = os.path.join(OWN, f"onward-test-{os.getpid()}")
    os.mkdir(path)
    yield path
    remove(path)


def start_in(cgroup: AttemptCgroup, *argv: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, preexec_fn=cgroup.enter, start_new_session=True)


@pytest.mark.parametrize(("top", "ours", "found"), [
    ("/", "0::/system.slice/x.service", "{mount}/system.slice/x.service"),
    ("/docker/abc", "0::/docker/abc/sub", "{mount}/sub"),  # mounted from below its top, as in a container
    ("/docker/abc", "0::/elsewhere", None),  # our cgroup is not in the part that is mounted
    ("/", "0::/../outside", None),  # outside our cgroup namespace
    ("/", "1:name=systemd:/x", None),  # cgroup v1 only
])
def test_our_cgroup_is_found_from_mountinfo_and_proc_self_cgroup(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, top: str, ours: str, found: str | None) -> None:
    mount = tmp_path / "my cgroups"
    (mount / "system.slice" / "x.service").mkdir(parents=True)
    (mount / "sub").mkdir()
    escaped = str(mount).replace(" ", "\\040")
    files = {
        "/proc/self/mountinfo": "25 1 0:23 / /sys/fs/cgroup/cpu rw shared:9 - cgroup cgroup rw,cpu\n"
                                f"41 31 0:38 {top} {escaped} rw,relatime shared:10 master:2 - cgroup2 cgroup2 rw\n",
        "/proc/self/cgroup": ours + "\n",
    }
    for name, text in files.items():
        (tmp_path / name.replace("/", "_")).write_text(text)
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        tmp_path / path.replace("/", "_") if path in files else path, *a, **k))
    assert cgroups.hierarchy() == str(mount)
    assert cgroups.own_cgroup() == (found.format(mount=mount) if found else None)


def test_without_a_cgroup2_mount_there_is_no_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("25 1 0:23 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(
        mountinfo if path == "/proc/self/mountinfo" else path, *a, **k))
    assert cgroups.hierarchy() is None and cgroups.own_cgroup() is None
    assert cgroups.WorkerCgroups.create() is None


@needs_cgroup2
def test_a_process_that_forks_away_into_a_new_session_is_still_killed_with_its_attempt(scratch: str) -> None:
    attempt = AttemptCgroup(os.path.join(scratch, "attempt-1"))
    child = start_in(attempt, sys.executable, "-c",
                     "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nelse:\n"
                     "    os._exit(0)")
    child.wait()
    assert populated(attempt.path), "the grandchild runs on in the attempt's cgroup"
    attempt.close()
    assert remove(attempt.path)
    assert not os.path.exists(attempt.path)


@needs_cgroup2
def test_without_cgroup_kill_every_listed_process_is_killed_until_none_is_left(scratch: str) -> None:
    """The path for kernels before 5.14 (no cgroup.kill), on processes that keep forking."""
    attempt = AttemptCgroup(os.path.join(scratch, "attempt-1"))
    child = start_in(attempt, sys.executable, "-c",
                     "import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n        time.sleep(60)\n"
                     "time.sleep(60)")
    wait_for(lambda: len(cgroups._listed(attempt.path)) > 20, 20, "the forks")
    kill_listed_until_empty(scratch, timeout=10)
    child.wait()
    wait_for(lambda: not populated(scratch), 10, "the cgroup to empty")


@needs_cgroup2
def test_a_live_workers_cgroups_are_never_swept_and_a_dead_ones_are(scratch: str) -> None:
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        live_dir = os.path.join(scratch, cgroups.worker_dir_name(live.pid, cgroups.pid_start_time(live.pid) or 0, 1))
        dead_dir = os.path.join(scratch, cgroups.worker_dir_name(dead.pid, 12345, 1))
        # A dead pid here may be a live worker in another pid namespace: never swept.
        foreign_dir = os.path.join(scratch, f"onward-{dead.pid}-12345-{cgroups.pid_namespace() + 1}-1")
        for folder in (live_dir, dead_dir, foreign_dir):
            os.makedirs(os.path.join(folder, "attempt-1"))
        leftover = AttemptCgroup(os.path.join(dead_dir, "attempt-2"))
        orphan = start_in(leftover, "sleep", "60")
        assert cgroups.sweep_dead_workers(scratch) == 1
        assert orphan.wait(timeout=10) == -9
        assert os.path.isdir(os.path.join(live_dir, "attempt-1")) and not os.path.exists(dead_dir)
        assert os.path.isdir(os.path.join(foreign_dir, "attempt-1"))
    finally:
        live.kill()
        live.wait()


@needs_cgroup2
def test_an_attempt_cgroup_is_emptied_and_reused_and_removed_when_the_worker_closes() -> None:
    worker = WorkerCgroups.create()
    other = WorkerCgroups.create()  # a second job in the same process has a directory of its own
    assert worker is not None and other is not None and worker.path != other.path
    first = worker.attempt()
    left = start_in(first, sys.executable, "-c", "import os, time\nif os.fork() == 0:\n    time.sleep(60)")
    left.wait()
    worker.finished(first)  # the command exited and was reaped; what it forked is killed
    assert not populated(first.path)
    # Killed with cgroup.kill, the leaf is not reused (whatever is born in it later dies at once): removed.
    second = worker.attempt()
    assert second is not first and not os.path.exists(first.path)
    assert start_in(second, "true").wait() == 0
    worker.finished(second)  # nothing left, nothing killed: reused
    assert worker.attempt() is second
    child = start_in(second, "sleep", "60")
    bystander = start_in(other.attempt(), "sleep", "60")
    worker.close()
    assert child.wait(timeout=10) == -9
    assert not os.path.exists(worker.path)
    assert bystander.poll() is None
    other.close()
    assert bystander.wait(timeout=10) == -9


@needs_cgroup2
def test_a_reused_leaf_still_finds_and_kills_what_an_attempt_left_outside_its_process_group() -> None:
    """The end of an attempt reads ``cgroup.events`` through a descriptor kept open across attempts: it
    must see every attempt's leftovers afresh, not the file as it was first read. A leaf whose commands
    left nothing is reused; one whose leftovers had to be killed is not (see the test above)."""
    worker = WorkerCgroups.create()
    assert worker is not None
    try:
        leaf = worker.attempt()
        assert not leaf.populated()
        for _ in range(2):  # the same leaf, attempt after attempt, while its commands leave nothing
            assert start_in(leaf, "true").wait() == 0
            worker.finished(leaf)
            assert worker.attempt() is leaf, "an empty leaf is reused"
        command = start_in(leaf, sys.executable, "-c",
                           "import os, time\nif os.fork() == 0:\n    os.setsid()"
                           "\n    time.sleep(60)\nelse:\n    os._exit(0)")
        assert command.wait() == 0
        assert leaf.populated() and populated(leaf.path), "the setsid grandchild runs on in the leaf"
        worker.finished(leaf)
        assert not populated(leaf.path)
        assert cgroups._listed(leaf.path) == []
        assert worker.attempt() is not leaf, "a leaf killed with cgroup.kill is not reused"
    finally:
        worker.close()


@needs_cgroup2
def test_a_command_that_cannot_enter_its_cgroup_fails_to_start_and_the_leaf_is_not_reused() -> None:
    """Hostile twin: the attempt's cgroup vanished between its creation and the fork."""
    worker = WorkerCgroups.create()
    assert worker is not None
    try:
        attempt = worker.attempt()
        os.rmdir(attempt.path)
        with pytest.raises(OSError, match="cannot move the command into its cgroup .*attempt-1"):
            _spawn(["true"], dict(os.environ), attempt)
        worker.finished(attempt, reusable=False)
        assert worker.attempt() is not attempt
    finally:
        worker.close()
