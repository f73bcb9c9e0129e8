"""The engine's KV memory: one pool of blocks per attention layer, one state slot per sequence.

:class:`KVPool` holds the tensors, sized once from the model's ``cache_layers()``
(:class:`lollm.batch.CacheLayer`)::

    full / sliding layer:  k, v (num_blocks, block_size, K, D)     the paged keys and values
    recurrent layer:       one tensor per state, (max_sequences, *shape)   a row per sequence slot
    shared layer:          nothing (it reads the keys of an earlier layer)

:class:`PagedCache` is what a family's forward receives in an engine step, in place
of its own cache. It offers the same three calls the forward already makes, plus one
for recurrent layers:

* ``length``: the step's :class:`lollm.batch.Batch` (each sequence's own length);
* ``update(layer, k, v)``: writes the N new keys/values into their pool slots and
  returns the layer's whole pool, which :func:`lollm.attention.attend` reads through
  the block tables;
* ``check_room(T)`` / ``advance(T)``: room was made by the scheduler before the step,
  and each sequence's length is the engine's to advance;
* ``state(layer, b)``: sequence b's recurrent state tensors (views: update them in place).

**Sliding-window layers have a pool of their own.** Their attention reads only the last
W positions, so the blocks before a sequence's window are never read again: the
scheduler gives them back as the sequence moves on (``Request.window_table``, -1 for a
block given back), while the full layers keep every block. The two kinds therefore
need two block tables per sequence and two pools of block ids, so that a sliding
layer's released block costs nothing in the full layers' tensors::

    full layers:     k, v (num_blocks, ...)          seq A: block_table  [b3, b0, b5, b7]
    sliding layers:  k, v (num_window_blocks, ...)   seq A: window_table [-1, -1, w2, w0]

A sequence holds at most ``window_blocks_per_sequence`` window blocks however long it
grows: 49 for a window of 512, blocks of 16 and steps of 256 tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from lollm.batch import Batch, CacheLayer
from lollm.errors import GenerationError
from lollm.generate import memory  # memory.free_memory looked up per call (tests replace it)
from lollm.model import CausalLM


def largest_window(layers: list[CacheLayer]) -> int | None:
    """The largest window of the sliding-window layers (None: the model has none)."""
    windows = [spec.window for spec in layers if spec.kind == "sliding"]
    return max(windows) if windows else None


def window_blocks_per_sequence(window: int, block_size: int, max_batch_tokens: int) -> int:
    """The most window blocks one sequence holds at once: a step of up to ``max_batch_tokens`` new
    tokens reads the W - 1 positions before its first one, and those may straddle one more block."""
    return -(-(window - 1 + max_batch_tokens) // block_size) + 1


class KVPool:
    """The engine's cache tensors for ``num_blocks`` blocks and ``max_sequences`` state slots.

    ``num_window_blocks``: the sliding-window layers' own pool (None: they share ``num_blocks``
    ids with the full layers, and no block is released early).
    """

    def __init__(self, layers: list[CacheLayer], num_blocks: int, block_size: int, max_sequences: int, *,
                 device: torch.device | str, dtype: torch.dtype, num_window_blocks: int | None = None):
        self.layers, self.num_blocks, self.block_size = list(layers), num_blocks, block_size
        self.num_window_blocks = num_window_blocks
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.states: list[dict[str, torch.Tensor]] = []
        for spec in self.layers:
            windowed = spec.kind == "sliding" and num_window_blocks is not None
            shape = (num_window_blocks if windowed else num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            self.k.append(torch.zeros(shape, device=device, dtype=dtype) if spec.stores_keys else None)
            self.v.append(torch.zeros(shape, device=device, dtype=dtype) if spec.stores_keys else None)
            self.states.append({name: torch.zeros((max_sequences, *dims), device=device, dtype=spec.state_dtype or dtype)
                                for name, dims in spec.state.items()})

    @property
    def recurrent(self) -> bool:
        """True when some layer keeps a recurrent state (prefix blocks alone cannot restore it)."""
        return any(spec.kind == "recurrent" for spec in self.layers)

    def slot_states(self, slot: int) -> list[dict[str, torch.Tensor]]:
        """Every layer's recurrent states of sequence slot ``slot``: views (a snapshot copies them, a restore writes them)."""
        return [{name: tensor[slot] for name, tensor in states.items()} for states in self.states]

    def clear_state(self, slot: int) -> None:
        """Zero sequence slot ``slot``'s recurrent states (a new sequence starts from zero)."""
        for states in self.states:
            for tensor in states.values():
                tensor[slot].zero_()


def block_bytes(layers: list[CacheLayer], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers: 2 (K and V) x block_size x K x D x element size, summed."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * spec.num_kv_heads * spec.head_dim * size for spec in layers if spec.stores_keys)


def model_dtype(model: CausalLM) -> torch.dtype:
    """The dtype of the model's activations: that of its first floating-point parameter (the pool's dtype)."""
    for p in itertools.chain(model.parameters(), model.buffers()):
        if p.is_floating_point():
            return p.dtype
    return torch.float32


@dataclass(frozen=True)
class PoolRoom:
    """What one KV block of a model costs, and the memory free for blocks on its device.

    block_bytes: :func:`block_bytes` of the model's cache layers (at least 1).
    free_bytes:  the device's free memory (:func:`lollm.generate.memory.free_memory`), None when unknown.
    Every sizer of a pool (the engine's default, ``lollm serve``, ``lollm.LLM``, ``bench --concurrency``)
    keeps to at most half the free memory: :attr:`half_free_blocks`.
    """

    block_bytes: int
    free_bytes: int | None

    @property
    def half_free_blocks(self) -> int | None:
        """Blocks that fit in half the free memory (None: the free memory is unknown)."""
        return None if self.free_bytes is None else self.free_bytes // 2 // self.block_bytes


def pool_room(model: CausalLM, block_size: int) -> PoolRoom:
    """The :class:`PoolRoom` of ``model`` with blocks of ``block_size`` positions."""
    per_block = max(block_bytes(model.cache_layers(), block_size, model_dtype(model)), 1)
    return PoolRoom(per_block, memory.free_memory(next(model.parameters()).device))


def pool_blocks(model: CausalLM, positions: Sequence[int], *, block_size: int, max_running: int,
                at_least: int = 0, advice: str = "ask for fewer tokens") -> int:
    """How many KV blocks a pool gets: the one sizing rule of every pool (the engine's default,
    ``lollm serve``, ``lollm.LLM``, ``bench --concurrency``).

    positions:   the positions each request may reach (prompt + token budget).
    max_running: how many of them run at once: the pool has room for the ``max_running`` longest
                 together (their blocks added up, so none is preempted).
    at_least:    positions the pool must hold whatever the requests (``lollm serve``: one request
                 that fills the context).

    The room asked for is capped at half the device's free memory, but never below the longest
    request (or ``at_least``): that one must always fit, waiting for memory rather than being
    refused. With the free memory unknown, the room asked for. Raises GenerationError (ending
    with ``advice``) when even that one request does not fit in the free memory.
    """
    if not positions:
        raise GenerationError("no requests to size the KV pool for")
    blocks = sorted((-(-n // block_size) for n in positions), reverse=True)
    longest = max(max(positions), at_least)
    floor = -(-longest // block_size)
    wanted = max(floor, sum(blocks[:max_running]))
    room = pool_room(model, block_size)
    if room.free_bytes is None:
        return wanted
    if floor * room.block_bytes > room.free_bytes:
        raise GenerationError(f"a request of {longest} positions needs {floor * room.block_bytes / 2**20:.0f} "
                              f"MiB of KV blocks, but {room.free_bytes / 2**20:.0f} MiB are free: {advice}")
    return max(floor, min(wanted, room.half_free_blocks))


class PagedCache:
    """One engine step's view of the :class:`KVPool`, passed to ``model.forward`` as its cache."""

    def __init__(self, pool: KVPool, batch: Batch):
        self.pool, self.batch = pool, batch
        device = next((k.device for k in pool.k if k is not None), torch.device("cpu"))
        self.slots = batch.slots.to(device)
        self.window_slots = batch.window_slots.to(device) if batch.window_slots is not None else None
        if (pool.num_window_blocks is None) != (self.window_slots is None):
            raise ValueError("the pool and the batch disagree on whether sliding-window layers have their own blocks")

    @property
    def length(self) -> Batch:
        """The step's layout: a family's ``start = cache.length`` becomes the :class:`Batch` (see lollm.batch)."""
        return self.batch

    def check_room(self, T: int) -> None:
        if T != self.batch.num_tokens:
            raise ValueError(f"the engine laid out {self.batch.num_tokens} tokens, the forward got {T}")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys/values into their slots; return the layer's pools.

        k, v: (1, K, N, D) -> k_pool, v_pool: (num_blocks, block_size, K, D).
        """
        k_pool, v_pool = self.pool.k[layer], self.pool.v[layer]
        if k_pool is None:
            raise ValueError(f"cache layer {layer} is {self.pool.layers[layer].kind!r}: it stores no keys")
        K, D = k_pool.shape[2], k_pool.shape[3]
        slots = self.window_slots if self.pool.layers[layer].kind == "sliding" and self.window_slots is not None else self.slots
        k_pool.view(-1, K, D)[slots] = k[0].transpose(0, 1).to(k_pool.dtype)  # (N, K, D)
        v_pool.view(-1, K, D)[slots] = v[0].transpose(0, 1).to(v_pool.dtype)
        return k_pool, v_pool

    def advance(self, T: int) -> None:
        """Nothing: the engine advances each sequence's length after the step."""

    def state(self, layer: int, b: int) -> dict[str, torch.Tensor]:
        """Sequence b's recurrent states for ``layer``: name -> tensor view of its slot (update in place)."""
        slot = self.batch.state_slots[b]
        return {name: tensor[slot] for name, tensor in self.pool.states[layer].items()}
