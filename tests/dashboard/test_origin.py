"""``onward dashboard --origin``: the page served behind an HTTPS reverse proxy, whose browser sends the
proxy's origin, through the installed command and real HTTP requests; and the values it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import run_onward
from tests.dashboard.conftest import Served, status_of

PUBLIC = "https://jobs.example.com"
REFUSED = {"error": "cross-origin request refused"}


def make_store(tmp_path: Path) -> str:
    db = str(tmp_path / "store" / "onward.db")
    added = run_onward("add", "--db", db, "a", "b", "c")
    assert added.returncode == 0, added.stderr
    return db


def counts(db: str) -> dict[str, Any]:
    report = status_of(db)
    return {key: report[key] for key in ("pending", "cancelled", "paused")}


def test_behind_a_proxy_actions_come_from_exactly_the_named_origins(tmp_path: Path, dashboard: Any) -> None:
    """Was: behind an HTTPS proxy every action was 403, since the page's Origin (https://jobs.example.com)
    was compared with http:// + Host. With --origin, the named origins are accepted however the value was
    written (case, a default port, a trailing /), and nothing else is, not even http:// + Host."""
    db = make_store(tmp_path)
    served: Served = dashboard(db, "--origin", "HTTPS://Jobs.Example.COM:443/", "--origin", "http://[0::1]:9000")
    # A proxy that passes the browser's Host on (Caddy's default): the name of an origin given passes the
    # Host rule, which still refuses every other name (DNS rebinding).
    answer = served.post("/api/pause", {}, headers={"Origin": PUBLIC, "Host": "jobs.example.com"})
    assert answer.status == 200 and answer.json() == {"paused": True, "changed": True}, answer.body
    assert counts(db) == {"pending": 3, "cancelled": 0, "paused": True}
    assert served.get("/api/status", headers={"Host": "jobs.example.com"}).status == 200
    assert served.get("/api/status", headers={"Host": "evil.example"}).status == 403
    # A proxy that sends its upstream's address as Host (nginx's default).
    answer = served.post("/api/resume", {}, headers={"Origin": PUBLIC})
    assert answer.status == 200 and answer.json() == {"paused": False, "changed": True}, answer.body
    answer = served.post("/api/cancel", {"tasks": ["b"]}, headers={"Origin": "http://[::1]:9000"})
    assert answer.status == 200 and answer.json() == {"tasks": {"b": "cancelled"}}, answer.body
    after = {"pending": 2, "cancelled": 1, "paused": False}
    assert counts(db) == after

    own = served.url.rstrip("/")
    for origin in (own, own.replace("127.0.0.1", "localhost"), "http://jobs.example.com", "https://jobs.example.com:8443",
                   "https://jobs.example.com.evil.example", "https://evil.jobs.example.com", "https://evil.example",
                   "null", "https://jobs.example.com/path", "https://user@jobs.example.com", "http://[::1]:9001",
                   "https://jobs.example.com\x00", "\xef\xbb\xbf" + PUBLIC, "https://jobs.example.com\t"):
        for path, value in (("/api/pause", {}), ("/api/retry", {"tasks": ["b"]}), ("/api/cancel", {"tasks": ["a"]})):
            answer = served.post(path, value, headers={"Origin": origin})
            assert answer.status == 403 and answer.json() == REFUSED, (origin, path, answer.body)
    assert counts(db) == after


def test_forwarded_headers_vouch_for_nothing(tmp_path: Path, dashboard: Any) -> None:
    """Any client can send X-Forwarded-* or Forwarded: with or without --origin, they neither make an origin
    acceptable nor a Host. Without --origin the rule is the one before it: http:// + Host."""
    db = make_store(tmp_path)
    before = counts(db)
    for args in ((), ("--origin", PUBLIC)):
        served: Served = dashboard(db, *args)
        own_host = served.url.split("//")[1].rstrip("/")
        for forged in ({"X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example", "X-Forwarded-Port": "443"},
                       {"Forwarded": f"for=127.0.0.1;host={own_host};proto=https"},
                       {"X-Forwarded-Host": "jobs.example.com", "X-Forwarded-Proto": "https"}):
            for origin in ("https://evil.example", f"https://{own_host}"):
                answer = served.post("/api/pause", {}, headers={"Origin": origin, **forged})
                assert answer.status == 403 and answer.json() == REFUSED, (args, forged, origin)
            rebound = served.get("/api/status", headers={"Host": "evil.example", **forged})
            assert rebound.status == 403, (args, forged)
        served.stop()
    assert counts(db) == before


BAD_ORIGINS = [
    ("jobs.example.com", "no scheme"),
    ("//jobs.example.com", "no scheme"),
    ("", "no scheme"),
    ("null", "no scheme"),
    ("*", "no scheme"),
    ("https://jobs.example.com/dashboard", "no user, path"),
    ("https://jobs.example.com//", "no user, path"),
    ("https://jobs.example.com?x=1", "no user, path"),
    ("https://jobs.example.com#top", "no user, path"),
    ("https://user:pw@jobs.example.com", "no user, path"),
    ("https://jobs.example.com\\evil.example", "no user, path"),
    ("ftp://jobs.example.com", "http or https"),
    ("javascript://jobs.example.com", "http or https"),
    ("file:///etc/passwd", "http or https"),
    ("ws://jobs.example.com", "http or https"),
    ("https://", "the host must be"),
    ("https://:8443", "the host must be"),
    ("https://jobs..example.com", "the host must be"),
    ("https://-jobs.example.com", "the host must be"),
    ("https://999.0.0.1", "not an IPv4 address"),
    ("https://jobs.example.com:0", "port"),
    ("https://jobs.example.com:65536", "port"),
    ("https://jobs.example.com:", "port"),
    ("https://jobs.example.com:+443", "port"),
    ("https://jobs.example.com:443:443", "port"),
    ("https://[::1", "brackets"),
    ("https://[::1]x", "brackets"),
    ("https://[fe80::1%eth0]", "not an IPv6 address"),
    ("https://[jobs.example.com]", "not an IPv6 address"),
    ("\ufeffhttps://jobs.example.com", "printable ASCII"),
    ("https://jobs.example.com\n", "printable ASCII"),
    ("https://jobs.example.com\r\nX-Evil: 1", "printable ASCII"),
    ("https://jobs.example.com\x1b[2J", "printable ASCII"),
    ("https://jöbs.example.com", "printable ASCII"),
    ("https://jobs example.com", "printable ASCII"),
]


def test_bad_origin_values_are_one_line_exit_2_and_nothing_starts(tmp_path: Path) -> None:
    db = make_store(tmp_path)
    for value, message in BAD_ORIGINS:
        # A good value beside it changes nothing: every value must be an origin.
        shown = run_onward("dashboard", "--db", db, "--port", "0", "--origin", PUBLIC, "--origin", value,
                           timeout=30)
        assert_refused(shown, message, value)
    # argv cannot carry a NUL (the kernel ends the string there): given through the same entry point.
    with_nul = subprocess.run(
        [sys.executable, "-c", "import json, sys; from onward.cli import entry; sys.exit(entry(json.load(sys.stdin)))"],
        input=json.dumps(["dashboard", "--db", db, "--port", "0", "--origin", PUBLIC + "\x00"]).encode(),
        capture_output=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    assert_refused(with_nul, "printable ASCII", "NUL")
    assert counts(db) == {"pending": 3, "cancelled": 0, "paused": False}


def assert_refused(shown: subprocess.CompletedProcess[bytes], message: str, value: str) -> None:
    """One line naming the option and what is wrong, exit 2, and no URL printed (nothing listened)."""
    assert shown.returncode == 2, (value, shown)
    lines = shown.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onward: error: --origin "), (value, lines)
    assert message in lines[0], (value, lines)
    assert lines[0].isprintable(), (value, lines)  # control characters, a BOM: shown escaped
    assert shown.stdout == b"", value
