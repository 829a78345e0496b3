"""A stand-in for an OpenAI-compatible chat API, to try the agent offline: it plays a model that works
out an arithmetic question step by step with the calculator tool, slowly, and counts every call it gets.

    python stub_server.py --port 8000 --delay 1.0
    curl -s http://127.0.0.1:8000/stats        # {"calls": N, "repeated_keys": M}

"repeated_keys" counts calls whose Idempotency-Key it had already answered: a durable agent sends none.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STATS: dict[str, Any] = {"calls": 0, "repeated_keys": 0, "keys": set()}
LOCK = threading.Lock()


def answer(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Multiply the question's numbers one pair at a time with the tool, then answer."""
    question = next(m["content"] for m in messages if m["role"] == "user")
    numbers = [int(n) for n in re.findall(r"\d+", question)] or [1]
    results = [m["content"] for m in messages if m["role"] == "tool"]
    value = results[-1] if results else str(numbers[0])
    step = len(results) + 1
    if step < len(numbers):
        expression = f"{value} * {numbers[step]}"
        return {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{step}", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}]}
    return {"role": "assistant", "content": f"The product is {value}."}


class Handler(BaseHTTPRequestHandler):
    delay = 1.0

    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        with LOCK:
            body = json.dumps({"calls": STATS["calls"], "repeated_keys": STATS["repeated_keys"]}).encode()
        self._send(200, body)

    def do_POST(self) -> None:  # noqa: N802
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = self.headers.get("Idempotency-Key")
        with LOCK:
            STATS["calls"] += 1
            if key in STATS["keys"]:
                STATS["repeated_keys"] += 1
            STATS["keys"].add(key)
            n = STATS["calls"]
        print(f"call {n} key={key}", flush=True)
        time.sleep(self.delay)  # a model takes its time
        reply = {"id": f"stub-{n}", "object": "chat.completion", "model": request.get("model"),
                 "choices": [{"index": 0, "message": answer(request["messages"]), "finish_reason": "stop"}]}
        try:
            self._send(200, json.dumps(reply).encode())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller was killed while it waited

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds per answer")
    args = parser.parse_args()
    Handler.delay = args.delay
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"stub model on http://127.0.0.1:{args.port}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
