"""Keeping passwords out of sight: redacting URLs, scrubbing texts, hiding secrets from ``ps``.

Backend-neutral: the CLI, the supervisor and the PostgreSQL store all use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

# A password in a URL is whatever follows ``scheme://user:`` up to the "@" before the host, whatever it holds:
# libpq takes ``#``, ``?`` and ``/`` unencoded, and a malformed URL (a space in the password) must be
# hidden as well as a valid one. The host is what follows an "@" with no other "@" before the next
# whitespace or the end. A password holds no whitespace or no "/" (the first alternative, then the second):
# without that limit, "https://host:443/v1 failed for user@example.org" would lose its middle.
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[a-z][a-z0-9+.-]*://[^:/?#@\s]*:)(?P<password>\S*?|[^/\n]*?)@(?=[^@\s]*(?:\s|$))",
    re.IGNORECASE)
# A colon right before a space or the end is the message's, not the password's ("store URL?password=…: connection
# failed"): it stays shown.
_KEYWORD_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<password>'(?:[^'\\]|\\.)*'|[^\s&]*?(?=:?(?:[\s&]|\Z)))",
                               re.IGNORECASE)
# A text that is one URL (a store location as given, one argument) rather than free text: its password runs
# from "scheme://user:" to the last "@", whatever it holds. Free text cannot be read so (see above), and there a
# password holding both a space and a "/" (a malformed URL, which libpq refuses and quotes) was not found at all.
# One URL: the text starts with it (or with "NAME=" before it) and nothing after its host is whitespace.
_WHOLE_URL_PASSWORD = re.compile(r"\A(?:[^\s=]*=)?[a-z][a-z0-9+.-]*://[^:/?#@\s]*:(?P<password>.*)@[^@\s]*\Z",
                                 re.IGNORECASE | re.DOTALL)
# In a text that is one URL, a ``password=`` of its query runs to the next "&NAME=" or the end, whatever it
# holds: libpq cuts "password=Sec&ret" at the "&" and refuses "ret" as a parameter, quoting it, and refuses
# "Secr et", quoting it whole; the rule for free text stopped at either and showed the rest.
_WHOLE_URL_QUERY_PASSWORD = re.compile(
    r"\A(?:[^\s=]*=)?[a-z][a-z0-9+.-]*://[^?]*\?(?:.*?&)?password=(?P<password>.*?)(?=&[a-z_]+=|\Z)",
    re.IGNORECASE | re.DOTALL)


def redact_url(text: str) -> str:
    """``text`` with the password of every URL in it (in the user part or a ``password=`` parameter)
    replaced by ``***``."""
    return _KEYWORD_PASSWORD.sub(r"\g<head>***", _URL_PASSWORD.sub(r"\g<head>***@", text))


def redact_one_url(url: str) -> str:
    """``redact_url`` for a text that is a single URL (or one argument holding one, ``--db=URL``): its whole
    password is hidden, up to the last "@", even where ``redact_url`` cannot tell where it ends."""
    for pattern in (_WHOLE_URL_PASSWORD, _WHOLE_URL_QUERY_PASSWORD):
        whole = pattern.search(url)
        if whole is not None and whole["password"]:
            url = url[:whole.start("password")] + "***" + url[whole.end("password"):]
    return redact_url(url)


MIN_PIECE = 4  # the shortest part of a password after an "@" that is hidden on its own (url_secrets)


def url_secrets(text: str) -> list[str]:
    """Every form in which the password of a URL in ``text`` (and $PGPASSWORD) could show up in a text: as
    written, percent-decoded, unquoted for a quoted ``password='…'``, up to its first "@", and after it."""
    found = [m["password"] for pattern in (_URL_PASSWORD, _KEYWORD_PASSWORD) for m in pattern.finditer(text)]
    whole = _WHOLE_URL_PASSWORD.search(text)
    if whole is not None:  # ``text`` is one URL: its password runs to the last "@" (see redact_one_url)
        found.append(whole["password"])
    query = _WHOLE_URL_QUERY_PASSWORD.search(text)
    if query is not None and query["password"]:
        # ... or to the next "&NAME=" of its query: whole, and the pieces libpq quotes, around an "&" or a space.
        found.append(query["password"])
        found += [piece for piece in re.split(r"[&\s]+", query["password"]) if len(piece) >= MIN_PIECE]
    found += [raw[1:-1] for raw in found if len(raw) >= 2 and raw[0] == raw[-1] == "'"]
    found += [raw.split("@", 1)[0] for raw in found]  # libpq reads up to the first "@", and quotes that
    # ... and takes what follows it for the host, which a driver's message then quotes ("failed to resolve
    # host 'Tr0ub4dor@127.0.0.1'"): every piece after an "@" too. Not the shortest: a piece of a few
    # characters would be replaced wherever it occurs, and the message would say nothing.
    found += [piece for raw in found for at in _at_signs(raw)
              for piece in (raw[at + 1:], raw[at + 1:].split("@", 1)[0]) if len(piece) >= MIN_PIECE]
    # libpq also ends the user part at a "/" before any "@", and quotes what lies around it ("unexpected spaces
    # found in "my pw"" for "my pw/x"): the pieces between "/"s too.
    found += [piece for raw in found if "/" in raw for piece in raw.split("/") if len(piece) >= MIN_PIECE]
    if os.environ.get("PGPASSWORD"):
        found.append(os.environ["PGPASSWORD"])
    if not found:
        return []  # the usual case (a path, or a URL without a password): urllib is not even loaded
    from urllib.parse import unquote

    secrets = {s for raw in found for s in (raw, unquote(raw)) if s}
    return sorted(secrets, key=len, reverse=True)  # longest first: a secret may contain a shorter one


def _at_signs(text: str) -> list[int]:
    return [i for i, c in enumerate(text) if c == "@"]


# A secret shorter than this is hidden only where it stands alone (no letter, digit or "_" right before or
# after it): hidden wherever it occurred, a password "ex" made a task's "next example" into "n*** ***ample",
# and every masked spot told a reader where the password's letters were.
WHOLE_WORD_BELOW = 8


def scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` without any of the secrets (one shorter than ``WHOLE_WORD_BELOW`` where it stands alone), nor
    anything that looks like a password in a URL."""
    for secret in secrets:
        if len(secret) >= WHOLE_WORD_BELOW:
            text = text.replace(secret, "***")
        elif secret in text:
            text = re.sub(rf"(?<!\w){re.escape(secret)}(?!\w)", "***", text)
    return redact_url(text)


def hide_secrets_in_argv(secrets: Sequence[str]) -> None:
    """Overwrite the secrets in this process's command line (``/proc/self/cmdline``, what ``ps`` and
    ``top`` show) with asterisks, in place: the kernel reads the command line from the memory the process
    was started with, and Python keeps its own copy (``sys.argv`` is unaffected). Linux only; elsewhere
    nothing happens. The password is visible until the store is first opened: prefer ``PGPASSWORD``,
    ``~/.pgpass`` or ``ONWARD_DB`` to a password on the command line."""
    if not secrets:
        return
    import ctypes  # here: only a command line with a password needs it

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
