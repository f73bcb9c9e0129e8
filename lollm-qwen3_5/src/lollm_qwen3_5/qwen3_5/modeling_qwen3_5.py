"""The qwen3_5 model: a hybrid stack of Gated DeltaNet and gated-attention layers.

::

    input_ids (1, T)
        │ embed_tokens
        ▼
    x (1, T, C) ─────────────────────────┐  ×num_hidden_layers
        │ input_layernorm                │
        │ token mixer, by layer_types:   │
        │   linear_attention: Gated DeltaNet   ◄── conv state + recurrent state
        │   full_attention:   gated attention  ◄── K/V cache
        + ◄──────────────────────────────┘
        ├────────────────────────────────┐
        │ post_attention_layernorm       │
        │ mlp (SwiGLU)                   │
        + ◄──────────────────────────────┘
        │ norm ──────────────────────────────► (kept for the MTP head)
        │ lm_head
        ▼
    logits (1, T, vocab)

With ``full_attention_interval`` 4 the pattern is linear, linear, linear, full,
repeated: three DeltaNet layers (fixed-size memory, cost independent of the
context length) for each attention layer (exact recall over the whole context).

Module names mirror transformers' text-only Qwen3_5ForCausalLM
(``model.embed_tokens``, ``model.layers.N.linear_attn.in_proj_qkv``,
``model.layers.N.self_attn.q_proj``, ``model.norm``, ``lm_head``) plus the
checkpoint's ``mtp.*``, so the name map of a text-only checkpoint is the
identity. Shape letters as in blocks.py.
"""

from __future__ import annotations

import torch
from torch import nn

from lollm.batch import Batch, CacheLayer, keep_logit_rows
from lollm.errors import GenerationError
from lollm.vision.spec import ImageBatch
from lollm.vision.step import scatter_step_images

from .mrope import forward_cos_sin, sequence_cos_sin

from .blocks import Qwen3_5Attention, Qwen3_5GatedDeltaNet, Qwen3_5MLP, RMSNorm, RotaryEmbedding
from .config import Qwen3_5Config
from .kv import Qwen3_5EngineCache, Qwen3_5HybridCache
from .mtp import Qwen3_5MTP


class Qwen3_5DecoderLayer(nn.Module):
    """One pre-norm decoder layer: x + mixer(norm(x)), then x + mlp(norm(x)).

    The mixer is ``linear_attn`` (Gated DeltaNet) or ``self_attn`` (gated
    attention), as ``layer_types`` says; only that one exists in the layer.

    x: (1, T, C) -> (1, T, C)
    """

    def __init__(self, config: Qwen3_5Config, layer_idx: int, slot: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.layer_type == "linear_attention":
            self.linear_attn = Qwen3_5GatedDeltaNet(config, slot)
        else:
            self.self_attn = Qwen3_5Attention(config, slot, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3_5MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x, cos, sin, cache, start: int) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, cache)
        else:
            h = self.self_attn(h, cos, sin, cache, start)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    """The decoder body, a container named ``model`` so parameter names match HF checkpoints.

    Its work is done in :meth:`Qwen3_5ForCausalLM.forward`, which narrates every step.
    """

    def __init__(self, config: Qwen3_5Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Each mixer owns one slot of its kind in the hybrid cache: attention layers
        # number their K/V slots 0, 1, ..., DeltaNet layers their state slots 0, 1, ...
        slots = {"full_attention": 0, "linear_attention": 0}
        layers = []
        for i, kind in enumerate(config.layer_types):
            layers.append(Qwen3_5DecoderLayer(config, i, slots[kind]))
            slots[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)  # no weights: inv_freq is computed


class Qwen3_5ForCausalLM(nn.Module):
    """A qwen3_5 causal language model, following :class:`lollm.model.CausalLM` (and ``DraftModel`` with MTP)."""

    #: its forward takes images in an engine step too (lollm.model.VisionLM; lollm.vision.step)
    batches_images = True

    def __init__(self, config: Qwen3_5Config, *, with_mtp: bool = False):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.num_layers = config.num_hidden_layers
        self.eos_token_ids = config.eos_token_ids
        self.model = Qwen3_5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The MTP head's attention takes the K/V slot after the main model's attention layers.
        self.mtp = Qwen3_5MTP(config, slot=len(config.full_attention_layers)) if with_mtp else None
        self.has_draft_head = with_mtp

    def new_cache(self, max_tokens: int) -> Qwen3_5HybridCache:
        """An empty hybrid cache for ``max_tokens`` positions, on the model's device and dtype."""
        weight = self.model.embed_tokens.weight
        return Qwen3_5HybridCache(
            self.config, max_tokens, device=weight.device, dtype=weight.dtype, with_mtp=self.mtp is not None
        )

    def cache_layers(self) -> list[CacheLayer]:
        """What each cache layer holds, for the batched engine (lollm.batch); cache layer i is decoder layer i.

        A full-attention layer keeps K heads of D per position ("full"); a Gated DeltaNet
        layer keeps a fixed-size state per sequence ("recurrent"): its last W-1 conv inputs
        (W-1, conv_dim) and its delta-rule memory (Hv, Dk, Dv), both in float32 (the engine
        keeps one dtype per layer's states; the memory needs float32, see kv.py).
        """
        c = self.config
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        recurrent = CacheLayer("recurrent", state={
            "conv": (c.linear_conv_kernel_dim - 1, conv_dim),
            "recurrent": (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
        }, state_dtype=torch.float32)
        full = CacheLayer("full", c.num_key_value_heads, c.head_dim)
        return [full if kind == "full_attention" else recurrent for kind in c.layer_types]

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Qwen3_5HybridCache | None = None,
        *,
        logits_to_keep: int | torch.Tensor = 0,
        hidden_states: list[torch.Tensor] | None = None,
        images: ImageBatch | list[ImageBatch | None] | None = None,
    ) -> torch.Tensor:
        """input_ids (1, T) int64 -> logits (1, T or logits_to_keep, vocab).

        The T tokens sit at positions ``cache.length .. cache.length+T-1`` (0.. without
        a cache); the cache receives their keys/values and DeltaNet states and advances by T.
        In an engine step the cache is a lollm.engine PagedCache: the T tokens are those of
        several sequences end to end, ``cache.length`` is their lollm.batch.Batch, and
        ``logits_to_keep`` a tensor of rows (lollm.batch explains the seam; kv.py how the
        DeltaNet states of each sequence are reached).
        ``hidden_states``, when a list, receives transformers' ``output_hidden_states``:
        the embeddings, each layer's output but the last, the final-normed output.
        ``images`` (plugin contract 3: vision, docs/vision.md): the sequence's images, encoded by
        vision_family.py; those inside these T positions replace their placeholder rows (step 1b),
        and every forward of a sequence with images turns by M-RoPE (step 2). The cache keeps
        the images' spans, so decode steps (images=None) get their shifted positions. In an engine
        step (``batches_images``) ``images`` is a list, one ImageBatch or None per sequence of the
        Batch, given in every step of a sequence with images (lollm.vision.step).
        """
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.length  # an int; in an engine step, a lollm.batch.Batch
        if isinstance(start, Batch):  # an engine step: the engine's cache under this family's names (kv.py)
            cache = Qwen3_5EngineCache(cache, self.config)
        if cache is not None:
            cache.begin(T)  # room check; a short multi-token step on a non-empty cache is recorded for rollback

        # 1. Embed: each token id becomes a row of the embedding matrix.
        x = self.model.embed_tokens(input_ids)  # (1, T, C)
        # 1b. Images (docs/vision.md): their rows replace their placeholders' rows.
        #     In an engine step `images` is a list, one ImageBatch or None per sequence (lollm.vision.step).
        x = scatter_step_images(x, images, start)  # (1, T, C); x itself without images here
        if hidden_states is not None:
            hidden_states.append(x)

        # 2. Positions of the new tokens and the cos/sin of their RoPE angles (R channels),
        #    shared by every attention layer. DeltaNet layers need no positions: the
        #    order of tokens is in their recurrence. A sequence with images takes M-RoPE
        #    (mrope.py): an image token turns by the (time, row, column) of its
        #    place in the image, and the text after an image of h' x w' tokens resumes at
        #    p + max(h', w'), not p + h' * w': every later position is shifted (delta <= 0).
        #    In an engine step each sequence takes its own: M-RoPE with images, 1-D RoPE without.
        cos, sin = forward_cos_sin(self.model.rotary_emb, self.config.mrope_section, images, start, T, cache,
                                   x.dtype)  # (T, R) each

        # 3. The decoder layers; each writes its K/V or its DeltaNet states into the cache.
        #    The attention layers read their keys causally (the mask is made where attention
        #    runs, lollm.attention); the DeltaNet layers carry the order in their recurrence.
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, cache, start)  # (1, T, C)
            if hidden_states is not None and i < last:
                hidden_states.append(x)
        if cache is not None:
            cache.advance(T)

        # 4. Final RMSNorm. The MTP head drafts from these normed states: keep them
        #    (not in an engine step: the engine does not draft).
        x = self.model.norm(x)  # (1, T, C)
        if hidden_states is not None:
            hidden_states.append(x)
        if cache is not None and self.mtp is not None:
            cache.remember_last_forward(start, input_ids[0], x[0])

        # 5. Output head, only on the positions whose logits are wanted
        #    (an engine step passes a tensor: the row of each sequence's last token).
        x = keep_logit_rows(x, logits_to_keep)
        return self.lm_head(x)  # (1, T or logits_to_keep, vocab)

    def logit_lens(self, hidden: torch.Tensor, *, normed: bool = False) -> torch.Tensor:
        """The logit lens (``lollm trace``): a residual stream read the way steps 4-5 of forward read the last one.

        hidden (1, T, C), an entry of ``hidden_states`` -> (1, T, vocab). ``normed``: ``hidden``
        already went through the final norm (the last entry of ``hidden_states`` did).
        """
        return self.lm_head(hidden if normed else self.model.norm(hidden))

    def draft(self, cache: Qwen3_5HybridCache, pending: int, num_tokens: int) -> list[int]:
        """Greedy draft tokens after ``pending`` from the MTP head (see mtp.py).

        Uses the final hidden states the last forward left in the cache and the
        MTP head's own K/V slot; it does not touch what the main model's layers
        hold, so the loop can verify ``[pending, *drafts]`` with one forward.
        """
        if self.mtp is None:
            raise GenerationError("this checkpoint has no MTP head (no mtp.* tensors), so it cannot draft")
        return self.mtp.draft(
            cache, pending, num_tokens,
            embed_tokens=self.model.embed_tokens, lm_head=self.lm_head,
            rope=lambda first, T, dtype: sequence_cos_sin(
                self.model.rotary_emb, self.config.mrope_section, cache.image_spans, first, T, dtype),
        )
