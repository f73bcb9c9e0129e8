"""The llama KV cache: every layer's keys and values, preallocated once.

Decoding one token needs the keys and values of every earlier position in
every layer. Recomputing them would cost a whole prefill per token, so they
are kept here::

    k, v: (num_layers, 1, num_kv_heads, max_tokens, head_dim)
                                        ^^^^^^^^^^
                          positions 0 .. length-1 are filled; the rest is room

Both tensors are allocated once, for ``max_tokens`` positions. A forward of
T tokens writes its keys/values into positions ``length .. length+T-1`` (a
slice assignment: no new memory) and attention reads the view
``[:length+T]``. The model advances ``length`` once per forward, after its
last layer. Growing the tensors with ``torch.cat`` at every step instead would
copy the whole cache per token (quadratic work) and churn the allocator.

Only the K heads of GQA are stored (8 for Llama 3.2 1B, not 32): that is the
memory GQA saves. Size: ``2 * layers * K * max_tokens * D * bytes`` (K and V), e.g.
2 * 16 * 8 * 64 * 2 bytes = 32 KiB per position for Llama 3.2 1B in bfloat16
(Llama 2 7B, without GQA: 2 * 32 * 32 * 128 * 2 bytes = 512 KiB).
"""

from __future__ import annotations

import torch

from lollm.errors import GenerationError


class LlamaKVCache:
    """Preallocated keys and values of every layer, for up to ``max_tokens`` positions (batch 1).

    Attributes:
      k, v:       (num_layers, 1, num_kv_heads, max_tokens, head_dim), allocated once.
      length:     positions filled so far; the next forward's tokens start there.
      max_tokens: capacity in positions.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
    ):
        shape = (num_layers, 1, num_kv_heads, max_tokens, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0
        self.max_tokens = max_tokens

    def check_room(self, T: int) -> None:
        """Raise GenerationError when T more positions do not fit."""
        if self.length + T > self.max_tokens:
            raise GenerationError(
                f"the KV cache holds {self.max_tokens} positions: {self.length} are used and "
                f"{T} more do not fit"
            )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values of ``layer``; return that layer's cached ones so far.

        k, v: (1, K, T, D), for positions ``length .. length+T-1``
        returns k, v: (1, K, length+T, D), views into the cache (no copy)
        """
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, T: int) -> None:
        """Mark T more positions as filled (once per forward, after the last layer)."""
        self.length += T

    def can_rollback(self, length: int) -> bool:
        """A full KV cache can return to any length it holds: every position keeps its own row."""
        return 0 <= length <= self.length

    def rollback(self, length: int) -> None:
        """Forget every position from ``length`` on (speculative decoding rejects drafts so; the
        prompt cache goes back to the prefix a new prompt shares with the conversation).

        Nothing is erased: attention only reads ``[:length]``, and the next
        forward overwrites the positions from ``length`` on.
        """
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll a cache of length {self.length} back to {length}")
        self.length = length
