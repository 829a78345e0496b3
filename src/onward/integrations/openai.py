"""The OpenAI SDK made durable: ``durable(OpenAI())`` (or ``AsyncOpenAI``) is the same client, except that
inside an onward task ``chat.completions.create``, ``responses.create`` and ``embeddings.create`` are
durable steps: recorded when they return, replayed on resume as the SDK's own response objects (equal,
field by field, to the originals), sent with the step's ``Idempotency-Key`` header. ``stream=True``: the
chunks are handed on as they arrive and recorded; the step commits when the stream ends, and a replayed
stream yields the recorded chunks again. Outside a task every call goes to the server as usual.

    from openai import OpenAI
    from onward.integrations.openai import durable

    client = durable(OpenAI())

Needs ``pip install 'onward[openai]'``.
"""

from __future__ import annotations

from typing import TypeVar

try:
    import openai as _sdk  # fail here, with the extra to install, rather than at the first call
except ImportError:
    raise ImportError("onward.integrations.openai needs the openai package: pip install 'onward[openai]'") from None

from .clients import DurableResource, SdkSpec

C = TypeVar("C")

SPEC = SdkSpec("openai", frozenset({("chat", "completions", "create"), ("responses", "create"),
                                    ("embeddings", "create")}),
              (_sdk.AsyncOpenAI,))


def durable(client: C) -> C:
    """``client`` (``openai.OpenAI`` or ``openai.AsyncOpenAI``) with its model calls as durable steps."""
    return DurableResource(client, SPEC)  # type: ignore[return-value]

