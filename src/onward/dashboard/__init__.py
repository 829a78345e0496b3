"""The web dashboard (``onward dashboard``): a local page and its public JSON API over one job's store.

``api`` turns requests into answers from the store (the same functions as ``onward status --json``),
``server`` speaks HTTP (routing, the token, the origin and content-type checks, server-sent events),
``command`` is the CLI face; ``static/`` holds the page, shipped as package data (no CDN, no build step).
"""
