"""``lollm serve``: an OpenAI- and Anthropic-compatible HTTP server for one model, or several.

::

    POST /v1/chat/completions   messages ─► chat template ─► token ids ─┐
    POST /v1/completions        prompt text (or ids) ─► token ids ──────┤   (in a thread pool, off the event loop)
                                                                        ▼
                 a bounded queue (503 + Retry-After when full) ─► the batched engine: one thread steps it,
                 every request joins the running batch at the next step (lollm.engine.driver)
                                                                        │
                 JSON, or server-sent events (``stream: true``) ◄───────┘
    GET  /v1/models             the models served, each with whether it is loaded
    GET  /health                {"status": "ok", ...}, request counters and how requests are batched
    GET  /metrics               Prometheus text format (lollm.serve.metrics)
    GET  /openapi.json          the OpenAPI 3.0 description of the endpoints above
    GET  /                      a chat page (lollm/serve/static/chat.html) that streams through /v1/chat/completions

Once it listens, :func:`serve` logs a banner (URL, model, family, context, a curl
line, the chat page) and every generation logs one line (:func:`request_line`:
endpoint, prompt / cached / generated tokens, time to first token, tok/s, finish).

Requests and answers follow OpenAI's API, so its clients (the ``openai``
package, editors, agent tools) talk to it unchanged; see docs/serving.md.

* Many requests, one batch: requests run through :class:`lollm.engine.Engine`
  (continuous batching over a paged KV cache with prefix caching, docs/batching.md):
  a request joins the running batch at the engine's next step, leaves it the step
  it ends, and reuses every full KV block of its prompt that an earlier request
  left in the pool (``usage.prompt_tokens_details.cached_tokens`` says how much).
  At most ``max_queue`` requests wait; one more gets a 503 with ``Retry-After``.
* One request at a time where the engine cannot serve: tensor parallel (``--tp``),
  speculative decoding (``--mtp``), a family whose model has no ``cache_layers()``.
  Then one worker thread runs requests in arrival order through one
  :class:`~lollm.generate.prompt_cache.PromptCache`, so a client that sends its growing
  conversation again reuses what its last request computed.
* One request cannot stall the others: the event loop only reads bodies (at
  most :func:`body_limit` bytes) and writes answers. Parsing the JSON (at most
  :data:`MAX_JSON_DEPTH` levels deep), checking the fields, rendering the
  template and tokenizing run in a thread pool (Starlette's
  ``run_in_threadpool``), after a size check that refuses a text too long to
  fit the context before it is tokenized (:meth:`ModelServer.check_text_size`).
* A client that goes away (a closed stream, a dropped connection) cancels its
  generation at the next token; in the engine its KV blocks go back to the pool.
* A bad request gets a 4xx with an OpenAI-style error body
  (``{"error": {"message", "type", "param", "code"}}``) that names the field;
  a bug gets a 500 with the same shape and one log line (type, message, where;
  the traceback is logged at DEBUG level).
* Message text from clients is encoded with special-token parsing off
  (``Tokenizer.encode_chat(parse_special=False)``): a message cannot forge
  ``<|im_end|>``. A /v1/completions prompt is raw model input, parsed as is.
* Under tensor parallelism (``torchrun … -m lollm serve --tp N``, docs/tensor-parallel.md)
  rank 0 serves HTTP; before each generation its worker broadcasts the job (ids,
  resolved sampling with a concrete seed, stops) and the other ranks, in
  :meth:`ModelServer.follow`, run the same generation in lockstep (the collectives
  need every rank); before each step rank 0's cancel flag is broadcast, so a
  client that goes away stops every rank at the same token (:mod:`lollm.load.ranks`:
  ``broadcast``, ``follow``, ``agree``).
* With ``tools`` the chat template shows them to the model and the answer's
  text is read for calls (:mod:`lollm.serve.tools`: one format per template kind,
  a parser shared by the streamed and the whole answer); ``tool_choice``
  "required" or a named function makes the generation follow a grammar of the
  calls (:mod:`lollm.generate.structured`). docs/tools.md.
* Bound to 127.0.0.1 unless told otherwise; ``--api-key`` (or ``--api-key-file``) makes every /v1
  request show ``Authorization: Bearer KEY``. In front of the routes, :mod:`lollm.serve.guard`
  refuses what a web page could forge: a POST that is not JSON (415), a Host that does not name
  this server (403, DNS rebinding), a cross-origin call from an origin not given to ``--cors-origin``.
* On SIGTERM or Ctrl-C, :mod:`lollm.serve.shutdown` stops accepting, answers the queue with 503,
  lets running requests go on for ``--shutdown-timeout`` seconds, then ends them (a stream with
  ``finish_reason: "shutdown"``) and exits 0.

* Several models (``lollm serve A B ...`` or a folder of them): each request's ``model`` picks one;
  :class:`lollm.serve.models.ServedModels` loads a model on its first request (the first at start),
  one load at a time while the others serve, within ``--memory-budget`` by unloading idle models,
  least recently used first. Every model has its own :class:`ModelServer` and engine.

Where each part lives: :mod:`lollm.serve.requests` reads a request (JSON, fields, messages,
``response_format``), :mod:`lollm.serve.model_server` runs it (the engine, or one worker), :mod:`lollm.serve.models` picks the model,
:mod:`lollm.serve.answers` and :mod:`lollm.serve.stream` shape the answer (JSON, server-sent events),
:mod:`lollm.serve.openapi` describes the endpoints, and :mod:`lollm.serve.app` is the HTTP side
(Starlette's routes, uvicorn). This module gathers their public names.
"""

from __future__ import annotations

from lollm.serve.answers import FINISH_REASON, request_line
from lollm.serve.app import announce, banner, chat_page_html, create_app, guarded, read_limited, require_serve_extra, serve
from lollm.serve.model_server import (DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_MAX_RUNNING,
                                      RETRY_AFTER_SECONDS, ModelServer)
from lollm.serve.models import ModelEntry, ServedModels
from lollm.serve.openapi import openapi_schema
from lollm.serve.requests import (BODY_BYTES_BASE, BODY_BYTES_PER_POSITION, MAX_INTEGER, MAX_JSON_DEPTH, ApiError, Job,
                                  PreparedRequest, body_limit, parse_body, response_format)
from lollm.serve.stream import EventStream, sse

__all__ = [
    "ApiError", "BODY_BYTES_BASE", "BODY_BYTES_PER_POSITION", "DEFAULT_MAX_BATCH_TOKENS", "DEFAULT_MAX_QUEUE",
    "DEFAULT_MAX_RUNNING", "EventStream", "FINISH_REASON", "Job", "MAX_INTEGER", "MAX_JSON_DEPTH", "ModelEntry", "ModelServer",
    "PreparedRequest", "RETRY_AFTER_SECONDS", "ServedModels", "announce", "banner", "body_limit", "chat_page_html", "create_app",
    "guarded", "openapi_schema", "parse_body", "read_limited", "request_line", "require_serve_extra", "response_format", "serve",
    "sse",
]
