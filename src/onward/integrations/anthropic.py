"""The Anthropic SDK made durable: ``durable(Anthropic())`` (or ``AsyncAnthropic``) is the same client,
except that inside an onward task ``messages.create`` is a durable step: recorded when it returns, replayed
on resume as the SDK's own ``Message`` (equal, field by field, to the original), sent with the step's
``Idempotency-Key`` header. ``stream=True``: the events are handed on as they arrive and recorded; the step
commits when the stream ends, and a replayed stream yields the recorded events again. Outside a task
every call goes to the server as usual.

    from anthropic import Anthropic
    from onward.integrations.anthropic import durable

    client = durable(Anthropic())

Needs ``pip install 'onward[anthropic]'``. (``messages.stream(...)``, the SDK's stream helper, is not a
step: use ``messages.create(stream=True)``.)
"""

from __future__ import annotations

from typing import TypeVar

try:
    import anthropic as _sdk  # fail here, with the extra to install, rather than at the first call
except ImportError:
    raise ImportError("onward.integrations.anthropic needs the anthropic package: pip install 'onward[anthropic]'") from None

from .clients import DurableResource, SdkSpec

C = TypeVar("C")

SPEC = SdkSpec("anthropic", frozenset({("messages", "create")}), (_sdk.AsyncAnthropic,))


def durable(client: C) -> C:
    """``client`` (``anthropic.Anthropic`` or ``anthropic.AsyncAnthropic``) with ``messages.create`` as a
    durable step."""
    return DurableResource(client, SPEC)  # type: ignore[return-value]
