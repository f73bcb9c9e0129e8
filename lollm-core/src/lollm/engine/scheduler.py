"""The scheduler: which requests run in the next step, and how many of their tokens.

Continuous batching (Yu et al. 2022, "Orca"): the batch is decided again before every
step. A request joins the running batch as soon as there is room and leaves it the
step it finishes, so a short request never waits for a long one to end.

Each step has a **token budget** (``max_batch_tokens``). The running requests come first,
in arrival order: each brings its next decode token, or the next chunk of a prompt it
has not finished (chunked prefill, so one long prompt never stalls everyone's decode
for a whole prefill). The budget left admits waiting requests, first come first
served, while there are blocks for their first chunk and a free sequence slot.

When a running request needs a block and the pool has none, the newest running request
is **preempted by recompute**: its blocks go back to the pool, it returns to the front
of the waiting queue with every token it has so far, and later it is prefilled again
(its own full blocks may still be in the prefix cache then). Its sampler keeps its
state, so the tokens it goes on to produce are those of an uninterrupted run.

A model with a recurrent layer shares a prefix only up to a block that has a
recurrent-state snapshot (:mod:`lollm.engine.snapshots`); the scheduler then ends its
prompt chunks on block boundaries, where the engine can take snapshots.

A model with sliding-window layers keeps their keys in a pool of their own
(``window_pool``, :mod:`lollm.engine.cache`): each request has a second block table
there, and before each step the blocks that left its window (every position before
``computed - W + 1``) go back to that pool. A prefix-cache hit then needs, in that pool,
only the blocks its first step's window reads; the hit is cut back to a length where
they are all still cached.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lollm.engine.blocks import BlockPool, block_hash
from lollm.engine.snapshots import StateSnapshots
from lollm.generate.sequence import Sequence
from lollm.vision.spec import ImageBatch


@dataclass(eq=False)
class Request:
    """One generation inside the engine.

    request_id:   the caller's name for it.
    tokens:       prompt ids, then every token generated so far (the newest is not yet computed).
    prompt_len:   how many of ``tokens`` are the prompt.
    budget:       the most tokens it may generate (max_new_tokens, within the context).
    seq:          its per-request state (:class:`lollm.generate.sequence.Sequence`: sampler, matcher, ids seen,
                  the end-of-sequence ids that end it).
    computed:     how many of ``tokens`` have their keys/values in the cache.
    blocks:       its block table.
    window_table: its block table in the sliding-window layers' pool (as long as ``blocks``;
                  -1 where a block left the window and went back); empty without that pool.
    names:        the prefix-cache names of its full blocks, in order.
    slot:         its row in the recurrent-state storage while it runs.
    cached_tokens: prompt tokens the prefix cache supplied on admission.
    images:       the prompt's images (:class:`lollm.vision.spec.ImageBatch`, embeddings computed once
                  at admission), or None: a prefill chunk never cuts one, and the prefix cache names
                  a block holding image tokens by the images' pixel hashes too.
    """

    request_id: str
    tokens: list[int]
    prompt_len: int
    budget: int
    seq: Sequence
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    window_table: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)
    slot: int | None = None
    cached_tokens: int = 0
    preemptions: int = 0
    arrival: float = 0.0
    first_token_time: float | None = None
    images: ImageBatch | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class Scheduler:
    """Waiting and running queues over one :class:`BlockPool`.

    pool:             the block bookkeeping.
    max_sequences:    the most requests running at once (sequence slots).
    max_batch_tokens: the most tokens in one step (decode tokens + prefill chunks).
    prefix_caching:   reuse named full blocks.
    snapshots:        for a model with recurrent state: the saved states; a prefix is reused
                      only up to a block that has one (None: a model without recurrent state).
    window_pool:      for a model with sliding-window layers: their own block ids, given back
                      as each request's window moves on (None: they share ``pool``'s).
    window:           the largest window W of those layers (with ``window_pool``).
    """

    def __init__(self, pool: BlockPool, *, max_sequences: int, max_batch_tokens: int, prefix_caching: bool,
                 snapshots: StateSnapshots | None = None, window_pool: BlockPool | None = None,
                 window: int | None = None):
        if (window_pool is None) != (window is None):
            raise ValueError("a window pool goes with its window, and a window with its pool")
        self.pool, self.max_sequences, self.max_batch_tokens = pool, max_sequences, max_batch_tokens
        self.prefix_caching, self.snapshots = prefix_caching, snapshots
        self.window_pool, self.window = window_pool, window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_sequences))
        self.cleared_slots: list[int] = []  # slots handed out this step: their state must be zeroed ...
        self.restored_slots: list[tuple[int, bytes]] = []  # ... or set from the snapshot of this name

    def schedule(self) -> list[tuple[Request, int]]:
        """The next step: (request, number of its tokens to run), running requests first."""
        budget, plan = self.max_batch_tokens, []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted a moment ago, to make room for an older one
                continue
            n = self._chunk(req, budget)
            if n == 0:  # an image it must take whole, and the budget left this step is too small
                continue
            if self._make_room(req, req.computed + n):
                plan.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_sequences:
            req = self.waiting[0]
            self._attach_prefix(req)
            n = self._chunk(req, budget)
            if n == 0 or not self._reserve(req, req.computed + n):
                # no blocks for its first chunk: it waits, and so does everyone behind it. It lets go of the
                # cached blocks it took: a waiting request pinning them could starve the running ones
                # (and a recurrent model's snapshot may be gone by its next try). It attaches again then.
                self._release(req)
                break
            self.waiting.popleft()
            req.slot = self.free_slots.pop(0)
            if req.computed and self.snapshots is not None:  # it resumes after a cached prefix
                self.restored_slots.append((req.slot, req.names[-1]))
            else:
                self.cleared_slots.append(req.slot)
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        return plan

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of req's uncomputed tokens run this step: as many as the budget allows.

        A model with recurrent state (``snapshots``) stops a chunk at the last block boundary it
        crosses before the final token: the engine saves the states there, so a later prompt that
        shares this one up to its last token can resume from that boundary (its last token is
        always computed). A decode step (one token) is never cut.
        """
        n = min(len(req.tokens) - req.computed, budget)
        if self.snapshots is not None:
            size = self.pool.block_size
            boundary = min(req.computed + n, len(req.tokens) - 1) // size * size
            if req.computed < boundary < req.computed + n:
                n = boundary - req.computed
        return _whole_images(req, n, budget)

    def _make_room(self, req: Request, positions: int) -> bool:
        """Blocks for ``positions``, preempting the newest running requests if needed; False if ``req`` itself went."""
        while not self._reserve(req, positions):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is req:
                return False
        return True

    def _reserve(self, req: Request, positions: int) -> bool:
        """Grow req's block tables to cover ``positions``; False (nothing taken) when a pool lacks blocks.

        First the window blocks its next step no longer reads go back (:meth:`_leave_window`)."""
        self._leave_window(req)
        needed = -(-positions // self.pool.block_size) - len(req.blocks)
        if needed > self.pool.num_free or (self.window_pool is not None and needed > self.window_pool.num_free):
            return False
        for _ in range(max(needed, 0)):
            req.blocks.append(self.pool.allocate())
            if self.window_pool is not None:
                req.window_table.append(self.window_pool.allocate())
        return True

    def _leave_window(self, req: Request) -> None:
        """Give back req's window blocks before its window: its next query, at ``computed``, reads
        positions from ``computed - W + 1`` on, and so does every later one."""
        if self.window_pool is None:
            return
        i = max(0, req.computed - self.window + 1) // self.pool.block_size - 1
        while i >= 0 and req.window_table[i] >= 0:  # the blocks given back are a prefix: walk back to it
            self.window_pool.release(req.window_table[i])
            req.window_table[i] = -1
            i -= 1

    def _attach_prefix(self, req: Request) -> None:
        """Take every cached full block the request's tokens start with (leaving at least one token to compute)."""
        if not self.prefix_caching or req.blocks:
            return
        size, previous = self.pool.block_size, b""
        for i in range((len(req.tokens) - 1) // size):
            name = block_name(previous, req, i, size)
            block = self.pool.lookup(name)
            if block is None:
                break
            req.blocks.append(block)
            req.names.append(name)
            previous = name
        if self.snapshots is not None:  # recurrent state: back to the deepest block with a snapshot
            while req.names and req.names[-1] not in self.snapshots:
                req.names.pop()
                self.pool.release(req.blocks.pop())
        # back to a length that cuts no image (a forward holds whole images) and whose window blocks are all cached
        while _inside_image(req, len(req.blocks) * size) or not self._attach_window(req):
            req.names.pop()
            self.pool.release(req.blocks.pop())
        req.computed = len(req.blocks) * size
        if req.preemptions == 0:
            req.cached_tokens = req.computed

    def _attach_window(self, req: Request) -> bool:
        """Take, from the window pool, the cached blocks that req's first step reads after its
        prefix of ``len(req.blocks)`` blocks (those before are -1); False (nothing taken) when one is
        gone. True at once without a window pool, or with no prefix."""
        if self.window_pool is None:
            return True
        size, count = self.pool.block_size, len(req.blocks)
        first = max(0, count * size - self.window + 1) // size
        taken: list[int] = []
        for name in req.names[first:count]:
            block = self.window_pool.lookup(name)
            if block is None:
                for got in taken:
                    self.window_pool.release(got)
                return False
            taken.append(block)
        req.window_table = [-1] * first + taken
        return True

    def name_full_blocks(self, req: Request) -> None:
        """Name every block the request has filled since the last call, so later prompts can share it."""
        if not self.prefix_caching:
            return
        size = self.pool.block_size
        for i in range(len(req.names), req.computed // size):
            name = block_name(req.names[-1] if req.names else b"", req, i, size)
            self.pool.name(req.blocks[i], name)
            if self.window_pool is not None and req.window_table[i] >= 0:
                self.window_pool.name(req.window_table[i], name)
            req.names.append(name)

    def _release(self, req: Request) -> None:
        """Give back req's blocks (the last first, so the pool reuses a prompt's tail before its head) and its slot."""
        for block in reversed(req.blocks):
            self.pool.release(block)
        for block in reversed(req.window_table):
            if block >= 0:
                self.window_pool.release(block)
        req.blocks, req.window_table, req.names, req.computed = [], [], [], 0
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    def preempt(self, req: Request) -> None:
        """Stop req for now: free its memory; it waits at the front and is recomputed later."""
        self.running.remove(req)
        self._release(req)
        req.preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """req is done (finished or aborted): free everything it holds, wherever it is."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)


def block_name(previous: bytes, req: Request, i: int, size: int) -> bytes:
    """The prefix-cache name of req's block i: its token ids chained to ``previous``
    (:func:`lollm.engine.blocks.block_hash`), and the pixel hash of every image with a token in it.

    Every image's placeholder ids are the same, so ids alone would let two prompts with different
    images share keys computed from the wrong pixels; with the hashes in the name the same image
    reuses its blocks and a different one never does (and, chained, nor does any block after it).
    """
    lo, hi = i * size, (i + 1) * size
    hashes = [im.pixel_hash for im in (req.images.images if req.images is not None else [])
              if im.start < hi and im.end > lo]
    return block_hash(previous, req.tokens[lo:hi], extra="".join(hashes).encode())


def _inside_image(req: Request, position: int) -> bool:
    """True when ``position`` falls strictly inside one of req's images (a forward starting there would cut it)."""
    return req.images is not None and any(im.start < position < im.end for im in req.images.images)


def _whole_images(req: Request, n: int, budget: int) -> int:
    """A chunk of ``n`` tokens from ``req.computed``, made to hold whole images (Gemma 3's tokens of one
    image attend to each other both ways, so one forward holds them all).

    A chunk that would end inside an image ends before it instead; one that starts at the image
    takes it whole when ``budget`` allows, else 0 (the request waits for a step with room: the
    engine refused at admission an image larger than the whole budget, ``max_batch_tokens``).
    """
    end = req.computed + n
    for im in ([] if req.images is None else req.images.images):
        if im.start < end < im.end:
            if im.start > req.computed:
                return im.start - req.computed
            return im.end - req.computed if im.end - req.computed <= budget else 0
    return n
