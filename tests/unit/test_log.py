"""Log lines (log.py): what a task writes must not reach the reader's terminal or log as control codes."""

from __future__ import annotations

import io

from onward.log import Log, printable


def test_control_characters_are_shown_escaped_and_the_rest_kept() -> None:
    assert printable("a\x1b[2J\x1b]0;pwned\x07\x9b\x7f\x00") == "a\\x1b[2J\\x1b]0;pwned\\x07\\x9b\\x7f\\x00"
    assert printable("\u202eevil\u2066\u2028") == "\\u202eevil\\u2066\\u2028"
    assert printable("café ☃ 漢字 \\x1b") == "café ☃ 漢字 \\x1b"


def test_a_log_line_with_escape_sequences_or_undecodable_bytes_stays_one_escaped_line() -> None:
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    log = Log(stream=stream)
    log.warning("failed: \x1b[2J\r\nnext \udcff")
    stream.seek(0)
    (line,) = stream.read().splitlines()
    assert line.endswith("failed: \\x1b[2J\\x0d next \\udcff")
