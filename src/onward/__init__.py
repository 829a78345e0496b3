"""onward: make long-running jobs and AI agents resume after a crash.

The public surface: ``Job`` (a store plus a task function), the task context's ``Cancelled``, the result
of a run (``RunSummary``), durable steps (``step``, ``current_step_key``) and the error types. Everything
else is internal.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: E402
    CorruptStore,
    Fenced,
    NotAStore,
    OnwardError,
    SchemaTooNew,
    SchemaTooOld,
    StepDrift,
    StoreError,
    TaskNotDone,
    UsageError,
)
from .executions import AsyncTaskContext, Cancelled, TaskContext  # noqa: E402
from .job import Job  # noqa: E402
from .runner import RunSummary  # noqa: E402
from .steps import StepError, current_step_key, step  # noqa: E402

__all__ = [
    "Job", "RunSummary", "TaskContext", "AsyncTaskContext", "Cancelled", "step", "current_step_key",
    "StepError",
    "OnwardError", "UsageError", "StoreError", "NotAStore", "SchemaTooNew", "SchemaTooOld", "CorruptStore",
    "TaskNotDone", "Fenced", "StepDrift", "__version__",
]
