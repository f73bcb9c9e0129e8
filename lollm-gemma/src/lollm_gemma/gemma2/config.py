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

Every value is untrusted and read through :class:`lollm.load.checks.ConfigReader`:
its type and range are checked where it is read (a count is a positive integer
under a stated bound, a RoPE base a finite number above 1, a flag a real
boolean), and an error names the file, the key and the value.
:meth:`Gemma2Config.check_weights` then compares the sizes with the
checkpoint's tensor table, so nothing is built that the weights do not back.

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lollm.load.checks import (
    MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, ConfigReader, WeightTable, show,
)
from lollm.errors import ConfigError, WeightsError

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
        read = ConfigReader(raw, "gemma2: config.json", defaults=DEFAULTS)
        read.string("model_type", choices=MODEL_TYPES)
        _refuse_unimplemented(read)

        # The sizes: every one positive and bounded (lollm.load.checks), then consistent with each other.
        heads = read.positive_int("num_attention_heads", at_most=MAX_HEADS)
        kv_heads = read.positive_int("num_key_value_heads", at_most=heads)
        read.check(heads % kv_heads == 0, f"'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        head_dim = read.positive_int("head_dim", at_most=MAX_WIDTH)
        read.check(head_dim % 2 == 0, f"'head_dim' is {head_dim}; RoPE needs an even head width")
        num_layers = read.positive_int("num_hidden_layers", at_most=MAX_LAYERS)
        return cls(
            vocab_size=read.positive_int("vocab_size", at_most=MAX_VOCAB),
            hidden_size=read.positive_int("hidden_size", at_most=MAX_WIDTH),
            intermediate_size=read.positive_int("intermediate_size", at_most=MAX_WIDTH),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=read.positive_int("max_position_embeddings", at_most=MAX_CONTEXT),
            rms_norm_eps=read.number("rms_norm_eps", above=0.0, at_most=1.0),
            query_pre_attn_scalar=read.number("query_pre_attn_scalar", above=0.0),
            sliding_window=read.positive_int("sliding_window", at_most=MAX_CONTEXT),
            layer_types=_read_layer_types(read, num_layers),
            rope=_read_rope(read),
            attn_logit_softcapping=read.number("attn_logit_softcapping", default=None, above=0.0),  # null: no cap
            final_logit_softcapping=read.number("final_logit_softcapping", default=None, above=0.0),
            tie_word_embeddings=read.boolean("tie_word_embeddings"),
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
        table = WeightTable(shapes, f"gemma2: {'GGUF metadata' if gguf else 'config.json'}", GGUF_FIELD_KEYS if gguf else None)
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
                "gemma2: config.json says the output head is not tied to the embedding "
                "('tie_word_embeddings' false), but the checkpoint has no tensor for 'lm_head.weight'"
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


def _refuse_unimplemented(read: ConfigReader) -> None:
    """ConfigError for every setting that would change the math and that this family does not implement."""
    act = read.string("hidden_activation", default=read.string("hidden_act", default=None))
    read.check(act in ("gelu_pytorch_tanh", "gelu_tanh"),
               f"'hidden_activation' is {show(act)}; only 'gelu_pytorch_tanh' (tanh GELU) is implemented")
    read.check(not read.boolean("use_bidirectional_attention", default=False),
               "sets 'use_bidirectional_attention'; only causal attention is implemented")
    read.check(not read.boolean("attention_bias", default=False),
               "sets 'attention_bias': true; attention biases are not implemented")
    quantization = read.mapping("quantization_config") or {}
    read.check(not quantization, f"has 'quantization_config' ({show(quantization.get('quant_method', '?'))}); quantized safetensors are not supported")


def _read_layer_types(read: ConfigReader, num_layers: int) -> tuple[str, ...]:
    """Which layers are sliding-window and which global.

    transformers 5: an explicit ``layer_types`` list. hub: none, and the layers
    alternate, sliding first (transformers' rule: layer i is sliding when i is even).
    """
    alternating = tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    return read.strings("layer_types", default=alternating, length=num_layers, choices=LAYER_TYPES)


def _read_rope(read: ConfigReader) -> RopeConfig:
    """Read RoPE settings from either schema into one RopeConfig.

    transformers 5: everything in ``rope_parameters`` (``rope_theta`` inside it).
    hub:            ``rope_theta`` at the top level, scaling in ``rope_scaling``
                    (``null`` or absent for plain RoPE).
    """
    params = read.mapping("rope_parameters")
    scaling = read.mapping("rope_scaling")
    read.check(params is None or scaling is None or params == scaling,
               "has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
    where = "rope_parameters" if params is not None else "rope_scaling"
    rope = ConfigReader(params if params is not None else scaling or {}, f"gemma2: config.json {where!r}")
    rope.check(not any(isinstance(v, dict) for v in rope.raw.values()),
               "is nested per layer type; gemma2 has one RoPE for every layer")

    hub_type = rope.string("type", default="default", choices=tuple(ROPE_TYPES))  # the hub's spelling of rope_type
    rope_type = rope.string("rope_type", default=hub_type, choices=tuple(ROPE_TYPES))
    rope.refuse_unknown(ROPE_TYPES[rope_type], f"RoPE type {rope_type!r}")
    theta = rope.rope_theta("rope_theta", default=None)  # the dict's theta first, then the top level's
    return RopeConfig(
        rope_type=rope_type,
        theta=read.rope_theta("rope_theta") if theta is None else theta,
        factor=rope.rope_factor("factor") if rope_type == "linear" else None,
    )


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


#: Config fields -> the GGUF keys they come from, for error messages.
GGUF_FIELD_KEYS = {
    "num_hidden_layers": "gemma2.block_count",
    "hidden_size": "gemma2.embedding_length",
    "intermediate_size": "gemma2.feed_forward_length",
    "num_attention_heads": "gemma2.attention.head_count",
    "num_key_value_heads": "gemma2.attention.head_count_kv",
    "head_dim": "gemma2.attention.key_length",
    "vocab_size": "gemma2.vocab_size",
}


def _from_gguf(cls, metadata: dict[str, Any], vocab_size: int, tie_word_embeddings: bool) -> "Gemma2Config":
    read = ConfigReader(metadata, "gemma2: GGUF metadata")
    arch = metadata.get("general.architecture")
    if arch != "gemma2":
        raise ConfigError(f"gemma2: GGUF general.architecture is {show(arch)}, expected 'gemma2'")
    for key in sorted(k for k in metadata if k.startswith("gemma2.")):
        if key[len("gemma2."):] not in GGUF_REQUIRED + GGUF_OPTIONAL:
            raise ConfigError(f"gemma2: unverified GGUF key {key!r} (= {show(metadata[key])}); this family does not know what it changes")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = read.positive_int(key("embedding_length"), at_most=MAX_WIDTH)
    heads = read.positive_int(key("attention.head_count"), at_most=MAX_HEADS)
    kv_heads = read.positive_int(key("attention.head_count_kv"), at_most=heads)
    read.check(heads % kv_heads == 0, f"{key('attention.head_count')!r} ({heads}) is not a multiple of {key('attention.head_count_kv')!r} ({kv_heads})")
    head_dim = read.positive_int(key("attention.key_length"), at_most=MAX_WIDTH)
    read.check(head_dim % 2 == 0, f"{key('attention.key_length')!r} is {head_dim}; RoPE needs an even head width")
    for other in ("attention.value_length", "rope.dimension_count"):
        value = read.positive_int(key(other), default=head_dim, at_most=MAX_WIDTH)
        read.check(value == head_dim, f"{key(other)!r} ({value}) differs from the head width ({head_dim}); not implemented")
    file_vocab = read.positive_int(key("vocab_size"), default=vocab_size, at_most=MAX_VOCAB)
    read.check(file_vocab == vocab_size, f"{key('vocab_size')!r} ({file_vocab}) differs from token_embd.weight's {vocab_size} rows")
    num_layers = read.positive_int(key("block_count"), at_most=MAX_LAYERS)
    scalar = hidden // heads if num_layers == GGUF_27B_BLOCK_COUNT else head_dim
    read.check(scalar >= 1, f"{key('embedding_length')!r} ({hidden}) is smaller than {key('attention.head_count')!r} ({heads})")
    eos = [read.token_ids(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return cls(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=read.positive_int(key("feed_forward_length"), at_most=MAX_WIDTH),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=read.positive_int(key("context_length"), at_most=MAX_CONTEXT),
        rms_norm_eps=read.number(key("attention.layer_norm_rms_epsilon"), above=0.0, at_most=1.0),
        query_pre_attn_scalar=float(scalar),
        sliding_window=read.positive_int(key("attention.sliding_window"), at_most=MAX_CONTEXT),
        layer_types=tuple(SLIDING if i % GGUF_SWA_PATTERN < GGUF_SWA_PATTERN - 1 else FULL for i in range(num_layers)),
        rope=RopeConfig("default", read.rope_theta(key("rope.freq_base"), default=GGUF_ROPE_BASE)),
        attn_logit_softcapping=read.number(key("attn_logit_softcapping"), above=0.0),
        final_logit_softcapping=read.number(key("final_logit_softcapping"), above=0.0),
        tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=tuple(dict.fromkeys(i for ids in eos for i in ids)),
    )
