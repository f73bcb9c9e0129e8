"""Recurrent-state snapshots: what lets a model with a recurrent layer share a prefix.

A block of keys and values is all an attention layer needs to resume after a cached
prefix. A recurrent layer (Gated DeltaNet, a convolution window) needs its state
*after* that prefix instead, and no block of keys can rebuild it. So the engine saves a
sequence's recurrent states at the moment its computed tokens end exactly on a block
boundary, under the name of the block that ends there (:func:`lollm.engine.blocks.block_hash`
covers the whole prefix, so one name means one state). A later request may take cached
blocks only up to a block that has a snapshot; its state slot then starts from that
snapshot instead of zeros. Without a snapshot at a boundary, nothing past it is reused:
never a wrong state.

Snapshots cost memory (Qwen3.5-0.8B: about 19 MiB each, every DeltaNet layer's state), so
at most ``capacity`` are kept, the least recently used dropped first.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class StateSnapshots:
    """Recurrent states by block name: ``name -> [layer's {state name: tensor}]``, at most ``capacity``, LRU."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.states: OrderedDict[bytes, list[dict[str, torch.Tensor]]] = OrderedDict()

    def __contains__(self, name: bytes) -> bool:
        return name in self.states

    def __len__(self) -> int:
        return len(self.states)

    def save(self, name: bytes, slot_states: list[dict[str, torch.Tensor]]) -> None:
        """Copy one sequence's states (the views of its slot) under ``name``; the first copy of a name is kept."""
        if self.capacity < 1 or name in self.states:
            return
        self.states[name] = [{key: t.clone() for key, t in layer.items()} for layer in slot_states]
        while len(self.states) > self.capacity:
            self.states.popitem(last=False)

    def restore(self, name: bytes, slot_states: list[dict[str, torch.Tensor]]) -> None:
        """Write the snapshot ``name`` into a sequence's slot (its views, in place). KeyError if it is gone."""
        saved = self.states[name]
        self.states.move_to_end(name)
        for layer, kept in zip(slot_states, saved):
            for key, tensor in layer.items():
                tensor.copy_(kept[key])
