"""Loading a backend's named queries from its .sql file (``-- name: NAME`` starts each one), and finding
its schema migrations among them."""

from __future__ import annotations

import os


def load_queries(filename: str) -> dict[str, str]:
    # The file beside this module, read directly: importlib.resources would cost every command (`onward
    # status` included) a few milliseconds of imports for what is a plain file in every install.
    with open(os.path.join(os.path.dirname(__file__), filename), encoding="utf-8") as f:
        text = f.read()
    # Cut at each "-- name:" that starts a line (text mode reads every line ending as "\n"); what comes
    # before the first is the file's heading. One split of the whole text rather than a loop over its lines:
    # this runs at every start of `onward status`, and the loop took three times as long (0.15 ms a start).
    queries: dict[str, str] = {}
    for part in ("\n" + text).split("\n-- name:")[1:]:
        name, _, body = part.partition("\n")
        if name.strip():
            queries[name.strip()] = body.strip()
    return queries


def migration(queries: dict[str, str], version: int) -> str:
    """The SQL that brings a store to ``version`` from the one before: ``schema`` creates version 1, and
    ``migrate_to_N`` each later one. A new store runs them all in order, so old and new stores end alike."""
    return queries["schema"] if version == 1 else queries[f"migrate_to_{version}"]


def latest_version(queries: dict[str, str]) -> int:
    """The schema version that a backend's migrations lead to: that of its last ``migrate_to_N`` (1 with
    ``schema`` alone). The same number as sqlbase.SCHEMA_VERSION (a test holds them together), read from the
    .sql file, for readers that must not load the store's classes to know it."""
    return max([1, *(int(name[len("migrate_to_"):]) for name in queries if name.startswith("migrate_to_"))])
