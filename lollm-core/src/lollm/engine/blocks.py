"""The block pool: KV memory in fixed-size blocks, shared by every sequence, with prefix caching.

A sequence's keys and values do not sit in one contiguous tensor sized for the
longest possible sequence (the single-sequence caches do that). They sit in
blocks of ``block_size`` positions taken from one pool as the sequence grows, and
its **block table** lists them in order (Kwon et al. 2023, "PagedAttention", the
paper behind vLLM)::

    pool:   [ b0 | b1 | b2 | b3 | b4 | b5 | b6 | ... ]      each block: block_size positions
    seq A:  table [b3, b0, b5]   positions 0-15 in b3, 16-31 in b0, 32-40 in b5
    seq B:  table [b3, b1]       shares b3 with A: the same first 16 prompt tokens

No memory is reserved for tokens a request may never produce, and a finished
request's blocks go straight back to the pool.

**Prefix caching.** A block full of tokens is named by a hash of its tokens chained
with the hash of the block before it, so the name says "these 16 tokens, after
exactly that prefix". When a new request's prompt starts with blocks already
named in the pool, it takes them (their reference count goes up) and skips
computing them. A block whose count falls to 0 is free, but keeps its name and
contents until the pool hands it out again: the least recently freed goes first
(LRU), so a popular system prompt stays cached while memory allows. This is the
scheme of vLLM's automatic prefix caching and nano-vllm; SGLang keeps a radix tree
instead.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from lollm.errors import GenerationError


def block_hash(previous: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """The name of a full block: sha256 of the previous block's name, this block's token ids and ``extra``
    (the pixel hashes of the images whose tokens it holds: :func:`lollm.engine.scheduler.block_name`).

    Chaining makes the name cover the whole prefix, so two blocks with the same 16
    tokens after different prefixes never share keys (their keys differ: attention
    and RoPE saw different pasts). sha256 rather than Python's ``hash``: a collision
    would hand a request another prompt's keys, silently.
    """
    digest = hashlib.sha256(previous)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    if extra:
        digest.update(b"images:" + extra)
    return digest.digest()


class BlockPool:
    """Block ids ``0 .. num_blocks-1``: who uses each (a reference count), which are free, which carry a name.

    Pure bookkeeping: the tensors live in :class:`lollm.engine.cache.KVPool`.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise GenerationError(f"a block pool needs at least one block of at least one position, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # least recently freed first
        self.name_of: dict[int, bytes] = {}  # block -> its name, for full blocks
        self.by_name: dict[bytes, int] = {}  # name -> block

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self) -> int:
        """A free block for new positions (the least recently freed); its old name, if any, is forgotten."""
        if not self.free:
            raise GenerationError("the KV block pool is empty")  # the scheduler checks num_free first
        block, _ = self.free.popitem(last=False)
        name = self.name_of.pop(block, None)
        if name is not None:
            del self.by_name[name]
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        """One user fewer; at 0 the block is free again (its name and contents stay until it is reused)."""
        if self.refs[block] <= 0:
            raise GenerationError(f"block {block} released more often than taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def lookup(self, name: bytes) -> int | None:
        """The cached block with this name, taken (reference count + 1), or None."""
        block = self.by_name.get(name)
        if block is None:
            return None
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1
        return block

    def name(self, block: int, name: bytes) -> None:
        """Record that ``block`` is full and holds the prefix named ``name`` (first writer wins)."""
        if name in self.by_name or block in self.name_of:
            return
        self.name_of[block] = name
        self.by_name[name] = block
