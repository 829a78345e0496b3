"""Keeping passwords out of sight: redacting URLs, scrubbing texts, hiding secrets from ``ps``.

Backend-neutral: the CLI, the supervisor and the PostgreSQL store all use it.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/?#@\s]*:)([^@\s]*)@", re.IGNORECASE)
_KEYWORD_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]*)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """The URL with its password (in the user part or a ``password=`` parameter) replaced by ``***``."""
    return _KEYWORD_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", url))


def url_secrets(url: str) -> list[str]:
    """Every form in which the URL's password (and $PGPASSWORD) could show up in a text."""
    found: list[str] = []
    try:
        parts = urlsplit(url)
        netloc = parts.netloc.rpartition("@")[0]
        if ":" in netloc:
            found.append(netloc.split(":", 1)[1])
        found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "password"]
        found += [m.group(2) for m in _KEYWORD_PASSWORD.finditer(parts.query)]
    except ValueError:
        pass
    if os.environ.get("PGPASSWORD"):
        found.append(os.environ["PGPASSWORD"])
    secrets = {s for raw in found for s in (raw, unquote(raw)) if s}
    return sorted(secrets, key=len, reverse=True)  # longest first: a secret may contain a shorter one


def scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` without any of the secrets, nor anything that looks like a password in a URL."""
    for secret in secrets:
        text = text.replace(secret, "***")
    return redact_url(text)


def hide_secrets_in_argv(secrets: Sequence[str]) -> None:
    """Overwrite the secrets in this process's command line (``/proc/self/cmdline``, what ``ps`` and
    ``top`` show) with asterisks, in place: the kernel reads the command line from the memory the process
    was started with, and Python keeps its own copy (``sys.argv`` is unaffected). Linux only; elsewhere
    nothing happens. The password is visible until the store is first opened: prefer ``PGPASSWORD``,
    ``~/.pgpass`` or ``ONWARD_DB`` to a password on the command line."""
    if not secrets:
        return
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # fields[0] is field 3 of proc(5)
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
        with open("/proc/self/cmdline", "rb") as f:
            cmdline = f.read()
        area = ctypes.string_at(start, end - start)
    except (OSError, ValueError, IndexError):
        return
    if area != cmdline:
        return  # not the layout we expect (someone rewrote the title already): leave it alone
    for secret in secrets:
        raw = secret.encode("utf-8", "surrogateescape")
        at = area.find(raw)
        while at >= 0:
            ctypes.memmove(start + at, b"*" * len(raw), len(raw))
            at = area.find(raw, at + len(raw))
