"""An OpenAI Agents SDK agent, made durable by running it with ``OnwardRunner`` instead of ``Runner``.
Inside a task each model call and each function-tool call is a step. The model is the stub server through
the SDK's chat-completions model.

    python examples/stub_server.py --port 8765 &
    python examples/agents/openai_agents_agent.py --db .onward/openai_agents.db
"""

from __future__ import annotations

import sys

from agents import Agent, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
from common import calculator, make_job, parse_args, run
from openai import AsyncOpenAI

from onward import AsyncTaskContext
from onward.integrations.openai_agents import OnwardRunner

args = parse_args("An OpenAI Agents SDK agent, durable.")
set_tracing_disabled(True)  # offline: no traces sent anywhere


@function_tool
def calculator_tool(expression: str) -> str:
    """Multiply two integers: 'a * b'."""
    return calculator(expression, args.tool_log)


agent = Agent(name="multiplier", instructions="Multiply the numbers with the calculator, two at a time.",
              tools=[calculator_tool],
              model=OpenAIChatCompletionsModel("stub", AsyncOpenAI(base_url=args.base_url, api_key="stub")))
job = make_job(args.db)


@job.task
async def solve(question: str, ctx: AsyncTaskContext) -> str:
    result = await OnwardRunner.run(agent, question, max_turns=32)  # <- instead of Runner.run
    return str(result.final_output)


if __name__ == "__main__":
    sys.exit(run(job, args.questions))
