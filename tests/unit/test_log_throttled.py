"""log.Throttled: a warning that repeats many times a second is written once, then counted."""

from __future__ import annotations

import io
import re

from onward.log import Log, Throttled


def lines(out: io.StringIO) -> list[str]:
    return [re.sub(r"^.*? pid=\d+ ", "", line) for line in out.getvalue().splitlines()]  # the text alone


def test_a_store_error_repeated_a_thousand_times_is_one_line_then_a_count() -> None:
    out = io.StringIO()
    throttled = Throttled(Log(stream=out), window=3600)
    for i in range(1000):
        throttled.warning("store error, will retry", f"database or disk is full ({i})")
    throttled.warning("could not renew leases", "database or disk is full")  # another kind: its own line
    assert lines(out) == ["store error, will retry: database or disk is full (0)",
                          "could not renew leases: database or disk is full"]
    throttled.window = 0  # the window is over: the next line carries the count of those held back
    throttled.warning("store error, will retry", "database or disk is full (1000)")
    assert lines(out)[-1] == "store error, will retry: database or disk is full (1000) (999 more in the last 0 s)"
    throttled.warning("store error, will retry", "database or disk is full (1001)")
    assert lines(out)[-1] == "store error, will retry: database or disk is full (1001)"


def test_when_the_trouble_ends_the_lines_held_back_are_counted() -> None:
    out = io.StringIO()
    throttled = Throttled(Log(stream=out), window=3600)
    throttled.flush()  # nothing held back: nothing written
    for _ in range(3):
        throttled.warning("store unavailable", "connection refused")
    throttled.flush("store unavailable")
    throttled.flush("store unavailable")
    assert lines(out) == ["store unavailable: connection refused", "store unavailable: 2 more in the last 0 s"]
    throttled.warning("store unavailable", "connection refused")  # a new episode is written at once
    assert len(lines(out)) == 3
