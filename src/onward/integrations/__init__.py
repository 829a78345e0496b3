"""Durable steps where agents are built: model clients and agent frameworks whose calls, made inside an
onward task, are recorded when they return and replayed on resume.

- ``onward.integrations.openai.durable(client)``, ``onward.integrations.anthropic.durable(client)``:
  the SDK clients (sync and async), each model call a step.
- ``onward.integrations.pydantic_ai.OnwardAgent(agent)``: each model request and tool call a step.
- ``onward.integrations.openai_agents.OnwardRunner``: ``agents.Runner`` with model and tool calls as steps.

Each module imports its framework when it is imported (``pip install 'onward[openai]'`` and so on);
``import onward`` never does. ``onward.integrations.calls`` is the one helper they share.
"""
