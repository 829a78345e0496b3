"""Task results as stored bytes with a kind, and back: str as UTF-8, bytes as they are, the rest as JSON."""

from __future__ import annotations

import json
from typing import Any

from .config import MAX_STORED_BYTES
from .errors import UsageError


def encode(value: Any) -> tuple[bytes, str]:
    if isinstance(value, bytes | bytearray | memoryview):
        data, kind = bytes(value), "bytes"
    elif isinstance(value, str):
        try:
            data, kind = value.encode("utf-8", "surrogateescape"), "str"
        except UnicodeEncodeError:
            # A lone surrogate (half an emoji in a model's cut answer): stored as a JSON string.
            data, kind = _result_json(value), "json"
    else:
        data, kind = _result_json(value), "json"
    check_stored_size("task result", len(data))
    return data, kind


def _result_json(value: Any) -> bytes:
    try:
        return json_bytes(value)
    except ValueError as e:
        raise UsageError(f"task result is not str, bytes or a JSON value: {e}") from None


def check_stored_size(what: str, size: int) -> None:
    """Refuse a value bigger than a store takes (``MAX_STORED_BYTES``) before anything tries to commit it."""
    if size > MAX_STORED_BYTES:
        raise UsageError(f"{what} is {size:,} bytes, more than a store takes ({MAX_STORED_BYTES:,} at most)")


def json_bytes(value: Any, separators: tuple[str, str] | None = None, allow_nan: bool = False) -> bytes:
    """``value`` as JSON in UTF-8, read back equal by ``json.loads``, or ``ValueError`` saying why not (see
    ``json_problem``; a set, NaN, an object). Text holding a lone surrogate (half an emoji in a model's cut
    answer, a file name that is not UTF-8) has no UTF-8 form, but JSON has an escape for it ("\\ud83d"),
    which loads back as the same str: such a value is written ASCII-escaped. (A high surrogate followed by a
    low one would load back as the one character they make together: refused.) ``allow_nan``: NaN and the
    infinities written as JavaScript's tokens, which ``json.loads`` reads back (not JSON: for records only
    onward reads)."""
    problem = json_problem(value)
    if problem is not None:
        raise ValueError(problem)
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=allow_nan, separators=separators)
    except TypeError as e:
        raise ValueError(str(e)) from None
    try:
        return text.encode()
    except UnicodeEncodeError:
        escaped = json.dumps(value, ensure_ascii=True, allow_nan=allow_nan, separators=separators)
        if repr(json.loads(escaped)) != repr(json.loads(text)):  # (repr: a NaN is not equal to itself)
            raise ValueError("a string holds a surrogate pair as two characters") from None
        return escaped.encode()


MAX_DEPTH = 200  # arrays and objects in one another: json.loads of a deeper value may exhaust the stack


def json_problem(value: Any) -> str | None:
    """What ``json.dumps`` would change or choke on without a word, in a value to be stored (a result, a
    step's value): an object key that is not a string (``{1: "a", "1": "b"}`` would become
    ``{"1": "a", "1": "b"}``, one value lost when read back; a replayed step would differ from the first
    run), or nesting deeper than ``MAX_DEPTH`` (it could not be read back). None when there is neither; the
    rest (a set, NaN, an object) ``json.dumps`` refuses itself."""
    if not isinstance(value, dict | list | tuple):
        return None
    return _not_json(value, 1)


def _not_json(value: Any, depth: int) -> str | None:
    if depth > MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                return f"the object key {key!r} is not a string"
        value = value.values()
    for item in value:
        if isinstance(item, dict | list | tuple):
            problem = _not_json(item, depth + 1)
            if problem:
                return problem
    return None


def decode(data: bytes, kind: str) -> Any:
    if kind == "bytes":
        return data
    if kind == "str":
        return data.decode("utf-8", "surrogateescape")
    return json.loads(data)

