"""Qwen3_5MoeConfig: the numbers that shape a qwen3_5_moe model, read from config.json.

A Qwen3.5 MoE config.json comes in two layouts, and both must load:

* the **multimodal** layout (what Qwen published: ``Qwen3_5MoeForConditionalGeneration``)::

      {"model_type": "qwen3_5_moe",
       "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, ...},
       "vision_config": {...},            # the vision tower: not used for text
       "tie_word_embeddings": true, ...}

* the **text-only** layout (``Qwen3_5MoeForCausalLM``): the keys of ``text_config``
  at the top level, with ``"model_type": "qwen3_5_moe_text"``.

The decoder's keys are the same in both; this module finds them and turns
them into one :class:`Qwen3_5MoeConfig`. The layer pattern comes from
``layer_types`` (one ``"linear_attention"`` / ``"full_attention"`` per layer)
or, when that list is absent, from ``full_attention_interval`` (every n-th
layer is full attention; transformers' default n is 4).

Every layer's feed-forward is a sparse mixture of experts: a router picks
``num_experts_per_tok`` of ``num_experts`` small SwiGLU experts per token
(their weights renormalised to sum to 1 when ``norm_topk_prob``, the default),
plus one shared expert that every token uses, scaled by a sigmoid gate.
``mlp_only_layers`` (dense layers inside a MoE model, a Qwen3-Next option) must be
empty: every Qwen3.5 MoE release has it so, and dense layers are not implemented here.

RoPE: Qwen3.5 rotates only the first ``partial_rotary_factor`` of each head's
channels (0.25: 64 of 256), with ``rope_theta`` 1e7. Its ``rope_parameters``
also carry ``mrope_section`` / ``mrope_interleaved``: *multimodal* RoPE gives
each token three positions (time, height, width) for image and video patches.
For text every token's three positions are the same number, so every channel
pair turns by ``position * inv_freq`` whichever section it belongs to: M-RoPE
reduces exactly to ordinary 1-D RoPE (checked against transformers by the
parity tests). lollm takes text only, so the sections are read and ignored.

The rule is *hard-fail, never guess*: a missing key the math needs, a RoPE
type we do not implement, a layer type we do not know, or a setting that
changes the math in a way this family does not implement raises
:class:`lollm.errors.ConfigError` naming the key. Keys that do not change the
math (``initializer_range``, ``use_cache``, ``dtype`` ...) are ignored.

Every value is untrusted and read through :class:`lollm.load.checks.ConfigReader`:
its type and range are checked where it is read (a count is a positive integer
under a stated bound, a RoPE base a finite number above 1, a flag a real
boolean), and an error names the file, the key and the value.
:meth:`Qwen3_5MoeConfig.check_weights` then compares the sizes with the
checkpoint's tensor table, so nothing is built that the weights do not back.

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lollm.load.checks import (
    MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, ConfigReader, WeightTable, show,
)
from lollm.errors import WeightsError

from . import MODEL_TYPES

#: Keys a ``rope_parameters`` (or hub ``rope_scaling``) dict may hold.
#: ``mrope_*`` only matter for image/video positions (see the module docstring).
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}

#: The two kinds of token mixer a layer can have.
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen3_5MoeConfig:
    """The hyper-parameters of a qwen3_5_moe model (the numbers are Qwen3.5-35B-A3B's).

    vocab_size:               rows of the embedding and of the logits (248320).
    hidden_size:              width of the residual stream (2048).
    num_experts:              routed experts per layer (256).
    num_experts_per_tok:      experts the router picks for each token (8).
    moe_intermediate_size:    width of one routed expert's hidden layer (512).
    shared_expert_intermediate_size: width of the shared expert's hidden layer (512).
    norm_topk_prob:           renormalise the picked experts' weights to sum to 1 (True).
    num_hidden_layers:        number of decoder layers (40).
    layer_types:              per layer, "linear_attention" (Gated DeltaNet) or
                              "full_attention" (gated softmax attention).
    num_attention_heads:      query heads of the full-attention layers (16).
    num_key_value_heads:      their key/value heads (GQA) (2).
    head_dim:                 width of one attention head (256).
    attention_bias:           q/k/v/o projections have a bias (False for every release).
    rotary_dim:               channels of each head that RoPE rotates: head_dim * partial_rotary_factor (64).
    rope_theta:               base of the RoPE frequencies (1e7).
    linear_num_key_heads:     DeltaNet query/key heads (16).
    linear_num_value_heads:   DeltaNet value heads (32): each
                              query/key head serves value_heads / key_heads value heads.
    linear_key_head_dim:      width of a DeltaNet query/key head (128).
    linear_value_head_dim:    width of a DeltaNet value head (128).
    linear_conv_kernel_dim:   length of the causal depthwise convolution (4).
    max_position_embeddings:  the longest context the model supports (262144).
    rms_norm_eps:             epsilon inside every RMSNorm.
    tie_word_embeddings:      the output head reuses the embedding matrix.
    eos_token_ids:            end-of-sequence ids from ``eos_token_id`` (int or list).
    mtp_num_hidden_layers:    decoder layers of the MTP draft head (1), used only when the
                              checkpoint carries ``mtp.*`` tensors.
    """

    vocab_size: int
    hidden_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rotary_dim: int
    rope_theta: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    mtp_num_hidden_layers: int = 1

    @property
    def full_attention_layers(self) -> list[int]:
        """Indices of the full-attention layers (3, 7, 11, ... for Qwen3.5)."""
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        """Indices of the Gated DeltaNet layers."""
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen3_5MoeConfig":
        """Parse config.json (as a dict), multimodal or text-only layout.

        Raises ConfigError naming the key for a missing required key or a
        setting this family does not implement.
        """
        read, tie = _decoder_keys(raw)

        # Settings that would change the math and that we do not implement.
        read.string("hidden_act", default="silu", choices=("silu",))
        read.check(read.boolean("attn_output_gate", default=True), "sets 'attn_output_gate' to false; only gated attention is implemented")
        read.check(read.positive_int("num_experts", default=0, at_most=MAX_HEADS) > 0,
                   "has no 'num_experts' (a dense model); it belongs to the family qwen3_5")
        mlp_only = read.value("mlp_only_layers", [])
        read.check(mlp_only == [], f"'mlp_only_layers' is {show(mlp_only)}; dense layers inside the MoE model are not implemented")
        read.check(read.integer("decoder_sparse_step", default=1, at_most=MAX_LAYERS) == 1,
                   "'decoder_sparse_step' is not 1; a MoE block in every layer (1) is implemented")
        for source in (read, ConfigReader(raw, "qwen3_5_moe: config.json")):
            source.check(not source.boolean("use_sliding_window", default=False),
                         "sets 'use_sliding_window'; sliding-window attention is not implemented")
            quantization = source.mapping("quantization_config") or {}
            source.check(not quantization, f"has 'quantization_config' ({show(quantization.get('quant_method', '?'))}); quantized safetensors are not supported")
        read.string("mamba_ssm_dtype", default="float32", choices=("float32",))  # the DeltaNet state is kept in float32 only
        read.check(not read.boolean("mtp_use_dedicated_embeddings", default=False),
                   "sets 'mtp_use_dedicated_embeddings'; an MTP head with its own embeddings is not implemented")

        # The sizes: every one positive and bounded (lollm.load.checks), then consistent with each other.
        num_layers = read.positive_int("num_hidden_layers", at_most=MAX_LAYERS)
        hidden = read.positive_int("hidden_size", at_most=MAX_WIDTH)
        heads = read.positive_int("num_attention_heads", at_most=MAX_HEADS)
        kv_heads = read.positive_int("num_key_value_heads", default=heads, at_most=heads)
        read.check(heads % kv_heads == 0, f"'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        head_dim = read.positive_int("head_dim", default=hidden // heads, at_most=MAX_WIDTH)
        read.check(head_dim >= 1, f"'hidden_size' ({hidden}) is smaller than 'num_attention_heads' ({heads}) and there is no 'head_dim'")
        k_heads = read.positive_int("linear_num_key_heads", at_most=MAX_HEADS)
        v_heads = read.positive_int("linear_num_value_heads", at_most=MAX_HEADS)
        read.check(v_heads % k_heads == 0, f"'linear_num_value_heads' ({v_heads}) is not a multiple of 'linear_num_key_heads' ({k_heads})")
        theta, factor = _read_rope(read)
        rotary_dim = int(head_dim * factor)
        read.check(rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim,
                   f"'partial_rotary_factor' {factor} gives {rotary_dim} rotary channels of {head_dim}; need an even number")
        experts = read.positive_int("num_experts", at_most=MAX_HEADS)
        top_k = read.positive_int("num_experts_per_tok", at_most=experts)
        eos = read.token_ids("eos_token_id") or ConfigReader(raw, "qwen3_5_moe: config.json").token_ids("eos_token_id")
        return cls(
            vocab_size=read.positive_int("vocab_size", at_most=MAX_VOCAB),
            hidden_size=hidden,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=read.positive_int("moe_intermediate_size", at_most=MAX_WIDTH),
            shared_expert_intermediate_size=read.positive_int("shared_expert_intermediate_size", at_most=MAX_WIDTH),
            norm_topk_prob=read.boolean("norm_topk_prob", default=True),  # transformers' Qwen3.5 MoE always normalises
            num_hidden_layers=num_layers,
            layer_types=_read_layer_types(read, num_layers),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            attention_bias=read.boolean("attention_bias", default=False),
            rotary_dim=rotary_dim,
            rope_theta=theta,
            linear_num_key_heads=k_heads,
            linear_num_value_heads=v_heads,
            linear_key_head_dim=read.positive_int("linear_key_head_dim", at_most=MAX_WIDTH),
            linear_value_head_dim=read.positive_int("linear_value_head_dim", at_most=MAX_WIDTH),
            linear_conv_kernel_dim=read.positive_int("linear_conv_kernel_dim", at_most=MAX_WIDTH),
            max_position_embeddings=read.positive_int("max_position_embeddings", at_most=MAX_CONTEXT),
            rms_norm_eps=read.number("rms_norm_eps", above=0.0, at_most=1.0),
            tie_word_embeddings=tie,
            eos_token_ids=eos,
            mtp_num_hidden_layers=read.integer("mtp_num_hidden_layers", default=1, at_most=MAX_LAYERS),
        )

    def check_weights(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Check the sizes against the checkpoint's tensor table, before any module is built.

        shapes: model tensor name -> shape (:func:`lollm.load.checks.tensor_table`; names and shapes
        come from the file headers, no data is read). Raises ConfigError naming the key, its
        value and what the weights hold; WeightsError naming a tensor the check needs that is
        absent (an untied model without ``lm_head.weight`` included).
        """
        table = WeightTable(shapes, "qwen3_5_moe: config.json")
        table.layers("num_hidden_layers", self.num_hidden_layers, "model.layers.")
        table.size("vocab_size", self.vocab_size, "model.embed_tokens.weight", 0)
        table.size("hidden_size", self.hidden_size, "model.embed_tokens.weight", 1)
        table.size("num_experts", self.num_experts, "model.layers.0.mlp.gate.weight", 0)
        table.size("moe_intermediate_size", self.moe_intermediate_size, "model.layers.0.mlp.experts.down_proj", 2)
        table.size("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                   "model.layers.0.mlp.shared_expert.up_proj.weight", 0)
        full, linear = self.full_attention_layers[:1], self.linear_attention_layers[:1]
        for i in full:  # queries and their output gates: 2 x heads x head_dim rows
            table.size(("num_attention_heads", "head_dim"), 2 * self.num_attention_heads * self.head_dim,
                       f"model.layers.{i}.self_attn.q_proj.weight", 0)
            table.size(("num_key_value_heads", "head_dim"), self.num_key_value_heads * self.head_dim,
                       f"model.layers.{i}.self_attn.k_proj.weight", 0)
        for i in linear:
            table.size(("linear_num_value_heads", "linear_value_head_dim"), self.linear_num_value_heads * self.linear_value_head_dim,
                       f"model.layers.{i}.linear_attn.in_proj_z.weight", 0)
            table.size("linear_conv_kernel_dim", self.linear_conv_kernel_dim, f"model.layers.{i}.linear_attn.conv1d.weight", 2)
        if not self.tie_word_embeddings and "lm_head.weight" not in shapes:
            raise WeightsError(
                "qwen3_5_moe: config.json says the output head is not tied to the embedding "
                "('tie_word_embeddings' false), but the checkpoint has no tensor for 'lm_head.weight'"
            )


def _decoder_keys(raw: dict[str, Any]) -> tuple[ConfigReader, bool]:
    """A reader of the decoder's keys, and whether the output head is tied.

    Multimodal: ``raw["text_config"]``; the tie flag is the top-level one (the
    wrapper owns ``lm_head``), or text_config's when the top level has none.
    Text-only: ``raw`` itself.
    """
    top = ConfigReader(raw, "qwen3_5_moe: config.json")
    model_type = top.string("model_type", choices=MODEL_TYPES)
    if model_type == "qwen3_5_moe_text":
        return top, top.boolean("tie_word_embeddings", default=False)  # transformers' default
    top.check(isinstance(raw.get("text_config"), dict),
              "has model_type 'qwen3_5_moe' but no 'text_config' object holding the decoder")
    text = ConfigReader(raw["text_config"], "qwen3_5_moe: config.json 'text_config'")
    text.string("model_type", default="qwen3_5_moe_text", choices=("qwen3_5_moe_text",))
    outer, inner = top.boolean("tie_word_embeddings", default=None), text.boolean("tie_word_embeddings", default=None)
    top.check(outer is None or inner is None or outer == inner,
              f"'tie_word_embeddings' is {outer} at the top level but {inner} in 'text_config'; "
              f"cannot tell whether the output head is tied")
    return text, bool(outer if outer is not None else inner if inner is not None else False)


def _read_layer_types(read: ConfigReader, num_layers: int) -> tuple[str, ...]:
    """``layer_types`` as a tuple, or the pattern ``full_attention_interval`` describes.

    With interval n, layer i is full attention when (i + 1) is a multiple of n
    (layers 3, 7, 11, ... for n = 4), as in transformers.
    """
    interval = read.positive_int("full_attention_interval", default=None, at_most=MAX_LAYERS)
    from_interval = tuple(
        "full_attention" if (i + 1) % (interval or 4) == 0 else "linear_attention" for i in range(num_layers)
    )
    types = read.strings("layer_types", default=from_interval, length=num_layers, choices=LAYER_TYPES)
    read.check(interval is None or types == from_interval,
               f"'layer_types' does not match 'full_attention_interval' ({interval}); cannot tell which one holds")
    return types


def _read_rope(read: ConfigReader) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` (or the hub's ``rope_scaling`` + ``rope_theta``).

    transformers' rules: theta and the factor are looked up in the RoPE dict
    first, then at the top level; the factor defaults to 0.25 for this family.
    """
    params = read.mapping("rope_parameters")
    scaling = read.mapping("rope_scaling")
    read.check(params is None or scaling is None or params == scaling,
               "has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
    where = "rope_parameters" if params is not None else "rope_scaling"
    rope = ConfigReader(params if params is not None else scaling or {}, f"{read.where} {where!r}")
    rope.check(not any(isinstance(v, dict) for v in rope.raw.values()),
               "is nested per layer type; one RoPE for all layers is implemented")
    hub_type = rope.string("type", default="default", choices=("default",))  # the hub's spelling of rope_type
    rope.string("rope_type", default=hub_type, choices=("default",))
    rope.refuse_unknown(ROPE_KEYS, "this family")

    theta = rope.rope_theta("rope_theta", default=None)
    inner = rope.number("partial_rotary_factor", default=None, above=0.0, at_most=1.0)
    outer = read.number("partial_rotary_factor", default=None, above=0.0, at_most=1.0)
    read.check(inner is None or outer is None or inner == outer,
               f"'partial_rotary_factor' is {outer} at the top level but {inner} in {where!r}; cannot tell which one holds")
    factor = inner if inner is not None else outer if outer is not None else 0.25
    return (read.rope_theta("rope_theta") if theta is None else theta), factor
