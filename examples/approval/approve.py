"""A human-approval flow made durable with onward: each task drafts a report (a step: the expensive part,
done once), waits for a person's decision (``ctx.wait``), then publishes it or not.

While a report waits for its approval, its task holds no worker slot and no lease: it is parked in the
state ``waiting`` and the worker runs other reports meanwhile. Kill the worker at any moment; the draft is
never made twice, and a decision sent while no worker runs is kept until the task waits for it.

    python approve.py --db .onward/approval.db report-1 report-2     # add the reports and work on them
    onward send --db .onward/approval.db report-1 approval '{"approved": true, "by": "ana"}'

Standard library only, plus onward. Each draft appends a line to drafts.log beside the store, so that you
can count how many were made.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from onward import Job, TaskContext
from onward.errors import WaitTimeout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default=".onward/approval.db")
    parser.add_argument("--timeout", type=float, default=24 * 3600, help="seconds to wait for a decision")
    parser.add_argument("reports", nargs="*", help="reports to add (names); already added ones are kept")
    args = parser.parse_args()
    drafts_log = os.path.join(os.path.dirname(os.path.abspath(args.db)), "drafts.log")

    job = Job(args.db, concurrency=2, heartbeat=1.0)

    @job.task
    def handle(report: str, ctx: TaskContext) -> dict[str, Any]:
        def draft() -> str:
            time.sleep(1.0)  # the expensive part: a model call, a long query
            with open(drafts_log, "a") as f:
                f.write(report + "\n")
            return f"Draft of {report}: all figures are up."

        text = ctx.step("draft", draft)
        ctx.beat("waiting for approval")
        try:
            decision = ctx.wait("approval", timeout=args.timeout)
        except WaitTimeout:
            return {"report": report, "published": False, "why": "no decision in time"}
        if not isinstance(decision, dict) or decision.get("approved") is not True:
            return {"report": report, "published": False, "why": "rejected", "decision": decision}
        ctx.step("publish", lambda: print(f"published {report} (approved by {decision.get('by')})", flush=True))
        return {"report": report, "published": True, "by": decision.get("by"), "text": text}

    job.add(args.reports)
    return job.run().exit_code


if __name__ == "__main__":
    sys.exit(main())
