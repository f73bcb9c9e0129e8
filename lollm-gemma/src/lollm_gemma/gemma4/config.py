"""Gemma4Config: the numbers that shape a gemma4 text decoder, read from config.json.

Layouts (``model_type``):

* ``gemma4_text`` (Gemma4ForCausalLM): the decoder's keys at the top level.
* ``gemma4`` (Gemma4ForConditionalGeneration, e.g. gemma-4-E2B-it as published):
  the decoder's keys under ``text_config``, beside ``vision_config`` and
  ``audio_config``, which we do not load.

Gemma 4 configs are born in the transformers-5 schema: RoPE lives in
``rope_parameters``, one entry per layer type, and the pattern in
``layer_types``::

    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                           "rope_theta": 1000000.0}},
    "layer_types": ["sliding_attention", x4, "full_attention", ...]

The head widths and KV-head counts of the global layers are spelled two ways:
``global_head_dim`` / ``num_global_key_value_heads`` (the published hub files,
transformers 5.5), or a sparse ``per_layer_config`` of per-layer overrides
(``{"4": {"head_dim": 512}, "9": {...}}``, what transformers 5.24 writes). Both
are read; every layer of one type must end up with the same shapes.

Keys config.json leaves out take transformers' ``Gemma4TextConfig`` defaults
(:data:`TEXT_DEFAULTS`), as transformers does. Old-style RoPE keys
(``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``) without
``rope_parameters`` are refused: transformers' Gemma 4 ignores them, so their
meaning is unclear.

What is new since Gemma 3 and read here:

* ``hidden_size_per_layer_input`` / ``vocab_size_per_layer_input``: per-layer
  embeddings (PLE), a second, small embedding per layer (0 turns them off);
* ``num_kv_shared_layers``: the last N layers compute no keys/values of their
  own and reuse those of the last earlier layer of the same type;
* ``global_head_dim``: global layers use wider heads than sliding ones;
* ``use_double_wide_mlp``: the KV-sharing layers get an MLP twice as wide;
* ``attention_k_eq_v`` / ``num_global_key_value_heads``: global layers whose
  values are their (un-normed) keys, with their own number of KV heads;
* the "proportional" RoPE type (rotate only the first ``partial_rotary_factor``
  of each head's channel pairs, at the speeds of the full head).

Hard-fail, never guess: the mixture-of-experts block (``enable_moe_block``),
bidirectional text attention (``use_bidirectional_attention: "all"``), a last
layer that is not global (transformers would silently force it), an unknown
RoPE type or key, attention biases or another activation raise
:class:`lollm.errors.ConfigError` naming the key.

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lollm.errors import ConfigError

from . import MODEL_TYPES

SLIDING = "sliding_attention"
FULL = "full_attention"
#: The two kinds of decoder layer: attention over a window of recent tokens, or over all of them.
LAYER_TYPES = (SLIDING, FULL)

#: The RoPE types implemented in blocks.py, with the parameter keys each one reads.
ROPE_TYPES = {
    "default": {"rope_type", "rope_theta"},
    "linear": {"rope_type", "rope_theta", "factor"},
    "proportional": {"rope_type", "rope_theta", "partial_rotary_factor", "factor"},
}

#: transformers' ``Gemma4TextConfig`` defaults, used for keys config.json leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_144,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "sliding_window": 512,
    "final_logit_softcapping": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "tie_word_embeddings": True,
}

#: transformers' default ``global_head_dim`` (when neither it nor ``per_layer_config`` is given).
DEFAULT_GLOBAL_HEAD_DIM = 512

#: The RoPE transformers uses when ``rope_parameters`` is absent.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class RopeConfig:
    """How positions are turned into rotation angles (see ``blocks.rope_inverse_frequencies``).

    rope_type:       "default", "linear" or "proportional".
    theta:           the base of the frequencies.
    factor:          speeds divided by this (linear; proportional, default 1).
    rotary_fraction: proportional only: the fraction of channel pairs that rotate (0.25 on Gemma 4).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    rotary_fraction: float = 1.0


@dataclass(frozen=True)
class Gemma4Config:
    """The hyper-parameters of a gemma4 text decoder (values for gemma-4-E2B in brackets).

    vocab_size:                  rows of the embedding and of the logits (262144).
    hidden_size:                 width of the residual stream (1536).
    intermediate_size:           width of the GeGLU MLP's hidden layer (6144).
    num_hidden_layers:           number of decoder layers (35).
    num_attention_heads:         query heads (8).
    num_key_value_heads:         key/value heads of the sliding layers (1).
    global_num_key_value_heads:  key/value heads of the global layers (1).
    head_dim:                    head width of the sliding layers (256).
    global_head_dim:             head width of the global layers (512).
    attention_k_eq_v:            global layers use their keys as values (no v_proj) (False).
    max_position_embeddings:     the longest context the model supports (131072).
    rms_norm_eps:                epsilon inside every RMSNorm (1e-6).
    sliding_window:              a sliding layer's query sees this many positions, itself included (512).
    layer_types:                 per layer, "sliding_attention" or "full_attention" (global).
    rope_local, rope_global:     RoPE of the sliding layers (default, base 1e4) and of the
                                 global ones (proportional 0.25, base 1e6).
    final_logit_softcapping:     logits pass through ``cap * tanh(l / cap)`` (30; None: off).
    hidden_size_per_layer_input: width of each layer's per-layer embedding, 0 for none (256).
    vocab_size_per_layer_input:  rows of the per-layer embedding table (262144).
    num_kv_shared_layers:        the last N layers reuse earlier layers' keys/values (20).
    use_double_wide_mlp:         the KV-sharing layers' MLP is 2x intermediate_size wide (True).
    tie_word_embeddings:         the output head reuses the embedding matrix.
    eos_token_ids:               end-of-sequence ids from ``eos_token_id`` (int or list).
    multimodal:                  True for ``model_type`` "gemma4" (decoder under ``model.language_model.*``).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    global_num_key_value_heads: int
    attention_k_eq_v: bool
    max_position_embeddings: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_local: RopeConfig
    rope_global: RopeConfig
    final_logit_softcapping: float | None
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    tie_word_embeddings: bool = True
    eos_token_ids: tuple[int, ...] = ()
    multimodal: bool = False

    # -- per-layer shapes --------------------------------------------------
    def rope_for(self, layer_type: str) -> RopeConfig:
        """The RoPE settings of a layer type."""
        return self.rope_local if layer_type == SLIDING else self.rope_global

    def head_dim_for(self, layer_type: str) -> int:
        """Head width of a layer type: ``head_dim`` (sliding) or ``global_head_dim`` (global)."""
        return self.head_dim if layer_type == SLIDING else self.global_head_dim

    def kv_heads_for(self, layer_type: str) -> int:
        """KV heads of a layer type."""
        return self.num_key_value_heads if layer_type == SLIDING else self.global_num_key_value_heads

    @property
    def first_kv_shared_layer(self) -> int:
        """Index of the first layer that reuses another layer's keys/values (= num layers when none does)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose keys/values ``layer`` attends over: itself, or (for a KV-sharing
        layer) the last layer of the same type before the first KV-sharing one."""
        first_shared = self.first_kv_shared_layer
        if layer < first_shared:
            return layer
        layer_type = self.layer_types[layer]
        return max(i for i in range(first_shared) if self.layer_types[i] == layer_type)

    def intermediate_size_for(self, layer: int) -> int:
        """MLP width of a layer: doubled on KV-sharing layers when ``use_double_wide_mlp``."""
        doubled = self.use_double_wide_mlp and layer >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if doubled else 1)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Gemma4Config":
        """Parse config.json (as a dict), either layout.

        Raises ConfigError naming the key for a missing required key or a
        setting this family does not implement.
        """
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"gemma4: config.json has model_type {model_type!r}, expected one of {MODEL_TYPES}")
        multimodal = model_type == "gemma4"
        if multimodal:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("gemma4: config.json of model_type 'gemma4' has no 'text_config' object")
            where = "text_config"
        else:
            text, where = raw, "config.json"
        cfg = {**TEXT_DEFAULTS, **text}
        _refuse_unimplemented(raw, cfg, where)

        heads = _required(cfg, "num_attention_heads", int, where)
        num_layers = _required(cfg, "num_hidden_layers", int, where)
        layer_types = _read_layer_types(cfg, num_layers, where)
        shapes = _read_layer_shapes(cfg, layer_types, where)
        for layer_type, (_, kv_heads) in shapes.items():
            if heads % kv_heads:
                raise ConfigError(
                    f"gemma4: {where} 'num_attention_heads' ({heads}) is not a multiple of the "
                    f"{kv_heads} key/value heads of the {layer_type} layers"
                )
        shared = _required(cfg, "num_kv_shared_layers", int, where)
        _check_kv_sharing(layer_types, shared, where)
        window = _required(cfg, "sliding_window", int, where)
        if window < 1:
            raise ConfigError(f"gemma4: {where} 'sliding_window' is {window}; it must be >= 1")
        rope_local, rope_global = _read_rope(cfg, where)
        cap = cfg.get("final_logit_softcapping")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise ConfigError(f"gemma4: {where} 'final_logit_softcapping' is {cap!r}; expected a positive number or null")

        eos: list[int] = []
        for source in (text, raw) if multimodal else (raw,):
            value = source.get("eos_token_id")
            for i in [] if value is None else [value] if isinstance(value, int) else value:
                if i not in eos:
                    eos.append(i)
        tie = raw.get("tie_word_embeddings", cfg["tie_word_embeddings"]) if multimodal else cfg["tie_word_embeddings"]
        return cls(
            vocab_size=_required(cfg, "vocab_size", int, where),
            hidden_size=_required(cfg, "hidden_size", int, where),
            intermediate_size=_required(cfg, "intermediate_size", int, where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=shapes[SLIDING][1],
            global_num_key_value_heads=shapes[FULL][1],
            head_dim=shapes[SLIDING][0],
            global_head_dim=shapes[FULL][0],
            attention_k_eq_v=bool(cfg["attention_k_eq_v"]),
            max_position_embeddings=_required(cfg, "max_position_embeddings", int, where),
            rms_norm_eps=float(_required(cfg, "rms_norm_eps", (int, float), where)),
            sliding_window=window,
            layer_types=layer_types,
            rope_local=rope_local,
            rope_global=rope_global,
            final_logit_softcapping=None if cap is None else float(cap),
            hidden_size_per_layer_input=_required(cfg, "hidden_size_per_layer_input", int, where),
            vocab_size_per_layer_input=_required(cfg, "vocab_size_per_layer_input", int, where),
            num_kv_shared_layers=shared,
            use_double_wide_mlp=bool(cfg["use_double_wide_mlp"]),
            tie_word_embeddings=bool(tie),
            eos_token_ids=tuple(eos),
            multimodal=multimodal,
        )


def _refuse_unimplemented(raw: dict[str, Any], cfg: dict[str, Any], where: str) -> None:
    """ConfigError for every setting that would change the math and that this family does not implement."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"gemma4: {where} 'hidden_activation' is {act!r}; only 'gelu_pytorch_tanh' (tanh GELU) is implemented")
    if cfg.get("enable_moe_block"):
        raise ConfigError(f"gemma4: {where} sets 'enable_moe_block': true; the mixture-of-experts block (26B-A4B) is not implemented")
    if cfg.get("use_bidirectional_attention") not in (None, False, "vision"):
        raise ConfigError(
            f"gemma4: {where} 'use_bidirectional_attention' is {cfg['use_bidirectional_attention']!r}; "
            f"only causal text attention is implemented ('vision' only concerns image tokens)"
        )
    if cfg.get("attention_bias"):
        raise ConfigError(f"gemma4: {where} sets 'attention_bias': true; attention biases are not implemented")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError(f"gemma4: {where} sets 'attn_logit_softcapping'; Gemma 4 has no attention soft-cap and this family does not implement one")
    if "rope_parameters" not in cfg:
        old = [k for k in ("rope_theta", "rope_local_base_freq", "rope_scaling") if cfg.get(k) is not None]
        if old:
            raise ConfigError(
                f"gemma4: {where} has {old[0]!r} but no 'rope_parameters'; Gemma 4 reads RoPE from "
                f"'rope_parameters' only (transformers ignores {old[0]!r}), so its meaning is unclear"
            )
    for source in (raw, cfg):
        if source.get("quantization_config"):
            method = source["quantization_config"].get("quant_method", "?")
            raise ConfigError(f"gemma4: config.json has 'quantization_config' ({method}); quantized safetensors are not supported")


def _required(cfg: dict[str, Any], key: str, kind, where: str) -> Any:
    """``cfg[key]``; ConfigError naming the key when it is missing, null or of the wrong type."""
    value = cfg.get(key)
    if value is None:
        raise ConfigError(f"gemma4: {where} has no {key!r}, which the model needs")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"gemma4: {where} {key!r} is {value!r}, not a number of the expected kind")
    return value


def _read_layer_types(cfg: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    """``layer_types``, or transformers' default pattern (every 6th layer global) when absent."""
    types = cfg.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"gemma4: {where} 'layer_types' must be a list of {num_layers} entries (one per layer)")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"gemma4: {where} 'layer_types' holds {unknown[0]!r}; implemented: {', '.join(LAYER_TYPES)}")
    if types[-1] != FULL:
        raise ConfigError(
            f"gemma4: {where} 'layer_types' ends with {types[-1]!r}; Gemma 4's last layer must be "
            f"'full_attention' (transformers would silently change it)"
        )
    return tuple(types)


def _read_layer_shapes(cfg: dict[str, Any], layer_types: tuple[str, ...], where: str) -> dict[str, tuple[int, int]]:
    """(head dim, KV heads) per layer type, from either spelling.

    hub / transformers 5.5: ``head_dim`` and ``num_key_value_heads`` for every layer, except
    that global layers use ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` (when set).
    transformers 5.24: the same base values, overridden per layer by ``per_layer_config``
    (``{"<layer index>": {"head_dim": ..., "num_key_value_heads": ...}}``).
    """
    base_dim = _required(cfg, "head_dim", int, where)
    base_kv = _required(cfg, "num_key_value_heads", int, where)
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        global_kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
        global_dim = cfg.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)
        if isinstance(global_dim, bool) or not isinstance(global_dim, int):
            raise ConfigError(f"gemma4: {where} 'global_head_dim' is {global_dim!r}, not an integer")
        return {SLIDING: (base_dim, base_kv), FULL: (global_dim, global_kv or base_kv)}

    if not isinstance(per_layer, dict):
        raise ConfigError(f"gemma4: {where} 'per_layer_config' must map layer indices to overrides")
    shapes: dict[str, set[tuple[int, int]]] = {SLIDING: set(), FULL: set()}
    overrides = {}
    for key, value in per_layer.items():
        if not str(key).isdigit() or int(key) >= len(layer_types) or not isinstance(value, dict):
            raise ConfigError(f"gemma4: {where} 'per_layer_config' has an entry {key!r}; expected layer indices 0..{len(layer_types) - 1}")
        unknown = sorted(set(value) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise ConfigError(f"gemma4: {where} 'per_layer_config.{key}' overrides {unknown[0]!r}, which this family does not implement per layer")
        overrides[int(key)] = value
    for i, layer_type in enumerate(layer_types):
        value = overrides.get(i, {})
        shapes[layer_type].add((value.get("head_dim", base_dim), value.get("num_key_value_heads", base_kv)))
    for layer_type, found in shapes.items():
        if len(found) > 1:
            raise ConfigError(f"gemma4: {where} 'per_layer_config' gives the {layer_type} layers different shapes {sorted(found)}; not implemented")
    out = {t: next(iter(found)) if found else (base_dim, base_kv) for t, found in shapes.items()}
    if cfg.get("global_head_dim") is not None and cfg["global_head_dim"] != out[FULL][0]:
        raise ConfigError(f"gemma4: {where} 'global_head_dim' and 'per_layer_config' disagree")
    return out


def _check_kv_sharing(layer_types: tuple[str, ...], shared: int, where: str) -> None:
    """Every layer type used by a KV-sharing layer must appear among the layers before them."""
    if not 0 <= shared < len(layer_types):
        raise ConfigError(f"gemma4: {where} 'num_kv_shared_layers' is {shared}; expected 0 .. {len(layer_types) - 1}")
    producers = set(layer_types[: len(layer_types) - shared])
    missing = sorted(set(layer_types[len(layer_types) - shared :]) - producers)
    if missing:
        raise ConfigError(
            f"gemma4: {where} 'num_kv_shared_layers' = {shared} leaves no earlier {missing[0]!r} layer "
            f"whose keys/values the shared layers could reuse"
        )


def _read_rope(cfg: dict[str, Any], where: str) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of the sliding layers and of the global layers, from ``rope_parameters``."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = DEFAULT_ROPE
    if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES) or \
            not all(isinstance(v, dict) for v in params.values()):
        raise ConfigError(
            f"gemma4: {where} 'rope_parameters' must map each layer type ({', '.join(LAYER_TYPES)}) "
            f"to its RoPE settings; found {params!r}"
        )
    out = []
    for layer_type in (SLIDING, FULL):
        entry = params.get(layer_type)
        if entry is None:
            entry = DEFAULT_ROPE[layer_type]
        out.append(_rope(entry, f"{where} 'rope_parameters.{layer_type}'"))
    return out[0], out[1]


def _rope(params: dict[str, Any], where: str) -> RopeConfig:
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"gemma4: {where} has RoPE type {rope_type!r}, which is not implemented "
            f"(implemented: {', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(set(params) - ROPE_TYPES[rope_type])
    if unknown:
        raise ConfigError(f"gemma4: {where} has {unknown[0]!r}, which RoPE type {rope_type!r} does not implement")
    theta = params.get("rope_theta")
    if theta is None or isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise ConfigError(f"gemma4: {where} 'rope_theta' is {theta!r}, not a number")
    factor = params.get("factor", 1.0)
    if rope_type == "linear" and "factor" not in params:
        raise ConfigError(f"gemma4: {where}: RoPE type 'linear' needs 'factor'")
    fraction = params.get("partial_rotary_factor", 1.0)
    if not 0.0 <= float(fraction) <= 1.0:
        raise ConfigError(f"gemma4: {where} 'partial_rotary_factor' is {fraction!r}; expected 0 .. 1")
    return RopeConfig(rope_type=rope_type, theta=float(theta), factor=float(factor), rotary_fraction=float(fraction))
