"""Qwen2Config: the numbers that shape a qwen2 model, read from config.json.

config.json comes in two schemas, and both must load:

* the **hub** schema (what Qwen published, transformers 4.x)::

      "rope_theta": 1000000.0,
      "rope_scaling": null            # or {"type": "yarn", "factor": 4.0, ...}

* the **transformers 5** schema (what ``save_pretrained`` writes today)::

      "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}

Both end up in one :class:`RopeConfig`. The rule is *hard-fail, never guess*:
a missing key the math needs, a RoPE type or RoPE parameter we do not
implement, sliding-window attention, or an activation other than SiLU raise
:class:`lollm.errors.ConfigError` naming the key. Keys that do not change the
math (``initializer_range``, ``use_cache``, ``architectures`` …) are ignored.

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lollm.errors import ConfigError

from . import MODEL_TYPES

#: The RoPE types implemented in blocks.py, with the parameter keys each one reads.
#: (``type`` is the hub spelling of ``rope_type``.)
ROPE_TYPES = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
    "yarn": {
        "rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
        "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
    },
}


@dataclass(frozen=True)
class RopeConfig:
    """How positions are turned into rotation angles (see ``blocks.rope_inverse_frequencies``).

    rope_type: "default" (plain RoPE), "linear" (positions divided by ``factor``)
               or "yarn" (YaRN: interpolate the slow frequencies, keep the fast ones,
               scale cos/sin by an attention factor).
    theta:     the base of the frequencies, ``inv_freq[i] = theta ** (-2i / head_dim)``.
    factor:    context-extension factor (linear, yarn).
    The remaining fields are YaRN's, with transformers' meaning and defaults.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class Qwen2Config:
    """The hyper-parameters of a qwen2 model.

    vocab_size:               rows of the embedding and of the logits.
    hidden_size:              width of the residual stream (896 for Qwen2.5-0.5B).
    intermediate_size:        width of the SwiGLU MLP's hidden layer (4864).
    num_hidden_layers:        number of decoder layers (24).
    num_attention_heads:      query heads (14).
    num_key_value_heads:      key/value heads, shared by groups of query heads (GQA) (2).
    head_dim:                 width of one head (hidden_size // num_attention_heads = 64).
    max_position_embeddings:  the longest context the model supports (32768).
    rms_norm_eps:             epsilon inside every RMSNorm.
    rope:                     the RoPE settings (:class:`RopeConfig`).
    tie_word_embeddings:      the output projection (lm_head) reuses the embedding matrix.
    eos_token_ids:            end-of-sequence ids from ``eos_token_id`` (int or list).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Qwen2Config":
        """Parse config.json (as a dict) in the hub or the transformers-5 schema.

        Raises ConfigError naming the key for a missing required key or a
        setting this family does not implement.
        """
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"qwen2: config.json has model_type {model_type!r}, expected one of {MODEL_TYPES}")

        # Settings that would change the math and that we do not implement.
        if raw.get("use_sliding_window"):
            raise ConfigError("qwen2: config.json sets 'use_sliding_window': true; sliding-window attention is not implemented")
        other_layers = sorted({t for t in raw.get("layer_types") or () if t != "full_attention"})
        if other_layers:
            raise ConfigError(f"qwen2: config.json 'layer_types' holds {other_layers}; only 'full_attention' is implemented")
        act = raw.get("hidden_act", "silu")  # transformers' default for qwen2
        if act != "silu":
            raise ConfigError(f"qwen2: config.json 'hidden_act' is {act!r}; only 'silu' is implemented")
        if raw.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ConfigError("qwen2: config.json 'partial_rotary_factor' is set; partial RoPE is not implemented")
        if raw.get("quantization_config"):
            method = raw["quantization_config"].get("quant_method", "?")
            raise ConfigError(f"qwen2: config.json has 'quantization_config' ({method}); quantized safetensors are not supported")

        hidden = _required(raw, "hidden_size", int)
        heads = _required(raw, "num_attention_heads", int)
        # transformers' Qwen2 reads an explicit head_dim when config.json has one.
        head_dim = raw.get("head_dim") or hidden // heads
        # Absent num_key_value_heads means plain multi-head attention (transformers' rule).
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ConfigError(f"qwen2: 'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        max_pos = _required(raw, "max_position_embeddings", int)

        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return cls(
            vocab_size=_required(raw, "vocab_size", int),
            hidden_size=hidden,
            intermediate_size=_required(raw, "intermediate_size", int),
            num_hidden_layers=_required(raw, "num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(_required(raw, "rms_norm_eps", (int, float))),
            rope=_read_rope(raw, max_pos),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),  # transformers' default for qwen2
            eos_token_ids=eos_ids,
        )


def _required(raw: dict[str, Any], key: str, kind) -> Any:
    """``raw[key]``; ConfigError naming the key when it is missing, null or of the wrong type."""
    value = raw.get(key)
    if value is None:
        raise ConfigError(f"qwen2: config.json has no {key!r}, which the model needs")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"qwen2: config.json {key!r} is {value!r}, not a number of the expected kind")
    return value


def _read_rope(raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
    """Read RoPE settings from either schema into one RopeConfig.

    transformers 5: everything in ``rope_parameters`` (``rope_theta`` inside it).
    hub:            ``rope_theta`` at the top level, scaling in ``rope_scaling``
                    (``null`` or absent for plain RoPE), its type under ``type`` or ``rope_type``.
    """
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError("qwen2: config.json has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
    if params is not None:
        where, params = "rope_parameters", dict(params)
    else:
        where, params = "rope_scaling", dict(scaling or {})

    # transformers looks for theta in the RoPE dict first, then at the top level.
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError(f"qwen2: config.json has no 'rope_theta' (neither at the top level nor in {where!r})")

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"qwen2: config.json {where!r} has RoPE type {rope_type!r}, which is not implemented "
            f"(implemented: {', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(set(params) - ROPE_TYPES[rope_type])
    if unknown:
        raise ConfigError(f"qwen2: config.json {where!r} has {unknown[0]!r}, which RoPE type {rope_type!r} does not implement")

    factor = params.get("factor")
    if rope_type != "default" and factor is None:
        raise ConfigError(f"qwen2: config.json {where!r}: RoPE type {rope_type!r} needs 'factor'")
    original = None
    if rope_type == "yarn":
        # transformers' rule: a top-level key wins, else the dict's, else max_position_embeddings.
        original = (
            raw.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or max_position_embeddings
        )
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=None if factor is None else float(factor),
        original_max_position_embeddings=original,
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )
