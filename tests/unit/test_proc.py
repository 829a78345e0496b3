"""onward.proc with real processes: children, a subreaper's orphans, start times."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward import proc
from tests.conftest import wait_for


@pytest.fixture
def subreaper() -> Iterator[frozenset[int]]:
    """This test process as a child subreaper for the test's length; yields the children it already had."""
    before = frozenset(proc.children())
    proc.set_child_subreaper(True)
    try:
        yield before
    finally:
        proc.set_child_subreaper(False)


def test_children_are_listed_with_or_without_the_kernels_children_file(monkeypatch: pytest.MonkeyPatch) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert child.pid in proc.children()
        real_open = open

        def no_children_file(path: object, *args: object, **kwargs: object) -> object:
            if str(path).endswith("/children"):
                raise FileNotFoundError(path)
            return real_open(path, *args, **kwargs)  # type: ignore[call-overload]
        monkeypatch.setattr("builtins.open", no_children_file)
        assert child.pid in proc.children()
    finally:
        child.kill()
        child.wait()


def test_a_subreaper_kills_the_orphans_that_left_their_group_and_session_but_not_its_own_children(
        subreaper: frozenset[int], tmp_path: Path) -> None:
    mine = subprocess.Popen(["sleep", "60"])
    pids = tmp_path / "pids"
    # A double fork into a new session, three deep: each re-parents to us only once its parent is dead.
    script = ("import os, sys, time\n"
              "for _ in range(3):\n"
              "    if os.fork():\n"
              "        os._exit(0)\n"
              "    os.setsid()\n"
              "    open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
              "    if os.fork():\n"
              "        time.sleep(60)\n"
              "        os._exit(0)\n"
              "time.sleep(60)\n")
    subprocess.run([sys.executable, "-c", script, str(pids)], check=True)
    wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 3, 20, "the three sessions")
    try:
        killed = proc.kill_orphans(keep=subreaper | {mine.pid}, timeout=10)
        assert killed >= 3
        assert all(proc.pid_start_time(int(pid)) is None for pid in pids.read_text().split())
        assert mine.poll() is None, "a child the process started itself is left alone"
        assert set(proc.children()) == subreaper | {mine.pid}, "every orphan was reaped"
    finally:
        mine.kill()
        mine.wait()


def test_a_subreaper_reaps_exited_orphans_and_leaves_its_own_children_to_their_owners(
        subreaper: frozenset[int]) -> None:
    mine = subprocess.Popen(["true"])
    subprocess.run(["sh", "-c", "true & exit 0"], check=True)  # its `true` is re-parented to us
    wait_for(lambda: mine.pid in proc.children() and len(set(proc.children()) - subreaper) >= 2, 10,
             "both to exit")
    def reaped() -> bool:
        proc.reap_orphans(keep=subreaper | {mine.pid})
        return set(proc.children()) - subreaper == {mine.pid}

    wait_for(reaped, 10, "the orphan to be reaped")
    assert mine.wait() == 0, "its exit status was left for its Popen"


def test_a_childs_start_time_from_the_boot_clock_is_the_one_proc_gives() -> None:
    """``child_start_time`` reads a child's start time off the boot clock read around its making, where /proc
    would be read otherwise: for real children it must be /proc's value, or whoever takes a task over would
    find a noted process's start time wrong and leave the process running (or take another for it)."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    agreed = straddled = 0
    for _ in range(300):
        made_after = proc.boot_clock_ns()
        # posix_spawn (a vfork): the readings a fraction of a millisecond apart, as around the worker's clone.
        pid = os.posix_spawn(sleep, ["sleep", "60"], os.environ)
        made_before = proc.boot_clock_ns()
        try:
            expected = proc.pid_start_time(pid)
            assert expected is not None
            assert proc.child_start_time(pid, made_after, made_before) == expected
            if made_after // proc.BOOT_CLOCK_TICK_NS == made_before // proc.BOOT_CLOCK_TICK_NS:
                agreed += 1
            else:
                straddled += 1
        finally:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    # The clock, not /proc, answered for most (a straddle is the readings' gap over 10 ms: 2 % here).
    assert agreed > 150, (agreed, straddled)


def test_a_child_made_across_a_tick_of_the_boot_clock_has_its_start_time_read_from_proc() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        start = proc.pid_start_time(child.pid)
        assert start is not None
        tick = proc.BOOT_CLOCK_TICK_NS
        # Readings a tick apart cannot tell which tick the clone fell in: /proc is asked, and answers.
        assert proc.child_start_time(child.pid, start * tick, (start + 1) * tick) == start
        assert proc.child_start_time(child.pid, (start - 1) * tick, start * tick + 1) == start
    finally:
        child.kill()
        child.wait()
    # Gone (reaped): /proc has no answer, and the caller is told so.
    assert proc.child_start_time(child.pid, 0, 10 * proc.BOOT_CLOCK_TICK_NS) is None
