"""A Pydantic AI agent with a tool, made durable by wrapping it: ``OnwardAgent(agent)``. Inside a task
each model request and each tool call is a step. The model is the stub server, through Pydantic AI's
OpenAI provider (any OpenAI-compatible server works the same way).

    python examples/stub_server.py --port 8765 &
    python examples/agents/pydantic_ai_agent.py --db .onward/pydantic_ai.db
"""

from __future__ import annotations

import sys

from common import calculator, make_job, parse_args, run
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from onward.integrations.pydantic_ai import OnwardAgent

args = parse_args("A Pydantic AI agent with a tool, durable.")
model = OpenAIChatModel("stub", provider=OpenAIProvider(base_url=args.base_url, api_key="stub"))
plain = Agent(model, instructions="Multiply the numbers with the calculator, two at a time.")


@plain.tool_plain
def calculator_tool(expression: str) -> str:
    """Multiply two integers: 'a * b'."""
    return calculator(expression, args.tool_log)


agent = OnwardAgent(plain)  # <- durable inside a task, the plain agent outside
job = make_job(args.db)


@job.task
def research(question: str, ctx: object) -> str:
    return agent.run_sync(question).output


if __name__ == "__main__":
    sys.exit(run(job, args.questions))
