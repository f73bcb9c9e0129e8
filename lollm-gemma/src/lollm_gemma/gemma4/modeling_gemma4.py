"""The gemma4 text decoder: Gemma 3's sandwich layers plus per-layer embeddings and shared KV.

::

    input_ids (1, T) ──────────────────────────────┐  (image positions: <pad>)
        │ embed_tokens, × sqrt(C)                  │ embed_tokens_per_layer, × sqrt(P)
        │ images: their rows replace <pad>'s       │
        ▼                                          ▼
    x (1, T, C) ── per_layer_model_projection ──► per-layer inputs (1, T, L, P)
        │                                          │  (one P-wide vector per token per layer)
        ├──────────────────────────────┐           │
        │ input_layernorm              │  ×L       │
        │ self_attn (QK-norm, v-norm,  │           │
        │   RoPE local / proportional) ◄── cache, or the source layer's K/V (last layers)
        │ post_attention_layernorm     │           │
        + ◄────────────────────────────┘           │
        ├──────────────────────────────┐           │
        │ pre_feedforward_layernorm    │           │
        │ mlp (GeGLU; 2x wide on the   │           │
        │   KV-sharing layers)         │           │
        │ post_feedforward_layernorm   │           │
        + ◄────────────────────────────┘           │
        ├──────────────────────────────┐           │
        │ gelu(per_layer_input_gate) × ◄───────────┘  layer i's slice
        │ per_layer_projection         │
        │ post_per_layer_input_norm    │
        + ◄────────────────────────────┘
        │ × layer_scalar (a per-layer constant stored in the checkpoint)
        │ norm
        │ lm_head (tied), cap * tanh(logits / cap)
        ▼
    logits (1, T, vocab)

Module names mirror transformers' Gemma4ForCausalLM (``model.embed_tokens_per_layer``,
``model.layers.N.per_layer_input_gate``, ``model.layers.N.layer_scalar`` …), so the
name map from a Hugging Face checkpoint is the identity (weights.py).
Images (plugin contract 3, docs/vision.md; the tower is gemma4_vision.py) enter at the
embedding: see :meth:`Gemma4ForCausalLM.embed` and docs/gemma4.md, Vision.
Shape letters as in blocks.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lollm.batch import CacheLayer, keep_logit_rows, token_positions
from lollm.trace import record_series, record_softcap, tracing
from lollm.vision.spec import ImageBatch
from lollm.vision.step import image_numbers, scatter_step_images

from .blocks import Gemma4Attention, Gemma4MLP, ImageBlocks, RMSNorm, RotaryEmbedding
from .config import SLIDING, Gemma4Config
from .kv import Gemma4Cache


#: What ``lollm trace`` says under its charts.
SOFTCAP_NOTE = ("Every final logit x becomes cap * tanh(x / cap), inside (-cap, cap): small logits pass almost "
                "unchanged, large ones flatten against the cap. The points are the selected token's largest "
                "logits, before (x) and after (y) the cap.")
PLE_NOTE = ("Gemma 4 gives each layer its own small embedding of every token (P numbers: a row of a per-layer "
            "table averaged with a projection of the main embedding). The layer gates it with its residual "
            "stream, projects it to C and adds it. Lines: the size of that per-layer input, of what is added, "
            "and of the stream it joins.")


class Gemma4DecoderLayer(nn.Module):
    """One layer: Gemma 3's sandwich, then the per-layer-embedding block, then a constant scale.

        x = x + post_attention_layernorm(attention(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
        x = x + post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(x)) * ple))
        x = x * layer_scalar

    x: (1, T, C), ple: (1, T, P) -> (1, T, C)
    """

    def __init__(self, config: Gemma4Config, layer_idx: int):
        super().__init__()
        C, P, eps = config.hidden_size, config.hidden_size_per_layer_input, config.rms_norm_eps
        self.layer_type = config.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(C, eps)
        self.self_attn = Gemma4Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(C, eps)
        self.pre_feedforward_layernorm = RMSNorm(C, eps)
        self.mlp = Gemma4MLP(config, layer_idx)
        self.post_feedforward_layernorm = RMSNorm(C, eps)
        self.has_per_layer_input = P > 0
        if self.has_per_layer_input:
            self.per_layer_input_gate = nn.Linear(C, P, bias=False)
            self.per_layer_projection = nn.Linear(P, C, bias=False)
            self.post_per_layer_input_norm = RMSNorm(C, eps)
        # a checkpoint buffer, not a parameter: a fixed per-layer scale of the residual stream
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x, per_layer_input, cos, sin, start: int, window: int | None, cache, shared_kv,
                images: ImageBlocks | None = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, start, window, cache, shared_kv, images)
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.has_per_layer_input:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh")  # (1, T, P)
            added = self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))  # (1, T, C)
            if tracing():  # only inside `lollm trace`: how much the per-layer embedding adds, beside the stream
                record_series(self, "per-layer embedding", torch.stack(
                    (per_layer_input.norm(dim=-1), added.norm(dim=-1), x.norm(dim=-1)), dim=-1), note=PLE_NOTE,
                    channels=("||per-layer input||", "||added to the stream||", "||stream||"))
            x = x + added
        return x * self.layer_scalar


class Gemma4TextModel(nn.Module):
    """The decoder body, a container named ``model`` so parameter names match HF checkpoints.

    Per-layer embeddings (PLE), when ``hidden_size_per_layer_input`` P > 0:
      embed_tokens_per_layer:     (vocab_per_layer, L*P) table, a P-wide vector per token per layer;
      per_layer_model_projection: C -> L*P, the same from the (scaled) token embedding;
      per_layer_projection_norm:  RMSNorm over each P-wide slice.
    Its work is done in :meth:`Gemma4ForCausalLM.forward`.
    """

    def __init__(self, config: Gemma4Config):
        super().__init__()
        C, L, P = config.hidden_size, config.num_hidden_layers, config.hidden_size_per_layer_input
        self.embed_tokens = nn.Embedding(config.vocab_size, C)
        if P:
            self.embed_tokens_per_layer = nn.Embedding(config.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = nn.Linear(C, L * P, bias=False)
            self.per_layer_projection_norm = RMSNorm(P, config.rms_norm_eps)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(L))
        self.norm = RMSNorm(C, config.rms_norm_eps)
        self.rotary_emb = nn.ModuleDict(
            {t: RotaryEmbedding(config.rope_for(t), config.head_dim_for(t)) for t in sorted(set(config.layer_types))}
        )


class Gemma4ForCausalLM(nn.Module):
    """A gemma4 causal language model, following :class:`lollm.model.VisionLM` (a CausalLM that takes images)."""

    #: its forward takes images in an engine step too (lollm.model.VisionLM; lollm.vision.step)
    batches_images = True

    def __init__(self, config: Gemma4Config):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.num_layers = config.num_hidden_layers
        self.eos_token_ids = config.eos_token_ids
        self.model = Gemma4TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # sqrt(C) and sqrt(P), stored in the model dtype as transformers does
        self.register_buffer("embed_scale", torch.empty(()), persistent=False)
        self.register_buffer("per_layer_embed_scale", torch.empty(()), persistent=False)

    def materialize(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """Compute the embedding scales, which no checkpoint holds, on ``device`` in ``dtype``.

        :func:`lollm.load.build.build_model` calls it after building the model on the meta device
        (and calls each RotaryEmbedding's own ``materialize`` for the RoPE frequencies).
        """
        self.embed_scale = torch.tensor(self.config.hidden_size**0.5, dtype=dtype, device=device)
        self.per_layer_embed_scale = torch.tensor(self.config.hidden_size_per_layer_input**0.5, dtype=dtype, device=device)

    def new_cache(self, max_tokens: int) -> Gemma4Cache:
        """An empty cache for ``max_tokens`` positions, on the model's device and dtype."""
        weight = self.model.embed_tokens.weight
        return Gemma4Cache(self.config, max_tokens, device=weight.device, dtype=weight.dtype)

    def cache_layers(self) -> list[CacheLayer]:
        """What each cache layer holds, for the batched engine (lollm.batch), one entry per decoder layer.

        Layer i's keys have its type's shape (``kv_heads_for``, ``head_dim_for``: a global
        layer may be wider, or have other KV heads, than a sliding one): "sliding" with a
        window of W, or "full". A KV-sharing layer (``kv_source(i) != i``) stores nothing
        and calls no ``cache.update``: it is "shared", and reads the pool of its source
        layer, which the forward hands it through ``shared_kv``.
        """
        c = self.config
        out = []
        for i, t in enumerate(c.layer_types):
            K, D = c.kv_heads_for(t), c.head_dim_for(t)
            if c.kv_source(i) != i:
                out.append(CacheLayer("shared"))
            elif t == SLIDING:
                out.append(CacheLayer("sliding", K, D, window=c.sliding_window))
            else:
                out.append(CacheLayer("full", K, D))
        return out

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The per-layer embeddings: (1, T) ids and (1, T, C) scaled embeddings -> (1, T, L, P).

        Two views of each token, averaged: its own row of the per-layer table (what
        the token *is*), and a projection of its main embedding (normed per layer).
        The factor 1/sqrt(2) keeps the sum of the two at the size of either.
        """
        m, L, P = self.model, self.config.num_hidden_layers, self.config.hidden_size_per_layer_input
        T = input_ids.shape[1]
        from_table = m.embed_tokens_per_layer(input_ids).view(1, T, L, P) * self.per_layer_embed_scale
        projected = m.per_layer_model_projection(x) * self.config.hidden_size**-0.5  # (1, T, L*P)
        projected = m.per_layer_projection_norm(projected.view(1, T, L, P))
        return (projected + from_table) * 2.0**-0.5

    def embed(self, input_ids: torch.Tensor, start, images: ImageBatch | list[ImageBatch | None] | None):
        """Steps 1-2 of forward: (1, T) ids -> x (1, T, C), per-layer inputs (1, T, L, P) or None, ImageBlocks or None.

        Text: x = embed_tokens(ids) * sqrt(C), and the per-layer inputs read the ids and x.
        With images inside these T positions (docs/gemma4.md, Vision), as transformers'
        Gemma4Model does:

          a. each image position's id becomes ``pad_token_id`` (<pad>): the placeholder id has
             no meaning of its own, and <pad> is what both tables read there;
          b. embed and scale as text; then the image's rows (the tower's soft tokens, already C
             wide and not scaled) replace the <pad> rows (lollm.vision.step.scatter_step_images);
          c. the per-layer inputs: the table's row of <pad> at the image positions, and the
             projection of x *with the images in*, so each layer still sees the image.

        The third value says which positions belong to which image (blocks.ImageBlocks), for the
        sliding layers' mask; None unless the config makes them bidirectional (26B, 31B) and an
        image falls here. start: an int, or an engine step's Batch; then ``images`` is a list of
        one ImageBatch or None per sequence, and a-c run on each sequence's rows of the N
        (lollm.vision.step: the images are numbered across the step, so two sequences' images
        never count as one). ValueError for images given to a config that lacks ``pad_token_id``
        or does not say how images attend (a GGUF file of a width not in config_gguf's table), and
        for an image this forward would cut.
        """
        c = self.config
        blocks = self._image_numbers(images, start, input_ids.shape[1], input_ids.device)  # (T,), -1: text
        if blocks is not None:
            input_ids = input_ids.masked_fill(blocks[None] >= 0, c.pad_token_id)  # a.
        x = self.model.embed_tokens(input_ids) * self.embed_scale  # (1, T, C)
        if blocks is not None:
            x = scatter_step_images(x, images, start)  # b. (1, T, C), the images' rows in place
        ple = self.per_layer_inputs(input_ids, x) if c.hidden_size_per_layer_input else None  # c. (1, T, L, P)
        bidirectional = blocks is not None and c.images_bidirectional
        return x, ple, ImageBlocks(start, blocks) if bidirectional else None

    def _image_numbers(self, images, start, T: int, device: torch.device) -> torch.Tensor | None:
        """(T,) int64: for each new token the number of the image it belongs to, -1 for text; None without images here.

        images and start as :func:`lollm.vision.step.image_numbers` (an ImageBatch and an int, or
        one ImageBatch-or-None per sequence and a Batch); ValueError for a cut image, or for a
        config that cannot place images.
        """
        blocks = image_numbers(images, start, T, device)  # None: no image among these T tokens
        c = self.config
        if blocks is not None and (c.pad_token_id is None or c.images_bidirectional is None):
            raise ValueError("gemma4: this checkpoint does not say which id an image's positions embed ('pad_token_id') "
                             "or how its images attend ('use_bidirectional_attention'; a GGUF file says it only "
                             "through its width, gemma4/config_gguf.py IMAGE_ATTENTION_BY_WIDTH)")
        return blocks

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Gemma4Cache | None = None,
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
        gemma4_vision.py; those inside these T positions go in at steps 1-2 (:meth:`embed`) and,
        on the 26B/31B, attend both ways inside themselves on the sliding layers (step 4). In an
        engine step, a list of one ImageBatch or None per sequence of the Batch (``batches_images``;
        lollm.vision.step).
        """
        c = self.config
        T = input_ids.shape[1]
        start = 0 if cache is None else cache.length  # an int; in an engine step, a lollm.batch.Batch
        if cache is not None:
            cache.check_room(T)

        # 1-2. Embed, scale by sqrt(C), put the images in; then the per-layer embeddings (PLE):
        #      one P-wide input per token for every layer (see embed).
        x, ple, image_blocks = self.embed(input_ids, start, images)  # (1, T, C), (1, T, L, P) or None
        if hidden_states is not None:
            hidden_states.append(x)

        # 3. Positions, and the cos/sin of their RoPE angles per layer type (the head
        #    widths differ: 256 for sliding layers, 512 for global ones on E2B).
        positions = token_positions(start, T, input_ids.device)  # (T,): start .. start+T-1, or each token's own
        rope = {t: emb(positions, x.dtype) for t, emb in self.model.rotary_emb.items()}  # t -> (cos, sin)

        # 4. Who may attend to whom, per layer type: causally, a sliding layer only within the
        #    last W positions (None: global). The masks are built where attention runs (lollm.attention);
        #    with image_blocks (26B/31B, images in this forward) a sliding layer's by blocks.image_visible.
        windows = {t: c.sliding_window if t == SLIDING else None for t in rope}

        # 5. The decoder layers. Layers that compute keys/values write them to their cache;
        #    the last num_kv_shared_layers read their source layer's from `shared_kv`.
        #    In an engine step the stored keys are the source layer's pools (blocks, block_size, K, D),
        #    which the KV-sharing layers read through the same Batch (ring order never applies there).
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor, bool]] = {}  # type -> (k, v, ring order?)
        cut = logits_to_keep if isinstance(logits_to_keep, int) else 0  # an engine step (a tensor of rows): no cut
        last = len(self.model.layers) - 1
        q_start = start  # position of the first query the layers carry
        for i, layer in enumerate(self.model.layers):
            if i == c.first_kv_shared_layer and 0 < cut < x.shape[1] and hidden_states is None:
                # 5a. From here on no layer writes to the cache, and position t of the output
                #     depends only on position t of x (plus the stored keys/values). So only the
                #     positions whose logits are wanted need to go on: a prefill carries its
                #     last token alone through the KV-sharing layers (against all the stored keys).
                #     (An engine step carries all its N tokens on, with the same Batch.)
                x, ple, rope = self._keep_last(cut, x, ple, rope)
                q_start = start + T - cut
            t = layer.layer_type
            cos, sin = rope[t]
            x = layer(x, None if ple is None else ple[:, :, i], cos, sin, q_start, windows[t], cache, shared_kv,
                      image_blocks)  # (1, T, C)
            if hidden_states is not None and i < last:
                hidden_states.append(x)
        if cache is not None:
            cache.advance(T)

        # 6. Final RMSNorm.
        x = self.model.norm(x)  # (1, T, C)
        if hidden_states is not None:
            hidden_states.append(x)

        # 7. Output head, only on the positions whose logits are wanted (an engine
        #    step passes a tensor: the row of each sequence's last token).
        x = keep_logit_rows(x, logits_to_keep)
        logits = self.lm_head(x)  # (1, T or logits_to_keep, vocab)

        # 8. Final-logit soft-cap: cap * tanh(logits / cap) keeps every logit in (-cap, cap).
        if c.final_logit_softcapping is not None:
            before, logits = logits, torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
            record_softcap(self, "final-logit soft-cap", before, logits, cap=c.final_logit_softcapping,
                           note=SOFTCAP_NOTE)  # lollm trace only
        return logits

    def logit_lens(self, hidden: torch.Tensor, *, normed: bool = False) -> torch.Tensor:
        """The logit lens (``lollm trace``): a residual stream read the way steps 6-8 of forward read the last one.

        hidden (1, T, C), an entry of ``hidden_states`` -> (1, T, vocab), soft-capped like the real
        logits. ``normed``: ``hidden`` already went through the final norm (the last entry did).
        """
        logits = self.lm_head(hidden if normed else self.model.norm(hidden))
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @staticmethod
    def _keep_last(n, x, ple, rope):
        """Cut every per-position input of the remaining layers to the last n positions.

        The stored keys stay whole; attention is told where the remaining queries sit
        (``start + T - n``), and builds their masks from that.
        """
        x = x[:, -n:]
        ple = None if ple is None else ple[:, -n:]
        rope = {t: (cos[-n:], sin[-n:]) for t, (cos, sin) in rope.items()}
        return x, ple, rope
