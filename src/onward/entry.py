"""The ``onward`` console script. ``onward status [--db URL] [--job NAME] [--json]`` on a SQLite store that
is plainly fine is answered by ``status.print_plain_status``, without loading click, rich or the store's
classes (a start-up near that of Python with sqlite3); every other command line, and every case that one
declines, goes to the CLI (``onward.cli``), unchanged."""

from __future__ import annotations

import sys


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["status"]:
        options = plain_status_options(args[1:])
        if options is not None:
            try:
                from .status import print_plain_status

                if print_plain_status(*options):
                    sys.exit(0)
            except KeyboardInterrupt:  # as the CLI says it (cli.entry)
                sys.stderr.write("onward: aborted\n")
                sys.exit(130)
    from .cli import cli_main

    cli_main()


def plain_status_options(args: list[str]) -> tuple[str | None, str | None, bool] | None:
    """``--db``, ``--job`` and ``--json`` of ``onward status``, when they are all it was given, each at most
    once, and read by click the same way for sure: ``--db URL`` or ``--db=URL`` with a value that is not
    empty, does not start with "-" and holds no "://" (a URL, whose password the CLI hides from ``ps``);
    None for anything else (``--watch``, ``--help``, a typo), which the CLI then reads and answers."""
    db: str | None = None
    job: str | None = None
    as_json = False
    seen: set[str] = set()
    rest = iter(args)
    for arg in rest:
        name, equals, value = arg.partition("=")
        if name in seen:
            return None
        seen.add(name)
        if arg == "--json":
            as_json = True
            continue
        if name not in ("--db", "--job"):
            return None
        if not equals:
            value = next(rest, "")
        if not value or value.startswith("-") or "://" in value:
            return None
        if name == "--db":
            db = value
        else:
            job = value
    return db, job, as_json
