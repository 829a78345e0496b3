"""The click parameter types and options shared by ``onward.cli`` and the command modules it loads lazily
(``deploy_cli``, ``steps_cli``, ``db_cli``): here rather than in ``cli`` so that those modules need not
import the module that imports them.
"""

from __future__ import annotations

import math
from typing import Any

import click


class NotEmpty(click.ParamType):
    """A path or a location given as an option (``--db``, ``--tasks``, ``--out``, ``--keep-awake``): refused
    when empty. ``--out ""`` was taken for no ``--out`` at all, and the run wrote no result file without a
    word; ``--db ""`` used the default store; ``--tasks ""`` said "no tasks: give --tasks FILE"."""

    name = "text"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not text:
            self.fail("must not be empty", param, ctx)
        return text


NOT_EMPTY = NotEmpty()

db_option = click.option("--db", "db", metavar="URL", default=None, type=NOT_EMPTY,
                         help="Store: a file path, sqlite:///path or postgresql://… (env ONWARD_DB;"
                              " default .onward/onward.db).")


class JobName(click.ParamType):
    """A job's name (``--job``, env ONWARD_JOB): refused up front, as bad input, when it breaks the rule of
    ``onward.store.job_name`` (empty, too long, a '/', not UTF-8), before any store is opened."""

    name = "job"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from .errors import UsageError
        from .store import job_name

        try:
            return job_name(str(value))
        except UsageError as e:
            self.fail(str(e), param, ctx)


job_option = click.option("--job", "job", metavar="NAME", type=JobName(), envvar="ONWARD_JOB", default="default",
                          show_default=True, help="The job, one of several a store may hold (env ONWARD_JOB).")


class TaskText(click.ParamType):
    """A task's name as given on the command line, to every command that takes one (``add``, ``result``,
    ``retry``, ``cancel``, ``send``, ``steps``, ``logs --task``): normalised as ``onward add`` stores it
    (``tasksfile.task_name``: surrounding whitespace removed), so that each finds the task ``add`` stored.
    A name that is not UTF-8 (``$'bad\\xff'``) reaches Python as lone surrogates, which no store can hold:
    refused here as bad input, not a traceback later. Only the encoding is checked here: a name breaking
    another rule (empty, too long) names no task, and ``onward add`` checks every rule."""

    name = "task"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from .tasksfile import NOT_UTF8, task_name, task_name_problem

        text = task_name(str(value))
        if task_name_problem(text) == NOT_UTF8:
            shown = text.encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")
            self.fail(f"\"{shown}\" {NOT_UTF8}", param, ctx)
        return text


TASK_TEXT = TaskText()


class FiniteFloat(click.ParamType):
    """A number of seconds. Python's float() takes "nan" and "inf", which no duration means: a NaN retry
    delay cannot be stored and an infinite heartbeat overflows a timer, so both are refused up front; so
    is a finite one past ``MAX_SECONDS``, which overflows ``time.sleep`` and ``select`` all the same."""

    name = "float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        from .config import MAX_SECONDS

        number: float = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        if number > MAX_SECONDS:
            self.fail(f"{value} is more than {MAX_SECONDS:,} seconds", param, ctx)
        return number


FINITE_FLOAT = FiniteFloat()
