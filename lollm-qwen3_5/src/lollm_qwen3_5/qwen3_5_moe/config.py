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

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lollm.errors import ConfigError

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
        text, tie = _decoder_keys(raw)

        # Settings that would change the math and that we do not implement.
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"qwen3_5_moe: config.json 'hidden_act' is {act!r}; only 'silu' is implemented")
        if text.get("attn_output_gate", True) is not True:
            raise ConfigError("qwen3_5_moe: config.json sets 'attn_output_gate' to false; only gated attention is implemented")
        if not text.get("num_experts"):
            raise ConfigError("qwen3_5_moe: config.json has no 'num_experts' (a dense model); it belongs to the family qwen3_5")
        if text.get("mlp_only_layers"):
            raise ConfigError(
                f"qwen3_5_moe: config.json 'mlp_only_layers' is {text['mlp_only_layers']}; dense layers inside the MoE model are not implemented"
            )
        if text.get("decoder_sparse_step", 1) != 1:
            raise ConfigError(
                f"qwen3_5_moe: config.json 'decoder_sparse_step' is {text['decoder_sparse_step']}; a MoE block in every layer (1) is implemented"
            )
        if text.get("use_sliding_window") or raw.get("use_sliding_window"):
            raise ConfigError("qwen3_5_moe: config.json sets 'use_sliding_window'; sliding-window attention is not implemented")
        ssm_dtype = text.get("mamba_ssm_dtype", "float32")
        if ssm_dtype != "float32":
            raise ConfigError(
                f"qwen3_5_moe: config.json 'mamba_ssm_dtype' is {ssm_dtype!r}; the DeltaNet state is kept in float32 only"
            )
        if text.get("mtp_use_dedicated_embeddings"):
            raise ConfigError(
                "qwen3_5_moe: config.json sets 'mtp_use_dedicated_embeddings'; an MTP head with its own embeddings is not implemented"
            )
        for where in (raw, text):
            if where.get("quantization_config"):
                method = where["quantization_config"].get("quant_method", "?")
                raise ConfigError(f"qwen3_5_moe: config.json has 'quantization_config' ({method}); quantized safetensors are not supported")

        num_layers = _required(text, "num_hidden_layers", int)
        hidden = _required(text, "hidden_size", int)
        heads = _required(text, "num_attention_heads", int)
        kv_heads = text.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"qwen3_5_moe: 'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        head_dim = text.get("head_dim") or hidden // heads
        k_heads = _required(text, "linear_num_key_heads", int)
        v_heads = _required(text, "linear_num_value_heads", int)
        if v_heads % k_heads:
            raise ConfigError(
                f"qwen3_5_moe: 'linear_num_value_heads' ({v_heads}) is not a multiple of 'linear_num_key_heads' ({k_heads})"
            )
        theta, factor = _read_rope(text)
        rotary_dim = int(head_dim * factor)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ConfigError(f"qwen3_5_moe: partial_rotary_factor {factor} gives {rotary_dim} rotary channels of {head_dim}; need an even number")

        experts = _required(text, "num_experts", int)
        top_k = _required(text, "num_experts_per_tok", int)
        if not 0 < top_k <= experts:
            raise ConfigError(f"qwen3_5_moe: 'num_experts_per_tok' ({top_k}) must be in 1 .. 'num_experts' ({experts})")
        mtp_layers = text.get("mtp_num_hidden_layers", 1)
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            vocab_size=_required(text, "vocab_size", int),
            hidden_size=hidden,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=_required(text, "moe_intermediate_size", int),
            shared_expert_intermediate_size=_required(text, "shared_expert_intermediate_size", int),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),  # transformers' Qwen3.5 MoE always normalises
            num_hidden_layers=num_layers,
            layer_types=_read_layer_types(text, num_layers),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            attention_bias=bool(text.get("attention_bias", False)),
            rotary_dim=rotary_dim,
            rope_theta=theta,
            linear_num_key_heads=k_heads,
            linear_num_value_heads=v_heads,
            linear_key_head_dim=_required(text, "linear_key_head_dim", int),
            linear_value_head_dim=_required(text, "linear_value_head_dim", int),
            linear_conv_kernel_dim=_required(text, "linear_conv_kernel_dim", int),
            max_position_embeddings=_required(text, "max_position_embeddings", int),
            rms_norm_eps=float(_required(text, "rms_norm_eps", (int, float))),
            tie_word_embeddings=tie,
            eos_token_ids=eos_ids,
            mtp_num_hidden_layers=int(mtp_layers or 0),
        )


def _decoder_keys(raw: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The dict holding the decoder's keys, and whether the output head is tied.

    Multimodal: ``raw["text_config"]``; the tie flag is the top-level one (the
    wrapper owns ``lm_head``), or text_config's when the top level has none.
    Text-only: ``raw`` itself.
    """
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"qwen3_5_moe: config.json has model_type {model_type!r}, expected one of {MODEL_TYPES}")
    if model_type == "qwen3_5_moe_text":
        return raw, bool(raw.get("tie_word_embeddings", False))  # transformers' default
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("qwen3_5_moe: config.json has model_type 'qwen3_5_moe' but no 'text_config' object holding the decoder")
    if text.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
        raise ConfigError(f"qwen3_5_moe: config.json 'text_config' has model_type {text['model_type']!r}, expected 'qwen3_5_moe_text'")
    top, inner = raw.get("tie_word_embeddings"), text.get("tie_word_embeddings")
    if top is not None and inner is not None and bool(top) != bool(inner):
        raise ConfigError(
            f"qwen3_5_moe: config.json 'tie_word_embeddings' is {top} at the top level but {inner} in 'text_config'; "
            f"cannot tell whether the output head is tied"
        )
    return text, bool(top if top is not None else inner if inner is not None else False)


def _read_layer_types(text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types`` as a tuple, or the pattern ``full_attention_interval`` describes.

    With interval n, layer i is full attention when (i + 1) is a multiple of n
    (layers 3, 7, 11, ... for n = 4), as in transformers.
    """
    interval = text.get("full_attention_interval")
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        raise ConfigError(f"qwen3_5_moe: config.json 'full_attention_interval' is {interval!r}, not a positive integer")
    from_interval = [
        "full_attention" if (i + 1) % (interval or 4) == 0 else "linear_attention" for i in range(num_layers)
    ]
    types = text.get("layer_types")
    if types is None:
        return tuple(from_interval)
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"qwen3_5_moe: config.json 'layer_types' must list one type per layer ({num_layers})")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"qwen3_5_moe: config.json 'layer_types' holds {unknown}; implemented: {', '.join(LAYER_TYPES)}")
    if interval is not None and list(types) != from_interval:
        raise ConfigError(
            f"qwen3_5_moe: config.json 'layer_types' does not match 'full_attention_interval' ({interval}); "
            f"cannot tell which one holds"
        )
    return tuple(types)


def _read_rope(text: dict[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor) from ``rope_parameters`` (or the hub's ``rope_scaling`` + ``rope_theta``).

    transformers' rules: theta and the factor are looked up in the RoPE dict
    first, then at the top level; the factor defaults to 0.25 for this family.
    """
    params = text.get("rope_parameters")
    scaling = text.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError("qwen3_5_moe: config.json has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
    where = "rope_parameters" if params is not None else "rope_scaling"
    params = dict(params if params is not None else scaling or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"qwen3_5_moe: config.json {where!r} is nested per layer type; one RoPE for all layers is implemented")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"qwen3_5_moe: config.json {where!r} has RoPE type {rope_type!r}, which is not implemented (implemented: default)")
    unknown = sorted(set(params) - ROPE_KEYS)
    if unknown:
        raise ConfigError(f"qwen3_5_moe: config.json {where!r} has {unknown[0]!r}, which this family does not implement")

    theta = params.get("rope_theta", text.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"qwen3_5_moe: config.json has no 'rope_theta' (neither at the top level nor in {where!r})")
    inner, outer = params.get("partial_rotary_factor"), text.get("partial_rotary_factor")
    if inner is not None and outer is not None and inner != outer:
        raise ConfigError(
            f"qwen3_5_moe: config.json 'partial_rotary_factor' is {outer} at the top level but {inner} in {where!r}; "
            f"cannot tell which one holds"
        )
    factor = inner if inner is not None else outer if outer is not None else 0.25
    return float(theta), float(factor)


def _required(raw: dict[str, Any], key: str, kind) -> Any:
    """``raw[key]``; ConfigError naming the key when it is missing, null or of the wrong type."""
    value = raw.get(key)
    if value is None:
        raise ConfigError(f"qwen3_5_moe: config.json has no {key!r}, which the model needs")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"qwen3_5_moe: config.json {key!r} is {value!r}, not a number of the expected kind")
    return value
