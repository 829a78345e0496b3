"""A fresh PostgreSQL database per test, on the local server (127.0.0.1:5432, user postgres, trust auth)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

PG_HOST = os.environ.get("ONWARD_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("ONWARD_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("ONWARD_TEST_PG_USER", "postgres")
ADMIN_DB = os.environ.get("ONWARD_TEST_PG_DB", "test")


def _require_server():  # type: ignore[no-untyped-def]
    try:
        import psycopg
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("psycopg is not installed, and CI needs the PostgreSQL tests")
        pytest.skip("psycopg is not installed (pip install 'onward[postgres]')")
    try:
        return psycopg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=ADMIN_DB, autocommit=True,
                               connect_timeout=3)
    except psycopg.OperationalError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"no PostgreSQL server at {PG_HOST}:{PG_PORT}, and CI needs it: {e}")
        pytest.skip(f"no PostgreSQL server at {PG_HOST}:{PG_PORT} ({str(e).strip().splitlines()[0]})")


@contextmanager
def fresh_database() -> Iterator[str]:
    admin = _require_server()
    name = f"onward_t_{uuid.uuid4().hex[:12]}"
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        yield f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()
