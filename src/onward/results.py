"""Task results as stored bytes with a kind, and back: str as UTF-8, bytes as they are, the rest as JSON."""

from __future__ import annotations

import json
from typing import Any

from .errors import UsageError


def encode(value: Any) -> tuple[bytes, str]:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), "bytes"
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape"), "str"
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode(), "json"
    except (TypeError, ValueError) as e:
        raise UsageError(f"task result is not str, bytes or a JSON value: {e}") from None


def decode(data: bytes, kind: str) -> Any:
    if kind == "bytes":
        return data
    if kind == "str":
        return data.decode("utf-8", "surrogateescape")
    return json.loads(data)

