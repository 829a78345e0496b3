"""Start-up of `onward status`: it loads what it uses and little else (issue 12, item 5). How long it takes
is measured by bench/bench_fast.py; this checks what it imports, which cannot drift unnoticed."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_onward

# Loaded by none of status's needs: the worker loop and its threads' machinery, asyncio, pathlib (which
# pulls in urllib and ipaddress) and importlib.resources (zipfile, compression modules).
NOT_FOR_STATUS = ("asyncio", "pathlib", "importlib.resources", "zipfile", "onward.runner", "onward.progress",
                  "onward.attempts", "onward.steps")


def imports_of(*args: str) -> set[str]:
    r = run_onward(*args, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert r.returncode == 0, r.stderr.decode()
    return {line.rsplit("|", 1)[1].strip() for line in r.stderr.decode().splitlines()
            if line.startswith("import time:") and "|" in line}


# Not loaded either by the plain status (onward.entry, status.print_plain_status): the CLI's machinery, the
# store's classes, and what they pull in.
NOT_FOR_PLAIN_STATUS = ("click", "rich", "onward.cli", "onward.store.base", "onward.store.sqlite", "typing",
                        "dataclasses", "inspect")


def loaded(imported: set[str], unwanted: tuple[str, ...]) -> set[str]:
    return {name for name in imported for u in unwanted if name == u or name.startswith(u + ".")}


def test_status_on_a_fresh_store_imports_only_what_it_uses(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    assert run_onward("add", "--db", db, "a").returncode == 0
    for args in (("status", "--db", db), ("status", "--json", "--db", db)):
        imported = imports_of(*args)
        assert "onward.status" in imported and "sqlite3" in imported  # the profile is there
        assert not loaded(imported, NOT_FOR_STATUS), args
        assert not loaded(imported, NOT_FOR_PLAIN_STATUS), args
    # Neither needs a regular expression, nor json (status.plain_json writes the JSON of such a report), nor
    # the error types (loaded once one is raised).
    for args in (("status", "--db", db), ("status", "--json", "--db", db)):
        assert not loaded(imports_of(*args), ("re", "json", "onward.log", "onward.errors")), args
