"""The schema version a store records is checked on every open: a value that is not a version number (a
damaged or hand-edited meta row) is refused like any damaged store, with one line and exit 2, by every
command, `onward db upgrade` included, and the store is left as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.conftest import run_onward

NOT_VERSIONS = ["abc", "", "5.0", "-1", "0", "٥"]  # the last: a digit Python's int() takes, in Arabic-Indic


def _set_version(url: str, value: str) -> None:
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute("UPDATE onward.meta SET value = %s WHERE key = 'schema_version'", (value,))
        return
    import sqlite3

    with sqlite3.connect(url) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (value,))
    db.close()


def _state(url: str) -> object:
    """What must not change: the file's bytes (SQLite), the rows that matter (PostgreSQL)."""
    if url.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(url, autocommit=True) as pg:
            return (pg.execute("SELECT key, value FROM onward.meta ORDER BY key").fetchall(),
                    pg.execute("SELECT name, state FROM onward.tasks ORDER BY id").fetchall(),
                    pg.execute("SELECT count(*) FROM onward.events").fetchall())
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(url).parent.iterdir())}


@pytest.mark.parametrize("value", NOT_VERSIONS)
def test_a_store_whose_schema_version_is_not_a_number_is_refused_in_one_line(store_url: str, value: str) -> None:
    r = run_onward("add", "--db", store_url, "a", "b")
    assert r.returncode == 0, r.stderr
    _set_version(store_url, value)
    before = _state(store_url)
    for args in (("status", "--db", store_url), ("status", "--json", "--db", store_url), ("add", "--db", store_url, "c"),
                 ("jobs", "--db", store_url), ("db", "upgrade", "--db", store_url),
                 ("run", "--db", store_url, "--", "true")):
        r = run_onward(*args)
        err = r.stderr.decode()
        assert r.returncode == 2, (args, r.returncode, err)
        assert err.startswith("onward: error: ") and err.count("\n") == 1 and "Traceback" not in err, (args, err)
        assert "not an onward store" in err or "is corrupt" in err, (args, err)
        assert _state(store_url) == before, args
