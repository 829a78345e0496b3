"""A stand-in for the OpenAI and Anthropic HTTP APIs, to run agents offline and count what they pay for.

    python examples/stub_server.py --port 8765 --delay 0.3 --calls calls.jsonl
    curl -s http://127.0.0.1:8765/stats         # {"calls": N, "repeated_keys": M}

It plays a model that multiplies the numbers of the user's question one pair at a time with a tool (the
first tool the request offers, ``calculator`` by default), then answers "The product is N.". Served:

- ``POST /v1/chat/completions`` (OpenAI chat, ``stream`` as server-sent events)
- ``POST /v1/responses`` (OpenAI Responses, ``stream`` as server-sent events)
- ``POST /v1/embeddings`` (a deterministic 8-number vector per input)
- ``POST /v1/messages`` (Anthropic Messages, ``stream`` as server-sent events)

Every call is appended as one JSON line to ``--calls`` (its ``Idempotency-Key`` header, path, whether it
streamed, the question and the turn: how many tool results the conversation had) the moment it arrives, so the count survives the caller's crash; ``/stats`` sums it up.
"repeated_keys" counts calls whose key an earlier call already had: a durable agent repeats at most the one
call in flight at a crash. The answers depend only on the conversation, so a run that resumed ends with the
same answer as one that was never interrupted.

The Responses API's server-side conversation state is kept in memory: a request may continue a stored
response (``previous_response_id``: its history is that response's history, input and output) or a
conversation (``conversation``, made by ``POST /v1/conversations``; ``GET /v1/conversations/ID/items`` lists
it), to which a response's input and output items are appended once it is complete, even if its caller has
gone. A Responses call's log line also holds what it continued (``previous_response_id``, ``conversation``),
the items it sent (``sent``: ``type:call_id`` or ``message:role``) and the id of the response it made
(``response_id``: a new one for every call that continues state, as a real server makes).

Faults, asked for by the request's model name (any other name is answered as above):

- ``error-after-N``: a stream sends N events, then the provider's error event (Anthropic's ``event: error``,
  OpenAI's ``data: {"error": ...}``), as a server overloaded mid-answer does;
- ``half-emoji``: the chat answer's text ends with a lone surrogate escape (``\\ud83d``), valid JSON that a
  model cut inside an emoji sends.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

CREATED = 1_700_000_000  # a fixed clock: equal conversations get byte-equal answers


# --- the model: the next move, from the conversation alone --------------------------------------------
def next_move(question: str, results: list[str]) -> tuple[str, str | None]:
    """("call", expression) to multiply the next number in, or ("answer", text)."""
    numbers = [int(n) for n in re.findall(r"\d+", question)] or [1]
    value = results[-1].strip() if results else str(numbers[0])
    step = len(results) + 1
    if step < len(numbers):
        return "call", f"{value} * {numbers[step]}"
    return "answer", f"The product is {value}."


def _text(content: Any) -> str:
    """The text of a message's content: a string or a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(_text(p.get("text") or p.get("content") or p.get("output") or "") if isinstance(p, dict)
                        else str(p) for p in content)
    return "" if content is None else str(content)


def _tool_name(tools: list[dict[str, Any]] | None) -> str:
    for t in tools or []:
        name = t.get("name") or (t.get("function") or {}).get("name")
        if name:
            return str(name)
    return "calculator"


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def chat_results(body: dict[str, Any]) -> tuple[str, list[str]]:
    """The question and the tool results so far of a chat-completions conversation."""
    messages = body["messages"]
    question = next((_text(m.get("content")) for m in messages if m.get("role") == "user"), "")
    return question, [_text(m.get("content")) for m in messages if m.get("role") == "tool"]


def chat_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    messages = body["messages"]
    question, results = chat_results(body)
    move, arg = next_move(question, results)
    if move == "call":
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
            "id": f"call_{len(results) + 1}", "type": "function",
            "function": {"name": _tool_name(body.get("tools")), "arguments": json.dumps({"expression": arg})}}]}
        finish = "tool_calls"
    else:
        message, finish = {"role": "assistant", "content": arg}, "stop"
    return {"id": f"chatcmpl-{_digest(body)}", "object": "chat.completion", "created": CREATED,
            "model": body.get("model", "stub"),
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": 10 * len(messages), "completion_tokens": 7, "total_tokens": 10 * len(messages) + 7}}


def chat_chunks(reply: dict[str, Any]) -> Iterator[dict[str, Any]]:
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": CREATED, "model": reply["model"]}
    message = reply["choices"][0]["message"]
    yield {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    if message.get("tool_calls"):
        calls = [{"index": 0, **c} for c in message["tool_calls"]]
        yield {**base, "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]}
    else:
        for word in re.findall(r"\S+\s*", message["content"]):
            yield {**base, "choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
    yield {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": reply["choices"][0]["finish_reason"]}],
           "usage": reply["usage"]}


def _items(body: dict[str, Any]) -> list[dict[str, Any]]:
    return body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]


def responses_results(body: dict[str, Any]) -> tuple[str, list[str]]:
    items = _items(body)
    question = next((_text(i.get("content")) for i in items if i.get("role") == "user"), "")
    # One result per tool call: a conversation that holds a call's output twice (a caller that sent it again
    # after a crash) is read as a model would, as the one result.
    outputs = {i.get("call_id") or n: _text(i.get("output")) for n, i in enumerate(items)
               if i.get("type") == "function_call_output"}
    return question, list(outputs.values())


def item_key(item: dict[str, Any]) -> str:
    """An item as the log names it: ``type:call_id`` (tool calls and outputs) or ``message:role``."""
    kind = item.get("type") or "message"
    return f"{kind}:{item.get('call_id') or item.get('role') or item.get('id') or ''}"


class ServerState:
    """The Responses API's server-side conversation state: every response's history (the items it continued,
    its input, its output), by id, and the conversations, by id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.responses: dict[str, list[dict[str, Any]]] = {}
        self.conversations: dict[str, list[dict[str, Any]]] = {}
        self.made = 0

    def create_conversation(self, items: list[dict[str, Any]]) -> str:
        with self.lock:
            self.made += 1
            cid = f"conv_{self.made:06d}"
            self.conversations[cid] = list(items)
            return cid

    def history(self, body: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The items the request continues; None if it names a response or conversation not kept here."""
        previous, conversation = body.get("previous_response_id"), conversation_id(body)
        with self.lock:
            if previous is not None:
                return list(self.responses[previous]) if previous in self.responses else None
            if conversation is not None:
                return list(self.conversations[conversation]) if conversation in self.conversations else None
            return []

    def new_id(self, reply: dict[str, Any]) -> str:
        """A fresh id for a response that continues state: a real server makes a new one every call, also
        for a call sent again with the same body."""
        with self.lock:
            self.made += 1
            return f"{reply['id']}_{self.made:06d}"

    def keep(self, body: dict[str, Any], history: list[dict[str, Any]], reply: dict[str, Any]) -> None:
        """The complete response: stored by id; its input and output appended to its conversation."""
        new = _items(body) + reply["output"]
        with self.lock:
            self.responses[reply["id"]] = history + new
            conversation = conversation_id(body)
            if conversation is not None:
                self.conversations[conversation].extend(new)


def conversation_id(body: dict[str, Any]) -> str | None:
    conversation = body.get("conversation")
    return conversation.get("id") if isinstance(conversation, dict) else conversation


def responses_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    items = _items(body)
    question, results = responses_results(body)
    move, arg = next_move(question, results)
    rid = _digest(body)
    if move == "call":
        output: dict[str, Any] = {"type": "function_call", "id": f"fc_{rid}", "call_id": f"call_{len(results) + 1}",
                                  "name": _tool_name(body.get("tools")), "arguments": json.dumps({"expression": arg}),
                                  "status": "completed"}
    else:
        output = {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": "completed",
                  "content": [{"type": "output_text", "text": arg, "annotations": []}]}
    return {"id": f"resp_{rid}", "object": "response", "created_at": CREATED, "status": "completed",
            "model": body.get("model", "stub"), "output": [output], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "error": None, "incomplete_details": None, "instructions": None,
            "metadata": {}, "temperature": None, "top_p": None,
            "usage": {"input_tokens": 10 * len(items), "output_tokens": 7, "total_tokens": 10 * len(items) + 7,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


def responses_events(reply: dict[str, Any]) -> Iterator[dict[str, Any]]:
    started = {**reply, "status": "in_progress", "output": []}
    yield {"type": "response.created", "sequence_number": 0, "response": started}
    seq = 1
    item = reply["output"][0]
    yield {"type": "response.output_item.added", "sequence_number": seq, "output_index": 0,
           "item": {**item, "status": "in_progress", **({"content": []} if item["type"] == "message" else {})}}
    seq += 1
    if item["type"] == "message":
        for word in re.findall(r"\S+\s*", item["content"][0]["text"]):
            yield {"type": "response.output_text.delta", "sequence_number": seq, "item_id": item["id"],
                   "output_index": 0, "content_index": 0, "delta": word, "logprobs": []}
            seq += 1
    yield {"type": "response.output_item.done", "sequence_number": seq, "output_index": 0, "item": item}
    yield {"type": "response.completed", "sequence_number": seq + 1, "response": reply}


def embeddings_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    data = []
    for i, text in enumerate(inputs):
        digest = hashlib.sha256(str(text).encode()).digest()
        data.append({"object": "embedding", "index": i, "embedding": [round(b / 255, 6) for b in digest[:8]]})
    return {"object": "list", "data": data, "model": body.get("model", "stub"),
            "usage": {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}}


def messages_results(body: dict[str, Any]) -> tuple[str, list[str]]:
    messages = body["messages"]
    question = next((_text(m["content"]) for m in messages if m.get("role") == "user"), "")
    return question, [_text(block.get("content")) for m in messages if isinstance(m.get("content"), list)
                      for block in m["content"] if isinstance(block, dict) and block.get("type") == "tool_result"]


def messages_reply(body: dict[str, Any], n: int) -> dict[str, Any]:
    messages = body["messages"]
    question, results = messages_results(body)
    move, arg = next_move(question, results)
    if move == "call":
        content: list[dict[str, Any]] = [{"type": "tool_use", "id": f"toolu_{len(results) + 1}",
                                          "name": _tool_name(body.get("tools")), "input": {"expression": arg}}]
        stop = "tool_use"
    else:
        content, stop = [{"type": "text", "text": arg}], "end_turn"
    return {"id": f"msg_{_digest(body)}", "type": "message", "role": "assistant", "model": body.get("model", "stub"),
            "content": content, "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": 10 * len(messages), "output_tokens": 7}}


def messages_events(reply: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield {"type": "message_start", "message": {**reply, "content": [], "stop_reason": None,
                                                "usage": {**reply["usage"], "output_tokens": 1}}}
    block = reply["content"][0]
    if block["type"] == "text":
        yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        for word in re.findall(r"\S+\s*", block["text"]):
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": word}}
    else:
        yield {"type": "content_block_start", "index": 0, "content_block": {**block, "input": {}}}
        yield {"type": "content_block_delta", "index": 0,
               "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
    yield {"type": "content_block_stop", "index": 0}
    yield {"type": "message_delta", "delta": {"stop_reason": reply["stop_reason"], "stop_sequence": None},
           "usage": {"output_tokens": reply["usage"]["output_tokens"]}}
    yield {"type": "message_stop"}


def embeddings_results(body: dict[str, Any]) -> tuple[str, list[str]]:
    return json.dumps(body["input"]), []


# path -> (the conversation's question and tool results, the answer, its stream of events)
ROUTES: dict[str, tuple[Any, Any, Any]] = {
    "/v1/chat/completions": (chat_results, chat_reply, chat_chunks),
    "/v1/responses": (responses_results, responses_reply, responses_events),
    "/v1/embeddings": (embeddings_results, embeddings_reply, None),
    "/v1/messages": (messages_results, messages_reply, messages_events),
}


# --- the HTTP side ------------------------------------------------------------------------------------
# The error event a provider sends in the middle of a stream (``error-after-N``).
STREAM_ERRORS = {
    "messages": b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error",'
                b' "message": "Overloaded"}}\n\n',
    "openai": b'data: {"error": {"message": "server error mid-stream", "type": "server_error"}}\n\n',
}

class CallLog:
    """Every call, one JSON line each, appended to a file (or kept in memory)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.entries: list[dict[str, Any]] = []

    def add(self, entry: dict[str, Any]) -> int:
        with self.lock:
            self.entries.append(entry)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            return len(self.entries)

    def stats(self) -> dict[str, int]:
        with self.lock:
            keys = [e["key"] for e in self.entries if e["key"]]
        return {"calls": len(self.entries), "repeated_keys": len(keys) - len(set(keys))}


def read_calls(path: Path) -> list[dict[str, Any]]:
    """The calls a stub logged to ``path`` (for tests and examples)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def make_server(port: int = 0, *, delay: float = 0.0, chunk_delay: float = 0.0,
                calls: Path | None = None) -> ThreadingHTTPServer:
    log = CallLog(calls)
    state = ServerState()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # A response leaves in one segment (headers and body buffered together, no Nagle wait): without
        # this a kept-alive connection waits for the client's delayed ACK, ~40 ms a call.
        wbufsize = 1 << 16
        disable_nagle_algorithm = True

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            path = self.path.split("?")[0]
            if path.startswith("/v1/conversations/") and path.endswith("/items"):
                with state.lock:
                    items = state.conversations.get(path.split("/")[3])
                if items is None:
                    self._send(404, b'{"error": {"message": "no such conversation", "type": "not_found"}}')
                    return
                self._send(200, json.dumps({"object": "list", "data": items}).encode())
                return
            self._send(200, json.dumps(log.stats()).encode())

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            path = self.path.split("?")[0]
            if path == "/v1/conversations":
                cid = state.create_conversation(body.get("items") or [])
                self._send(200, json.dumps({"id": cid, "object": "conversation", "created_at": CREATED,
                                            "metadata": {}}).encode())
                return
            route = ROUTES.get(path)
            if route is None:
                self._send(404, b'{"error": {"message": "no such route", "type": "not_found"}}')
                return
            results_of, reply_of, events_of = route
            stream = bool(body.get("stream")) and events_of is not None
            history: list[dict[str, Any]] = []
            view, reply, extra = body, None, {}
            if path == "/v1/responses":
                found = state.history(body)
                if found is None:
                    self._send(404, b'{"error": {"message": "previous response or conversation not found",'
                                    b' "type": "invalid_request_error"}}')
                    return
                history = found
                if body.get("previous_response_id") is not None or conversation_id(body) is not None:
                    # The model answers the whole conversation: the history continued, then the input.
                    view = {**body, "input": history + _items(body)}
                    reply = reply_of(view, 0)
                    reply["id"] = state.new_id(reply)
                else:
                    reply = reply_of(body, 0)
                extra = {"previous_response_id": body.get("previous_response_id"),
                         "conversation": conversation_id(body), "sent": [item_key(i) for i in _items(body)],
                         "response_id": reply["id"]}
            question, results = results_of(view)
            n = log.add({"key": self.headers.get("Idempotency-Key"), "path": self.path, "stream": stream,
                         "question": question, "turn": len(results), "t": time.time(), **extra})
            time.sleep(delay)  # a model takes its time
            if reply is None:
                reply = reply_of(body, n)
            if path == "/v1/responses":  # complete: kept (and in its conversation) whether the caller waits or not
                state.keep(body, history, reply)
            model = str(body.get("model", ""))
            if model == "half-emoji" and reply.get("object") == "chat.completion":
                message = reply["choices"][0]["message"]
                message["content"] = (message.get("content") or "") + "\ud83d"
            error_after = int(model.removeprefix("error-after-")) if model.startswith("error-after-") else None
            try:
                if not stream:
                    self._send(200, json.dumps(reply).encode())
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.send_header("Connection", "close")
                self.end_headers()
                for i, event in enumerate(events_of(reply)):
                    if i == error_after:
                        self.wfile.write(STREAM_ERRORS["messages" if self.path.startswith("/v1/messages") else "openai"])
                        self.wfile.flush()
                        self.close_connection = True
                        return
                    name = f"event: {event['type']}\n" if "type" in event else ""
                    self.wfile.write(f"{name}data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(chunk_delay)
                if self.path.startswith("/v1/chat"):
                    self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True
            except (BrokenPipeError, ConnectionResetError):
                pass  # the caller was killed while it waited, or walked away from a stream

        def _send(self, status: int, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765, help="0: any free port")
    parser.add_argument("--delay", type=float, default=0.3, help="seconds before each answer")
    parser.add_argument("--chunk-delay", type=float, default=0.0, help="seconds between streamed events")
    parser.add_argument("--calls", type=Path, help="append every call to this file (JSON lines)")
    args = parser.parse_args()
    server = make_server(args.port, delay=args.delay, chunk_delay=args.chunk_delay, calls=args.calls)
    print(f"stub model on http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
