"""Durable task stores: the ``Store`` contract (base.py) and one module per backend.

``open_store`` picks the backend from the URL: ``postgresql://`` (or ``postgres://``) for PostgreSQL,
anything else is a SQLite file path or ``sqlite:///`` URL.
"""

from __future__ import annotations

import os

from .base import Store

DEFAULT_DB = ".onward/onward.db"


def store_url(explicit: str | None = None) -> str:
    """The store location: the explicit value, else $ONWARD_DB, else the default file."""
    return explicit or os.environ.get("ONWARD_DB") or DEFAULT_DB


def is_postgres_url(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def open_store(url: str | None = None, *, create: bool = True) -> Store:
    """Open (and, with ``create``, initialise) the store at ``url``. Raises a ``StoreError`` subclass."""
    url = store_url(url)
    if is_postgres_url(url):
        from .postgres import PostgresStore

        return PostgresStore(url, create=create)
    from .sqlite import SqliteStore

    return SqliteStore(url, create=create)


__all__ = ["Store", "open_store", "store_url", "DEFAULT_DB", "is_postgres_url"]
