"""Several models behind one server: the request's ``model`` picks one; models load on first use, within a budget.

::

    lollm serve A B C --memory-budget 8
                    request {"model": "B", ...}
                                  │
        ServedModels.use("B") ────┤ unknown name ─► 404 naming the models served
                                  │ B loaded ─────► B's ModelServer (its own engine)
                                  │ B not loaded ─► wait for the one load at a time (requests queue, none refused):
                                  │                   unload idle models, least recently used first, until B's
                                  │                   weights fit the budget (wait while the others are busy);
                                  │                   load B (a failure is B's requests' error, not the others')
                                  ▼
                   the request runs on that ModelServer as on a one-model server

Each model is a :class:`ModelEntry`: its name, what the user gave for it, its weights' size
estimated before it loads (:func:`weight_bytes`: every tensor at the dtype it loads in, a GGUF's
packed matrices at their bytes in the file, ``--quantize int8/int4`` matrices at their packed size) and how to load it (a callable that returns a :class:`ModelServer`). The first model
loads when the server starts (:meth:`ServedModels.load_first`); the others on first use.

A model is never unloaded while one of its requests is in flight: from the moment a handler
picks it (:meth:`ServedModels.use`) until its job ends, ``users`` or the server's live jobs
count it. Unloading closes its engine and drops the registry's reference; a stream still
writing its last events keeps the tokenizer it needs.

With one model, requests and answers are those of a one-model server, unchanged: the name is
checked by :meth:`ModelServer.check_model`, ``/metrics`` has no ``model`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from lollm.errors import LollmError
from lollm.serve.guard import check_authorization
from lollm.serve.metrics import metrics_available
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import ApiError, body_limit_rule, parse_body, short_repr

if TYPE_CHECKING:
    from lollm.load.quantized import Quantization

log = logging.getLogger("lollm.serve.server")  # one logger for the whole server (docs/serving.md)

#: Seconds between two looks at whether a busy model has become idle, while a load waits for room.
ROOM_POLL_SECONDS = 0.05
GB = 1e9
#: Seconds an unload waits for the model's engine thread to finish its current step.
ENGINE_STOP_SECONDS = 30.0


def gb(size: int) -> str:
    """``size`` bytes in gigabytes, three significant digits (``"1.23 GB"``)."""
    return f"{size / GB:.3g} GB"


def weight_bytes(weights: object, dtype_bytes: int, packed: bool = False, quantization: Quantization | None = None) -> int:
    """Bytes a checkpoint's weights take once loaded, estimated before the load.

    weights:      a checkpoint's tensor source (``names()``, ``shape(name)``, ``dtype(name)``, ``fmt``: safetensors or GGUF).
    dtype_bytes:  the element size of the dtype it loads in (4 for float32, 2 for bfloat16).
    packed:       the load keeps a GGUF's blocks packed (``--weights auto``, the default for a GGUF: the resolved
                  options' ``quantization.mode == "gguf"``, lollm.load.quantized).
    quantization: the load's :class:`lollm.load.quantized.Quantization`; mode int8 or int4 (``--quantize``) packs a
                  safetensors checkpoint's matrices at load (:func:`quantized_matrix_bytes`).
    A tensor counts its elements times ``dtype_bytes``, except, with ``packed``, a GGUF matrix (2 or more
    dimensions) of a quantized ggml type: it counts its bytes in the file, the size its packed form keeps
    (Q4_K, Q6_K, Q8_0 ... in the file's bits; the load summary names the few it dequantizes instead); and, under
    ``--quantize``, a safetensors matrix counts its packed bytes. Without these a 486 MB Q4 GGUF was estimated at
    2.5 GB of float32, and a safetensors model under ``--quantize int4`` at its float size (5.4 times what the
    tiny Qwen2 of tests/test_serve_models_quantized.py loads in).
    """
    from lollm.gguf.quants import ggml_type

    fmt = getattr(weights, "fmt", None)
    quantize = quantization if quantization is not None and quantization.mode in ("int8", "int4") and fmt != "gguf" else None
    total = 0
    for name in weights.names():
        shape = weights.shape(name)
        elements = math.prod(shape)
        quantized = quantized_matrix_bytes(name, shape, quantize) if quantize is not None else None
        kind = ggml_type(weights.dtype(name)) if packed and fmt == "gguf" else None
        if quantized is not None:
            total += quantized
        elif kind is not None and kind.is_quantized and len(shape) >= 2:
            total += kind.nbytes(elements)
        else:
            total += elements * dtype_bytes
    return total


#: Name pieces of a vision or audio tower's tensors (Gemma 3 ``vision_tower``, ``multi_modal_projector``; Gemma 4
#: ``embed_vision``, ``audio_tower``; Qwen3.5 ``visual``): the decoder's load leaves them, and the tower loads in
#: float on the first image, so ``--quantize`` does not shrink them.
TOWER_MARKS = ("vision", "visual", "audio", "multi_modal")


def quantized_matrix_bytes(name: str, shape: tuple[int, ...], quantization: Quantization) -> int | None:
    """Bytes a safetensors tensor takes packed by ``--quantize`` (``quantization.mode`` int8 or int4), or None
    when it stays float: anything but a 2-D ``*.weight`` matrix of the decoder.

    The families pack their linear and embedding matrices (each family's ``QUANTIZABLE`` pattern in its
    weights.py, which core does not read: a few small 2-D matrices outside it are counted packed too):

    * int8, a ``(rows, cols)`` matrix: one byte per weight and a float32 scale per row
      (lollm.load.packed_linear.Int8Linear, Int8Embedding);
    * int4: half a byte per weight and a bfloat16 scale and zero per group of ``group_size`` (Int4Linear),
      except an embedding (a name holding ``embed``), which stays int8, and a matrix the int4 kernel cannot
      tile (rows not a multiple of 16, columns not of the group size), which falls back to int8
      (lollm.load.quantized.linear_from_float).
    """
    if len(shape) != 2 or not name.endswith(".weight") or any(mark in name for mark in TOWER_MARKS):
        return None
    rows, cols = shape
    int8 = rows * cols + 4 * rows
    group = quantization.group_size
    if quantization.mode == "int8" or "embed" in name or rows % 16 or cols % group:
        return int8
    return rows * cols // 2 + (cols // group) * rows * 2 * 2


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``); False where there is none (not glibc).

    Freed tensors under glibc's mmap threshold go back to the heap, which keeps them for the next
    allocations: after an unload the process's resident memory would stay higher than the models loaded.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # no C library by that name, or one without malloc_trim (musl, macOS)
        return False


@dataclass
class ModelEntry:
    """One model a server may serve.

    name:         the id clients send in ``model`` (and /v1/models lists).
    source:       what the user gave for it (a folder, a .gguf file, a local name, a hub id), for messages.
    weight_bytes: its weights' bytes, estimated before it loads (:func:`weight_bytes`); 0: unknown.
    load:         makes its :class:`ModelServer` (loads the weights); raises on a broken model.
    has_template: whether it has a chat template, read from its tokenizer alone (no weights); None: not known
                  before it loads. A chat request to an unloaded model without one is refused before any
                  load or unload (:meth:`ServedModels.check_chat`).
    images:       whether it may read images (:func:`lollm.serve.images.reads_images`, known before it loads):
                  its body limit has room for them, and /v1/models says ``vision``.
    """

    name: str
    source: str
    weight_bytes: int
    load: Callable[[], ModelServer]
    has_template: Callable[[], bool] | None = None
    images: bool = False
    server: ModelServer | None = None
    chat: bool | None = None  # has_template's answer, once asked (None: not asked yet, or unknown)
    error: str | None = None  # why its load failed (kept: its requests get it until the server restarts)
    resident_bytes: int = 0  # its weights' bytes while loaded, measured (lollm.load.quantized.model_bytes)
    last_used: float = 0.0  # time.monotonic() of its last request's start or end
    users: int = 0  # requests that picked it and have not finished their handler
    loads: int = 0  # how many times it was loaded
    waiting: int = 0  # requests waiting for it to load
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' "created": when it was listed


class ServedModels:
    """The models of one server by name, who is loaded, and the memory budget (:mod:`lollm.serve.models`).

    entries:        the models, in the order given; the first is the default (chat page, banner).
    budget_bytes:   the most bytes of weights loaded at once (None: no budget, nothing is unloaded).
    api_key:        when set, every /v1 request must show it (:func:`lollm.serve.guard.check_authorization`).
    max_body_bytes: the largest request body read before the model is known, the largest of the models' limits
                    (each model then checks its own: :attr:`ModelServer.max_body_bytes`).
    Raises LollmError on a name given twice, or a model whose weights alone exceed the budget.
    """

    def __init__(self, entries: list[ModelEntry], *, budget_bytes: int | None = None, api_key: str | None = None,
                 max_body_bytes: int):
        if not entries:
            raise LollmError("no model to serve")
        self.entries: dict[str, ModelEntry] = {}
        for entry in entries:
            if entry.name in self.entries:
                raise LollmError(f"two models are named {entry.name!r}: {self.entries[entry.name].source} and "
                                 f"{entry.source}; rename a folder or file (the name is its last part, without .gguf)")
            if budget_bytes is not None and entry.weight_bytes > budget_bytes:
                raise LollmError(f"--memory-budget {gb(budget_bytes)}: the model {entry.name!r} ({entry.source}) "
                                 f"alone needs about {gb(entry.weight_bytes)} of weights; raise the budget")
            self.entries[entry.name] = entry
        self.budget_bytes, self.api_key, self.max_body_bytes = budget_bytes, api_key, max_body_bytes
        #: what max_body_bytes is made of, for its 413: with room for images when a model reads them
        self.body_rule = body_limit_rule(any(e.images for e in entries))
        self.closing = False
        self._loading: asyncio.Lock | None = None  # one load at a time (made on the event loop, on first use)

    @classmethod
    def one(cls, server: ModelServer) -> ServedModels:
        """A server of one model, loaded already: its name, key and body limit (never unloaded: no budget)."""
        entry = ModelEntry(server.name, server.name, 0, load=lambda: server, server=server, loads=1, created=server.created,
                           images=server.reads_images)
        return cls([entry], api_key=server.api_key, max_body_bytes=server.max_body_bytes)

    # -- which model ----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.entries)

    @property
    def first(self) -> ModelEntry:
        return next(iter(self.entries.values()))

    def loaded(self) -> list[ModelServer]:
        return [e.server for e in self.entries.values() if e.server is not None]

    def check_auth(self, authorization: str | None, *, x_api_key: bool = False) -> None:
        """ApiError 401 unless ``authorization`` is ``Bearer <api_key>`` (nothing without a key); ``x_api_key``: the
        endpoint also takes ``x-api-key`` (:func:`lollm.serve.guard.check_authorization`)."""
        check_authorization(authorization, self.api_key, x_api_key=x_api_key)

    def served_list(self) -> str:
        return ", ".join(repr(name) for name in self.entries)

    def entry_for(self, raw: bytes) -> ModelEntry:
        """The model a request body names in ``model`` (in a thread: it parses the JSON).

        One model: it, whatever the body says (its ModelServer checks the name, as a one-model server does).
        ApiError 400 when ``model`` is missing, 404 naming the models served when it names none of them.
        """
        if len(self.entries) == 1:
            return self.first
        name = parse_body(raw).get("model")
        if name is None:
            raise ApiError(400, f"the request has no 'model': name one of the models this server serves, "
                                f"{self.served_list()}", param="model", code="missing_required_parameter")
        if not isinstance(name, str) or name not in self.entries:
            raise ApiError(404, f"the model {short_repr(name)} does not exist here; this server serves "
                                f"{self.served_list()} (GET /v1/models lists them)", param="model", code="model_not_found")
        return self.entries[name]

    # -- using a model, loading it, unloading others ---------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, raw: bytes, chat: str | None = None) -> AsyncIterator[ModelServer]:
        """The ModelServer of the model ``raw`` names, loaded (after a wait in the queue) and held while inside.

        chat: the request's conversation field (``"messages"``, ``"input"``) when it needs a chat template:
        a model known to have none is then refused before it loads (:meth:`check_chat`), evicting nothing.
        ApiError 400/404 for a missing or unknown name (:meth:`entry_for`, its JSON parsed off the event loop),
        500 ``model_load_failed`` naming the model and the cause when its load failed, 503 when the server
        shuts down while the request waits for room.
        """
        entry = self.first if len(self.entries) == 1 else await asyncio.to_thread(self.entry_for, raw)
        if chat is not None and entry.server is None:
            await asyncio.to_thread(self.check_chat, entry, chat)
        entry.users += 1
        entry.last_used = time.monotonic()
        try:
            yield await self._ready(entry)
        finally:
            entry.users -= 1
            entry.last_used = time.monotonic()

    def can_chat(self, entry: ModelEntry) -> bool | None:
        """Whether ``entry`` has a chat template (its tokenizer, read once; None: not known). Blocking: in a thread."""
        if entry.server is not None:
            return entry.server.tokenizer.chat_template is not None
        if entry.chat is None and entry.has_template is not None and entry.error is None:
            try:
                entry.chat = bool(entry.has_template())
            except Exception:  # a broken tokenizer: its load says so, with the file and the cause
                entry.chat = None
        return entry.chat

    def check_chat(self, entry: ModelEntry, field: str) -> None:
        """ApiError 400 naming ``field`` when ``entry`` is known to have no chat template (before it loads)."""
        if self.can_chat(entry) is False:
            raise ApiError(400, f"the model {entry.name!r} has no chat template; use /v1/completions with a plain "
                                f"prompt", param=field)

    async def _ready(self, entry: ModelEntry) -> ModelServer:
        """``entry``'s server, loading it first if needed (one load at a time, the others' requests go on)."""
        if entry.server is None and entry.error is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            entry.waiting += 1
            try:
                async with self._loading:
                    if entry.server is None and entry.error is None:
                        await self._make_room(entry)
                        await self._load(entry)
            finally:
                entry.waiting -= 1
        if entry.error is not None:
            raise ApiError(500, f"the model {entry.name!r} ({entry.source}) failed to load: {entry.error}; the other "
                                f"models still answer (fix it and restart the server)", kind="server_error",
                           code="model_load_failed")
        return entry.server

    async def _load(self, entry: ModelEntry) -> None:
        """Load ``entry`` in a thread (the event loop goes on serving); a failure is kept in ``entry.error``."""
        from lollm.load.quantized import model_bytes

        started = time.monotonic()
        log.info("loading %s (%s, about %s of weights)", entry.name, entry.source, gb(entry.weight_bytes))
        try:
            server = await asyncio.to_thread(entry.load)
        except Exception as error:  # the model's own failure: its requests are told, the server goes on
            entry.error = f"{type(error).__name__}: {error}" if not isinstance(error, LollmError) else str(error)
            log.info("model %s failed to load: %s", entry.name, entry.error)
            return
        entry.server, entry.loads = server, entry.loads + 1
        entry.resident_bytes = model_bytes(server.model) or entry.weight_bytes
        if self.closing:
            server.begin_shutdown()
        log.info("loaded %s in %.1f s (%s of weights)", entry.name, time.monotonic() - started, gb(entry.resident_bytes))

    def resident_bytes(self) -> int:
        return sum(e.resident_bytes for e in self.entries.values() if e.server is not None)

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload idle models, least recently used first, until ``entry``'s weights fit the budget.

        A model with a request in flight is never unloaded: while only busy ones are left, wait for one
        to become idle. ApiError 503 when the server starts shutting down meanwhile.
        """
        while self.budget_bytes is not None and self.resident_bytes() + entry.weight_bytes > self.budget_bytes:
            idle = [e for e in self.entries.values()
                    if e.server is not None and e.users == 0 and e.server.live_jobs() == 0]
            if idle:
                victim = min(idle, key=lambda e: e.last_used)  # a thread: the wait for its engine thread to end
                await asyncio.to_thread(self.unload, victim, f"to make room for {entry.name}")
                continue
            if self.closing:
                raise ApiError(503, "the server is shutting down", kind="server_error", code="server_shutting_down")
            await asyncio.sleep(ROOM_POLL_SECONDS)

    def unload(self, entry: ModelEntry, why: str) -> None:
        """Close ``entry``'s engine and let its memory go (it loads again on its next request). Blocking (up to
        :data:`ENGINE_STOP_SECONDS`): call it in a thread.

        The model, its engine and its ModelServer refer to each other (the engine loop reports to the server),
        so only the cycle collector frees them, and only once the engine thread, which holds the loop, has
        ended: the thread is waited for, then ``gc.collect()`` runs. (Collected before the thread ended, the
        cycle stayed until some later collection: its memory was never seen to go, issue 40.)
        """
        server, entry.server = entry.server, None
        server.close()
        thread = getattr(server.engine_loop, "thread", None)
        if thread is not None:
            thread.join(ENGINE_STOP_SECONDS)  # it ends after its current step
            if thread.is_alive():
                log.info("%s: its engine thread is still in a step after %s s; its memory goes when it ends",
                         entry.name, ENGINE_STOP_SECONDS)
        freed, entry.resident_bytes = entry.resident_bytes, 0
        del server, thread
        gc.collect()
        trim_heap()
        log.info("unloaded %s (least recently used, %s) %s; --memory-budget %s", entry.name, gb(freed), why,
                 gb(self.budget_bytes or 0))

    def load_first(self) -> ModelServer:
        """Load the first model now, outside the event loop (the server's start); LollmError when it fails."""
        entry = self.first
        if entry.server is None:
            entry.server, entry.loads = entry.load(), entry.loads + 1
            from lollm.load.quantized import model_bytes

            entry.resident_bytes = model_bytes(entry.server.model) or entry.weight_bytes
        entry.last_used = time.monotonic()
        return entry.server

    # -- what the server tells: /v1/models, /health, /metrics --------------------------------------
    def listing(self) -> list[dict[str, object]]:
        """``/v1/models``' ``data``: every model, with lollm's extension fields ``loaded``, ``chat`` (it has a
        chat template: false means Completions only; null: not known before it loads) and ``vision`` (it may
        read images: :func:`lollm.serve.images.reads_images`). Blocking: in a thread."""
        return [{"id": e.name, "object": "model", "created": e.created, "owned_by": "lollm",
                 "loaded": e.server is not None, "chat": self.can_chat(e), "vision": e.images}
                for e in self.entries.values()]

    def render_metrics(self) -> bytes:
        """Prometheus' text of every loaded model: one model as it is; several, each series labelled ``model``."""
        from lollm.serve.metrics import labelled_by_model

        servers = {e.name: e.server for e in self.entries.values() if e.server is not None and e.server.metrics}
        if len(self.entries) == 1 and servers:
            return next(iter(servers.values())).metrics.render()
        return labelled_by_model({name: server.metrics for name, server in servers.items()})

    # -- shutdown (lollm.serve.shutdown): every loaded model's requests --------------------------------
    def begin_shutdown(self) -> int:
        self.closing = True
        return sum(server.begin_shutdown() for server in self.loaded())

    def live_jobs(self) -> int:
        return sum(server.live_jobs() for server in self.loaded())

    def stop_all(self) -> int:
        return sum(server.stop_all() for server in self.loaded())

    def close(self) -> None:
        for server in self.loaded():
            server.close()


def check_metrics_available() -> None:
    """ApiError 501 naming the extra when prometheus-client is missing."""
    if not metrics_available():
        raise ApiError(501, "/metrics needs prometheus-client: pip install 'lollm-core[serve]'", kind="server_error")
