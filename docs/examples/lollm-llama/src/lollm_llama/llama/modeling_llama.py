"""The llama model: a stack of pre-norm decoder layers between an embedding and an output head.

::

    input_ids (1, T)
        │ embed_tokens
        ▼
    x (1, T, C) ──────────────┐  ×num_hidden_layers
        │ input_layernorm     │
        │ self_attn (GQA+RoPE)│  ◄── KV cache
        + ◄───────────────────┘
        ├─────────────────────┐
        │ post_attention_layernorm
        │ mlp (SwiGLU)        │
        + ◄───────────────────┘
        │ norm
        │ lm_head
        ▼
    logits (1, T, vocab)

Module names mirror transformers' LlamaForCausalLM exactly
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``model.norm``,
``lm_head``), so the name map from a Hugging Face checkpoint is the identity.
Shape letters as in blocks.py (T tokens now, C hidden, S visible positions).
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.batch import CacheLayer, keep_logit_rows, token_positions

from .blocks import LlamaAttention, LlamaMLP, RMSNorm, RotaryEmbedding
from .config import LlamaConfig
from .kv import LlamaKVCache


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder layer: x + attention(norm(x)), then x + mlp(norm(x)).

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: LlamaConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, start: int, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    """The decoder body, a container named ``model`` so parameter names match HF checkpoints.

    Its work is done in :meth:`LlamaForCausalLM.forward`, which narrates every step.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)  # no weights: inv_freq is computed


class LlamaForCausalLM(nn.Module):
    """A llama causal language model, following :class:`lollm.model.CausalLM`."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.num_layers = config.num_hidden_layers
        self.eos_token_ids = config.eos_token_ids
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_cache(self, max_tokens: int) -> LlamaKVCache:
        """An empty KV cache for ``max_tokens`` positions, on the model's device and dtype."""
        weight = self.model.embed_tokens.weight
        c = self.config
        return LlamaKVCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_tokens,
            device=weight.device, dtype=weight.dtype,
        )

    def cache_layers(self) -> list[CacheLayer]:
        """What each cache layer holds, for the batched engine (lollm.batch): every layer full attention."""
        c = self.config
        return [CacheLayer("full", c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: LlamaKVCache | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        hidden_states: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids (1, T) int64 -> logits (1, T or logits_to_keep, vocab).

        The T tokens sit at positions ``cache.length .. cache.length+T-1`` (0.. without
        a cache); the cache receives their keys/values and advances by T. In an engine
        step the cache is a lollm.engine PagedCache: the T tokens are those of several
        sequences end to end, ``cache.length`` is their lollm.batch.Batch, and
        ``logits_to_keep`` a tensor of rows (lollm.batch explains the seam).
        ``hidden_states``, when a list, receives transformers' ``output_hidden_states``:
        the embeddings, each layer's output but the last, the final-normed output.
        """
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.length  # an int; in an engine step, a lollm.batch.Batch
        if cache is not None:
            cache.check_room(T)

        # 1. Embed: each token id becomes a row of the embedding matrix.
        x = self.model.embed_tokens(input_ids)  # (1, T, C)
        if hidden_states is not None:
            hidden_states.append(x)

        # 2. Positions of the new tokens, and the cos/sin of their RoPE angles,
        #    computed once here and shared by every layer.
        positions = token_positions(start, T, input_ids.device)  # (T,): start .. start+T-1, or each token's own
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # (T, D) each

        # 3. The decoder layers; each writes its keys/values into the cache, and its
        #    attention reads them causally (the mask is made where attention runs, lollm.attention).
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, start, cache)  # (1, T, C)
            if hidden_states is not None and i < last:
                hidden_states.append(x)
        if cache is not None:
            cache.advance(T)

        # 4. Final RMSNorm.
        x = self.model.norm(x)  # (1, T, C)
        if hidden_states is not None:
            hidden_states.append(x)

        # 5. Output head, only on the positions whose logits are wanted
        #    (a prefill needs the last one: 1 row of the vocab-sized matmul, not T).
        #    An engine step passes a tensor: the row of each sequence's last token.
        x = keep_logit_rows(x, logits_to_keep)
        return self.lm_head(x)  # (1, T or logits_to_keep, vocab)

    def logit_lens(self, hidden: torch.Tensor, *, normed: bool = False) -> torch.Tensor:
        """The logit lens (``lollm trace``): a residual stream read the way steps 4-5 of forward read the last one.

        hidden (1, T, C), an entry of ``hidden_states`` -> (1, T, vocab). ``normed``: ``hidden``
        already went through the final norm (the last entry of ``hidden_states`` did).
        """
        return self.lm_head(hidden if normed else self.model.norm(hidden))
