"""The click parameter types and options shared by ``onward.cli`` and the command modules it loads lazily
(``deploy_cli``, ``steps_cli``, ``db_cli``): here rather than in ``cli`` so that those modules need not
import the module that imports them.
"""

from __future__ import annotations

import math
from typing import Any

import click

db_option = click.option("--db", "db", metavar="URL", default=None,
                         help="Store: a file path, sqlite:///path or postgresql://… (env ONWARD_DB;"
                              " default .onward/onward.db).")


class TaskText(click.ParamType):
    """A task's text as given on the command line. A name that is not UTF-8 (``$'bad\\xff'``) reaches
    Python as lone surrogates, which no store can hold: refused here as bad input, not a traceback later."""

    name = "task"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            shown = text.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")
            self.fail(f"\"{shown}\" is not valid UTF-8", param, ctx)
        return text


TASK_TEXT = TaskText()


class FiniteFloat(click.ParamType):
    """A number of seconds. Python's float() takes "nan" and "inf", which no duration means: a NaN retry
    delay cannot be stored and an infinite heartbeat overflows a timer, so both are refused up front."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number: float = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return number


FINITE_FLOAT = FiniteFloat()
