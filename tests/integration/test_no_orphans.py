"""A command's processes never outlive their worker: real workers, real supervisors, real SIGKILLs, real
cgroups. Each test's task runs ``sleep 60.<unique digits>``, so the sleeps it leaves behind are found by
that argument in /proc, whatever process group or session they moved to.

Two modes: ``cgroup`` (cgroup v2 writable, as for root or a delegated subtree; under CI=true on a machine
with cgroup v2 this must not skip) and ``no-cgroup``, where the worker runs in a mount namespace of its own
in which the cgroup v2 hierarchy is read-only, so onward finds it not writable, as an unprivileged user
without a delegated subtree would.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward.cgroups import WORKER_DIR, hierarchy, own_cgroup
from tests.conftest import CGROUP_WRITABLE, needs_cgroup2, onward_argv, run_onward, wait_for


def _can_hide_cgroup2() -> bool:
    """Whether cgroups are off already, or can be made read-only in a mount namespace (CAP_SYS_ADMIN)."""
    return not CGROUP_WRITABLE or subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


can_hide_cgroup2 = pytest.mark.skipif(
    not _can_hide_cgroup2(), reason="making the cgroup v2 hierarchy read-only in a mount namespace needs "
                                    "CAP_SYS_ADMIN (unshare --mount)")
MODES = [pytest.param("cgroup", marks=needs_cgroup2), pytest.param("no-cgroup", marks=can_hide_cgroup2)]


def in_mode(mode: str, argv: list[str]) -> list[str]:
    """``argv`` as run in ``mode``: as it is, or in a mount namespace where cgroup v2 is read-only."""
    mount = hierarchy()
    if mode == "cgroup" or mount is None or not CGROUP_WRITABLE:
        return argv
    return ["unshare", "--mount", "sh", "-c", 'mount -o remount,bind,ro "$0" && exec "$@"', mount, *argv]


@pytest.fixture
def marker() -> Iterator[str]:
    """A sleep duration no other test uses; any sleep still holding it at the end is killed."""
    mark = f"60.{random.SystemRandom().randrange(10**12):012d}"
    yield mark
    for pid in sleeps(mark):
        os.kill(pid, signal.SIGKILL)


def sleeps(mark: str) -> list[int]:
    """The live processes whose arguments include ``mark``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                words = f.read().split(b"\0")
        except OSError:
            continue
        if mark.encode() in words:
            found.append(int(name))
    return found


def task_script(tmp_path: Path, mark: str, setsid: bool, first_attempt_only: bool = False) -> Path:
    """A task that writes its worker's pid (its parent) to worker.pid, then sleeps, in a session of its
    own with ``setsid``; with ``first_attempt_only``, later attempts just succeed."""
    script = tmp_path / "task.sh"
    sleep = f"{'setsid ' if setsid else ''}sleep {mark}"
    guard = 'if [ "$ONWARD_ATTEMPT" != 1 ]; then echo again; exit 0; fi\n' if first_attempt_only else ""
    script.write_text(f"#!/bin/sh\necho $PPID > {tmp_path / 'worker.pid'}\n{guard}{sleep}\n")
    script.chmod(0o755)
    return script


def start(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(p: subprocess.Popen[bytes]) -> bytes:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    return err


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def in_attempt_cgroup(pid: int) -> bool:
    """Whether the process runs in an onward attempt cgroup (checks that a test's mode is what it says)."""
    with open(f"/proc/{pid}/cgroup") as f:
        return any(line.startswith("0::") and "/onward-" in line and "/attempt-" in line for line in f)


def leftover_worker_cgroups(already: frozenset[str] = frozenset()) -> list[str]:
    """The worker cgroup directories in ours whose worker is gone, except those in ``already``: one an
    earlier test of the session left behind (that a sweep could not remove yet, e.g. with a process of its
    still stopped or frozen in it) is not this test's to answer for."""
    own = own_cgroup()
    names = os.listdir(own) if own is not None else []
    return [n for n in names if (m := WORKER_DIR.fullmatch(n)) and not alive(int(m.group(1))) and n not in already]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setsid", [False, True], ids=["sleep", "setsid-sleep"])
def test_the_sleep_of_a_killed_workers_task_dies_at_once_under_the_supervisor(
        tmp_path: Path, marker: str, mode: str, setsid: bool) -> None:
    """Was: a `kill -9` of the worker left `sleep` running until a later worker reclaimed the task (and one
    that had `setsid` for good). Now the supervisor, the sleep's subreaper, kills it at once: the restart
    is 60 s away, so no reclaim can be what killed it."""
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    script = task_script(tmp_path, marker, setsid)
    sup = start(in_mode(mode, onward_argv("supervise", "--restart-delay", "60", "--", *onward_argv(
        "run", "--db", db, "--", str(script)))), tmp_path)
    try:
        sleep = wait_for(lambda: sleeps(marker), 30, "the task's sleep to start")[0]  # type: ignore[index]
        assert in_attempt_cgroup(sleep) == (mode == "cgroup")
        worker = int((tmp_path / "worker.pid").read_text())
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: not sleeps(marker), 10, "the sleep to die with its worker")
        assert sup.poll() is None, "the supervisor is waiting to restart, not gone"
    finally:
        err = stop(sup)
    assert b"left" in err and b"killed them" in err, err.decode()


@needs_cgroup2
def test_a_task_that_setsids_leaves_no_copy_after_timeouts(tmp_path: Path, marker: str) -> None:
    """Was: a task whose sleep escaped its process group with `setsid` left one copy running per attempt
    (3 after `--timeout 1 --max-attempts 3`). Now each attempt's cgroup is killed with it."""
    (tmp_path / "t.txt").write_text("t\n")
    script = task_script(tmp_path, marker, setsid=True)
    before = frozenset(leftover_worker_cgroups())
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tmp_path / "t.txt"), "--timeout", "1",
                   "--max-attempts", "3", "--retry-delay", "0.1", "--", str(script), cwd=tmp_path)
    assert r.returncode == 3, r.stderr.decode()
    assert sleeps(marker) == []
    assert leftover_worker_cgroups(before) == []


@can_hide_cgroup2
def test_without_cgroups_a_setsid_task_timed_out_is_killed_when_its_supervised_worker_ends(
        tmp_path: Path, marker: str) -> None:
    """The weaker guarantee without cgroup v2 (README): a process that left its process group outlives
    its attempt, but not its supervised worker: it is re-parented to the supervisor, which kills it."""
    (tmp_path / "t.txt").write_text("t\n")
    script = task_script(tmp_path, marker, setsid=True)
    sup = start(in_mode("no-cgroup", onward_argv("supervise", "--", *onward_argv(
        "run", "--db", str(tmp_path / "s.db"), "--tasks", str(tmp_path / "t.txt"), "--timeout", "1",
        "--max-attempts", "2", "--retry-delay", "0.1", "--", str(script)))), tmp_path)
    _, err = sup.communicate(timeout=60)
    assert b"exited with status 3" in err, err.decode()
    assert sleeps(marker) == []


@needs_cgroup2
def test_what_a_killed_supervisors_worker_left_dies_when_the_next_worker_starts(
        tmp_path: Path, marker: str) -> None:
    """Was: `kill -9` of the supervisor took the worker along (PDEATHSIG) but a sleep that had `setsid`
    ran on for good. Now it is in the dead worker's cgroup, which the next worker kills as it starts."""
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    script = task_script(tmp_path, marker, setsid=True, first_attempt_only=True)
    before = frozenset(leftover_worker_cgroups())
    sup = start(onward_argv("supervise", "--", *onward_argv("run", "--db", db, "--", str(script))), tmp_path)
    wait_for(lambda: sleeps(marker), 30, "the task's sleep to start")
    worker = int((tmp_path / "worker.pid").read_text())
    sup.kill()
    sup.communicate()
    wait_for(lambda: not alive(worker), 10, "the worker to die with its supervisor (PDEATHSIG)")
    assert sleeps(marker), "the sleep outlived both (nothing reached it yet)"
    r = run_onward("run", "--db", db, "--", str(script), cwd=tmp_path)
    assert r.returncode == 0, r.stderr.decode()
    assert sleeps(marker) == []
    left = leftover_worker_cgroups(before)
    assert left == [], f"the killed worker {worker}'s cgroup or another of this test's was left: {left}"
    assert run_onward("result", "--db", db, "t").stdout == b"again\n"


@can_hide_cgroup2
def test_without_cgroups_what_a_killed_supervisors_worker_left_in_its_group_dies_at_the_reclaim(
        tmp_path: Path, marker: str) -> None:
    """The weaker guarantee without cgroup v2 (README): the sleep of a worker that died with its
    supervisor runs on until a later worker reclaims the task and kills its recorded process group."""
    db = str(tmp_path / "s.db")
    run_onward("add", "--db", db, "t")
    script = task_script(tmp_path, marker, setsid=False, first_attempt_only=True)
    sup = start(in_mode("no-cgroup", onward_argv("supervise", "--", *onward_argv(
        "run", "--db", db, "--", str(script)))), tmp_path)
    wait_for(lambda: sleeps(marker), 30, "the task's sleep to start")
    sup.kill()
    sup.communicate()
    r = subprocess.run(in_mode("no-cgroup", onward_argv("run", "--db", db, "--", str(script))), cwd=tmp_path,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert b"owner died" in r.stderr
    wait_for(lambda: not sleeps(marker), 5, "the reclaim to kill the dead attempt's process group")


@needs_cgroup2
def test_a_leaf_killed_at_a_timeout_is_not_reused_to_kill_the_next_commands_at_birth(tmp_path: Path) -> None:
    """Was: the attempt cgroup of a task killed at its --timeout (cgroup.kill) went back to the pool; this
    kernel SIGKILLs every process later born into such a cgroup with CLONE_INTO_CGROUP, so the next command
    died at birth three times, and the worker said "the command spawner died three times in a row", gave
    the attempt back and lowered its concurrency (also after a lease ran out: found by the paused-server
    fault cell). Now a killed leaf is never reused."""
    names = ["slow", *(f"f{i}" for i in range(6))]
    (tmp_path / "t.txt").write_text("".join(n + "\n" for n in names))
    script = tmp_path / "task.sh"
    script.write_text('#!/bin/sh\nif [ "$1" = slow ]; then exec sleep 30; fi\necho "ok $1"\n')
    script.chmod(0o755)
    r = run_onward("run", "--db", str(tmp_path / "s.db"), "--tasks", str(tmp_path / "t.txt"), "--timeout", "1",
                   "--max-attempts", "1", "--", str(script), "{task}")
    log = r.stderr.decode()
    assert r.returncode == 3, log  # "slow" failed for good, by its timeout
    assert "out of resources" not in log and "released" not in log, log
    assert all(f'done task="{n}" attempt=1 ' in log for n in names[1:]), log
