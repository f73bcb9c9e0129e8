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
same rule (see the table in its docstring and docs/qwen2-reference.md, "From GGUF").

Every value is untrusted and read through :class:`lollm.load.checks.ConfigReader`:
its type and range are checked where it is read (a count is a positive integer
under a stated bound, a RoPE base a finite number above 1, a flag a real
boolean), and an error names the file, the key and the value.
:meth:`Qwen2Config.check_weights` then compares the sizes with the
checkpoint's tensor table, so nothing is built that the weights do not back.

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lollm.load.checks import (
    MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_ROPE_SCALE, MAX_VOCAB, MAX_WIDTH, REQUIRED, ConfigReader, WeightTable, show,
)
from lollm.errors import ConfigError, WeightsError

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
        read = ConfigReader(raw, "qwen2: config.json")
        read.string("model_type", choices=MODEL_TYPES)

        # Settings that would change the math and that we do not implement.
        read.check(not read.boolean("use_sliding_window", default=False),
                   "sets 'use_sliding_window': true; sliding-window attention is not implemented")
        read.string("hidden_act", default="silu", choices=("silu",))  # transformers' default for qwen2
        read.check(read.number("partial_rotary_factor", default=1.0) == 1.0,
                   "'partial_rotary_factor' is set; partial RoPE is not implemented")
        quantization = read.mapping("quantization_config") or {}
        read.check(not quantization, f"has 'quantization_config' ({show(quantization.get('quant_method', '?'))}); quantized safetensors are not supported")

        # The sizes: every one positive and bounded (lollm.load.checks), then consistent with each other.
        num_layers = read.positive_int("num_hidden_layers", at_most=MAX_LAYERS)
        read.strings("layer_types", default=None, length=num_layers, choices=("full_attention",))
        hidden = read.positive_int("hidden_size", at_most=MAX_WIDTH)
        heads = read.positive_int("num_attention_heads", at_most=MAX_HEADS)
        # transformers' Qwen2 reads an explicit head_dim when config.json has one.
        head_dim = read.positive_int("head_dim", default=hidden // heads, at_most=MAX_WIDTH)
        read.check(head_dim >= 1 and head_dim % 2 == 0, f"gives a head width of {head_dim}; RoPE needs an even width of at least 2")
        # Absent num_key_value_heads means plain multi-head attention (transformers' rule).
        kv_heads = read.positive_int("num_key_value_heads", default=heads, at_most=heads)
        read.check(heads % kv_heads == 0, f"'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        max_pos = read.positive_int("max_position_embeddings", at_most=MAX_CONTEXT)

        return cls(
            vocab_size=read.positive_int("vocab_size", at_most=MAX_VOCAB),
            hidden_size=hidden,
            intermediate_size=read.positive_int("intermediate_size", at_most=MAX_WIDTH),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=read.number("rms_norm_eps", above=0.0, at_most=1.0),
            rope=_read_rope(read, max_pos),
            tie_word_embeddings=read.boolean("tie_word_embeddings", default=False),  # transformers' default for qwen2
            eos_token_ids=read.token_ids("eos_token_id"),
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
        table = WeightTable(shapes, f"qwen2: {'GGUF metadata' if gguf else 'config.json'}", GGUF_FIELD_KEYS if gguf else None)
        table.layers("num_hidden_layers", self.num_hidden_layers, "model.layers.")
        table.size("vocab_size", self.vocab_size, "model.embed_tokens.weight", 0)
        table.size("hidden_size", self.hidden_size, "model.embed_tokens.weight", 1)
        table.size("intermediate_size", self.intermediate_size, "model.layers.0.mlp.up_proj.weight", 0)
        table.size(("num_attention_heads", "head_dim"), self.num_attention_heads * self.head_dim,
                   "model.layers.0.self_attn.q_proj.weight", 0)
        table.size(("num_key_value_heads", "head_dim"), self.num_key_value_heads * self.head_dim,
                   "model.layers.0.self_attn.k_proj.weight", 0)
        if not self.tie_word_embeddings and "lm_head.weight" not in shapes:
            raise WeightsError(
                f"qwen2: {'the GGUF file' if gguf else 'config.json'} says the output head is not tied to the "
                f"embedding ('tie_word_embeddings' false), but the checkpoint has no tensor for 'lm_head.weight'"
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


def _read_rope(read: ConfigReader, max_position_embeddings: int) -> RopeConfig:
    """Read RoPE settings from either schema into one RopeConfig.

    transformers 5: everything in ``rope_parameters`` (``rope_theta`` inside it).
    hub:            ``rope_theta`` at the top level, scaling in ``rope_scaling``
                    (``null`` or absent for plain RoPE), its type under ``type`` or ``rope_type``.
    """
    params = read.mapping("rope_parameters")
    scaling = read.mapping("rope_scaling")
    read.check(params is None or scaling is None or params == scaling,
               "has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
    where = "rope_parameters" if params is not None else "rope_scaling"
    rope = ConfigReader(params if params is not None else scaling or {}, f"qwen2: config.json {where!r}")

    # transformers looks for theta in the RoPE dict first, then at the top level.
    theta = rope.rope_theta("rope_theta", default=None)
    if theta is None:
        theta = read.rope_theta("rope_theta")
    hub_type = rope.string("type", default="default", choices=tuple(ROPE_TYPES))  # the hub's spelling of rope_type
    rope_type = rope.string("rope_type", default=hub_type, choices=tuple(ROPE_TYPES))
    rope.refuse_unknown(ROPE_TYPES[rope_type], f"RoPE type {rope_type!r}")

    factor = rope.rope_factor("factor", default=REQUIRED if rope_type != "default" else None)
    original = None
    if rope_type == "yarn":
        # transformers' rule: a top-level key wins, else the dict's, else max_position_embeddings.
        original = read.positive_int("original_max_position_embeddings", default=None, at_most=MAX_CONTEXT) or \
            rope.positive_int("original_max_position_embeddings", default=max_position_embeddings, at_most=MAX_CONTEXT)
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=rope.rope_knob("attention_factor", at_most=MAX_ROPE_SCALE),
        beta_fast=rope.rope_knob("beta_fast"),
        beta_slow=rope.rope_knob("beta_slow"),
        mscale=rope.rope_knob("mscale", at_most=MAX_ROPE_SCALE),
        mscale_all_dim=rope.rope_knob("mscale_all_dim", at_most=MAX_ROPE_SCALE),
        truncate=rope.boolean("truncate", default=True),
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


#: Config fields -> the GGUF keys they come from (``{arch}`` = "qwen2"), for error messages.
GGUF_FIELD_KEYS = {
    "num_hidden_layers": "qwen2.block_count",
    "vocab_size": "token_embd.weight rows",
    "hidden_size": "qwen2.embedding_length",
    "intermediate_size": "qwen2.feed_forward_length",
    "num_attention_heads": "qwen2.attention.head_count",
    "num_key_value_heads": "qwen2.attention.head_count_kv",
    "head_dim": "qwen2.attention.key_length",
}


def config_from_gguf(metadata: dict[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]] | None = None) -> Qwen2Config:
    """Build a :class:`Qwen2Config` from a GGUF file's metadata (see :meth:`Qwen2Config.from_gguf`)."""
    read = ConfigReader(metadata, "qwen2: GGUF metadata")
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"qwen2: GGUF general.architecture is {show(arch)}, expected one of {GGUF_ARCHITECTURES}")

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

    hidden = read.positive_int(key("embedding_length"), at_most=MAX_WIDTH)
    heads = read.positive_int(key("attention.head_count"), at_most=MAX_HEADS)
    # llama.cpp's rule: no head_count_kv means plain multi-head attention.
    kv_heads = read.positive_int(key("attention.head_count_kv"), default=heads, at_most=heads)
    read.check(heads % kv_heads == 0, f"{key('attention.head_count')!r} ({heads}) is not a multiple of {key('attention.head_count_kv')!r} ({kv_heads})")
    # llama.cpp's rule (and transformers'): head_dim = embedding_length // head_count unless key_length says otherwise.
    head_dim = read.positive_int(key("attention.key_length"), default=hidden // heads, at_most=MAX_WIDTH)
    read.check(head_dim >= 1 and head_dim % 2 == 0, f"gives a head width of {head_dim}; RoPE needs an even width of at least 2")
    for other in ("attention.value_length", "rope.dimension_count"):
        value = read.positive_int(key(other), default=head_dim, at_most=MAX_WIDTH)
        read.check(value == head_dim, f"{key(other)!r} is {value}, but the head width is {head_dim}; only equal widths (full RoPE) are implemented")
    max_pos = read.positive_int(key("context_length"), at_most=MAX_CONTEXT)

    # RoPE: plain unless rope.scaling.type says otherwise.
    scaling = read.string(key("rope.scaling.type"), default="none", choices=tuple(GGUF_ROPE_TYPES))
    rope_type = GGUF_ROPE_TYPES[scaling]
    factor = read.rope_factor(key("rope.scaling.factor"), default=None)
    original = read.positive_int(key("rope.scaling.original_context_length"), default=None, at_most=MAX_CONTEXT)
    read.check(rope_type != "default" or (factor in (None, 1.0) and original is None),
               f"has rope.scaling factor/original_context_length but {key('rope.scaling.type')!r} is {scaling!r}")
    read.check(rope_type == "default" or factor is not None, f"RoPE scaling {scaling!r} needs {key('rope.scaling.factor')!r}")
    if rope_type == "yarn" and original is None:
        original = max_pos  # llama.cpp and transformers: the training context
    rope = RopeConfig(
        rope_type=rope_type,
        theta=read.rope_theta(key("rope.freq_base")),
        factor=None if rope_type == "default" else factor,
        original_max_position_embeddings=original if rope_type == "yarn" else None,
    )

    # Vocabulary: the embedding's rows are the truth (a converter may pad or trim them).
    shapes = tensor_shapes or {}
    declared = read.positive_int(key("vocab_size"), default=None, at_most=MAX_VOCAB)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in shapes:
        vocab = shapes["token_embd.weight"][0]
    elif declared is not None:
        vocab = declared
    elif isinstance(tokens, list):
        vocab = len(tokens)
    else:
        raise ConfigError("qwen2: cannot tell the vocabulary size: no token_embd.weight, no "
                          f"{key('vocab_size')!r} and no 'tokenizer.ggml.tokens' in the GGUF")
    if declared is not None and declared != vocab:
        raise ConfigError(f"qwen2: GGUF {key('vocab_size')} is {declared}, but token_embd.weight has {vocab} rows")
    if isinstance(tokens, list) and len(tokens) > vocab:
        raise ConfigError(f"qwen2: the GGUF tokenizer has {len(tokens)} tokens, more than the {vocab} embedding rows")

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=read.positive_int(key("feed_forward_length"), at_most=MAX_WIDTH),
        num_hidden_layers=read.positive_int(key("block_count"), at_most=MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=read.number(key("attention.layer_norm_rms_epsilon"), above=0.0, at_most=1.0),
        rope=rope,
        # llama.cpp's converter writes no output.weight when lm_head is tied to the embedding
        tie_word_embeddings=bool(shapes) and "output.weight" not in shapes,
        eos_token_ids=read.token_ids("tokenizer.ggml.eos_token_id"),
    )
