"""The test-only crash points (onward.crashpoints): armed only with ONWARD_TEST_HOOKS=1, a real SIGKILL on the
n-th pass of the named phase and not before, nothing at all otherwise. Each case runs in a fresh interpreter,
since the module reads its environment once, at import."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

PASS_THREE_TIMES = """
import sys
from onward import crashpoints
print("armed" if crashpoints.ARMED else "unarmed", flush=True)
for i in range(1, 4):
    if crashpoints.ARMED:
        crashpoints.hit("completion_committed")
    print(f"passed {i}", flush=True)
"""


def run(env: dict[str, str], code: str = PASS_THREE_TIMES) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("ONWARD_CRASH_AT", "ONWARD_TEST_HOOKS")}
    return subprocess.run([sys.executable, "-c", code], env={**full, **env}, capture_output=True, text=True,
                          timeout=60)


def test_kills_itself_on_the_nth_pass_with_sigkill() -> None:
    done = run({"ONWARD_TEST_HOOKS": "1", "ONWARD_CRASH_AT": "completion_committed:2"})
    assert done.returncode == -signal.SIGKILL
    assert done.stdout.splitlines() == ["armed", "passed 1"]


def test_other_phases_do_not_count() -> None:
    done = run({"ONWARD_TEST_HOOKS": "1", "ONWARD_CRASH_AT": "claim_committed:1,reclaim:1"})
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["armed", "passed 1", "passed 2", "passed 3"]


def test_ignored_without_the_test_switch() -> None:
    for switch in ({}, {"ONWARD_TEST_HOOKS": "0"}, {"ONWARD_TEST_HOOKS": "yes"}):
        done = run({"ONWARD_CRASH_AT": "completion_committed:1", **switch})
        assert done.returncode == 0, switch
        assert done.stdout.splitlines() == ["unarmed", "passed 1", "passed 2", "passed 3"]


@pytest.mark.parametrize("spec", ["no_such_phase:1", "completion_committed:0", "completion_committed:x"])
def test_a_bad_spec_is_a_loud_error(spec: str) -> None:
    done = run({"ONWARD_TEST_HOOKS": "1", "ONWARD_CRASH_AT": spec})
    assert done.returncode == 1
    assert "ValueError" in done.stderr
