"""Qwen2Config: the numbers that shape a qwen2 model, read from config.json or GGUF metadata.

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

A GGUF file carries the same numbers as llama.cpp metadata keys
(``qwen2.block_count`` …): :meth:`Qwen2Config.from_gguf` reads them, under the
same rule (see the table in its docstring and docs/qwen2.md, "From GGUF").

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lollm.errors import ConfigError

from . import GGUF_ARCHITECTURES, MODEL_TYPES

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

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> "Qwen2Config":
        """Build the config from a GGUF file's metadata (llama.cpp's keys); ``{arch}`` is ``qwen2``.

        The key names are gguf-py's (``gguf/constants.py``, class ``Keys``), the
        constants llama.cpp's converter writes them with (``convert_hf_to_gguf.py``,
        now ``conversion/base.py`` ``TextModel.set_gguf_parameters``, which
        ``conversion/qwen.py`` ``Qwen2Model`` inherits):

        ======================================  ============================  ===========================
        GGUF key                                gguf-py constant              Qwen2Config field
        ======================================  ============================  ===========================
        {arch}.block_count                      Keys.LLM.BLOCK_COUNT          num_hidden_layers
        {arch}.context_length                   Keys.LLM.CONTEXT_LENGTH       max_position_embeddings
        {arch}.embedding_length                 Keys.LLM.EMBEDDING_LENGTH     hidden_size
        {arch}.feed_forward_length              Keys.LLM.FEED_FORWARD_LENGTH  intermediate_size
        {arch}.attention.head_count             Keys.Attention.HEAD_COUNT     num_attention_heads
        {arch}.attention.head_count_kv          Keys.Attention.HEAD_COUNT_KV  num_key_value_heads (absent: = heads)
        {arch}.attention.key_length             Keys.Attention.KEY_LENGTH     head_dim (absent: hidden // heads)
        {arch}.attention.value_length           Keys.Attention.VALUE_LENGTH   must equal head_dim
        {arch}.attention.layer_norm_rms_epsilon Keys.Attention.LAYERNORM_RMS_EPS  rms_norm_eps (a float32)
        {arch}.rope.freq_base                   Keys.Rope.FREQ_BASE           rope.theta
        {arch}.rope.dimension_count             Keys.Rope.DIMENSION_COUNT     must equal head_dim
        {arch}.rope.scaling.type                Keys.Rope.SCALING_TYPE        "none" / "linear" / "yarn"; else raise
        {arch}.rope.scaling.factor              Keys.Rope.SCALING_FACTOR      rope.factor
        {arch}.rope.scaling.original_context_length  Keys.Rope.SCALING_ORIG_CTX_LEN  rope.original_max_position_embeddings
        {arch}.vocab_size                       Keys.LLM.VOCAB_SIZE           checked against token_embd.weight
        tokenizer.ggml.eos_token_id             Keys.Tokenizer.EOS_ID         eos_token_ids
        ======================================  ============================  ===========================

        ``tensor_shapes`` (tensor name -> shape, as :class:`lollm.gguf.GGUFTensorSource`
        gives them) supplies what the metadata does not say: the vocabulary size
        (rows of ``token_embd.weight``; without shapes: ``{arch}.vocab_size``, else
        the length of ``tokenizer.ggml.tokens``) and tied embeddings (no ``output.weight``).

        Hard-fail: a required key missing -> ConfigError naming it; any other
        ``{arch}.*`` key (``attention.sliding_window``, ``rope.scaling.attn_factor``,
        ``rope.scaling.yarn_*``, ``rope.scaling.finetuned``, ``pooling_type``,
        ``expert_count`` ...) -> ConfigError naming it, because it could change the
        math. Ignored as purely informational: ``general.*`` (name, file_type,
        quantization_version, …; ``general.alignment`` is the reader's) and the
        ``tokenizer.*`` keys (read by :mod:`lollm.tokenizer`) other than eos.
        """
        return config_from_gguf(metadata, tensor_shapes)


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


# ---------------------------------------------------------------------------
# GGUF: the same numbers, read from llama.cpp's metadata keys
# ---------------------------------------------------------------------------

#: The ``{arch}.*`` keys :meth:`Qwen2Config.from_gguf` reads (``{arch}`` is
#: ``general.architecture``, "qwen2"). Names as gguf-py spells them in
#: ``gguf/constants.py`` (class ``Keys``: ``LLM``, ``Attention``, ``Rope``).
GGUF_ARCH_KEYS_READ = (
    "block_count",                      # Keys.LLM.BLOCK_COUNT            -> num_hidden_layers
    "context_length",                   # Keys.LLM.CONTEXT_LENGTH         -> max_position_embeddings
    "embedding_length",                 # Keys.LLM.EMBEDDING_LENGTH       -> hidden_size
    "feed_forward_length",              # Keys.LLM.FEED_FORWARD_LENGTH    -> intermediate_size
    "vocab_size",                       # Keys.LLM.VOCAB_SIZE             (optional; checked against token_embd)
    "attention.head_count",             # Keys.Attention.HEAD_COUNT       -> num_attention_heads
    "attention.head_count_kv",          # Keys.Attention.HEAD_COUNT_KV    -> num_key_value_heads (absent: = head_count)
    "attention.key_length",             # Keys.Attention.KEY_LENGTH       -> head_dim (absent: embedding_length // head_count)
    "attention.value_length",           # Keys.Attention.VALUE_LENGTH     (optional; must equal head_dim)
    "attention.layer_norm_rms_epsilon", # Keys.Attention.LAYERNORM_RMS_EPS -> rms_norm_eps
    "rope.freq_base",                   # Keys.Rope.FREQ_BASE             -> rope theta
    "rope.dimension_count",             # Keys.Rope.DIMENSION_COUNT       (optional; must equal head_dim: no partial RoPE)
    "rope.scaling.type",                # Keys.Rope.SCALING_TYPE          "none" | "linear" | "yarn"
    "rope.scaling.factor",              # Keys.Rope.SCALING_FACTOR
    "rope.scaling.original_context_length",  # Keys.Rope.SCALING_ORIG_CTX_LEN (YaRN)
)

#: llama.cpp's ``rope.scaling.type`` values (gguf-py ``RopeScalingType``) -> our RoPE types.
GGUF_ROPE_TYPES = {"none": "default", "linear": "linear", "yarn": "yarn"}


def gguf_required(metadata: dict[str, Any], key: str, kind=int) -> Any:
    """``metadata[key]``; ConfigError naming the key when it is missing or of the wrong kind."""
    value = metadata.get(key)
    if value is None:
        raise ConfigError(f"qwen2: the GGUF metadata has no {key!r}, which the model needs")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"qwen2: GGUF metadata {key!r} is {value!r}, not a single number of the expected kind")
    return value


def gguf_optional(metadata: dict[str, Any], key: str, kind=int) -> Any:
    """``metadata[key]`` or None; ConfigError naming the key when it is of the wrong kind."""
    return None if metadata.get(key) is None else gguf_required(metadata, key, kind)


def config_from_gguf(metadata: dict[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Qwen2Config:
    """Build a :class:`Qwen2Config` from a GGUF file's metadata (see :meth:`Qwen2Config.from_gguf`)."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"qwen2: GGUF general.architecture is {arch!r}, expected one of {GGUF_ARCHITECTURES}")

    # Hard-fail: every {arch}.* key must be one we read. Anything else (sliding
    # window, YaRN tuning knobs, pooling, experts ...) could change the math.
    known = {f"{arch}.{k}" for k in GGUF_ARCH_KEYS_READ}
    unknown = sorted(k for k in metadata if k.startswith(f"{arch}.") and k not in known)
    if unknown:
        raise ConfigError(
            f"qwen2: the GGUF metadata has {unknown[0]!r}, which this family does not implement"
            + (f" (also: {', '.join(unknown[1:])})" if len(unknown) > 1 else "")
        )

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = gguf_required(metadata, key("embedding_length"))
    heads = gguf_required(metadata, key("attention.head_count"))
    # llama.cpp's rule: no head_count_kv means plain multi-head attention.
    kv_heads = gguf_optional(metadata, key("attention.head_count_kv")) or heads
    if heads % kv_heads:
        raise ConfigError(f"qwen2: GGUF {key('attention.head_count')} ({heads}) is not a multiple of {key('attention.head_count_kv')} ({kv_heads})")
    # llama.cpp's rule (and transformers'): head_dim = embedding_length // head_count unless key_length says otherwise.
    head_dim = gguf_optional(metadata, key("attention.key_length")) or hidden // heads
    for other in ("attention.value_length", "rope.dimension_count"):
        value = gguf_optional(metadata, key(other))
        if value is not None and value != head_dim:
            raise ConfigError(f"qwen2: GGUF {key(other)} is {value}, but the head width is {head_dim}; only equal widths (full RoPE) are implemented")
    max_pos = gguf_required(metadata, key("context_length"))

    # RoPE: plain unless rope.scaling.type says otherwise.
    scaling = metadata.get(key("rope.scaling.type"), "none")
    if scaling not in GGUF_ROPE_TYPES:
        raise ConfigError(
            f"qwen2: GGUF {key('rope.scaling.type')} is {scaling!r}, which is not implemented "
            f"(implemented: {', '.join(GGUF_ROPE_TYPES)})"
        )
    rope_type = GGUF_ROPE_TYPES[scaling]
    factor = gguf_optional(metadata, key("rope.scaling.factor"), (int, float))
    original = gguf_optional(metadata, key("rope.scaling.original_context_length"))
    if rope_type == "default" and (factor not in (None, 1, 1.0) or original is not None):
        raise ConfigError(f"qwen2: GGUF has rope.scaling factor/original_context_length but {key('rope.scaling.type')} is {scaling!r}")
    if rope_type != "default" and factor is None:
        raise ConfigError(f"qwen2: GGUF RoPE scaling {scaling!r} needs {key('rope.scaling.factor')!r}")
    if rope_type == "yarn" and original is None:
        original = max_pos  # llama.cpp and transformers: the training context
    rope = RopeConfig(
        rope_type=rope_type,
        theta=float(gguf_required(metadata, key("rope.freq_base"), (int, float))),
        factor=None if rope_type == "default" else float(factor),
        original_max_position_embeddings=original if rope_type == "yarn" else None,
    )

    # Vocabulary: the embedding's rows are the truth (a converter may pad or trim them).
    shapes = tensor_shapes or {}
    declared = gguf_optional(metadata, key("vocab_size"))
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in shapes:
        vocab = shapes["token_embd.weight"][0]
    elif declared is not None:
        vocab = declared
    elif tokens is not None:
        vocab = len(tokens)
    else:
        raise ConfigError("qwen2: cannot tell the vocabulary size: no token_embd.weight, no "
                          f"{key('vocab_size')!r} and no 'tokenizer.ggml.tokens' in the GGUF")
    if declared is not None and declared != vocab:
        raise ConfigError(f"qwen2: GGUF {key('vocab_size')} is {declared}, but token_embd.weight has {vocab} rows")
    if tokens is not None and len(tokens) > vocab:
        raise ConfigError(f"qwen2: the GGUF tokenizer has {len(tokens)} tokens, more than the {vocab} embedding rows")

    eos = gguf_optional(metadata, "tokenizer.ggml.eos_token_id")
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=gguf_required(metadata, key("feed_forward_length")),
        num_hidden_layers=gguf_required(metadata, key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(gguf_required(metadata, key("attention.layer_norm_rms_epsilon"), (int, float))),
        rope=rope,
        # llama.cpp's converter writes no output.weight when lm_head is tied to the embedding
        tie_word_embeddings=bool(shapes) and "output.weight" not in shapes,
        eos_token_ids=() if eos is None else (eos,),
    )
