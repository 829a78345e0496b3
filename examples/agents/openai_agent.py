"""A tool-using agent written by hand against the OpenAI SDK, made durable with one line:

    client = durable(OpenAI(base_url=..., api_key=...))

Each question is an onward task; inside it each ``chat.completions.create`` is a step (recorded when it
returns, replayed on resume), and so is each tool call (``@step``). Kill it with ``kill -9`` at any
moment and start it again: it replays what completed and goes on. See README.md for the walkthrough.

    python examples/stub_server.py --port 8765 &
    python examples/agents/openai_agent.py --db .onward/openai.db
"""

from __future__ import annotations

import json
import sys

from common import calculator, make_job, parse_args, run
from openai import OpenAI

from onward import step
from onward.integrations.openai import durable

args = parse_args("A hand-written OpenAI-SDK agent, durable.")
client = durable(OpenAI(base_url=args.base_url, api_key="stub"))  # <- the one line

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Multiply two integers: 'a * b'.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


@step(name="calculator")
def use_calculator(expression: str) -> str:
    return calculator(expression, args.tool_log)


job = make_job(args.db)


@job.task
def agent(question: str, ctx: object) -> str:
    messages: list[dict] = [{"role": "user", "content": question}]
    while True:
        reply = client.chat.completions.create(model="stub", messages=messages, tools=TOOLS)  # a step
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = use_calculator(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    sys.exit(run(job, args.questions))
