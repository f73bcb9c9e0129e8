"""A toy causal LM with one attention layer (optionally over a sliding window) and one recurrent layer, for the core engine tests.

Small enough to read in one sitting, and it follows the batch seam (lollm.batch) the way
a family does: ``start = cache.length`` (an int, or the engine's Batch), positions from
:func:`token_positions`, attention through :func:`lollm.attention.attend`, a recurrent
state per sequence through ``cache.state(layer, b)``, ``keep_logit_rows`` for the output.
Its weights are random (seeded) and large enough that the logits depend on position,
on every earlier token, and on the recurrent state.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.attention import attend
from lollm.batch import Batch, CacheLayer, keep_logit_rows, token_positions


class ToyCache:
    """The single-sequence cache: keys/values of layer 0, the running state of layer 1."""

    def __init__(self, heads: int, dim: int, width: int, max_tokens: int):
        self.k = torch.zeros(1, heads, max_tokens, dim)
        self.v = torch.zeros(1, heads, max_tokens, dim)
        self.running = torch.zeros(width)
        self.length, self.max_tokens = 0, max_tokens

    def check_room(self, T: int) -> None:
        assert self.length + T <= self.max_tokens

    def update(self, layer: int, k, v):
        end = self.length + k.shape[2]
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        return self.k[:, :, :end], self.v[:, :, :end]

    def state(self, layer: int, b: int) -> dict[str, torch.Tensor]:
        return {"running": self.running}

    def advance(self, T: int) -> None:
        self.length += T


class ToyLM(nn.Module):
    """input_ids (1, T) -> logits; layer 0 attention (2 KV heads, 4 query heads), layer 1 a decaying running sum."""

    def __init__(self, vocab_size: int = 40, width: int = 16, recurrent: bool = True, max_context: int = 128, seed: int = 0,
                 window: int | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.vocab_size, self.max_context, self.num_layers, self.eos_token_ids = vocab_size, max_context, 2, ()
        self.window = window  # layer 0 attends over a sliding window of this many positions (None: all)
        self.recurrent, self.width, self.heads, self.kv_heads, self.dim = recurrent, width, 4, 2, width // 4
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(max_context, width)
        self.qkv = nn.Linear(width, (self.heads + 2 * self.kv_heads) * self.dim)
        self.out = nn.Linear(self.heads * self.dim, width)
        self.head = nn.Linear(width, vocab_size)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0, 0.8)

    def cache_layers(self) -> list[CacheLayer]:
        layers = [CacheLayer("sliding", self.kv_heads, self.dim, window=self.window) if self.window
                  else CacheLayer("full", self.kv_heads, self.dim)]
        if self.recurrent:
            layers.append(CacheLayer("recurrent", state={"running": (self.width,)}, state_dtype=torch.float32))
        return layers

    def new_cache(self, max_tokens: int) -> ToyCache:
        return ToyCache(self.kv_heads, self.dim, self.width, max_tokens)

    def forward(self, input_ids, cache=None, *, logits_to_keep=0, hidden_states=None):
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.length
        x = self.embed(input_ids) + self.position(token_positions(start, T))  # (1, T, C)
        H, K, D = self.heads, self.kv_heads, self.dim
        q, k, v = self.qkv(x).split([H * D, K * D, K * D], dim=-1)
        q, k, v = (t.view(1, T, -1, D).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.update(0, k, v)
        x = x + self.out(attend(q, k, v, start=start, window=self.window, layer=0).transpose(1, 2).reshape(1, T, H * D))
        if self.recurrent:
            x = x + self._running_sum(x, start, cache)
        if cache is not None:
            cache.advance(T)
        return self.head(keep_logit_rows(torch.tanh(x), logits_to_keep))

    def _running_sum(self, x, start, cache):
        """h_t = 0.9 h_{t-1} + x_t over each sequence's own rows, from (and into) its own state (a slow decay:
        the state of 20 tokens back still counts, so a wrong restored state shows)."""
        segments = start.segments() if isinstance(start, Batch) else [(0, x.shape[1])]
        out = torch.empty_like(x)
        for b, (lo, hi) in enumerate(segments):
            state = cache.state(1, b)["running"] if cache is not None else torch.zeros(self.width)  # (C,), in place
            for t in range(lo, hi):
                state.mul_(0.9).add_(x[0, t])
                out[0, t] = state
        return out
