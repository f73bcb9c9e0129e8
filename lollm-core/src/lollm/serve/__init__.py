"""Serving, the layer of core above the engine (beside proof/, below the commands): ``lollm serve``'s
HTTP server (OpenAI's Chat Completions, Completions and Responses, Anthropic's Messages), its metrics,
its tool calls and its separated thinking, on top of the engine's one driver.

Reading order: ``server.py`` (the overview, and the public names), ``requests.py`` (a request
read and checked), ``model_server.py`` (how it runs: the batched engine, or one worker), ``models.py`` (several
models: which one a request names, loading on first use within a memory budget),
``answers.py`` and ``stream.py`` (the answer, whole or as server-sent events), ``app.py`` (HTTP:
the routes, uvicorn), ``guard.py`` (who may call: the key, Host, Origin, CORS, JSON bodies) and
``shutdown.py`` (SIGTERM: a drain with a deadline); beside them ``openapi.py``, ``metrics.py``, ``error_shapes.py`` (an error in each API's shape), ``tools.py`` with
``tool_formats.py`` (tool calls), ``reasoning.py`` (the thinking split off, constraints after it),
and the other APIs, each translated into a chat request and shaped back: ``messages.py``
(Anthropic's Messages) and ``responses.py`` (OpenAI's Responses).
"""
