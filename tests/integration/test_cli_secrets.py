"""Passwords that are hard to find (``#``, ``?``, percent-encoded, a space) stay out of ``ps``, the worker's
log, ``onward status`` and every error, with the installed console script and a real PostgreSQL server
(trust authentication: any password is accepted, so the password only has to survive being hidden)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pgutil
from tests.conftest import onward_argv, run_onward, wait_for

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pgutil.fresh_database() as url:
        yield url


def with_password(url: str, password: str) -> str:
    return url.replace(f"{pgutil.PG_USER}@", f"{pgutil.PG_USER}:{password}@", 1)


@pytest.mark.parametrize("encoded", [False, True], ids=["raw", "percent-encoded"])
def test_a_password_with_hash_or_question_mark_never_shows_in_ps_log_or_status(
        pg_url: str, tmp_path: Path, encoded: bool) -> None:
    secret = f"S3#cr?t{uuid.uuid4().hex[:10]}"
    written = secret.replace("#", "%23").replace("?", "%3F") if encoded else secret
    url = with_password(pg_url, written)
    # What a reader could recognise: the password as written, as meant, and the parts around # and ?.
    forbidden = {secret, written, secret.rsplit("?", 1)[1]}
    outputs: list[str] = []
    added = run_onward("add", "--db", url, "a")
    assert added.returncode == 0, added.stderr
    outputs.append((added.stdout + added.stderr).decode())
    log = tmp_path / "worker.log"
    gate = tmp_path / "gate"
    with open(log, "wb") as err:
        worker = subprocess.Popen(
            onward_argv("run", "--db", url, "--heartbeat", "0.5", "-v", "--", "sh", "-c",
                        f"while [ ! -e {gate} ]; do sleep 0.05; done"),
            env=os.environ, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for(lambda: "claimed" in log.read_text(), 30, "the worker to claim the task")
        cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes().decode()
        outputs.append(cmdline)
        assert f"{pgutil.PG_USER}:{'*' * len(written)}@" in cmdline  # wiped in place, the rest intact
        shown = run_onward("status", "--db", url)
        assert shown.returncode == 0, shown.stderr
        outputs.append((shown.stdout + shown.stderr).decode())
        assert "postgres:***@" in outputs[-1]
    finally:
        gate.touch()
        assert worker.wait(60) == 0
    outputs.append(log.read_text())
    assert "store=postgresql://postgres:***@" in outputs[-1]
    for text in outputs:
        for word in forbidden:
            assert word not in text, text


@pytest.mark.parametrize("password", ["my pw", "a b%zz", "x y@z", "sp ace/x", "s/la sh@x"])
@pytest.mark.parametrize("command", ["status", "run", "add"])
def test_an_unparsable_url_never_prints_its_password_in_the_error(command: str, password: str) -> None:
    token = uuid.uuid4().hex[:10]
    secret = password.replace(" ", f" {token}")
    url = f"postgresql://{pgutil.PG_USER}:{secret}@{pgutil.PG_HOST}:{pgutil.PG_PORT}/{pgutil.ADMIN_DB}"
    args = {"status": ["status"], "run": ["run", "--", "true"], "add": ["add", "t"]}[command]
    r = run_onward(*args[:1], "--db", url, *args[1:])
    text = (r.stdout + r.stderr).decode()
    assert r.returncode == 2, text
    assert text.startswith("onward: error: ") and text.count("\n") == 1, text
    assert token not in text and f"{pgutil.PG_USER}:***@" in text, text


@pytest.mark.parametrize("password", ["hunter2@{token}", "p#ss@w%rd{token}", "a@b@{token}@c"])
@pytest.mark.parametrize("command", ["status", "metrics", "jobs", "logs", "run"])
def test_a_password_with_an_unencoded_at_sign_never_shows_after_it(command: str, password: str) -> None:
    """libpq takes a password up to its first "@" and the rest for the host, which its error then quotes
    ("failed to resolve host 'Tr0ub4dor@127.0.0.1'"): that tail was printed in every command's error."""
    token = uuid.uuid4().hex[:10]
    url = (f"postgresql://{pgutil.PG_USER}:{password.format(token=token)}@{pgutil.PG_HOST}:{pgutil.PG_PORT}/"
           f"{pgutil.ADMIN_DB}")
    args = {"run": ["run", "--", "true"]}.get(command, [command])
    r = run_onward(*args[:1], "--db", url, *args[1:])
    text = (r.stdout + r.stderr).decode()
    assert r.returncode == 2, text
    assert text.startswith("onward: error: ") and text.count("\n") == 1, text
    assert token not in text, text


@pytest.mark.parametrize("scheme", ["mysql", "sqlite", "POSTGRESQL", "https"])
def test_a_store_url_of_the_wrong_kind_never_prints_its_password_in_the_error(scheme: str, tmp_path: Path) -> None:
    token = uuid.uuid4().hex[:10]
    url = f"{scheme}://{pgutil.PG_USER}:my pw{token}@{pgutil.PG_HOST}:{pgutil.PG_PORT}/{pgutil.ADMIN_DB}"
    r = run_onward("status", "--db", url, cwd=tmp_path)
    text = (r.stdout + r.stderr).decode()
    assert r.returncode == 2, text
    assert text.startswith("onward: error: ") and text.count("\n") == 1, text
    assert token not in text and "my pw" not in text, text
