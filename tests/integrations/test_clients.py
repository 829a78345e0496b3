"""The durable OpenAI and Anthropic clients against the stub, in a real job on a SQLite file: each model
call a step whose replay returns the SDK's own objects, equal to the first run's, without a call; streams
recorded chunk by chunk and replayed; an abandoned stream recorded as nothing; the plain client outside a
task; everything but the model calls passed through."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from onward import Job, step
from onward.log import QUIET
from onward.steps import idempotency_key
from tests.integrations.conftest import Stub

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
from onward.integrations import anthropic as durable_anthropic  # noqa: E402
from onward.integrations import openai as durable_openai  # noqa: E402

ASK = [{"role": "user", "content": "Multiply 6 7"}]
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def run_twice(tmp_path: Path, body: Callable[[], Any], is_async: bool = False) -> list[Any]:
    """Run ``body`` as a task that fails its first attempt after the calls: the second attempt replays them.
    Returns what each attempt's body returned."""
    seen: list[Any] = []
    job = Job(str(tmp_path / "job.db"), retry_delay=0, max_attempts=2, log_level=QUIET)

    def once_more() -> str:
        if len(seen) == 1:
            raise RuntimeError("fail the first attempt, after its steps")
        return "done"

    async def async_task(name: str, ctx: object) -> str:
        seen.append(await body())
        return once_more()

    def sync_task(name: str, ctx: object) -> str:
        seen.append(body())
        return once_more()

    job.task(async_task if is_async else sync_task)
    job.add(["t"])
    assert job.run().exit_code == 0
    job.close()
    assert len(seen) == 2
    return seen


def test_openai_calls_replay_as_the_sdks_objects_without_a_call(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))

    def calls() -> list[Any]:
        return [client.chat.completions.create(model="m", messages=ASK, tools=TOOLS),
                client.chat.completions.create(model="m", messages=ASK),
                client.responses.create(model="m", input="Multiply 6 7"),
                client.embeddings.create(model="m", input=["one", "two"])]

    first, replayed = run_twice(tmp_path, calls)
    assert stub.count() == 4  # the second attempt made no call
    assert [type(r) for r in replayed] == [openai.types.chat.ChatCompletion, openai.types.chat.ChatCompletion,
                                           openai.types.responses.Response,
                                           openai.types.CreateEmbeddingResponse]
    assert replayed == first  # field by field
    assert replayed[0].choices[0].message.tool_calls[0].function.name == "calculator"
    assert replayed[3].data[1].embedding == first[3].data[1].embedding and len(replayed[3].data[1].embedding) == 8
    names = ["openai.chat.completions.create"] * 2 + ["openai.responses.create", "openai.embeddings.create"]
    assert [c["key"] for c in stub.calls()] == [idempotency_key("t", n, i + 1) for i, n in enumerate(names)]


def test_async_openai_and_anthropic_replay(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.AsyncOpenAI(base_url=stub.base_url, api_key="stub"))
    claude = durable_anthropic.durable(anthropic.AsyncAnthropic(base_url=stub.url, api_key="stub"))

    async def calls() -> list[Any]:
        return [await client.chat.completions.create(model="m", messages=ASK),
                await claude.messages.create(model="m", max_tokens=9, messages=ASK)]

    first, replayed = run_twice(tmp_path, calls, is_async=True)
    assert stub.count() == 2
    assert type(replayed[1]) is anthropic.types.Message and replayed == first
    assert replayed[1].content[0].input == {"expression": "6 * 7"}


def test_streams_are_recorded_chunk_by_chunk_and_replayed(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))
    claude = durable_anthropic.durable(anthropic.Anthropic(base_url=stub.url, api_key="stub"))
    live: list[bool] = []

    def streams() -> list[list[Any]]:
        out = []
        for open_stream in (
                lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7"}],
                                                       stream=True),
                lambda: client.responses.create(model="m", input="7", stream=True),
                lambda: claude.messages.create(model="m", max_tokens=9, messages=[{"role": "user", "content": "7"}],
                                               stream=True)):
            calls_before = stub.count()
            stream = open_stream()
            chunks = []
            with stream:
                for chunk in stream:
                    chunks.append(chunk)
            # A live stream is the SDK's (its HTTP response passes through) and cost one call.
            live.append(hasattr(stream, "response") and stub.count() == calls_before + 1)
            out.append(chunks)
        return out

    first, replayed = run_twice(tmp_path, streams)
    assert stub.count() == 3 and [c["stream"] for c in stub.calls()] == [True] * 3
    assert replayed == first
    assert [len(s) for s in replayed] == [6, 8, 9]  # every chunk yielded again
    assert type(replayed[0][1]) is openai.types.chat.ChatCompletionChunk
    assert "".join(c.choices[0].delta.content or "" for c in replayed[0]) == "The product is 7."
    assert type(replayed[2][0]).__name__ == "RawMessageStartEvent"
    assert live == [True, True, True, False, False, False]  # the second attempt's streams were replays


def test_async_streams_replay(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.AsyncOpenAI(base_url=stub.base_url, api_key="stub"))
    claude = durable_anthropic.durable(anthropic.AsyncAnthropic(base_url=stub.url, api_key="stub"))

    async def streams() -> list[list[Any]]:
        s = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7"}], stream=True)
        chat = [chunk async for chunk in s]
        async with await claude.messages.create(model="m", max_tokens=9, messages=ASK, stream=True) as events:
            return [chat, [event async for event in events]]

    first, replayed = run_twice(tmp_path, streams, is_async=True)
    assert stub.count() == 2 and replayed == first and [len(s) for s in replayed] == [6, 6]
    assert replayed[1][2].delta.partial_json == '{"expression": "6 * 7"}'


def test_an_abandoned_stream_records_nothing_and_runs_again(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))

    def leave_early() -> Any:
        with client.chat.completions.create(model="m", messages=[{"role": "user", "content": "7"}],
                                            stream=True) as s:
            first = next(iter(s))
        return first

    first, again = run_twice(tmp_path, leave_early)
    assert stub.count() == 2  # nothing was recorded, so the second attempt asked again
    assert again == first
    job = Job(str(tmp_path / "job.db"), log_level=QUIET)
    task_id = job.store.task_id("t")
    assert task_id is not None and job.store.steps(task_id) == []
    job.close()


def test_outside_a_task_it_is_the_plain_client(stub: Stub) -> None:
    plain = openai.OpenAI(base_url=stub.base_url, api_key="stub")
    client = durable_openai.durable(plain)
    one = client.chat.completions.create(model="m", messages=ASK)
    two = client.chat.completions.create(model="m", messages=ASK)
    assert one == two and type(one) is openai.types.chat.ChatCompletion
    chunks = list(client.chat.completions.create(model="m", messages=ASK, stream=True))
    assert len(chunks) == 3
    claude = durable_anthropic.durable(anthropic.Anthropic(base_url=stub.url, api_key="stub"))
    claude.messages.create(model="m", max_tokens=9, messages=ASK)
    calls = stub.calls()
    assert len(calls) == 4 and all(c["key"] is None for c in calls)  # every call made, no step key sent
    # Everything but the model calls is the SDK's own object.
    assert client.models is plain.models
    assert client.chat.completions.with_raw_response is not None
    assert client.with_options(timeout=5).chat.completions.create(model="m", messages=ASK) == one
    assert client.api_key == "stub"


def test_the_header_a_caller_set_is_kept(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))
    run_twice(tmp_path, lambda: client.chat.completions.create(model="m", messages=ASK,
                                                               extra_headers={"idempotency-key": "mine"}))
    assert [c["key"] for c in stub.calls()] == ["mine"]


def test_a_replayed_record_never_rebuilds_a_class_outside_the_sdk() -> None:
    from onward.errors import StoreError
    from onward.integrations.calls import ModelCodec

    with pytest.raises(StoreError, match="outside openai"):
        ModelCodec("openai").decode({"type": "os:system", "data": {}})
    with pytest.raises(StoreError, match="outside openai"):
        ModelCodec("openai").decode({"type": "openai_evil.x:Y", "data": {}})
    with pytest.raises(StoreError, match="does not have"):
        ModelCodec("openai").decode({"type": "openai.types.chat:../../etc", "data": {}})
    with pytest.raises(StoreError, match="not a model class"):
        ModelCodec("openai").decode({"type": "openai:OpenAI", "data": {}})
    hostile: Any
    for hostile in ([], "<script>", {"type": "openai.types.chat:ChatCompletion"}, {"data": {}}, None):
        with pytest.raises(StoreError, match="not in the expected form"):
            ModelCodec("openai").decode(hostile)
    with pytest.raises(StoreError, match="not in the expected form"):
        ModelCodec("openai").decode_chunks({"types": ["openai.types.chat:ChatCompletionChunk"], "chunks": [[7, {}]]})


def test_async_wrapper_outside_a_task(stub: Stub) -> None:
    client = durable_openai.durable(openai.AsyncOpenAI(base_url=stub.base_url, api_key="stub"))

    async def call() -> Any:
        return await client.chat.completions.create(model="m", messages=ASK)
    assert type(asyncio.run(call())) is openai.types.chat.ChatCompletion
    assert stub.count() == 1


def test_concurrent_tasks_sharing_a_client_each_record_their_own_calls(tmp_path: Path, stub: Stub) -> None:
    client = durable_openai.durable(openai.AsyncOpenAI(base_url=stub.base_url, api_key="stub"))
    answers: dict[str, list[str]] = {}
    job = Job(str(tmp_path / "job.db"), concurrency=3, retry_delay=0, max_attempts=2, log_level=QUIET)

    @job.task
    async def task(name: str, ctx: object) -> str:
        messages: list[Any] = [{"role": "user", "content": name}]
        for _ in range(3):
            reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            call = reply.choices[0].message.tool_calls
            result = "done"
            if call:
                a, b = json.loads(call[0].function.arguments)["expression"].split("*")
                result = str(int(a) * int(b))
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call[0].id if call else "x", "content": result}]
        answers.setdefault(name, []).append(messages[-1]["content"])
        if len(answers[name]) == 1:
            raise RuntimeError("fail the first attempt, after its steps")
        return messages[-1]["content"]

    names = ["Multiply 2 3 4 5", "Multiply 3 5 7 9", "Multiply 5 7 11 13"]
    job.add(names)
    assert job.run().exit_code == 0
    job.close()
    assert answers == {"Multiply 2 3 4 5": ["120", "120"], "Multiply 3 5 7 9": ["945", "945"],
                       "Multiply 5 7 11 13": ["5005", "5005"]}
    keys = [c["key"] for c in stub.calls()]
    assert len(keys) == 9 == len(set(keys))  # three calls a task, each its own key, none replayed by a call
    assert set(keys) == {idempotency_key(n, "openai.chat.completions.create", i) for n in names for i in (1, 2, 3)}


class RefusingModel:
    """A model server that answers every call 429 (rate limited), counting them; or, given them, with ``status``
    and ``body`` (as sent: JSON with Python's extensions, such as -Infinity, if need be)."""

    def __init__(self, status: int = 429, body: str | None = None, content_type: str = "application/json") -> None:
        import http.server
        import threading

        model = self
        self.calls = 0
        answer = body if body is not None else json.dumps(
            {"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                model.calls += 1
                body = answer
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("sdk", ["openai", "anthropic", "anthropic-token"])
def test_a_provider_error_the_task_caught_replays_as_itself_and_keeps_no_api_key(tmp_path: Path, sdk: str) -> None:
    """A 429 the task catches (and falls back from) is recorded, and raised again on replay as the SDK's
    own RateLimitError, so that the same ``except`` takes the same path without a call. OpenAI's errors
    could not be rebuilt by pickle (their __init__ takes keyword arguments) and replayed as StepError,
    which no ``except openai.RateLimitError`` catches: the task failed for good. Anthropic's were pickled
    with the request they failed on, headers and all: the API key was in the store."""
    secret = "sk-TOPSECRET-" + sdk
    model = RefusingModel()
    try:
        if sdk == "openai":
            client: Any = durable_openai.durable(openai.OpenAI(base_url=model.url + "/v1", api_key=secret,
                                                               max_retries=0))
            limited: type[BaseException] = openai.RateLimitError

            def ask() -> Any:
                return client.chat.completions.create(model="m", messages=ASK)
        else:
            credential = {"auth_token" if sdk.endswith("token") else "api_key": secret}
            client = durable_anthropic.durable(anthropic.Anthropic(base_url=model.url, max_retries=0, **credential))
            limited = anthropic.RateLimitError

            def ask() -> Any:
                return client.messages.create(model="m", max_tokens=10, messages=ASK)

        @step(name="fallback")
        def fallback(why: str) -> str:  # a step after the error: a trailing error record would be run again
            return f"fell back after {why}"

        def body() -> str:
            try:
                ask()
            except limited as e:
                return fallback(f"{type(e).__name__} {getattr(e, 'status_code', None)}")
            return "no error"
        assert run_twice(tmp_path, body) == ["fell back after RateLimitError 429"] * 2
        assert model.calls == 1  # the replay raised the recorded error without a call
    finally:
        model.close()
    for path in tmp_path.iterdir():
        if path.name.startswith("job.db"):
            assert b"TOPSECRET" not in path.read_bytes(), path


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_an_error_in_the_middle_of_a_stream_replays_after_the_same_chunks(tmp_path: Path, stub: Stub, sdk: str,
                                                                         is_async: bool) -> None:
    """The provider sends two events, then an error event; the task catches the SDK's error around its loop
    (where the SDK raises it) and falls back. The replay yields the two events again and raises the same
    error from the iteration, inside the same ``try``. It was raised at ``create()``, before any chunk and
    outside the ``try``: the resumed task failed, every attempt after it too."""
    ask = [{"role": "user", "content": "Multiply 2 3"}]
    if sdk == "openai":
        error: type[BaseException] = openai.APIError
        client: Any = durable_openai.durable((openai.AsyncOpenAI if is_async else openai.OpenAI)(
            base_url=stub.base_url, api_key="stub", max_retries=0))
        create = client.chat.completions.create
        kwargs: dict[str, Any] = {"model": "error-after-2", "messages": ask, "stream": True}
    else:
        error = anthropic.APIError
        client = durable_anthropic.durable((anthropic.AsyncAnthropic if is_async else anthropic.Anthropic)(
            base_url=stub.url, api_key="stub", max_retries=0))
        create = client.messages.create
        kwargs = {"model": "error-after-2", "max_tokens": 9, "messages": ask, "stream": True}

    @step(name="fallback")
    def fallback(why: str) -> str:
        return f"fell back: {why}"

    def sync_body() -> tuple[list[Any], str]:
        chunks: list[Any] = []
        try:
            for chunk in create(**kwargs):
                chunks.append(chunk)
        except error as e:
            return chunks, fallback(f"{type(e).__name__} after {len(chunks)} chunks")
        return chunks, "no error"

    async def async_body() -> tuple[list[Any], str]:
        chunks: list[Any] = []
        try:
            async for chunk in await create(**kwargs):
                chunks.append(chunk)
        except error as e:
            return chunks, fallback(f"{type(e).__name__} after {len(chunks)} chunks")
        return chunks, "no error"

    first, replayed = run_twice(tmp_path, async_body if is_async else sync_body, is_async)
    assert first[1].startswith("fell back:") and first[1].endswith("after 2 chunks")
    assert replayed == first  # the same chunks, then the same error, of the same class
    assert stub.count() == 1  # the replay made no call


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
@pytest.mark.parametrize("first_stream", [True, False], ids=["stream-then-call", "call-then-stream"])
@pytest.mark.parametrize("replay", ["strict", "prefix"])
def test_switching_stream_on_or_off_across_a_resume_is_drift(tmp_path: Path, stub: Stub, sdk: str,
                                                              first_stream: bool, replay: str) -> None:
    """The same create() made with stream=True by one attempt and without it by the next is another call:
    StepDrift (strict), or the call made again (replay="prefix"). The stream's record was handed to the
    plain call's decoder (or the other way round): a StoreError saying the record was not in the expected
    form, under either policy."""
    if sdk == "openai":
        client: Any = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))
        create = client.chat.completions.create
        kwargs: dict[str, Any] = {"model": "m", "messages": ASK}
    else:
        client = durable_anthropic.durable(anthropic.Anthropic(base_url=stub.url, api_key="stub"))
        create = client.messages.create
        kwargs = {"model": "m", "max_tokens": 9, "messages": ASK}
    attempts: list[bool] = []
    job = Job(str(tmp_path / "job.db"), retry_delay=0, max_attempts=2, log_level=QUIET)

    @job.task(replay=replay)
    def t(name: str, ctx: object) -> str:
        stream = first_stream if not attempts else not first_stream
        attempts.append(stream)
        if stream:
            chunks = list(create(**kwargs, stream=True))
            result = f"{len(chunks)} chunks"
        else:
            result = type(create(**kwargs)).__name__
        if len(attempts) == 1:
            raise RuntimeError("fail the first attempt, after its call")
        return result

    job.add(["t"])
    summary = job.run()
    row = job.store.task("t")
    job.close()
    assert row is not None
    if replay == "strict":
        assert summary.exit_code != 0 and (row.error or "").startswith("StepDrift:"), row.error
        assert "stream=True" in (row.error or "")
        assert stub.count() == 1  # the drift was found before any call
    else:
        assert summary.exit_code == 0, row.error
        assert stub.count() == 2  # the recorded call was dropped and made again, in its new form


def test_an_answer_with_a_lone_surrogate_is_recorded_and_replays_equal(tmp_path: Path, stub: Stub) -> None:
    """The model's text ends inside an emoji (the JSON escape "\\ud83d" alone, valid JSON the SDK reads as a
    lone surrogate). It could not be written as UTF-8: the call was paid again on every attempt, and the
    task failed with advice (serializer=PICKLE) the durable client does not take."""
    client = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))
    first, replayed = run_twice(tmp_path, lambda: client.chat.completions.create(model="half-emoji", messages=ASK))
    assert first.choices[0].message.content.endswith("\ud83d")
    assert replayed == first
    assert stub.count() == 1  # recorded once, replayed without a call


def test_a_replayed_stream_says_which_attributes_it_lacks(tmp_path: Path, stub: Stub) -> None:
    """A replayed stream has the recorded chunks, not the HTTP response the SDK's stream holds: reading
    ``stream.response`` fails after a resume, naming why and what the replayed stream offers (it failed
    with a bare AttributeError)."""
    client = durable_openai.durable(openai.OpenAI(base_url=stub.base_url, api_key="stub"))

    def body() -> str:
        stream = client.chat.completions.create(model="m", messages=ASK, stream=True)
        chunks = list(stream)
        try:
            return f"{len(chunks)} chunks, status {stream.response.status_code}"
        except AttributeError as e:
            return f"{len(chunks)} chunks, {e}"

    first, replayed = run_twice(tmp_path, body)
    assert first == "3 chunks, status 200"
    assert replayed.startswith("3 chunks, ReplayedStream has no 'response': a replayed stream holds the recorded"
                               " chunks only"), replayed
    assert stub.count() == 1


def test_a_gateways_credentials_in_a_caught_error_never_reach_the_store(tmp_path: Path) -> None:
    """Behind a gateway or a proxy the request carries more credentials than the API key: headers of their own
    (Helicone-Auth, Ocp-Apim-Subscription-Key, cf-aig-authorization, x-portkey-api-key), a password in the base
    URL, a ?key= in its query. Only a fixed list of headers was redacted in the recorded error: the rest were
    stored word for word, for anyone who can read the store."""
    model = RefusingModel()
    secrets = {"Helicone-Auth": "Bearer GW-LEAK-1", "Ocp-Apim-Subscription-Key": "GW-LEAK-2",
               "cf-aig-authorization": "Bearer GW-LEAK-3", "x-portkey-api-key": "GW-LEAK-4"}
    try:
        base = model.url.replace("http://", "http://bob:GW-LEAK-5@") + "/v1"
        client: Any = durable_openai.durable(openai.OpenAI(base_url=base, api_key="sk-GW-LEAK-6", max_retries=0,
                                                           default_headers=secrets,
                                                           default_query={"key": "GW-LEAK-7", "region": "eu"}))

        def body() -> str:
            try:
                client.chat.completions.create(model="m", messages=ASK)
            except openai.RateLimitError as e:
                request = e.response.request  # as the SDK raised it, then as recorded
                return f"{e.status_code} {request.headers['helicone-auth']} {request.url.params['region']}"
            return "no error"
        assert run_twice(tmp_path, body) == ["429 Bearer GW-LEAK-1 eu", "429 [redacted] eu"]
        assert model.calls == 1
    finally:
        model.close()
    for path in tmp_path.iterdir():
        if path.name.startswith("job.db"):
            assert b"GW-LEAK" not in path.read_bytes(), path


def test_a_model_answer_with_an_infinite_logprob_is_recorded_and_replayed(tmp_path: Path) -> None:
    """A server's answer with -Infinity in a float field (a logprob), which Python's json and the SDK take: the
    record refused it as not JSON, so every attempt failed after paying for the call again, with advice to pass
    a serializer that a durable client has no place for. It is recorded as it came, and replayed so."""
    answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
              "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "x"},
                           "logprobs": {"content": [{"token": "x", "logprob": float("-inf"), "bytes": None,
                                                     "top_logprobs": []}]}}]}
    model = RefusingModel(200, json.dumps(answer))
    try:
        client: Any = durable_openai.durable(openai.OpenAI(base_url=model.url + "/v1", api_key="k", max_retries=0))

        def body() -> Any:
            reply = client.chat.completions.create(model="m", messages=ASK, logprobs=True)
            return (reply.choices[0].message.content, reply.choices[0].logprobs.content[0].logprob)
        assert run_twice(tmp_path, body) == [("x", float("-inf"))] * 2
        assert model.calls == 1
    finally:
        model.close()


@pytest.mark.parametrize(("body", "content_type"), [("<html>bad gateway</html>", "text/html"), ("null", "application/json")])
def test_a_200_answer_that_is_not_the_sdks_json_is_returned_as_the_sdk_returns_it(tmp_path: Path, body: str,
                                                                                content_type: str) -> None:
    """A gateway that answers 200 with an HTML page, or a bare null: the plain SDK hands back what it parsed (a
    str, None); inside a task the call raised AttributeError ('str' object has no attribute 'model_dump'),
    saying nothing of what the server sent. It is recorded and replayed as the SDK returned it."""
    model = RefusingModel(200, body, content_type)
    try:
        plain = openai.OpenAI(base_url=model.url + "/v1", api_key="k", max_retries=0)
        expected = plain.chat.completions.create(model="m", messages=ASK)
        client: Any = durable_openai.durable(openai.OpenAI(base_url=model.url + "/v1", api_key="k", max_retries=0))
        assert run_twice(tmp_path, lambda: client.chat.completions.create(model="m", messages=ASK)) == [expected] * 2
        assert model.calls == 2  # the plain call, then the first attempt's; the second attempt replayed
    finally:
        model.close()
