"""onward: make long-running jobs and AI agents resume after a crash.

The public surface: ``Job`` (a store plus a task function), the task context's ``Cancelled``, the result
of a run (``RunSummary``), durable steps (``step``, ``current_step_key``) and the error types. Everything
else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

# No `typing` at run time: `onward status` on a plain store loads this package and little else.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from .attempt import Cancelled
    from .context import AsyncTaskContext, TaskContext
    from .errors import (
        CorruptStore,
        Fenced,
        NotAStore,
        OnwardError,
        SchemaTooNew,
        SchemaTooOld,
        StepDrift,
        StoreError,
        StoreUnavailable,
        TaskNotDone,
        Unavailable,
        UnknownTask,
        UsageError,
    )
    from .job import Job
    from .settle import RunSummary
    from .steps import StepError, current_step_key, step

# The public surface loads on first use (PEP 562), so that `onward status` and friends do not pay for the
# runner, asyncio and the step machinery they never touch; nor for the error types, whose classes take a
# fifth of a millisecond to make, which the plain status (onward.entry) never raises.
_LAZY = {
    "Job": ".job", "RunSummary": ".settle", "TaskContext": ".context", "AsyncTaskContext": ".context",
    "Cancelled": ".attempt", "step": ".steps", "current_step_key": ".steps", "StepError": ".steps",
    **dict.fromkeys(("OnwardError", "UsageError", "StoreError", "NotAStore", "SchemaTooNew", "SchemaTooOld",
                     "CorruptStore", "TaskNotDone", "Fenced", "StepDrift", "Unavailable", "StoreUnavailable",
                     "UnknownTask"),
                    ".errors"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onward' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "Job", "RunSummary", "TaskContext", "AsyncTaskContext", "Cancelled", "step", "current_step_key",
    "StepError",
    "OnwardError", "UsageError", "StoreError", "NotAStore", "SchemaTooNew", "SchemaTooOld", "CorruptStore",
    "TaskNotDone", "Fenced", "StepDrift", "Unavailable", "StoreUnavailable", "UnknownTask", "__version__",
]
