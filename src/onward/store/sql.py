"""Loading a backend's named queries from its .sql file (``-- name: NAME`` starts each one), and finding
its schema migrations among them."""

from __future__ import annotations

from importlib.resources import files


def load_queries(filename: str) -> dict[str, str]:
    text = (files(__package__) / filename).read_text(encoding="utf-8")
    queries: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("-- name:"):
            if name:
                queries[name] = "\n".join(lines).strip()
            name, lines = line[len("-- name:") :].strip(), []
        elif name:
            lines.append(line)
    if name:
        queries[name] = "\n".join(lines).strip()
    return queries


def migration(queries: dict[str, str], version: int) -> str:
    """The SQL that brings a store to ``version`` from the one before: ``schema`` creates version 1, and
    ``migrate_to_N`` each later one. A new store runs them all in order, so old and new stores end alike."""
    return queries["schema"] if version == 1 else queries[f"migrate_to_{version}"]
