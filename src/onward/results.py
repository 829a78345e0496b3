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
        data, kind = value.encode("utf-8", "surrogateescape"), "str"
    else:
        problem = json_problem(value)
        if problem is None:
            try:
                data, kind = json.dumps(value, ensure_ascii=False, allow_nan=False).encode(), "json"
            except (TypeError, ValueError) as e:
                problem = str(e)
        if problem is not None:
            raise UsageError(f"task result is not str, bytes or a JSON value: {problem}")
    check_stored_size("task result", len(data))
    return data, kind


def check_stored_size(what: str, size: int) -> None:
    """Refuse a value bigger than a store takes (``MAX_STORED_BYTES``) before anything tries to commit it."""
    if size > MAX_STORED_BYTES:
        raise UsageError(f"{what} is {size:,} bytes, more than a store takes ({MAX_STORED_BYTES:,} at most)")


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

