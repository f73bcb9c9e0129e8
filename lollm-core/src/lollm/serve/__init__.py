"""Serving, the layer of core above the engine (beside proof/, below the commands): ``lollm serve``'s
HTTP server (OpenAI-compatible), its metrics and its tool calls, on top of the engine's one driver.

Reading order: ``server.py`` (the overview, and the public names), ``requests.py`` (a request
read and checked), ``model_server.py`` (how it runs: the batched engine, or one worker),
``answers.py`` and ``stream.py`` (the answer, whole or as server-sent events), ``app.py`` (HTTP:
the routes, uvicorn), ``guard.py`` (who may call: the key, Host, Origin, CORS, JSON bodies) and
``shutdown.py`` (SIGTERM: a drain with a deadline); beside them ``openapi.py``, ``metrics.py``, and
``tools.py`` with ``tool_formats.py`` (tool calls).
"""
