"""A tool-using agent loop against any OpenAI-compatible chat API, made durable with onward.

Every model call and every tool call is a ``@step``: its result is committed as soon as it returns. Kill the
worker at any moment (kill -9, OOM, reboot) and run it again: the calls that completed are replayed from the
store, not paid for again, and the loop goes on from the first call that had not completed.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python agent.py --db .onward/agent.db "What is 17 * 23 + 4?"

Environment: OPENAI_BASE_URL (required; e.g. a local llama.cpp / vLLM / Ollama server, or stub_server.py),
OPENAI_API_KEY (optional), OPENAI_MODEL (default "gpt-4o-mini"). Standard library only, plus onward.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import sys
import urllib.request
from collections.abc import Callable
from typing import Any

from onward import Job, TaskContext, current_step_key, step

MAX_TURNS = 20
TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / ** and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]


@step(name="llm", max_attempts=4, retry_on=(TimeoutError, ConnectionError, OSError), backoff=1.0)
def llm(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat completion. Retried in place on network errors; its answer is recorded when it returns."""
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    body = json.dumps({"model": os.environ.get("OPENAI_MODEL", "gpt-4o-mini"), "messages": messages,
                       "tools": TOOLS}).encode()
    headers = {"Content-Type": "application/json",
               # Servers that deduplicate requests answer a re-sent call (after a crash) from their cache.
               "Idempotency-Key": current_step_key()}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    request = urllib.request.Request(f"{base}/chat/completions", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.load(response)["choices"][0]["message"])


_OPS: dict[type, Callable[..., float]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only arithmetic is allowed")


@step(name="calculator")
def calculator(expression: str) -> str:
    """A tool. A tool with side effects (a payment, an e-mail) would pass current_step_key() on."""
    try:
        return str(_evaluate(ast.parse(expression, mode="eval")))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def run_agent(question: str, ctx: TaskContext) -> str:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Answer the question. Use the calculator for arithmetic."},
        {"role": "user", "content": question},
    ]
    for turn in range(MAX_TURNS):
        reply = llm(messages)
        messages.append({k: v for k, v in reply.items() if v is not None})
        calls = reply.get("tool_calls") or []
        if not calls:
            return str(reply.get("content") or "")
        for call in calls:
            arguments = json.loads(call["function"]["arguments"] or "{}")
            result = calculator(arguments.get("expression", "")) if call["function"]["name"] == "calculator" \
                else f"error: no tool {call['function']['name']}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        ctx.beat(f"turn {turn + 1}")  # shown by `onward status`
    return "(no answer within the turn limit)"


def main() -> int:
    parser = argparse.ArgumentParser(description="A durable agent loop (see the module docstring).")
    parser.add_argument("--db", default=".onward/agent.db", help="the onward store (default .onward/agent.db, git-ignored)")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("questions", nargs="*", help="questions to add (each one is a task)")
    args = parser.parse_args()
    if "OPENAI_BASE_URL" not in os.environ:
        print("set OPENAI_BASE_URL (e.g. http://127.0.0.1:8000/v1)", file=sys.stderr)
        return 2
    job = Job(args.db, concurrency=args.concurrency, max_attempts=5)
    job.task(run_agent)
    job.add(args.questions)
    summary = job.run()
    for row in job.store.iter_tasks():
        answer = job.result(row.name) if row.state == "done" else f"({row.state})"
        print(f"{row.name}\n  -> {answer}")
    return summary.exit_code


if __name__ == "__main__":
    sys.exit(main())
