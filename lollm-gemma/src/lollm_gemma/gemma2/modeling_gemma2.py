"""The gemma2 model: "sandwich" decoder layers, alternating sliding-window and global attention.

::

    input_ids (1, T)
        │ embed_tokens, × sqrt(C)
        ▼
    x (1, T, C) ─────────────────────┐  ×num_hidden_layers
        │ input_layernorm            │  (layer_types: sliding, full, sliding, full, ...)
        │ self_attn (GQA, RoPE,      │
        │   soft-capped scores)   ◄──┼── cache: ring (sliding) or full (global)
        │ post_attention_layernorm   │
        + ◄──────────────────────────┘
        ├────────────────────────────┐
        │ pre_feedforward_layernorm  │
        │ mlp (GeGLU)                │
        │ post_feedforward_layernorm │
        + ◄──────────────────────────┘
        │ norm
        │ lm_head (tied to embed_tokens)
        │ cap * tanh(logits / cap)   final-logit soft-cap
        ▼
    logits (1, T, vocab)

Module names mirror transformers' Gemma2ForCausalLM (``model.embed_tokens``,
``model.layers.N.pre_feedforward_layernorm``, ``model.norm``, ``lm_head``), so
the name map from a Hugging Face checkpoint is the identity (weights.py).
Shape letters as in blocks.py.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.batch import CacheLayer, keep_logit_rows, token_positions
from lollm.trace import record_softcap

from .blocks import Gemma2Attention, Gemma2MLP, RMSNorm, RotaryEmbedding
from .config import SLIDING, Gemma2Config
from .kv import Gemma2Cache


#: What ``lollm trace`` says under its soft-cap chart.
SOFTCAP_NOTE = ("Every final logit x becomes cap * tanh(x / cap), inside (-cap, cap): small logits pass almost "
                "unchanged, large ones flatten against the cap, so no token can run away with all the probability. "
                "The points are the selected token's largest logits, before (x) and after (y) the cap.")


class Gemma2DecoderLayer(nn.Module):
    """One "sandwich" layer: each sub-block's output is normed again before it joins the residual.

        x = x + post_attention_layernorm(attention(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: Gemma2Config, layer_idx: int):
        super().__init__()
        C, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = Gemma2Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.pre_feedforward_layernorm = RMSNorm(C, eps)
        self.mlp = Gemma2MLP(config)
        self.post_feedforward_layernorm = RMSNorm(C, eps)

    def forward(self, x, cos, sin, start: int, window: int | None, cache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, start, window, cache))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x


class Gemma2Model(nn.Module):
    """The decoder body, a container named ``model`` so parameter names match HF checkpoints.

    Its work is done in :meth:`Gemma2ForCausalLM.forward`, which narrates every step.
    """

    def __init__(self, config: Gemma2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim)  # no weights: inv_freq is computed


class Gemma2ForCausalLM(nn.Module):
    """A gemma2 causal language model, following :class:`lollm.model.CausalLM`."""

    def __init__(self, config: Gemma2Config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.num_layers = config.num_hidden_layers
        self.eos_token_ids = config.eos_token_ids
        self.model = Gemma2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # sqrt(C), stored in the model dtype (as transformers does: bf16 rounds sqrt(2304)=48 exactly,
        # but sqrt(3584)=59.87 to 60.0)
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute the embedding scale, which no checkpoint holds, on ``device`` in ``dtype``.

        :func:`lollm.load.build.build_model` calls it after building the model on the meta device
        (and calls each RotaryEmbedding's own ``materialize`` for the RoPE frequencies).
        """
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype, device=device)

    def new_cache(self, max_tokens: int) -> Gemma2Cache:
        """An empty cache for ``max_tokens`` positions, on the model's device and dtype."""
        weight = self.model.embed_tokens.weight
        return Gemma2Cache(self.config, max_tokens, device=weight.device, dtype=weight.dtype)

    def cache_layers(self) -> list[CacheLayer]:
        """What each cache layer holds, for the batched engine (lollm.batch), one entry per decoder layer.

        Layer i follows ``layer_types[i]``: a sliding layer reads a window of W positions
        (``CacheLayer("sliding", K, D, window=W)``), a global one every position ("full").
        The engine pages both alike; the window is applied where attention runs.
        """
        c = self.config
        K, D = c.num_key_value_heads, c.head_dim
        return [CacheLayer("sliding", K, D, window=c.sliding_window) if t == SLIDING else CacheLayer("full", K, D)
                for t in c.layer_types]

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Gemma2Cache | None = None,
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

        # 1. Embed, then scale by sqrt(C): Gemma's embeddings are stored small (they double
        #    as the output head), the scale brings them to the size the layers expect.
        x = self.model.embed_tokens(input_ids) * self.embed_scale  # (1, T, C)
        if hidden_states is not None:
            hidden_states.append(x)

        # 2. Positions of the new tokens, and the cos/sin of their RoPE angles,
        #    computed once here for just these T positions and shared by every layer.
        positions = token_positions(start, T, input_ids.device)  # (T,): start .. start+T-1, or each token's own
        cos, sin = self.model.rotary_emb(positions, x.dtype)  # (T, D) each

        # 3. Who may attend to whom: every layer causally, a sliding layer only within the
        #    last W positions (window None: a global layer). The masks themselves are built
        #    where attention runs (lollm.attention), from these windows and the positions.
        windows = {t: self.config.sliding_window if t == SLIDING else None for t in set(self.config.layer_types)}

        # 4. The decoder layers; each writes its keys/values into its own cache.
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, start, windows[layer.layer_type], cache)  # (1, T, C)
            if hidden_states is not None and i < last:
                hidden_states.append(x)
        if cache is not None:
            cache.advance(T)

        # 5. Final RMSNorm.
        x = self.model.norm(x)  # (1, T, C)
        if hidden_states is not None:
            hidden_states.append(x)

        # 6. Output head, only on the positions whose logits are wanted
        #    (a prefill needs the last one: 1 row of the vocab-sized matmul, not T).
        #    An engine step passes a tensor: the row of each sequence's last token.
        x = keep_logit_rows(x, logits_to_keep)
        logits = self.lm_head(x)  # (1, T or logits_to_keep, vocab)

        # 7. Final-logit soft-cap: cap * tanh(logits / cap) keeps every logit in (-cap, cap).
        cap = self.config.final_logit_softcapping
        if cap is not None:
            before, logits = logits, torch.tanh(logits / cap) * cap
            record_softcap(self, "final-logit soft-cap", before, logits, cap=cap, note=SOFTCAP_NOTE)  # lollm trace only
        return logits

    def logit_lens(self, hidden: torch.Tensor, *, normed: bool = False) -> torch.Tensor:
        """The logit lens (``lollm trace``): a residual stream read the way steps 5-7 of forward read the last one.

        hidden (1, T, C), an entry of ``hidden_states`` -> (1, T, vocab), soft-capped like the real
        logits. ``normed``: ``hidden`` already went through the final norm (the last entry did).
        """
        logits = self.lm_head(hidden if normed else self.model.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
