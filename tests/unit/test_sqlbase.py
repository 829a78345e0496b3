"""The layer both SQL backends share (store/sqlbase.py) and the package's only doors to a backend
(``open_store``, ``exists``, ``upgrade`` in store/__init__.py)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from onward import store
from onward.errors import StoreMissing
from onward.store.postgres import PostgresStore
from onward.store.sqlbase import SCHEMA_VERSION
from onward.store.sqlite import SqliteStore
from tests import pgutil


@pytest.fixture
def pg_url() -> Iterator[str]:
    with pgutil.fresh_database() as url:
        yield url


@pytest.mark.parametrize("backend", [SqliteStore, PostgresStore], ids=["sqlite", "postgres"])
def test_every_public_method_of_each_backend_translates_driver_errors(backend: type) -> None:
    """One decorator, applied to every public method of the base and of each backend (inherited ones
    included), so that no method can hand a caller a raw driver error (as iter_tasks once did)."""
    public = [name for name, member in inspect.getmembers(backend, inspect.isfunction) if not name.startswith("_")]
    assert "iter_tasks" in public and "claim" in public
    untranslated = [name for name in public if not hasattr(getattr(backend, name), "__wrapped__")]
    assert untranslated == []


def test_exists_tells_a_missing_or_empty_sqlite_file_from_one_to_open(tmp_path: Path) -> None:
    path = tmp_path / "onward.db"
    assert not store.exists(str(path))
    path.touch()  # a store whose creation was cut short: opening it would initialise it
    assert not store.exists(str(path))
    assert not path.with_name("onward.db-wal").exists()
    store.open_store(str(path)).close()
    assert store.exists(str(path)) and store.exists(f"sqlite:///{path}")
    assert store.exists(str(tmp_path))  # not a store: opening it says so


def test_exists_leaves_postgresql_to_open_store(pg_url: str) -> None:
    assert store.exists(pg_url)
    with pytest.raises(StoreMissing):
        store.open_store(pg_url, create=False)


def test_upgrade_names_the_store_without_its_password(tmp_path: Path, pg_url: str) -> None:
    path = tmp_path / "onward.db"
    assert store.upgrade(f"sqlite:///{path}") == (str(path), 0, SCHEMA_VERSION)
    assert store.upgrade(str(path)) == (str(path), SCHEMA_VERSION, SCHEMA_VERSION)
    secret = pg_url.replace(f"{pgutil.PG_USER}@", f"{pgutil.PG_USER}:hunter2@", 1)
    shown, before, after = store.upgrade(secret)
    assert (before, after) == (0, SCHEMA_VERSION) and "hunter2" not in shown and "***" in shown
