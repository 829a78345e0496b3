"""A tool-using agent written by hand against the Anthropic SDK (async), made durable with one line:

    client = durable(AsyncAnthropic(base_url=..., api_key=...))

Each ``messages.create`` inside a task is a step, and so is each tool call (``ctx.step``). The task is an
``async def``: it runs on the worker's event loop, and the commits wait in a thread.

    python examples/stub_server.py --port 8765 &
    python examples/agents/anthropic_agent.py --db .onward/anthropic.db --base-url http://127.0.0.1:8765
"""

from __future__ import annotations

import sys
from typing import Any

from anthropic import AsyncAnthropic
from common import calculator, make_job, parse_args, run

from onward import AsyncTaskContext
from onward.integrations.anthropic import durable

args = parse_args("A hand-written Anthropic-SDK agent, durable.")
client = durable(AsyncAnthropic(base_url=args.base_url.removesuffix("/v1"), api_key="stub"))  # <- the one line

TOOLS: list[Any] = [{"name": "calculator", "description": "Multiply two integers: 'a * b'.",
                     "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}}}]

job = make_job(args.db)


@job.task
async def agent(question: str, ctx: AsyncTaskContext) -> str:
    messages: list[Any] = [{"role": "user", "content": question}]
    while True:
        reply = await client.messages.create(model="stub", max_tokens=256, messages=messages, tools=TOOLS)
        calls = [block for block in reply.content if block.type == "tool_use"]
        if not calls:
            return "".join(block.text for block in reply.content if block.type == "text")
        messages.append({"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]})
        results = []
        for call in calls:
            value = await ctx.step("calculator", calculator, call.input["expression"], args.tool_log)
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": value})
        messages.append({"role": "user", "content": results})


if __name__ == "__main__":
    sys.exit(run(job, args.questions))
