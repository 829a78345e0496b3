"""Findings for RELIABILITY.md: what a torture or fault test did, how many times, and what held.

``make torture`` sets ``ONWARD_RELIABILITY_LOG`` to a file; each torture, power-cut, fault-matrix and
hostile-input test appends its findings there as JSON lines through ``record``, and the report writer
turns that file into RELIABILITY.md once the run is over. Outside ``make torture`` (the normal suite)
``record`` does nothing, so the same tests serve both.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def record(section: str, *, backend: str, case: str, seed: int | None = None, **figures: Any) -> None:
    """Append one finding: ``section`` is the class of fault (e.g. "kills", "power cut", "fault matrix",
    "hostile input"), ``backend`` "sqlite"/"postgres"/"-", ``case`` what was done (e.g. "SIGKILL at
    completion committed, 4 workers"), ``figures`` the counts (e.g. ``kills=250, lost=0, overlaps=0``)."""
    path = os.environ.get("ONWARD_RELIABILITY_LOG")
    if not path:
        return
    # The test that found it (pytest's node id): the report marks the findings of a failed test FAILED.
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    line = json.dumps({"section": section, "backend": backend, "case": case, "seed": seed,
                       "figures": figures, "at": time.time(), "test": test}, sort_keys=True)
    # One write of one line in append mode: lines from concurrent tests do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
