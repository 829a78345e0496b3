"""What the agent examples share: their command line, the calculator tool, and printing the answers."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from onward import Job

DEFAULT_QUESTION = "Multiply 2 3 5 7 11 13 17 19 23 29 31"  # 11 model calls + 10 tool calls


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("questions", nargs="*", default=[DEFAULT_QUESTION])
    parser.add_argument("--db", default=".onward/agents.db", help="the store (default: %(default)s)")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8765/v1"),
                        help="the model API, e.g. the stub: python examples/stub_server.py (default: %(default)s)")
    parser.add_argument("--tool-log", type=Path, help="append every tool execution to this file (to count them)")
    return parser.parse_args()


def calculator(expression: str, log: Path | None) -> str:
    """The tool: "a * b" -> their product. Each execution is one line in ``log``."""
    if log is not None:
        with open(log, "a") as f:
            f.write(json.dumps({"expression": expression, "pid": os.getpid()}) + "\n")
    a, b = (int(x) for x in expression.split("*"))
    return str(a * b)


def make_job(db: str) -> Job:
    # Many attempts, no delay: this example is meant to be killed and restarted over and over.
    Path(db).parent.mkdir(parents=True, exist_ok=True)
    return Job(db, max_attempts=1000, retry_delay=0, heartbeat=1.0)


def run(job: Job, questions: list[str]) -> int:
    job.add(questions)
    summary = job.run()
    for q in questions:
        answer: Any = job.result(q) if summary.exit_code == 0 else None
        print(f"{q}\n  -> {answer}")
    return summary.exit_code
