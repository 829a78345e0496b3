"""Folders onward creates for its state (the store's, the output folder, the keep-awake marker's, a unit's
environment file's): private, every level of them."""

from __future__ import annotations

import contextlib
import os


def create_private_folders(path: str) -> None:
    """Create ``path`` and any missing parents with mode 0o700. ``os.makedirs`` gives the parents it
    creates the default mode (0o755 under the usual umask, 0o777 under ``umask 000``): another user could
    then rename or replace what onward keeps below them. All or nothing: if one level cannot be made (a
    name too long, a read-only disk), the levels made before it are removed again, so that a refused
    path leaves nothing behind.

    A name that exists already is left as it is, whatever it is: opening it as a folder checks that.
    """
    created: list[str] = []
    try:
        _create(path, created)
    except OSError:
        for folder in reversed(created):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def _create(path: str, created: list[str]) -> None:
    head, tail = os.path.split(path)
    if not tail:  # a trailing '/'
        head, tail = os.path.split(head)
    if head and tail and not os.path.exists(head):
        _create(head, created)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    created.append(path)
