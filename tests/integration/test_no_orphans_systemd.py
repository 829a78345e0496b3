"""Attempt cgroups under systemd, in a container booted with systemd (see test_systemd_e2e.py for the
recipe): an unprivileged service (``User=nobody``) with a delegated subtree (``Delegate=yes``) runs each
attempt in a cgroup of its own; without delegation it has none, and the unit's kill mode is what ends
what escaped, when the service ends."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.integration.test_no_orphans import sleeps
from tests.integration.test_systemd_e2e import SRC, Container, container

__all__ = ["container"]  # the fixture, shared with the other end-to-end tests

pytestmark = pytest.mark.systemd


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "not-delegated"])
def test_an_unprivileged_service_and_what_its_attempts_leave_in_another_session(
        container: Container, delegate: bool) -> None:
    folder = container.work / f"unprivileged-{random.SystemRandom().randrange(10**9)}"
    folder.mkdir()
    folder.chmod(0o777)  # the service runs as nobody
    mark = f"60.{random.SystemRandom().randrange(10**12):012d}"
    script = folder / "task.sh"
    # Each attempt notes its cgroup and how many sleeps of earlier attempts still run, then starts one
    # that escapes its process group.
    script.write_text(f"#!/bin/sh\ngrep ^0:: /proc/self/cgroup >> {folder / 'cgroups'}\n"
                      f"pgrep -c -f 'sleep {mark}' >> {folder / 'earlier'}\nsetsid sleep {mark}\n")
    script.chmod(0o755)
    (folder / "t.txt").write_text("t\n")
    unit = f"onward-{folder.name}.service"
    command = [sys.executable, "-m", "onward.cli", "run", "--db", str(folder / "s.db"), "--tasks",
               str(folder / "t.txt"), "--timeout", "1", "--max-attempts", "2", "--retry-delay", "0.1", "--",
               str(script)]
    (folder / unit).write_text(
        f"[Service]\nType=oneshot\nUser=nobody\nDelegate={'yes' if delegate else 'no'}\nKillMode=mixed\n"
        f"WorkingDirectory={folder}\nEnvironment=PYTHONPATH={SRC}\nExecStart={' '.join(command)}\n")
    try:
        # nobody must reach the interpreter, the source and the folder: the folders above them that nspawn
        # made on the container's volatile root are root's only (chmod fails harmlessly on read-only binds).
        paths = [folder, Path(os.path.realpath(sys.executable)), Path(sys.executable), Path(SRC)]
        container.run("chmod", "o+x", *sorted({str(a) for p in paths for a in p.parents if str(a) != "/"}),
                      check=False)
        container.run("cp", str(folder / unit), "/etc/systemd/system/")
        container.run("systemctl", "daemon-reload")
        container.run("systemctl", "start", unit, check=False)  # oneshot: returns once the worker ended
        status = container.run("systemctl", "show", unit, "-p", "ExecMainStatus").stdout.strip()
        assert status == "ExecMainStatus=3", container.journal(unit)
        in_attempt_cgroup = [f"/{unit}/onward-" in line and "/attempt-" in line
                             for line in (folder / "cgroups").read_text().splitlines()]
        assert in_attempt_cgroup == [delegate, delegate]
        # Delegated: the first attempt's sleep died with it. Not delegated: it ran on beside the second.
        assert (folder / "earlier").read_text().split() == (["0", "0"] if delegate else ["0", "1"])
        wait_for(lambda: not sleeps(mark), 10, "the unit's kill mode to end what is left once it stopped")
    finally:
        for pid in sleeps(mark):
            os.kill(pid, 9)
        container.run("systemctl", "stop", unit, check=False)
