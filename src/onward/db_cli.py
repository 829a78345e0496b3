"""``onward db``: looking after the store's schema (``onward db upgrade``)."""

from __future__ import annotations

import click

from . import store
from .cli_types import db_option


@click.group(name="db")
def db_group() -> None:
    """Look after the store's schema."""


@db_group.command()
@db_option
def upgrade(db: str | None) -> None:
    """Create the store, or bring its schema up to this onward's version. Safe to run while workers of the
    same version run, and from several places at once (one of them does the work, the others wait). Refused
    (exit 2, nothing changed) while the store records a live worker of an older onward."""
    shown, before, after = store.upgrade(store.store_url(db))
    if before == after:
        click.echo(f"store {shown} is up to date (schema version {after})", err=True)
    elif not before:
        click.echo(f"store {shown} created (schema version {after})", err=True)
    else:
        click.echo(f"store {shown} upgraded from schema version {before} to {after}", err=True)
