"""Gemma3Config: the numbers that shape a gemma3 model, read from config.json.

A Gemma 3 config.json comes in two layouts and two schemas, and all four must load.

Layouts (``model_type``):

* ``gemma3_text`` (Gemma3ForCausalLM, the 270M and 1B models): the decoder's keys
  sit at the top level of config.json.
* ``gemma3`` (Gemma3ForConditionalGeneration, the 4B, 12B and 27B models): the
  decoder's keys sit under ``text_config``, beside a ``vision_config`` we do not
  load. The published files list only the keys that differ from transformers'
  ``Gemma3TextConfig`` defaults, so those defaults (:data:`TEXT_DEFAULTS`) are
  part of the format and we apply them.

Schemas (how RoPE and the layer pattern are spelled):

* **hub** (what Google published, transformers 4.x)::

      "rope_theta": 1000000.0,           # RoPE base of the global layers
      "rope_local_base_freq": 10000.0,   # RoPE base of the sliding-window layers
      "rope_scaling": {"rope_type": "linear", "factor": 8.0},   # global layers only, or null
      "sliding_window_pattern": 6        # every 6th layer is global

* **transformers 5** (what ``save_pretrained`` writes today)::

      "rope_parameters": {
          "full_attention":    {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
      "layer_types": ["sliding_attention", ..., "full_attention", ...]

Both end up in one :class:`Gemma3Config`. The rule is *hard-fail, never guess*:
a RoPE type or RoPE key we do not implement, a soft-cap (Gemma 2 had them,
Gemma 3 dropped them: transformers' Gemma3 silently ignores an attention soft-cap,
so we refuse to pick a meaning), bidirectional attention, attention biases or
another activation raise :class:`lollm.errors.ConfigError` naming the key.
Keys that do not change the math (``initializer_range``, ``use_cache`` …) are ignored.

Every value is untrusted and read through :class:`lollm.load.checks.ConfigReader`:
its type and range are checked where it is read (a count is a positive integer
under a stated bound, a RoPE base a finite number above 1, a flag a real
boolean), and an error names the file, the key and the value.
:meth:`Gemma3Config.check_weights` then compares the sizes with the
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

#: transformers' ``Gemma3TextConfig`` defaults, used for keys config.json leaves out
#: (the multimodal configs of Gemma 3 4B/12B/27B list only what differs from them).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,  # global layers
    "rope_local_base_freq": 10_000.0,  # sliding-window layers
    "sliding_window_pattern": 6,  # 5 sliding-window layers, then 1 global, repeated
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
class Gemma3Config:
    """The hyper-parameters of a gemma3 model (values for Gemma 3 270M in brackets).

    vocab_size:               rows of the embedding and of the logits (262144).
    hidden_size:              width of the residual stream (640).
    intermediate_size:        width of the GeGLU MLP's hidden layer (2048).
    num_hidden_layers:        number of decoder layers (18).
    num_attention_heads:      query heads (4).
    num_key_value_heads:      key/value heads, shared by groups of query heads (GQA) (1).
    head_dim:                 width of one head; *not* hidden_size / heads in Gemma (256).
    max_position_embeddings:  the longest context the model supports (32768).
    rms_norm_eps:             epsilon inside every RMSNorm (1e-6).
    query_pre_attn_scalar:    attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (256).
    sliding_window:           a sliding-window layer's query sees this many positions,
                              itself included (512).
    layer_types:              per layer, "sliding_attention" or "full_attention" (global).
    rope_local:               RoPE of the sliding-window layers (base 10000).
    rope_global:              RoPE of the global layers (base 1e6; linear scaling on 4B+).
    tie_word_embeddings:      the output head reuses the embedding matrix.
    eos_token_ids:            end-of-sequence ids from ``eos_token_id`` (int or list).
    multimodal:               True for ``model_type`` "gemma3": the decoder's tensors are
                              named ``model.language_model.*`` and a vision tower sits beside it.
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
    rope_local: RopeConfig
    rope_global: RopeConfig
    tie_word_embeddings: bool = True
    eos_token_ids: tuple[int, ...] = ()
    multimodal: bool = False

    def rope_for(self, layer_type: str) -> RopeConfig:
        """The RoPE settings of a layer type ("sliding_attention" or "full_attention")."""
        return self.rope_local if layer_type == SLIDING else self.rope_global

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "Gemma3Config":
        """Parse config.json (as a dict): either layout, either schema.

        Raises ConfigError naming the key for a missing required key or a
        setting this family does not implement.
        """
        top = ConfigReader(raw, "gemma3: config.json")
        multimodal = top.string("model_type", choices=MODEL_TYPES) == "gemma3"
        if multimodal:
            top.check(isinstance(raw.get("text_config"), dict), "of model_type 'gemma3' has no 'text_config' object")
            text = raw["text_config"]
            read = ConfigReader(text, "gemma3: config.json 'text_config'", defaults=TEXT_DEFAULTS)
        else:
            text = raw
            read = ConfigReader(raw, "gemma3: config.json", defaults=TEXT_DEFAULTS)
        _refuse_unimplemented(top, read)

        # The sizes: every one positive and bounded (lollm.load.checks), then consistent with each other.
        heads = read.positive_int("num_attention_heads", at_most=MAX_HEADS)
        kv_heads = read.positive_int("num_key_value_heads", at_most=heads)
        read.check(heads % kv_heads == 0, f"'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        head_dim = read.positive_int("head_dim", at_most=MAX_WIDTH)
        read.check(head_dim % 2 == 0, f"'head_dim' is {head_dim}; RoPE needs an even head width")
        num_layers = read.positive_int("num_hidden_layers", at_most=MAX_LAYERS)
        rope_local, rope_global = _read_rope(read)

        # end-of-sequence ids: the decoder's own, plus the multimodal wrapper's
        eos = read.token_ids("eos_token_id") if multimodal else ()
        eos = tuple(dict.fromkeys(eos + top.token_ids("eos_token_id")))
        tie = read.boolean("tie_word_embeddings")
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
            layer_types=_read_layer_types(ConfigReader(text, read.where), num_layers),
            rope_local=rope_local,
            rope_global=rope_global,
            # the multimodal wrapper owns lm_head: its flag wins over text_config's
            tie_word_embeddings=top.boolean("tie_word_embeddings", default=tie) if multimodal else tie,
            eos_token_ids=eos,
            multimodal=multimodal,
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
        where = "GGUF metadata" if gguf else "config.json 'text_config'" if self.multimodal else "config.json"
        table = WeightTable(shapes, f"gemma3: {where}", GGUF_FIELD_KEYS if gguf else None)
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
                "gemma3: config.json says the output head is not tied to the embedding "
                "('tie_word_embeddings' false), but the checkpoint has no tensor for 'lm_head.weight'"
            )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], *, vocab_size: int, tie_word_embeddings: bool = True) -> "Gemma3Config":
        """Parse the metadata of a GGUF file of ``general.architecture`` "gemma3".

        Keys read (gguf-py ``Keys``; written by llama.cpp's ``Gemma3Model.set_gguf_parameters``):
        ``gemma3.context_length`` (max_position_embeddings), ``.embedding_length`` (hidden_size),
        ``.block_count``, ``.feed_forward_length``, ``.attention.head_count``,
        ``.attention.head_count_kv``, ``.attention.key_length`` (head_dim),
        ``.attention.value_length`` (must equal key_length), ``.attention.layer_norm_rms_epsilon``,
        ``.attention.sliding_window``, ``.rope.freq_base`` (global layers) and the optional
        ``.rope.scaling.type`` / ``.rope.scaling.factor`` (linear, global layers only: the converter
        writes them from ``rope_scaling``), ``.rope.freq_base_swa``, ``.rope.dimension_count``,
        ``.attention.sliding_window_pattern``, ``.vocab_size``. Every one of the required keys
        missing raises naming it; any other ``gemma3.*`` key raises as an "unverified GGUF key";
        ``.final_logit_softcapping`` / ``.attn_logit_softcapping`` are refused (no soft-caps here).

        Not in the file at all, derived as llama.cpp does in ``llama_model::load_hparams``
        (src/llama-model.cpp, ``case LLM_ARCH_GEMMA3``):

        * the layer pattern: ``set_swa_pattern(6)``: layer i slides when ``i % 6 < 5``
          (the hub's ``sliding_window_pattern`` 6), unless the file has a
          ``sliding_window_pattern`` key;
        * the sliding layers' RoPE base: ``rope_freq_base_train_swa = 10000`` (unscaled), unless
          the file has ``rope.freq_base_swa``;
        * ``query_pre_attn_scalar``: ``f_attention_scale`` is ``1/sqrt(head_dim)``, except for the
          62-layer 27B model where it is ``1/sqrt(hidden / heads)`` (as gemma_pytorch's config.py
          and the hub config.json files: 256 for 270M..12B, 168 for 27B);
        * the activation (tanh GELU) and the absence of biases, fixed by the architecture.

        vocab_size: the rows of ``token_embd.weight`` (the converter trims the embedding to the
        tokenizer's real vocabulary, so a config default would be wrong); tie_word_embeddings:
        True when the file has no ``output.weight``. eos: ``tokenizer.ggml.eos_token_id`` and
        ``tokenizer.ggml.eot_token_id`` when present.
        """
        return _from_gguf(cls, metadata, vocab_size, tie_word_embeddings)


def _refuse_unimplemented(top: ConfigReader, read: ConfigReader) -> None:
    """ConfigError for every setting that would change the math and that this family does not implement.

    top: the whole config.json; read: the decoder's keys (``text_config`` in the multimodal layout).
    """
    act = read.string("hidden_activation", default=read.string("hidden_act", default=None))
    read.check(act in ("gelu_pytorch_tanh", "gelu_tanh"),
               f"'hidden_activation' is {show(act)}; only 'gelu_pytorch_tanh' (tanh GELU) is implemented")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        read.check(not read.has(key), f"sets {key!r} = {show(read.raw.get(key))}; Gemma 3 has no soft-caps "
                                      f"(that is Gemma 2) and this family does not implement them")
    read.check(not read.boolean("use_bidirectional_attention", default=False),
               "sets 'use_bidirectional_attention'; only causal attention is implemented")
    read.check(not read.boolean("attention_bias", default=False),
               "sets 'attention_bias': true; attention biases are not implemented")
    for source in (top, read):
        quantization = source.mapping("quantization_config") or {}
        source.check(not quantization, f"has 'quantization_config' ({show(quantization.get('quant_method', '?'))}); quantized safetensors are not supported")


def _read_layer_types(text: ConfigReader, num_layers: int) -> tuple[str, ...]:
    """Which layers are sliding-window and which global, from either schema.

    transformers 5: an explicit ``layer_types`` list. hub: ``sliding_window_pattern`` N
    means layer i is global when ``(i + 1) % N == 0`` (every N-th layer), sliding
    otherwise; absent, N is 6 (transformers' default). Some files carry both (the
    pattern then as ``_sliding_window_pattern``); they must agree.
    """
    patterns = {k: text.positive_int(k, at_most=MAX_LAYERS)
                for k in ("sliding_window_pattern", "_sliding_window_pattern") if text.has(k)}

    def from_pattern(n: int) -> tuple[str, ...]:
        return tuple(SLIDING if (i + 1) % n else FULL for i in range(num_layers))

    if not text.has("layer_types"):
        # transformers ignores the private spelling and would use 6: refuse to pick one
        text.check("sliding_window_pattern" in patterns or patterns.get("_sliding_window_pattern", 6) == 6,
                   "has '_sliding_window_pattern' but neither 'sliding_window_pattern' nor 'layer_types'")
        return from_pattern(patterns.get("sliding_window_pattern", TEXT_DEFAULTS["sliding_window_pattern"]))
    types = text.strings("layer_types", length=num_layers, choices=LAYER_TYPES)
    for key, value in patterns.items():
        text.check(types == from_pattern(value), f"'layer_types' and {key!r} ({value}) disagree")
    return types


def _read_rope(read: ConfigReader) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of the sliding-window layers and of the global layers, from either schema.

    transformers 5: ``rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}``.
    hub: ``rope_local_base_freq`` (sliding), ``rope_theta`` (global) and ``rope_scaling``,
    which applies to the global layers only.
    """
    params = read.section("rope_parameters")
    scaling = read.mapping("rope_scaling")
    if params is not None:
        params.refuse_unknown(LAYER_TYPES, "this family (one RoPE per layer type)")
        local = params.mapping(SLIDING, default={})
        glob = params.mapping(FULL, default={})
        read.check(scaling is None or all(glob.get(k) == v for k, v in scaling.items()),
                   "has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
        name_local, name_global = f"rope_parameters.{SLIDING}", f"rope_parameters.{FULL}"
    else:
        local, glob = {}, scaling or {}
        name_local, name_global = "rope_local_base_freq", "rope_scaling"
    local_base = read.rope_theta("rope_local_base_freq")
    global_base = read.rope_theta("rope_theta")
    return (_rope(ConfigReader(local, f"{read.where} {name_local!r}"), local_base),
            _rope(ConfigReader(glob, f"{read.where} {name_global!r}"), global_base))


def _rope(rope: ConfigReader, default_theta: float) -> RopeConfig:
    hub_type = rope.string("type", default="default", choices=tuple(ROPE_TYPES))  # the hub's spelling of rope_type
    rope_type = rope.string("rope_type", default=hub_type, choices=tuple(ROPE_TYPES))
    rope.refuse_unknown(ROPE_TYPES[rope_type], f"RoPE type {rope_type!r}")
    return RopeConfig(
        rope_type=rope_type,
        theta=rope.rope_theta("rope_theta", default=default_theta),
        factor=rope.rope_factor("factor") if rope_type == "linear" else None,
    )


# ---------------------------------------------------------------------------
# GGUF metadata (llama.cpp's keys)
# ---------------------------------------------------------------------------
#: The ``gemma3.*`` metadata keys this family reads, as llama.cpp's converter writes them
#: (``Gemma3Model.set_gguf_parameters`` in convert_hf_to_gguf.py / conversion/gemma.py, key
#: names from gguf-py's ``gguf/constants.py`` ``Keys``). Any other ``gemma3.*`` key is an
#: "unverified GGUF key" and raises: it may change the math in a way we do not know.
GGUF_KEYS = (
    "context_length",                    # max_position_embeddings
    "embedding_length",                  # hidden_size
    "block_count",                       # num_hidden_layers
    "feed_forward_length",               # intermediate_size
    "attention.head_count",              # num_attention_heads
    "attention.head_count_kv",           # num_key_value_heads
    "attention.key_length",              # head_dim
    "attention.value_length",            # head_dim again (must equal key_length)
    "attention.layer_norm_rms_epsilon",  # rms_norm_eps (a float32: 1e-6 reads 9.99999997e-07)
    "attention.sliding_window",          # sliding_window
    "attention.sliding_window_pattern",  # optional: N (every N-th layer global) or one bool per layer
    "rope.freq_base",                    # RoPE base of the global layers
    "rope.freq_base_swa",                # optional: RoPE base of the sliding-window layers
    "rope.dimension_count",              # optional: must equal head_dim (RoPE over the whole head)
    "rope.scaling.type",                 # optional: "none" or "linear" (global layers only)
    "rope.scaling.factor",               # with "linear"
    "vocab_size",                        # optional: must equal token_embd.weight's rows
)
#: Written by the converter only when the HF config sets them; Gemma 3 has no soft-caps,
#: so a file carrying one is refused by name (as ``from_hf`` refuses the config keys).
GGUF_REFUSED = ("final_logit_softcapping", "attn_logit_softcapping")

#: Values llama.cpp does not read from the file for architecture gemma3 but sets in
#: ``llama_model::load_hparams`` (src/llama-model.cpp, ``case LLM_ARCH_GEMMA3``):
#: ``hparams.set_swa_pattern(6)`` and ``rope_freq_base_train_swa = 10000.0f``.
GGUF_SWA_PATTERN = 6
GGUF_ROPE_BASE_SWA = 10_000.0
#: Gemma 3 27B (62 layers) scales attention by (hidden / heads) ** -0.5, every other size
#: by head_dim ** -0.5 (llama-model.cpp, ``f_attention_scale``, after gemma_pytorch's config.py).
GGUF_27B_BLOCK_COUNT = 62


#: Config fields -> the GGUF keys they come from, for error messages.
GGUF_FIELD_KEYS = {
    "num_hidden_layers": "gemma3.block_count",
    "hidden_size": "gemma3.embedding_length",
    "intermediate_size": "gemma3.feed_forward_length",
    "num_attention_heads": "gemma3.attention.head_count",
    "num_key_value_heads": "gemma3.attention.head_count_kv",
    "head_dim": "gemma3.attention.key_length",
    "vocab_size": "gemma3.vocab_size",
}


def _from_gguf(cls, metadata: dict[str, Any], vocab_size: int, tie_word_embeddings: bool) -> "Gemma3Config":
    read = ConfigReader(metadata, "gemma3: GGUF metadata")
    arch = metadata.get("general.architecture")
    if arch != "gemma3":
        raise ConfigError(f"gemma3: GGUF general.architecture is {show(arch)}, expected 'gemma3'")
    prefix = f"{arch}."
    for key in sorted(k for k in metadata if k.startswith(prefix)):
        short = key[len(prefix):]
        if short in GGUF_REFUSED:
            raise ConfigError(f"gemma3: GGUF metadata sets {key!r} = {show(metadata[key])}; Gemma 3 has no soft-caps and this family does not implement them")
        if short not in GGUF_KEYS:
            raise ConfigError(f"gemma3: unverified GGUF key {key!r} (= {show(metadata[key])}); this family does not know what it changes")

    def key(name: str) -> str:
        return f"{arch}.{name}"

    hidden = read.positive_int(key("embedding_length"), at_most=MAX_WIDTH)
    heads = read.positive_int(key("attention.head_count"), at_most=MAX_HEADS)
    kv_heads = read.positive_int(key("attention.head_count_kv"), at_most=heads)
    read.check(heads % kv_heads == 0, f"{key('attention.head_count')!r} ({heads}) is not a multiple of {key('attention.head_count_kv')!r} ({kv_heads})")
    head_dim = read.positive_int(key("attention.key_length"), at_most=MAX_WIDTH)
    read.check(head_dim % 2 == 0, f"{key('attention.key_length')!r} is {head_dim}; RoPE needs an even head width")
    value_dim = read.positive_int(key("attention.value_length"), default=head_dim, at_most=MAX_WIDTH)
    read.check(value_dim == head_dim, f"{key('attention.value_length')!r} ({value_dim}) differs from {key('attention.key_length')!r} ({head_dim}); not implemented")
    rope_dims = read.positive_int(key("rope.dimension_count"), default=head_dim, at_most=MAX_WIDTH)
    read.check(rope_dims == head_dim, f"{key('rope.dimension_count')!r} ({rope_dims}) is not the head width ({head_dim}); partial RoPE is not implemented")
    num_layers = read.positive_int(key("block_count"), at_most=MAX_LAYERS)
    file_vocab = read.positive_int(key("vocab_size"), default=vocab_size, at_most=MAX_VOCAB)
    read.check(file_vocab == vocab_size, f"{key('vocab_size')!r} ({file_vocab}) differs from token_embd.weight's {vocab_size} rows")
    scalar = hidden // heads if num_layers == GGUF_27B_BLOCK_COUNT else head_dim
    read.check(scalar >= 1, f"{key('embedding_length')!r} ({hidden}) is smaller than {key('attention.head_count')!r} ({heads})")

    # which layers slide: llama.cpp's set_swa_pattern(n) makes layer i sliding when i % n < n - 1
    pattern = read.value(key("attention.sliding_window_pattern"), GGUF_SWA_PATTERN)
    if isinstance(pattern, list):  # one bool per layer: true = sliding
        read.check(len(pattern) == num_layers and all(isinstance(b, bool) for b in pattern),
                   f"{key('attention.sliding_window_pattern')!r} is {show(pattern)}: neither a positive integer nor {num_layers} booleans")
        layer_types = tuple(SLIDING if b else FULL for b in pattern)
    else:
        pattern = read.positive_int(key("attention.sliding_window_pattern"), default=GGUF_SWA_PATTERN, at_most=MAX_LAYERS)
        layer_types = tuple(SLIDING if i % pattern < pattern - 1 else FULL for i in range(num_layers))

    # RoPE: the global layers read rope.freq_base and any linear scaling; the sliding ones use 10000
    scaling = read.string(key("rope.scaling.type"), default="none", choices=("none", "linear"))
    factor = read.rope_factor(key("rope.scaling.factor"), default=None)
    read.check(scaling == "none" or factor is not None, f"{key('rope.scaling.type')!r} is 'linear' but {key('rope.scaling.factor')!r} is missing")
    read.check(scaling == "linear" or factor in (None, 1.0), f"{key('rope.scaling.factor')!r} is {factor} but {key('rope.scaling.type')!r} is not 'linear'")
    base = read.rope_theta(key("rope.freq_base"))
    rope_global = RopeConfig("linear", base, factor) if scaling == "linear" else RopeConfig("default", base)
    rope_local = RopeConfig("default", read.rope_theta(key("rope.freq_base_swa"), default=GGUF_ROPE_BASE_SWA))

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
        layer_types=layer_types,
        rope_local=rope_local,
        rope_global=rope_global,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=tuple(dict.fromkeys(i for ids in eos for i in ids)),
        multimodal=False,
    )
