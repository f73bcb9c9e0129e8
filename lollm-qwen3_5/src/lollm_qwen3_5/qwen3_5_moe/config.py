"""Qwen3_5MoeConfig: the numbers that shape a qwen3_5_moe model, read from config.json or GGUF metadata.

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
parity tests). Image tokens do get three different positions; which frequencies
follow height and width is ``mrope_section`` (kept in the config, used by
``lollm_qwen3_5.qwen3_5_moe.mrope`` when a prompt holds images).

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

A GGUF file written by llama.cpp's converter carries the same numbers as
``qwen35moe.*`` metadata keys: :func:`config_from_gguf` reads them under the same
rule (the table in its docstring; docs/qwen3_5_moe.md, "From GGUF").

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lollm.load.checks import (
    MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, ConfigReader, WeightTable, show,
)
from lollm.errors import ConfigError, WeightsError

from . import GGUF_ARCHITECTURES, MODEL_TYPES

#: Keys a ``rope_parameters`` (or hub ``rope_scaling``) dict may hold.
#: ``mrope_*`` only matter for image/video positions (see the module docstring).
ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"}

#: M-RoPE's (time, height, width) frequency counts when a config gives none (transformers' and llama.cpp's).
DEFAULT_MROPE_SECTION = (11, 11, 10)

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
    mrope_section:            M-RoPE's (time, height, width) frequency counts, interleaved
                              T H W T H W ... (11, 11, 10): image tokens only (mrope.py).
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
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION

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
        theta, factor, section = _read_rope(read)
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
            mrope_section=section,
        )

    def check_weights(self, shapes: Mapping[str, tuple[int, ...]], fmt: str = "safetensors") -> None:
        """Check the sizes against the checkpoint's tensor table, before any module is built.

        shapes: model tensor name -> shape (:func:`lollm.load.checks.tensor_table`; names and shapes
        come from the file headers, no data is read); fmt: "safetensors" or "gguf", to name the
        key as that file spells it. Raises ConfigError naming the key, its value and what the
        weights hold; WeightsError naming a tensor the check needs that is absent (an untied
        model without ``lm_head.weight`` included).
        """
        gguf = fmt == "gguf"
        table = WeightTable(shapes, f"qwen3_5_moe: {'GGUF metadata' if gguf else 'config.json'}", GGUF_FIELD_KEYS if gguf else None)
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
                f"qwen3_5_moe: {'the GGUF file' if gguf else 'config.json'} says the output head is not tied to the embedding "
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


def _read_rope(read: ConfigReader) -> tuple[float, float, tuple[int, int, int]]:
    """(rope_theta, partial_rotary_factor, mrope_section) from ``rope_parameters`` (or the hub's ``rope_scaling`` + ``rope_theta``).

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
    section = _mrope_section(rope, "mrope_section", rope.value("mrope_section", None))
    return (read.rope_theta("rope_theta") if theta is None else theta), factor, section


def _mrope_section(read: ConfigReader, key: str, value: object) -> tuple[int, int, int]:
    """M-RoPE's (time, height, width) frequency counts from ``value``: config.json's ``mrope_section``
    (three ints) or GGUF's ``rope.dimension_sections`` (four, the last 0). Absent: (11, 11, 10), the
    default of transformers' Qwen3_5TextRotaryEmbedding and of llama.cpp's converter. (The hub's
    ``mrope_interleaved`` is not read: transformers interleaves for Qwen3.5 whatever it says.)
    ConfigError naming ``key`` for anything else.
    """
    if value is None:
        return DEFAULT_MROPE_SECTION
    counts = list(value) if isinstance(value, (list, tuple)) else []
    if len(counts) == 4 and counts[3] == 0:
        counts = counts[:3]
    read.check(len(counts) == 3 and all(type(n) is int and 0 <= n <= MAX_WIDTH for n in counts),
               f"{key!r} is {show(value)}: expected three counts (time, height, width) of M-RoPE frequencies")
    return (counts[0], counts[1], counts[2])


# ---------------------------------------------------------------------------
# GGUF: the same numbers, read from llama.cpp's metadata keys
# ---------------------------------------------------------------------------

#: The ``{arch}.*`` keys :func:`config_from_gguf` reads (``{arch}`` is ``general.architecture``,
#: "qwen35moe"). Names as gguf-py spells them in ``gguf/constants.py`` (class ``Keys``); the converter
#: writes them in ``conversion/qwen.py`` (``Qwen3NextModel.set_gguf_parameters``, ``Qwen2MoeModel``,
#: ``_QwenMtpMixin``, ``_Qwen35MRopeMixin``) on top of ``conversion/base.py`` ``TextModel.set_gguf_parameters``.
GGUF_ARCH_KEYS_READ = (
    "block_count",                      # Keys.LLM.BLOCK_COUNT: decoder layers + MTP layers
    "nextn_predict_layers",             # Keys.LLM.NEXTN_PREDICT_LAYERS: MTP layers (absent: 0)
    "context_length",                   # -> max_position_embeddings
    "embedding_length",                 # -> hidden_size
    "expert_count",                     # -> num_experts
    "expert_used_count",                # -> num_experts_per_tok
    "expert_feed_forward_length",       # -> moe_intermediate_size
    "expert_shared_feed_forward_length",  # -> shared_expert_intermediate_size
    "vocab_size",                       # optional; checked against token_embd.weight
    "attention.head_count",             # -> num_attention_heads
    "attention.head_count_kv",          # -> num_key_value_heads (absent: = head_count)
    "attention.key_length",             # -> head_dim
    "attention.value_length",           # must equal head_dim
    "attention.layer_norm_rms_epsilon", # -> rms_norm_eps
    "attention.recurrent_layers",       # per block, True for a Gated DeltaNet layer -> layer_types
    "full_attention_interval",          # must agree with recurrent_layers
    "rope.freq_base",                   # -> rope_theta
    "rope.dimension_count",             # -> rotary_dim (head_dim * partial_rotary_factor)
    "rope.dimension_sections",          # -> mrope_section (image tokens' M-RoPE)
    "ssm.conv_kernel",                  # -> linear_conv_kernel_dim
    "ssm.state_size",                   # -> linear_key_head_dim
    "ssm.group_count",                  # -> linear_num_key_heads
    "ssm.time_step_rank",               # -> linear_num_value_heads
    "ssm.inner_size",                   # -> linear_num_value_heads * linear_value_head_dim
)

#: Config fields -> the GGUF keys they come from, for error messages.
GGUF_FIELD_KEYS = {
    "num_hidden_layers": "qwen35moe.block_count - qwen35moe.nextn_predict_layers",
    "vocab_size": "token_embd.weight rows",
    "hidden_size": "qwen35moe.embedding_length",
    "num_experts": "qwen35moe.expert_count",
    "moe_intermediate_size": "qwen35moe.expert_feed_forward_length",
    "shared_expert_intermediate_size": "qwen35moe.expert_shared_feed_forward_length",
    "num_attention_heads": "qwen35moe.attention.head_count",
    "num_key_value_heads": "qwen35moe.attention.head_count_kv",
    "head_dim": "qwen35moe.attention.key_length",
    "linear_num_value_heads": "qwen35moe.ssm.time_step_rank",
    "linear_value_head_dim": "qwen35moe.ssm.inner_size / qwen35moe.ssm.time_step_rank",
    "linear_conv_kernel_dim": "qwen35moe.ssm.conv_kernel",
}


def config_from_gguf(metadata: dict[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]]) -> Qwen3_5MoeConfig:
    """Build a :class:`Qwen3_5MoeConfig` from a GGUF file's metadata (llama.cpp's keys, ``{arch}`` = ``qwen35moe``).

    ====================================  =================================================
    GGUF key                              Qwen3_5MoeConfig field
    ====================================  =================================================
    {arch}.block_count                    num_hidden_layers + the MTP layers
    {arch}.nextn_predict_layers           mtp_num_hidden_layers (absent: 0, no MTP head)
    {arch}.context_length                 max_position_embeddings
    {arch}.embedding_length               hidden_size
    {arch}.expert_count                   num_experts
    {arch}.expert_used_count              num_experts_per_tok
    {arch}.expert_feed_forward_length     moe_intermediate_size
    {arch}.expert_shared_feed_forward_length  shared_expert_intermediate_size
    {arch}.attention.head_count(_kv)      num_attention_heads, num_key_value_heads
    {arch}.attention.key_length           head_dim (value_length must be equal)
    {arch}.attention.layer_norm_rms_epsilon  rms_norm_eps (stored as a float32)
    {arch}.attention.recurrent_layers     layer_types (True: "linear_attention")
    {arch}.full_attention_interval        must agree with recurrent_layers
    {arch}.rope.freq_base                 rope_theta
    {arch}.rope.dimension_count           rotary_dim
    {arch}.rope.dimension_sections        mrope_section (its first three; absent: 11, 11, 10)
    {arch}.ssm.conv_kernel                linear_conv_kernel_dim
    {arch}.ssm.state_size                 linear_key_head_dim
    {arch}.ssm.group_count                linear_num_key_heads
    {arch}.ssm.time_step_rank             linear_num_value_heads
    {arch}.ssm.inner_size                 linear_num_value_heads * linear_value_head_dim
    tokenizer.ggml.eos_token_id           eos_token_ids
    ====================================  =================================================

    The converter writes no key for ``norm_topk_prob``: every Qwen3.5 MoE release and
    transformers' Qwen3.5 MoE normalise the picked experts' weights, and so does llama.cpp's
    qwen35moe graph, so it is True.

    ``tensor_shapes`` (GGUF tensor name -> shape in PyTorch order) gives what the metadata
    does not: the vocabulary (rows of ``token_embd.weight``), tied embeddings (no
    ``output.weight``) and ``attention_bias`` (``attn_q.bias`` present). Hard-fail: a required
    key missing, or any other ``{arch}.*`` key (it could change the math), raises ConfigError
    naming it; ``general.*`` and ``tokenizer.*`` (read by :mod:`lollm.tokenizer`) are not ours.
    """
    read, key = _gguf_reader(metadata, "qwen3_5_moe")
    blocks = read.positive_int(key("block_count"), at_most=MAX_LAYERS)
    mtp = read.integer(key("nextn_predict_layers"), default=0, at_most=MAX_LAYERS)
    read.check(mtp < blocks, f"{key('nextn_predict_layers')!r} ({mtp}) leaves no decoder layer of {key('block_count')!r} ({blocks})")
    num_layers = blocks - mtp
    hidden = read.positive_int(key("embedding_length"), at_most=MAX_WIDTH)
    heads = read.positive_int(key("attention.head_count"), at_most=MAX_HEADS)
    kv_heads = read.positive_int(key("attention.head_count_kv"), default=heads, at_most=heads)
    read.check(heads % kv_heads == 0, f"{key('attention.head_count')!r} ({heads}) is not a multiple of {key('attention.head_count_kv')!r} ({kv_heads})")
    head_dim = read.positive_int(key("attention.key_length"), at_most=MAX_WIDTH)
    value_length = read.positive_int(key("attention.value_length"), default=head_dim, at_most=MAX_WIDTH)
    read.check(value_length == head_dim, f"{key('attention.value_length')!r} ({value_length}) differs from {key('attention.key_length')!r} ({head_dim})")
    rotary_dim = read.positive_int(key("rope.dimension_count"), at_most=head_dim)
    read.check(rotary_dim % 2 == 0, f"{key('rope.dimension_count')!r} is {rotary_dim}; RoPE needs an even number of channels")
    section = _mrope_section(read, key("rope.dimension_sections"), read.value(key("rope.dimension_sections"), None))
    k_heads, v_heads, v_dim = _gguf_delta_net(read, key)
    layer_types = _gguf_layer_types(read, key, blocks, num_layers)
    experts = read.positive_int(key("expert_count"), at_most=MAX_HEADS)
    first_full = layer_types.index("full_attention") if "full_attention" in layer_types else num_layers
    return Qwen3_5MoeConfig(
        vocab_size=_gguf_vocab(read, key, metadata, tensor_shapes, "qwen3_5_moe"),
        hidden_size=hidden,
        num_experts=experts,
        num_experts_per_tok=read.positive_int(key("expert_used_count"), at_most=experts),
        moe_intermediate_size=read.positive_int(key("expert_feed_forward_length"), at_most=MAX_WIDTH),
        shared_expert_intermediate_size=read.positive_int(key("expert_shared_feed_forward_length"), at_most=MAX_WIDTH),
        norm_topk_prob=True,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        attention_bias=f"blk.{first_full}.attn_q.bias" in tensor_shapes,  # the converter keeps biases when there are any
        rotary_dim=rotary_dim,
        rope_theta=read.rope_theta(key("rope.freq_base")),
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=read.positive_int(key("ssm.state_size"), at_most=MAX_WIDTH),
        linear_value_head_dim=v_dim,
        linear_conv_kernel_dim=read.positive_int(key("ssm.conv_kernel"), at_most=MAX_WIDTH),
        max_position_embeddings=read.positive_int(key("context_length"), at_most=MAX_CONTEXT),
        rms_norm_eps=read.number(key("attention.layer_norm_rms_epsilon"), above=0.0, at_most=1.0),
        # llama.cpp's converter writes no output.weight when lm_head is tied to the embedding
        tie_word_embeddings="output.weight" not in tensor_shapes,
        eos_token_ids=read.token_ids("tokenizer.ggml.eos_token_id"),
        mtp_num_hidden_layers=mtp,
        mrope_section=section,
    )


def _gguf_reader(metadata: dict[str, Any], family: str):
    """A reader of the metadata and ``key(name) -> "{arch}.name"``; ConfigError for another
    architecture or for any ``{arch}.*`` key not in :data:`GGUF_ARCH_KEYS_READ`."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"{family}: GGUF general.architecture is {show(arch)}, expected one of {GGUF_ARCHITECTURES}")
    known = {f"{arch}.{k}" for k in GGUF_ARCH_KEYS_READ}
    unknown = sorted(k for k in metadata if k.startswith(f"{arch}.") and k not in known)
    if unknown:
        raise ConfigError(f"{family}: the GGUF metadata has {unknown[0]!r}, which this family does not implement"
                          + (f" (also: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""))
    return ConfigReader(metadata, f"{family}: GGUF metadata"), lambda name: f"{arch}.{name}"


def _gguf_delta_net(read: ConfigReader, key) -> tuple[int, int, int]:
    """(linear_num_key_heads, linear_num_value_heads, linear_value_head_dim) from the ``ssm.*`` keys."""
    k_heads = read.positive_int(key("ssm.group_count"), at_most=MAX_HEADS)
    v_heads = read.positive_int(key("ssm.time_step_rank"), at_most=MAX_HEADS)
    read.check(v_heads % k_heads == 0, f"{key('ssm.time_step_rank')!r} ({v_heads}) is not a multiple of {key('ssm.group_count')!r} ({k_heads})")
    inner = read.positive_int(key("ssm.inner_size"), at_most=MAX_WIDTH * MAX_HEADS)
    read.check(inner % v_heads == 0, f"{key('ssm.inner_size')!r} ({inner}) is not a multiple of {key('ssm.time_step_rank')!r} ({v_heads})")
    return k_heads, v_heads, inner // v_heads


def _gguf_layer_types(read: ConfigReader, key, blocks: int, num_layers: int) -> tuple[str, ...]:
    """``layer_types`` from ``attention.recurrent_layers`` (one bool per block, MTP blocks included).

    The converter writes the list from config.json's ``layer_types`` and pads the MTP
    blocks with False (full attention); without the list, ``full_attention_interval``
    says it as in config.json (layer i is full when (i + 1) % n == 0).
    """
    interval = read.positive_int(key("full_attention_interval"), default=None, at_most=MAX_LAYERS)
    recurrent = read.value(key("attention.recurrent_layers"), None)
    if recurrent is None:
        read.check(interval is not None, f"has neither {key('attention.recurrent_layers')!r} nor {key('full_attention_interval')!r}")
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    read.check(isinstance(recurrent, list) and len(recurrent) == blocks and all(isinstance(r, bool) for r in recurrent),
               f"{key('attention.recurrent_layers')!r} is {show(recurrent)}; expected {blocks} booleans (one per block)")
    read.check(not any(recurrent[num_layers:]), f"{key('attention.recurrent_layers')!r} marks an MTP block as recurrent")
    types = tuple("linear_attention" if r else "full_attention" for r in recurrent[:num_layers])
    from_interval = tuple("full_attention" if (i + 1) % (interval or 1) == 0 else "linear_attention" for i in range(num_layers))
    read.check(interval is None or types == from_interval,
               f"{key('attention.recurrent_layers')!r} does not match {key('full_attention_interval')!r} ({interval})")
    return types


def _gguf_vocab(read: ConfigReader, key, metadata: dict[str, Any], shapes: Mapping[str, tuple[int, ...]], family: str) -> int:
    """The vocabulary: the embedding's rows (a converter may pad them), checked against the metadata."""
    if "token_embd.weight" not in shapes:
        raise WeightsError(f"{family}: the GGUF file has no tensor 'token_embd.weight'")
    vocab = shapes["token_embd.weight"][0]
    declared = read.positive_int(key("vocab_size"), default=None, at_most=MAX_VOCAB)
    read.check(declared is None or declared == vocab, f"{key('vocab_size')!r} is {declared}, but token_embd.weight has {vocab} rows")
    tokens = metadata.get("tokenizer.ggml.tokens")
    read.check(not isinstance(tokens, list) or len(tokens) <= vocab,
               f"has {len(tokens) if isinstance(tokens, list) else 0} tokenizer tokens, more than the {vocab} embedding rows")
    return vocab
