"""The store's password never reaches a stored or printed error, even when a failing task prints the store
URL it was given (ONWARD_DB) to its stderr, and even when the error's 4 KiB cut falls inside the password."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import pgutil
from tests.conftest import onward_argv, run_onward

pytestmark = pytest.mark.postgres
SRC = str(Path(__file__).resolve().parents[2] / "src")

# Prints the URL it got to stderr and fails. Task "cut": enough output after the URL that the last 4 KiB
# of stderr (what is kept as the error) start in the middle of the password.
TASK = """
import os, sys
url = os.environ["ONWARD_DB"]
if sys.argv[1] == "cut":
    middle = url.index(os.environ["SECRET"]) + len(os.environ["SECRET"]) // 2
    sys.stderr.write(url + "\\n" + "y" * (middle + 4096 - len(url) - 1))
else:
    sys.stderr.write(f"could not connect to {url}: timeout\\n")
sys.exit(1)
"""


@pytest.mark.parametrize("shape", ["plain", "percent-encoded"])
def test_a_task_printing_the_store_url_does_not_leak_its_password(tmp_path: Path, shape: str) -> None:
    secret = f"S3cr3t-{uuid.uuid4().hex}"
    if shape == "percent-encoded":
        secret = f"S3c%23r%3Ft%40-{uuid.uuid4().hex}"  # '#', '?' and '@' in the password, as a URL holds them
    halves = (secret[: len(secret) // 2], secret[len(secret) // 2:])
    with pgutil.fresh_database() as plain_url:
        url = plain_url.replace(f"{pgutil.PG_USER}@", f"{pgutil.PG_USER}:{secret}@", 1)  # trust auth: accepted
        assert run_onward("add", "--db", url, "whole", "cut").returncode == 0
        log = tmp_path / "worker.log"
        with open(log, "wb") as err:
            worker = subprocess.run(
                onward_argv("run", "--db", url, "--max-attempts", "1", "--", sys.executable, "-c", TASK, "{task}"),
                env=dict(os.environ, PYTHONPATH=SRC, SECRET=secret), stdout=subprocess.DEVNULL, stderr=err,
                timeout=120)
        assert worker.returncode == 3, log.read_text()
        texts = {"worker log": log.read_text()}
        for args in (["status"], ["status", "--json"], ["logs"], ["logs", "--task", "cut"]):
            r = run_onward(*args, "--db", url)
            assert r.returncode == 0, r.stderr
            texts[" ".join(args)] = r.stdout.decode() + r.stderr.decode()
        errors = json.loads(texts["status --json"])["errors"]
        assert {e["task"] for e in errors} == {"whole", "cut"}, errors
        import psycopg

        with psycopg.connect(plain_url, autocommit=True) as conn:
            texts["tasks.error"] = "\n".join(
                row[0] for row in conn.execute("SELECT error FROM onward.tasks WHERE error IS NOT NULL"))
            texts["events.detail"] = "\n".join(
                row[0] for row in conn.execute("SELECT detail FROM onward.events WHERE detail IS NOT NULL"))
    assert "could not connect to postgresql://postgres:***@" in texts["tasks.error"]  # the rest stays readable
    assert "y" * 100 in texts["tasks.error"]
    for where, text in texts.items():
        for part in (secret, *halves):
            assert part not in text, f"{part!r} in {where}:\n{text[-3000:]}"


def test_a_python_task_whose_exception_holds_the_store_url_does_not_leak_its_password() -> None:
    from onward import Job

    secret = f"S3cr3t-{uuid.uuid4().hex}"
    with pgutil.fresh_database() as plain_url:
        url = plain_url.replace(f"{pgutil.PG_USER}@", f"{pgutil.PG_USER}:{secret}@", 1)
        job = Job(url)

        @job.task(max_attempts=1)
        def connect(task: str, ctx: object) -> str:
            raise ConnectionError(f"cannot reach {url} as {pgutil.PG_USER} with {secret}")

        job.add(["a"])
        try:
            assert job.run(install_signal_handlers=False).exit_code == 3
            row = job.store.task("a")
        finally:
            job.close()
    assert row is not None and row.error is not None
    assert "ConnectionError: cannot reach postgresql://postgres:***@" in row.error
    assert row.error.rstrip().endswith(f"as {pgutil.PG_USER} with ***"), row.error  # the bare password too
    assert secret not in row.error


@pytest.mark.parametrize("password", ["Secr et99Word", "Sec&ret99Word"])
def test_a_bad_url_with_a_password_parameter_is_refused_without_showing_any_of_it(password: str) -> None:
    """The error line of a URL libpq refuses for its ``password=`` (a space, an "&" in it) showed what followed
    the space or the "&", in the URL and in libpq's quote of it."""
    done = run_onward("status", "--db", f"postgresql://u@127.0.0.1/db?password={password}")
    assert done.returncode == 2
    err = done.stderr.decode()
    assert err.startswith("onward: error: bad PostgreSQL URL postgresql://u@127.0.0.1/db?password=***: "), err
    assert err.count("\n") == 1 and "99Word" not in err and "ret" not in err, err


def test_a_password_libpq_took_from_pgpass_is_scrubbed_from_a_tasks_error(tmp_path: Path) -> None:
    """A password the URL does not hold, which libpq read from ~/.pgpass (or a service file): a task that printed
    that file showed it in the log, status and the stored error. The one the connection used is scrubbed too."""
    secret = f"Long#Pass@/% word-{uuid.uuid4().hex[:8]}"
    home = tmp_path / "home"
    home.mkdir()
    pgpass = home / ".pgpass"
    pgpass.write_text(f"{pgutil.PG_HOST}:{pgutil.PG_PORT}:*:{pgutil.PG_USER}:{secret.replace(':', chr(92) + ':')}\n")
    pgpass.chmod(0o600)
    env = dict(os.environ, PYTHONPATH=SRC, HOME=str(home))
    env.pop("PGPASSWORD", None)
    with pgutil.fresh_database() as url:  # no password in it; trust auth takes the one .pgpass gives
        log = tmp_path / "worker.log"
        with open(log, "wb") as err:
            worker = subprocess.run(
                onward_argv("run", "--db", url, "--tasks", "-", "--max-attempts", "1", "--", sys.executable, "-c",
                            "import os, sys; sys.stderr.write(open(os.path.expanduser('~/.pgpass')).read()); sys.exit(1)",
                            "{task}"), input=b"t\n", env=env, stdout=subprocess.DEVNULL, stderr=err, timeout=120)
        assert worker.returncode == 3, log.read_text()
        status = subprocess.run(onward_argv("status", "--db", url, "--json"), env=env, capture_output=True,
                                timeout=60)
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            stored = "\n".join(row[0] for row in conn.execute("SELECT error FROM onward.tasks WHERE error IS NOT NULL"))
    assert f":{pgutil.PG_USER}:***" in stored, stored  # the rest of the line stays readable
    for where, text in (("worker log", log.read_text()), ("status", status.stdout.decode()), ("tasks.error", stored)):
        assert secret not in text and "word-" not in text, f"{where}:\n{text[-2000:]}"
