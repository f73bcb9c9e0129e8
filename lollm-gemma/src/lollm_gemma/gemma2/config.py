"""Gemma2Config: the numbers that shape a gemma2 model, read from config.json.

config.json comes in two schemas, and both must load:

* the **hub** schema (what Google published, transformers 4.x)::

      "rope_theta": 10000.0,
      "sliding_window": 4096,          # no layer_types: layers alternate, sliding first
      "attn_logit_softcapping": 50.0,
      "final_logit_softcapping": 30.0

* the **transformers 5** schema (what ``save_pretrained`` writes today)::

      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
      "layer_types": ["sliding_attention", "full_attention", ...]

Both end up in one :class:`Gemma2Config`. Gemma 2 uses one RoPE for every
layer (Gemma 3 will split it in two). Keys config.json leaves out take
transformers' ``Gemma2Config`` defaults (:data:`DEFAULTS`), as transformers does.

The rule is *hard-fail, never guess*: a RoPE type or RoPE key we do not
implement, bidirectional attention, attention biases or another activation
raise :class:`lollm.errors.ConfigError` naming the key. Keys that do not change
the math (``initializer_range``, ``cache_implementation`` …) are ignored.

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
#: (``type`` is the old hub spelling of ``rope_type``.)
ROPE_TYPES = {
    "default": {"rope_type", "type", "rope_theta"},
    "linear": {"rope_type", "type", "rope_theta", "factor"},
}

#: transformers' ``Gemma2Config`` defaults, used for keys config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class RopeConfig:
    """How positions are turned into rotation angles (see ``blocks.rope_inverse_frequencies``).

    rope_type: "default" (plain RoPE) or "linear" (positions divided by ``factor``).
    theta:     the base of the frequencies, ``inv_freq[i] = theta ** (-2i / head_dim)``.
    factor:    the linear context-extension factor (None for "default").
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float | None = None


@dataclass(frozen=True)
class Gemma2Config:
    """The hyper-parameters of a gemma2 model (values for gemma-2-2b in brackets).

    vocab_size:               rows of the embedding and of the logits (256000).
    hidden_size:              width of the residual stream (2304).
    intermediate_size:        width of the GeGLU MLP's hidden layer (9216).
    num_hidden_layers:        number of decoder layers (26).
    num_attention_heads:      query heads (8).
    num_key_value_heads:      key/value heads, shared by groups of query heads (GQA) (4).
    head_dim:                 width of one head; *not* hidden_size / heads in Gemma (256).
    max_position_embeddings:  the longest context the model supports (8192).
    rms_norm_eps:             epsilon inside every RMSNorm (1e-6).
    query_pre_attn_scalar:    attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (256).
    sliding_window:           a sliding-window layer's query sees this many positions,
                              itself included (4096).
    layer_types:              per layer, "sliding_attention" or "full_attention" (global).
    rope:                     the RoPE of every layer (base 10000).
    attn_logit_softcapping:   attention scores pass through ``cap * tanh(s / cap)`` (50; None: off).
    final_logit_softcapping:  the output logits too (30; None: off).
    tie_word_embeddings:      the output head reuses the embedding matrix.
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
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope: RopeConfig
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Gemma2Config":
        """Parse config.json (as a dict) in the hub or the transformers-5 schema.

        Raises ConfigError naming the key for a missing required key or a
        setting this family does not implement.
        """
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"gemma2: config.json has model_type {model_type!r}, expected one of {MODEL_TYPES}")
        cfg = {**DEFAULTS, **raw}
        _refuse_unimplemented(cfg)

        heads = _required(cfg, "num_attention_heads", int)
        kv_heads = _required(cfg, "num_key_value_heads", int)
        if heads % kv_heads:
            raise ConfigError(f"gemma2: 'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        num_layers = _required(cfg, "num_hidden_layers", int)
        window = _required(cfg, "sliding_window", int)
        if window < 1:
            raise ConfigError(f"gemma2: config.json 'sliding_window' is {window}; it must be >= 1")
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=_required(cfg, "vocab_size", int),
            hidden_size=_required(cfg, "hidden_size", int),
            intermediate_size=_required(cfg, "intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_required(cfg, "head_dim", int),
            max_position_embeddings=_required(cfg, "max_position_embeddings", int),
            rms_norm_eps=float(_required(cfg, "rms_norm_eps", (int, float))),
            query_pre_attn_scalar=float(_required(cfg, "query_pre_attn_scalar", (int, float))),
            sliding_window=window,
            layer_types=_read_layer_types(cfg, num_layers),
            rope=_read_rope(cfg),
            attn_logit_softcapping=_optional_cap(cfg, "attn_logit_softcapping"),
            final_logit_softcapping=_optional_cap(cfg, "final_logit_softcapping"),
            tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
            eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], *, vocab_size: int, tie_word_embeddings: bool = True) -> "Gemma2Config":
        """Parse the metadata of a GGUF file of ``general.architecture`` "gemma2".

        Keys (gguf-py ``Keys``; written by llama.cpp's ``Gemma2Model.set_gguf_parameters``,
        convert_hf_to_gguf.py / conversion/gemma.py), all required because that converter
        always writes them: ``gemma2.context_length``, ``.embedding_length``, ``.block_count``,
        ``.feed_forward_length``, ``.attention.head_count``, ``.attention.head_count_kv``,
        ``.attention.key_length`` (head_dim), ``.attention.value_length`` (= key_length),
        ``.attention.layer_norm_rms_epsilon``, ``.attention.sliding_window``,
        ``.attn_logit_softcapping``, ``.final_logit_softcapping``. Optional: ``.rope.freq_base``,
        ``.rope.dimension_count`` (must equal head_dim), ``.vocab_size`` (must equal
        token_embd's rows). Any other ``gemma2.*`` key raises as an "unverified GGUF key".

        Not in the file, derived as llama.cpp does (src/llama-model.cpp, ``load_hparams``,
        ``case LLM_ARCH_GEMMA2``):

        * RoPE base: this converter writes no ``rope.freq_base``; llama.cpp then uses its
          default ``rope_freq_base_train`` 10000 (also transformers' Gemma2 ``rope_theta``);
        * the layer pattern: ``set_swa_pattern(2)``: layer i slides when ``i % 2 == 0``;
        * ``query_pre_attn_scalar``: head_dim, except the 46-layer 27B model where it is
          ``hidden / heads`` (``f_attention_scale``; hub configs: 256 for 2B/9B, 144 for 27B).

        vocab_size: rows of ``token_embd.weight``; tie_word_embeddings: no ``output.weight``.
        """
        return _from_gguf(cls, metadata, vocab_size, tie_word_embeddings)


def _refuse_unimplemented(cfg: dict[str, Any]) -> None:
    """ConfigError for every setting that would change the math and that this family does not implement."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"gemma2: config.json 'hidden_activation' is {act!r}; only 'gelu_pytorch_tanh' (tanh GELU) is implemented")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("gemma2: config.json sets 'use_bidirectional_attention'; only causal attention is implemented")
    if cfg.get("attention_bias"):
        raise ConfigError("gemma2: config.json sets 'attention_bias': true; attention biases are not implemented")
    if cfg.get("quantization_config"):
        method = cfg["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"gemma2: config.json has 'quantization_config' ({method}); quantized safetensors are not supported")


def _required(cfg: dict[str, Any], key: str, kind) -> Any:
    """``cfg[key]``; ConfigError naming the key when it is missing, null or of the wrong type."""
    value = cfg.get(key)
    if value is None:
        raise ConfigError(f"gemma2: config.json has no {key!r}, which the model needs")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"gemma2: config.json {key!r} is {value!r}, not a number of the expected kind")
    return value


def _optional_cap(cfg: dict[str, Any], key: str) -> float | None:
    """A soft-cap value: a positive number, or null for "no cap"."""
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"gemma2: config.json {key!r} is {value!r}; expected a positive number or null")
    return float(value)


def _read_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Which layers are sliding-window and which global.

    transformers 5: an explicit ``layer_types`` list. hub: none, and the layers
    alternate, sliding first (transformers' rule: layer i is sliding when i is even).
    """
    types = cfg.get("layer_types")
    if types is None:
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"gemma2: config.json 'layer_types' must be a list of {num_layers} entries (one per layer)")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"gemma2: config.json 'layer_types' holds {unknown[0]!r}; implemented: {', '.join(LAYER_TYPES)}")
    return tuple(types)


def _read_rope(cfg: dict[str, Any]) -> RopeConfig:
    """Read RoPE settings from either schema into one RopeConfig.

    transformers 5: everything in ``rope_parameters`` (``rope_theta`` inside it).
    hub:            ``rope_theta`` at the top level, scaling in ``rope_scaling``
                    (``null`` or absent for plain RoPE).
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError("gemma2: config.json has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
    where = "rope_parameters" if params is not None else "rope_scaling"
    params = dict(params if params is not None else scaling or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ConfigError(f"gemma2: config.json {where!r} is nested per layer type; gemma2 has one RoPE for every layer")
    params.setdefault("rope_theta", cfg["rope_theta"])

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"gemma2: config.json {where!r} has RoPE type {rope_type!r}, which is not implemented "
            f"(implemented: {', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(set(params) - ROPE_TYPES[rope_type])
    if unknown:
        raise ConfigError(f"gemma2: config.json {where!r} has {unknown[0]!r}, which RoPE type {rope_type!r} does not implement")
    factor = params.get("factor")
    if rope_type == "linear" and not isinstance(factor, (int, float)):
        raise ConfigError(f"gemma2: config.json {where!r}: RoPE type 'linear' needs a numeric 'factor'")
    theta = params["rope_theta"]
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"gemma2: config.json 'rope_theta' is {theta!r}, not a number")
    return RopeConfig(rope_type=rope_type, theta=float(theta), factor=None if factor is None else float(factor))


# ---------------------------------------------------------------------------
# GGUF metadata (llama.cpp's keys)
# ---------------------------------------------------------------------------
#: Required ``gemma2.*`` keys (the converter always writes them) and optional ones.
GGUF_REQUIRED = (
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.key_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window",
    "attn_logit_softcapping", "final_logit_softcapping",
)
GGUF_OPTIONAL = ("attention.value_length", "rope.freq_base", "rope.dimension_count", "vocab_size")
#: llama.cpp's values for what the file does not say (llama-model.cpp, LLM_ARCH_GEMMA2).
GGUF_ROPE_BASE = 10_000.0
GGUF_SWA_PATTERN = 2
GGUF_27B_BLOCK_COUNT = 46


def _from_gguf(cls, metadata: dict[str, Any], vocab_size: int, tie_word_embeddings: bool) -> "Gemma2Config":
    arch = metadata.get("general.architecture")
    if arch != "gemma2":
        raise ConfigError(f"gemma2: GGUF general.architecture is {arch!r}, expected 'gemma2'")
    for key in sorted(k for k in metadata if k.startswith("gemma2.")):
        if key[len("gemma2."):] not in GGUF_REQUIRED + GGUF_OPTIONAL:
            raise ConfigError(f"gemma2: unverified GGUF key {key!r} (= {metadata[key]!r}); this family does not know what it changes")

    def get(key, kind=int, required=True):
        full = f"{arch}.{key}"
        value = metadata.get(full)
        if value is None:
            if required:
                raise ConfigError(f"gemma2: GGUF metadata has no {full!r}, which the model needs")
            return None
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ConfigError(f"gemma2: GGUF metadata {full!r} is {value!r}, not of the expected kind")
        return value

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv")
    if heads % kv_heads:
        raise ConfigError(f"gemma2: GGUF 'gemma2.attention.head_count' ({heads}) is not a multiple of 'gemma2.attention.head_count_kv' ({kv_heads})")
    head_dim = get("attention.key_length")
    for key in ("attention.value_length", "rope.dimension_count"):
        value = get(key, required=False)
        if value is not None and value != head_dim:
            raise ConfigError(f"gemma2: GGUF 'gemma2.{key}' ({value}) differs from the head width ({head_dim}); not implemented")
    file_vocab = get("vocab_size", required=False)
    if file_vocab is not None and file_vocab != vocab_size:
        raise ConfigError(f"gemma2: GGUF 'gemma2.vocab_size' ({file_vocab}) differs from token_embd.weight's {vocab_size} rows")
    num_layers = get("block_count")
    window = get("attention.sliding_window")
    if window < 1:
        raise ConfigError(f"gemma2: GGUF 'gemma2.attention.sliding_window' is {window}; it must be >= 1")
    base = get("rope.freq_base", (int, float), required=False)
    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if isinstance(metadata.get(k), int)]
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=get("context_length"),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", (int, float))),
        query_pre_attn_scalar=float(hidden // heads if num_layers == GGUF_27B_BLOCK_COUNT else head_dim),
        sliding_window=window,
        layer_types=tuple(SLIDING if i % GGUF_SWA_PATTERN < GGUF_SWA_PATTERN - 1 else FULL for i in range(num_layers)),
        rope=RopeConfig("default", float(GGUF_ROPE_BASE if base is None else base)),
        attn_logit_softcapping=float(get("attn_logit_softcapping", (int, float))),
        final_logit_softcapping=float(get("final_logit_softcapping", (int, float))),
        tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
