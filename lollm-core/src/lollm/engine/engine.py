"""The engine: many requests, one batched forward per step.

::

    engine = Engine(model)
    engine.add_request("a", prompt_ids, sampling=SamplingParams(temperature=0), max_new_tokens=64)
    while engine.has_unfinished():
        for out in engine.step():          # one scheduler iteration, one forward
            print(out.request_id, out.step.token, out.step.finish)

Each :meth:`Engine.step` is the whole lesson in four moves:

1. the scheduler (:mod:`lollm.engine.scheduler`) picks the requests and how many of their
   tokens run: decode tokens and prefill chunks together, within the token budget;
2. their tokens are laid end to end, a :class:`lollm.batch.Batch` says where each sits,
   and the model runs **one** forward over all of them, with a
   :class:`lollm.engine.cache.PagedCache` over the block pool as its cache;
3. each request whose tokens are all computed gets its next token from its own row of
   logits, through its own sampler (temperature, top-k/p, min-p, repetition penalty,
   seed, logprobs and a grammar mask are per request: the same ``choose`` as the
   single-sequence loop, so a request samples exactly as it would alone);
4. finished requests (an end-of-sequence id, their token budget, the context) leave and
   their blocks go back to the pool; new full blocks are named for the prefix cache (and
   the sliding-window layers' blocks that left every window went back before the step).

A request may carry images (``add_request(..., images=ImageBatch)``, docs/vision.md section 6): its
prefill chunks never cut one, the forward of a step holding image positions gets each sequence's
images, and the prefix cache names image blocks by their pixels (:func:`lollm.engine.scheduler.block_name`).

The single-sequence loop (:mod:`lollm.generate.loop`) stays the reference: the tests hold every
request's greedy tokens to those of the same request run alone.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from lollm.batch import Batch
from lollm.engine.blocks import BlockPool
from lollm.engine.cache import KVPool, PagedCache, largest_window, model_dtype, pool_blocks, window_blocks_per_sequence
from lollm.engine.scheduler import Request, Scheduler
from lollm.engine.snapshots import StateSnapshots
from lollm.errors import GenerationError
from lollm.generate.sequence import Sequence, Step, check_request
from lollm.generate.structured import CompiledConstraint
from lollm.model import CausalLM
from lollm.sampling_params import SamplingParams
from lollm.vision.spec import ImageBatch

#: Positions per KV block (vLLM's default). Smaller blocks waste less of a sequence's last
#: block and share prefixes at a finer grain; larger ones mean shorter block tables.
BLOCK_SIZE = 16
#: Positions per sequence the default pool leaves room for, at most (``lollm serve`` keeps to it too).
DEFAULT_POSITIONS_PER_SEQUENCE = 2048


@dataclass
class EngineOutput:
    """One new token of one request, as :meth:`Engine.step` returns it.

    request_id: the request's name.
    step:       the token (:class:`lollm.generate.sequence.Step`: token, logprobs, time, finish);
                ``step.finish`` is None, or why the request ended (a
                :class:`~lollm.generate.sequence.StopReason`): EOS (an id of ``stop_ids``),
                MAX_NEW_TOKENS or CONTEXT.
    """

    request_id: str
    step: Step

    @property
    def finished(self) -> bool:
        return self.step.finish is not None


@dataclass(frozen=True)
class EngineConfig:
    """The engine's sizes.

    kv_blocks:        blocks in the pool (None: room for ``max_sequences`` x 2048 positions,
                      at most half the device's free memory: :func:`~lollm.engine.cache.pool_blocks`). A model with sliding-window layers
                      gets a second pool for them, of ``max_sequences`` x
                      :func:`~lollm.engine.cache.window_blocks_per_sequence` blocks at most
                      (never more than ``kv_blocks``): their blocks go back as windows move on.
    block_size:       positions per block.
    max_sequences:    the most requests running at once.
    max_batch_tokens: the most tokens in one forward (decode tokens + prefill chunks).
    prefix_caching:   share full prompt blocks between requests.
    state_snapshots:  for a model with a recurrent layer: how many recurrent-state snapshots
                      (lollm.engine.snapshots) to keep, the points where a prefix can be shared
                      (0: such a model shares none).
    """

    kv_blocks: int | None = None
    block_size: int = BLOCK_SIZE
    max_sequences: int = 64
    max_batch_tokens: int = 256
    prefix_caching: bool = True
    state_snapshots: int = 8


def _pool_blocks(model: CausalLM, config: EngineConfig) -> int:
    """How many blocks the pool gets: the configured number, or the default of :class:`EngineConfig`
    (:func:`~lollm.engine.cache.pool_blocks` for ``max_sequences`` requests of ``DEFAULT_POSITIONS_PER_SEQUENCE``)."""
    if config.kv_blocks is not None:
        if config.kv_blocks < 1:
            raise GenerationError(f"kv_blocks must be >= 1, got {config.kv_blocks}")
        return config.kv_blocks
    positions = [min(DEFAULT_POSITIONS_PER_SEQUENCE, model.max_context)] * config.max_sequences
    return pool_blocks(model, positions, block_size=config.block_size, max_running=config.max_sequences)


def why_not_batched(model: CausalLM, *, tp: object = None, speculative: str | None = None,
                    family: str | None = None) -> str | None:
    """Why requests on ``model`` must run one at a time through the single-sequence loop (None: the engine can run them).

    tp:          the model's tensor-parallel group (``LoadedModel.tp``), None on one process;
    speculative: the flag that asks for speculative decoding (``"--mtp"``, ``"--prompt-lookup"``), None: none;
    family:      the family's name, for the message (None: the model's class name).

    The one answer ``lollm run``, ``lollm.LLM``, ``bench --concurrency`` and :class:`Engine` itself give.
    """
    if tp is not None:
        return "a model split over ranks (--tp) runs one prompt at a time: the engine does not split a model yet"
    if speculative is not None:
        return f"{speculative} decodes speculatively, which the engine does not: one prompt at a time"
    if not hasattr(model, "cache_layers"):
        return (f"the {family or type(model).__name__} family cannot run batched (its model has no cache_layers()): "
                f"one prompt at a time through the single-sequence loop")
    return None


class Engine:
    """Continuous batching over one model: :meth:`add_request`, :meth:`step`, :meth:`abort`.

    ``model`` must offer ``cache_layers()`` (:class:`lollm.batch.CacheLayer` per cache layer)
    and a forward that accepts a :class:`PagedCache` (every family shipped with lollm does).
    :meth:`add_request` and :meth:`abort` may be called from any thread; :meth:`step` from
    one thread at a time (the server runs it in a worker thread).
    """

    def __init__(self, model: CausalLM, config: EngineConfig = EngineConfig()):
        refusal = why_not_batched(model)
        if refusal is not None:
            raise GenerationError(refusal)
        self.model, self.config = model, config
        self.device = next(model.parameters()).device
        dtype = model_dtype(model)
        layers = model.cache_layers()
        num_blocks = _pool_blocks(model, config)
        self.window = largest_window(layers)
        window_blocks = None if self.window is None else min(
            num_blocks, config.max_sequences * window_blocks_per_sequence(self.window, config.block_size, config.max_batch_tokens))
        self.kv = KVPool(layers, num_blocks, config.block_size, config.max_sequences, device=self.device, dtype=dtype,
                         num_window_blocks=window_blocks)
        recurrent_sharing = config.prefix_caching and self.kv.recurrent and config.state_snapshots > 0
        self.snapshots = StateSnapshots(config.state_snapshots) if recurrent_sharing else None
        self.scheduler = Scheduler(BlockPool(num_blocks, config.block_size), max_sequences=config.max_sequences,
                                   max_batch_tokens=config.max_batch_tokens,
                                   prefix_caching=config.prefix_caching and (recurrent_sharing or not self.kv.recurrent),
                                   snapshots=self.snapshots,
                                   window_pool=None if window_blocks is None else BlockPool(window_blocks, config.block_size),
                                   window=self.window)
        self.requests: dict[str, Request] = {}
        self._inbox: deque[Request] = deque()
        self._aborts: deque[str] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()

    @property
    def capacity(self) -> int:
        """Positions the whole pool holds."""
        return self.kv.num_blocks * self.config.block_size

    def add_request(self, prompt_ids: list[int], *, sampling: SamplingParams, max_new_tokens: int,
                    request_id: str | None = None, stop_ids: frozenset[int] | set[int] = frozenset(),
                    logprobs: int | None = None, constraint: CompiledConstraint | None = None,
                    images: ImageBatch | None = None) -> str:
        """Queue a request; it joins the running batch at a coming step. Returns its id.

        images: the prompt's images, placed and encoded (:func:`lollm.vision.load.prepare_prompt`: the
        tower ran once, before this call); each forward that holds some of its image positions gets them.

        Raises GenerationError for what :func:`lollm.generate.sequence.check_request` refuses (an empty
        prompt, ``max_new_tokens < 1``, a prompt that fills the context, ids outside the vocabulary, a
        constraint for another vocabulary), a request that could not fit the whole pool even alone, a
        duplicate id, and images the engine cannot run (:meth:`_check_images`).
        """
        budget = check_request(self.model, prompt_ids, max_new_tokens, constraint=constraint)
        self._check_images(images, len(prompt_ids))
        if len(prompt_ids) + budget > self.capacity:
            raise GenerationError(f"a request of {len(prompt_ids)} prompt + {budget} new tokens cannot fit the KV pool "
                                  f"({self.capacity} positions): give the engine more blocks (kv_blocks) or ask for fewer tokens")
        seq = Sequence(self.model, prompt_ids, sampling, budget=budget, context=self.model.max_context, logprobs=logprobs,
                       constraint=constraint, stop_ids=frozenset(stop_ids))
        with self._lock:
            request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
            if request_id in self.requests:
                raise GenerationError(f"a request named {request_id!r} is already in the engine")
            req = Request(request_id, list(prompt_ids), len(prompt_ids), budget, seq,
                          arrival=time.perf_counter(), images=images if images is not None and images.images else None)
            self.requests[request_id] = req
            self._inbox.append(req)
        return request_id

    def _check_images(self, images: ImageBatch | None, prompt_len: int) -> None:
        """GenerationError unless the engine can run these images: a decoder that takes images in an engine
        step (``batches_images``), each image inside the prompt and no larger than ``max_batch_tokens``
        (one forward holds a whole image, and a step holds at most that many tokens)."""
        if images is None or not images.images:
            return
        if not getattr(self.model, "batches_images", False):
            raise GenerationError(f"the {type(self.model).__name__} decoder does not take images in an engine step "
                                  "(batches_images): run the prompt alone (lollm run --image)")
        for number, im in enumerate(images.images, 1):
            if im.start < 0 or im.end > prompt_len:
                raise GenerationError(f"image {number} sits at positions {im.start}..{im.end - 1}, outside the "
                                      f"prompt of {prompt_len} tokens")
            if im.end - im.start > self.config.max_batch_tokens:
                raise GenerationError(f"image {number} takes {im.end - im.start} tokens, more than the engine's "
                                      f"max_batch_tokens ({self.config.max_batch_tokens}): one step must hold a "
                                      "whole image; raise max_batch_tokens")

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away): its blocks return to the pool at the next step."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[EngineOutput]:
        """One scheduler iteration and one forward; the new token of every request that got one."""
        self._take_inbox()
        plan = self.scheduler.schedule()
        for slot in self.scheduler.cleared_slots:
            self.kv.clear_state(slot)
        for slot, name in self.scheduler.restored_slots:  # a recurrent model resuming after a cached prefix
            self.snapshots.restore(name, self.kv.slot_states(slot))
        self.scheduler.cleared_slots.clear()
        self.scheduler.restored_slots.clear()
        if not plan:
            return []
        logits = self._forward(plan)  # (B, V)
        rows = []
        for b, (req, n) in enumerate(plan):
            req.computed += n
            self.scheduler.name_full_blocks(req)
            self._snapshot(req)
            if req.computed == len(req.tokens):  # else a prefill chunk with more to come: nothing to sample yet
                rows.append(b)
        picks = self._greedy_picks(plan, logits, rows)
        return [EngineOutput(plan[b][0].request_id, self._choose(plan[b][0], logits[b], picks.get(b))) for b in rows]

    def _snapshot(self, req: Request) -> None:
        """A recurrent model's request whose computed tokens end on a named block: save its states there."""
        size = self.config.block_size
        if self.snapshots is not None and req.computed % size == 0 and len(req.names) == req.computed // size > 0:
            self.snapshots.save(req.names[-1], self.kv.slot_states(req.slot))

    @staticmethod
    def _greedy_picks(plan: list[tuple[Request, int]], logits: torch.Tensor, rows: list[int]) -> dict[int, int]:
        """The argmax of every plain greedy row at once (no penalty, grammar or logprobs): row -> token.

        The other rows go through their request's own sampler one by one: a seeded request must draw
        from its own generator, in its own order, to give exactly the tokens it gives alone.
        """
        plain = [b for b in rows if plan[b][0].seq.plain_greedy]
        if not plain:
            return {}
        picked = logits if plain == list(range(logits.shape[0])) else logits[plain]  # (G, V)
        # A row's sum is finite only if every logit in it is (a sum too large for float32 would
        # also refuse, and then the samplers decide): one pass over the logits, not four.
        if not bool(torch.isfinite(picked.sum(dim=-1, dtype=torch.float32)).all()):
            return {}  # let each sampler name the problem
        # max(dim) gives argmax's index (the first of equal maxima) at a third of its time on a CPU
        return dict(zip(plain, picked.max(dim=-1).indices.tolist()))

    def _take_inbox(self) -> None:
        """Move new requests to the waiting queue and drop aborted ones (between steps, on the stepping thread)."""
        with self._lock:
            while self._inbox:
                self.scheduler.waiting.append(self._inbox.popleft())
            while self._aborts:
                req = self.requests.pop(self._aborts.popleft(), None)
                if req is not None:
                    self.scheduler.finish(req)

    @torch.inference_mode()
    def _forward(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        """One forward over the planned tokens, end to end; the logits of each request's last row, (B, V)."""
        windowed = self.scheduler.window_pool is not None
        batch = Batch(starts=[req.computed for req, _ in plan], counts=[n for _, n in plan],
                      block_tables=[req.blocks for req, _ in plan], block_size=self.config.block_size,
                      state_slots=[req.slot for req, _ in plan],
                      window_tables=[req.window_table for req, _ in plan] if windowed else None,
                      window=self.window if windowed else None)
        ids = [t for req, n in plan for t in req.tokens[req.computed : req.computed + n]]
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, N)
        # images: one ImageBatch or None per sequence (lollm.vision.step), given in every step where some
        # sequence has images, its decode steps too: a decoder whose positions depend on earlier images
        # (Qwen3.5's M-RoPE) needs them; one that does not reads only the images inside the step's rows
        images = [req.images for req, _ in plan]
        extra = {"images": images} if any(im is not None for im in images) else {}
        return self.model(input_ids, PagedCache(self.kv, batch), logits_to_keep=batch.last_rows, **extra)[0]  # (B, V)

    def _choose(self, req: Request, logits_row: torch.Tensor, greedy_pick: int | None) -> Step:
        """The request's next token from its row (by its own sampler, unless the batch's argmax already
        picked it); the finish reason when it ends."""
        step = req.seq.check(req.seq.choose(logits_row, pick=greedy_pick))  # finish: EOS, MAX_NEW_TOKENS or CONTEXT
        req.tokens.append(step.token)
        if req.first_token_time is None:
            req.first_token_time = step.time
        if step.finish is not None:
            with self._lock:
                self.requests.pop(req.request_id, None)
            self.scheduler.finish(req)
        return step

    def stats(self) -> dict[str, int]:
        """running / waiting requests, KV blocks used / total (for /metrics and the bench); with sliding-window
        layers also their own pool's blocks used / total."""
        pool, window_pool = self.scheduler.pool, self.scheduler.window_pool
        out = {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting) + len(self._inbox),
               "kv_blocks_used": pool.num_used, "kv_blocks_total": pool.num_blocks}
        if window_pool is not None:
            out |= {"kv_window_blocks_used": window_pool.num_used, "kv_window_blocks_total": window_pool.num_blocks}
        return out
