"""The gemma3 model: a stack of "sandwich" decoder layers, 5 sliding-window layers to 1 global.

::

    input_ids (1, T)
        │ embed_tokens, × sqrt(C)
        ▼
    x (1, T, C) ─────────────────────┐  ×num_hidden_layers
        │ input_layernorm            │  (layer_types: sliding, sliding, sliding,
        │ self_attn (GQA, QK-norm,   │   sliding, sliding, full, sliding, ...)
        │   RoPE local or global) ◄──┼── cache: ring (sliding) or full (global)
        │ post_attention_layernorm   │
        + ◄──────────────────────────┘
        ├────────────────────────────┐
        │ pre_feedforward_layernorm  │
        │ mlp (GeGLU)                │
        │ post_feedforward_layernorm │
        + ◄──────────────────────────┘
        │ norm
        │ lm_head (tied to embed_tokens)
        ▼
    logits (1, T, vocab)

Module names mirror transformers' Gemma3ForCausalLM (``model.embed_tokens``,
``model.layers.N.self_attn.q_norm``, ``model.norm``, ``lm_head``), so the name
map from a Hugging Face checkpoint is the identity (weights.py).
Shape letters as in blocks.py.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.batch import CacheLayer, keep_logit_rows, token_positions
from lollm.vision.step import image_numbers, scatter_step_images
from lollm.vision.spec import ImageBatch

from .blocks import Gemma3Attention, Gemma3MLP, RMSNorm, RotaryEmbedding
from .config import SLIDING, Gemma3Config
from .kv import Gemma3Cache


class Gemma3DecoderLayer(nn.Module):
    """One "sandwich" layer: each sub-block's output is normed again before it joins the residual.

        x = x + post_attention_layernorm(attention(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: Gemma3Config, layer_idx: int):
        super().__init__()
        C, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.pre_feedforward_layernorm = RMSNorm(C, eps)
        self.mlp = Gemma3MLP(config)
        self.post_feedforward_layernorm = RMSNorm(C, eps)

    def forward(self, x, cos, sin, start: int, window: int | None, cache, blocks=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, start, window, cache, blocks))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x


class Gemma3TextModel(nn.Module):
    """The decoder body, a container named ``model`` so parameter names match HF checkpoints.

    ``rotary_emb`` holds one RoPE per layer type present (keys "sliding_attention",
    "full_attention"). Its work is done in :meth:`Gemma3ForCausalLM.forward`.
    """

    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = nn.ModuleDict(
            {t: RotaryEmbedding(config.rope_for(t), config.head_dim) for t in sorted(set(config.layer_types))}
        )


class Gemma3ForCausalLM(nn.Module):
    """A gemma3 causal language model, following :class:`lollm.model.CausalLM`."""

    #: its forward takes images in an engine step too (lollm.model.VisionLM; lollm.vision.step)
    batches_images = True

    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.num_layers = config.num_hidden_layers
        self.eos_token_ids = config.eos_token_ids
        self.model = Gemma3TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # sqrt(C), stored in the model dtype (as transformers does: bf16 rounds sqrt(640)=25.298 to 25.25)
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute the embedding scale, which no checkpoint holds, on ``device`` in ``dtype``.

        :func:`lollm.load.build.build_model` calls it after building the model on the meta device
        (and calls each RotaryEmbedding's own ``materialize`` for the RoPE frequencies).
        """
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype, device=device)

    def new_cache(self, max_tokens: int) -> Gemma3Cache:
        """An empty cache for ``max_tokens`` positions, on the model's device and dtype."""
        weight = self.model.embed_tokens.weight
        return Gemma3Cache(self.config, max_tokens, device=weight.device, dtype=weight.dtype)

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
        cache: Gemma3Cache | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        hidden_states: list[torch.Tensor] | None = None,
        images: ImageBatch | list[ImageBatch | None] | None = None,
    ) -> torch.Tensor:
        """input_ids (1, T) int64 -> logits (1, T or logits_to_keep, vocab).

        The T tokens sit at positions ``cache.length .. cache.length+T-1`` (0.. without
        a cache); the cache receives their keys/values and advances by T. In an engine
        step the cache is a lollm.engine PagedCache: the T tokens are those of several
        sequences end to end, ``cache.length`` is their lollm.batch.Batch, and
        ``logits_to_keep`` a tensor of rows (lollm.batch explains the seam).
        ``hidden_states``, when a list, receives transformers' ``output_hidden_states``:
        the embeddings, each layer's output but the last, the final-normed output.
        ``images`` (plugin contract 3: vision, docs/vision.md): the sequence's images, encoded by
        vision.py; those inside these T positions replace their placeholder rows after step 1, and
        attend inside themselves both ways (step 3). In an engine step, a list of one ImageBatch or
        None per sequence of the Batch (``batches_images``; lollm.vision.step).
        """
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.length  # an int; in an engine step, a lollm.batch.Batch
        if cache is not None:
            cache.check_room(T)

        # 1. Embed, then scale by sqrt(C): Gemma's embeddings are stored small (they double
        #    as the output head), the scale brings them to the size the layers expect.
        x = self.model.embed_tokens(input_ids) * self.embed_scale  # (1, T, C)
        # 1b. Images (docs/vision.md): their rows replace their placeholders' (after the scale, as HF).
        #     In an engine step ``images`` is a list, one ImageBatch or None per sequence (lollm.vision.step).
        blocks = image_numbers(images, start, T, input_ids.device)  # (T,) image number, -1 text; None: no image
        if blocks is not None:
            x = scatter_step_images(x, images, start)
        if hidden_states is not None:
            hidden_states.append(x)

        # 2. Positions of the new tokens, and the cos/sin of their RoPE angles: one pair
        #    per layer type (local base for sliding layers, global base for full ones),
        #    computed once here for just these T positions and shared by the layers.
        positions = token_positions(start, T, input_ids.device)  # (T,): start .. start+T-1, or each token's own
        rope = {t: emb(positions, x.dtype) for t, emb in self.model.rotary_emb.items()}  # t -> (cos, sin)

        # 3. Who may attend to whom: every layer causally, a sliding layer only within the
        #    last W positions (window None: a global layer). The masks themselves are built
        #    where attention runs (lollm.attention), from these windows and the positions;
        #    with images in this forward, by blocks.image_visible (an image sees all of itself).
        windows = {t: self.config.sliding_window if t == SLIDING else None for t in set(self.config.layer_types)}

        # 4. The decoder layers; each writes its keys/values into its own cache.
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope[layer.layer_type]
            x = layer(x, cos, sin, start, windows[layer.layer_type], cache, blocks)  # (1, T, C)
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
        return self.lm_head(x)  # (1, T or logits_to_keep, vocab)

    def logit_lens(self, hidden: torch.Tensor, *, normed: bool = False) -> torch.Tensor:
        """The logit lens (``lollm trace``): a residual stream read the way steps 5-6 of forward read the last one.

        hidden (1, T, C), an entry of ``hidden_states`` -> (1, T, vocab). ``normed``: ``hidden``
        already went through the final norm (the last entry of ``hidden_states`` did).
        """
        return self.lm_head(hidden if normed else self.model.norm(hidden))
