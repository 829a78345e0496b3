"""Status rendering helpers (status.py) that the integration tests cannot reach at every width."""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len

from onward.status import cut_middle
from onward.store.states import STATES


def test_long_texts_are_cut_in_the_middle_keeping_start_and_end() -> None:
    url = "https://example.com/" + "x" * 100 + "/page-1"
    cut = cut_middle(url, 30)
    assert len(cut) == 30 and cut.startswith("https://exampl") and cut.endswith("/page-1") and "…" in cut
    assert cut_middle("short", 30) == "short"


def test_wide_characters_are_cut_by_terminal_cells() -> None:
    cut = cut_middle("漢字" * 20, 11)
    assert cell_len(cut) <= 11 and cut.startswith("漢字") and cut.endswith("漢字") and "…" in cut


# --- the plain status (status.print_plain_status, render_status without rich) ------------------------------
def test_every_printable_character_is_left_as_it_is_by_printable() -> None:
    # status._printable takes a text of printable characters as it is, without calling log.printable:
    # that holds only while printable() changes none of them.
    from onward.log import printable

    chars = "".join(chr(c) for c in range(0x110000) if chr(c).isprintable())
    assert printable(chars) == chars


def test_the_schema_version_read_from_the_sql_files_is_the_stores() -> None:
    from onward.store.sql import latest_version, load_queries
    from onward.store.sqlbase import SCHEMA_VERSION
    from onward.store.sqlite_peek import SCHEMA_VERSION as PEEKED

    assert PEEKED == SCHEMA_VERSION
    assert latest_version(load_queries("sqlite.sql")) == latest_version(load_queries("postgres.sql")) == SCHEMA_VERSION


def a_report(store: str, job: str, paused: bool, counts: list[int], errors: list[tuple[str, str, str]],
             eta: int | None, alive: int, restarts: int, rate: float) -> dict[str, Any]:
    from onward.status import _report

    report = _report(store=store, job=job, paused=paused, counts=dict(zip(STATES, counts, strict=True)), workers=[],
                     tasks_running=[], tasks_waiting=[], restarts=restarts, rate=rate, working=alive,
                     errors=[{"at": "2026-11-30T03:30:01Z", "kind": kind, "task": task, "attempt": 1, "error": error}
                             for kind, task, error in errors])
    report["eta_seconds"] = eta
    return report


TEXTS = st.text(st.characters(codec="utf-8"), max_size=30) | st.sampled_from(
    ["漢字🎉", "[bold]x[/bold]", ":smile:", "e\u0301", "\x1b[2J\u202e", "tab\there ", " \u00a0\u200b "])


def written_to_stdout(mp: pytest.MonkeyPatch, write: Callable[[], None]) -> bytes:
    """The bytes ``write`` writes to sys.stdout, made a UTF-8 file that is not a terminal."""
    raw = io.BytesIO()
    mp.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8", newline="\n"))
    write()
    sys.stdout.flush()
    return raw.getvalue()


@settings(max_examples=300, deadline=None)
@given(store=TEXTS, job=TEXTS | st.just("default"), paused=st.booleans(),
       counts=st.lists(st.integers(0, 10**9), min_size=6, max_size=6),
       errors=st.lists(st.tuples(TEXTS, TEXTS, TEXTS), max_size=3), eta=st.none() | st.integers(0, 10**7),
       alive=st.integers(0, 3), restarts=st.integers(0, 10**6),
       rate=st.integers(0, 10**7).map(lambda done: done / 60))  # as Store.stats gives it: done per window
def test_the_plain_text_is_what_rich_prints_to_a_pipe(store: str, job: str, paused: bool, counts: list[int],
                                                       errors: list[tuple[str, str, str]], eta: int | None,
                                                       alive: int, restarts: int, rate: float) -> None:
    from onward.status import render_status

    report = a_report(store, job, paused, counts, errors, eta, alive, restarts, rate)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("FORCE_COLOR", raising=False)
        mp.delenv("TTY_COMPATIBLE", raising=False)
        plain = written_to_stdout(mp, lambda: render_status(report))  # plainly: no table, not a terminal
        # FORCE_COLOR="" leaves the text to rich, which takes stdout for what it is: not a terminal.
        mp.setenv("FORCE_COLOR", "")
        through_rich = written_to_stdout(mp, lambda: render_status(report))
    assert plain == through_rich


# Texts that json writes as they are, and texts it escapes or that take a second look (\x7f, \x85 and
# \u2028 are not escaped, though not printable; a lone surrogate comes from a file name that is not UTF-8).
JSON_TEXTS = st.sampled_from(["s.db", "/var/x/漢字 🎉.db", "default", "nightly-2"]) | TEXTS | st.sampled_from(
    ['a"b.db', "a\\b.db", "\x7f\x85\u2028.db", "\udc80.db", "tab\t.db", "\x00"])


@settings(max_examples=500, deadline=None)
@given(store=JSON_TEXTS, job=JSON_TEXTS, paused=st.booleans(),
       counts=st.lists(st.integers(0, 10**9), min_size=6, max_size=6),
       errors=st.just([]) | st.lists(st.tuples(TEXTS, TEXTS, TEXTS), max_size=1),
       eta=st.none() | st.integers(0, 10**7),
       rate=st.sampled_from([0.0, 2.5, 1e300, float("nan"), float("inf"), -float("inf")]) | st.floats())
def test_the_plain_json_is_what_json_writes(store: str, job: str, paused: bool, counts: list[int],
                                            errors: list[tuple[str, str, str]], eta: int | None,
                                            rate: float) -> None:
    import json

    from onward.log import json_line
    from onward.status import plain_json

    report = a_report(store, job, paused, counts, errors, eta, 0, 0, 0.0)
    report["rate_per_second"] = rate
    assert plain_json(report) == json_line(report)  # what the full command writes
    assert json.loads(plain_json(report)).keys() == report.keys()


@pytest.mark.parametrize(("args", "options"), [
    ([], (None, None, False)),
    (["--json"], (None, None, True)),
    (["--db", "s.db", "--job", "nightly", "--json"], ("s.db", "nightly", True)),
    (["--db=s.db", "--job=a=b"], ("s.db", "a=b", False)),
    (["--json", "--json"], None), (["--db", "a", "--db=b"], None), (["--db"], None), (["--db", ""], None),
    (["--db", "--json"], None), (["--db", "postgresql://h/db"], None), (["--json=1"], None), (["--watch"], None),
    (["-h"], None), (["--"], None), (["extra"], None), (["--interval", "1"], None), (["--jso"], None),
])
def test_the_options_the_plain_status_takes(args: list[str], options: tuple[Any, ...] | None) -> None:
    from onward.entry import plain_status_options

    assert plain_status_options(args) == options


def test_the_plain_status_runs_without_the_cyclic_gc_and_the_full_command_with_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    import onward.cli
    import onward.status
    from onward.entry import main

    seen: list[tuple[str, bool]] = []

    def plain(answers: bool) -> Callable[..., bool]:
        def print_plain_status(*options: Any) -> bool:
            seen.append(("plain", gc.isenabled()))
            return answers
        return print_plain_status

    monkeypatch.setattr(onward.cli, "cli_main", lambda: seen.append(("full", gc.isenabled())))
    monkeypatch.setattr(sys, "argv", ["onward", "status", "--db", "s.db"])
    try:
        monkeypatch.setattr(onward.status, "print_plain_status", plain(True))
        with pytest.raises(SystemExit) as exit_:
            main()
        assert exit_.value.code == 0 and seen == [("plain", False)]
        gc.enable()
        seen.clear()
        # Declined (a store that is not plain, a terminal...): the full command, which may run for long
        # (--watch), collects garbage as usual.
        monkeypatch.setattr(onward.status, "print_plain_status", plain(False))
        main()
        assert seen == [("plain", False), ("full", True)]
    finally:
        gc.enable()
