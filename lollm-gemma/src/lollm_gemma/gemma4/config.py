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

Every value is untrusted and read through :class:`lollm.load.checks.ConfigReader`:
its type and range are checked where it is read (a count is a positive integer
under a stated bound, a RoPE base a finite number above 1, a flag a real
boolean), and an error names the file, the key and the value.
:meth:`Gemma4Config.check_weights` then compares the sizes with the
checkpoint's tensor table, so nothing is built that the weights do not back.

No torch here: a config is plain numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from lollm.load.checks import (
    MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, REQUIRED, ConfigReader, WeightTable, show,
)
from lollm.errors import ConfigError, WeightsError

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
    "pad_token_id": 0,
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
    pad_token_id:                the id embedded at an image's positions (0, ``<pad>``; docs/gemma4.md, Vision);
                                 None when a GGUF file names no padding id.
    images_bidirectional:        ``use_bidirectional_attention: "vision"`` (26B, 31B): the sliding layers
                                 attend both ways inside an image (False on E2B: causal, like text);
                                 None when unknown: no GGUF key holds it, so a GGUF file gets it from its
                                 width (config_gguf.IMAGE_ATTENTION_BY_WIDTH), None for another width.
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
    pad_token_id: int | None = 0
    images_bidirectional: bool | None = False

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
        top = ConfigReader(raw, "gemma4: config.json")
        multimodal = top.string("model_type", choices=MODEL_TYPES) == "gemma4"
        if multimodal:
            top.check(isinstance(raw.get("text_config"), dict), "of model_type 'gemma4' has no 'text_config' object")
            read = ConfigReader(raw["text_config"], "gemma4: config.json 'text_config'", defaults=TEXT_DEFAULTS)
        else:
            read = ConfigReader(raw, "gemma4: config.json", defaults=TEXT_DEFAULTS)
        _refuse_unimplemented(top, read)

        # The sizes: every one positive and bounded (lollm.load.checks), then consistent with each other.
        heads = read.positive_int("num_attention_heads", at_most=MAX_HEADS)
        num_layers = read.positive_int("num_hidden_layers", at_most=MAX_LAYERS)
        layer_types = _read_layer_types(read, num_layers)
        shapes = _read_layer_shapes(read, layer_types)
        for layer_type, (head_dim, kv_heads) in shapes.items():
            read.check(heads % kv_heads == 0 and kv_heads <= heads,
                       f"'num_attention_heads' ({heads}) is not a multiple of the {kv_heads} key/value heads of the {layer_type} layers")
            read.check(head_dim % 2 == 0, f"gives the {layer_type} layers a head width of {head_dim}; RoPE needs an even width")
        shared = read.integer("num_kv_shared_layers", at_most=MAX_LAYERS)
        _check_kv_sharing(read, layer_types, shared)
        rope_local, rope_global = _read_rope(read)

        # end-of-sequence ids: the decoder's own, plus the multimodal wrapper's
        eos = read.token_ids("eos_token_id") if multimodal else ()
        tie = read.boolean("tie_word_embeddings")
        ple = read.integer("hidden_size_per_layer_input", at_most=MAX_WIDTH)  # 0: no per-layer embeddings
        vocab = read.positive_int("vocab_size", at_most=MAX_VOCAB)
        pad = read.integer("pad_token_id", at_most=vocab - 1)  # what an image's positions embed (modeling_gemma4.py)
        return cls(
            vocab_size=vocab,
            hidden_size=read.positive_int("hidden_size", at_most=MAX_WIDTH),
            intermediate_size=read.positive_int("intermediate_size", at_most=MAX_WIDTH),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=shapes[SLIDING][1],
            global_num_key_value_heads=shapes[FULL][1],
            head_dim=shapes[SLIDING][0],
            global_head_dim=shapes[FULL][0],
            attention_k_eq_v=read.boolean("attention_k_eq_v"),
            max_position_embeddings=read.positive_int("max_position_embeddings", at_most=MAX_CONTEXT),
            rms_norm_eps=read.number("rms_norm_eps", above=0.0, at_most=1.0),
            sliding_window=read.positive_int("sliding_window", at_most=MAX_CONTEXT),
            layer_types=layer_types,
            rope_local=rope_local,
            rope_global=rope_global,
            final_logit_softcapping=read.number("final_logit_softcapping", default=None, above=0.0),  # null: no cap
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=read.integer("vocab_size_per_layer_input", at_most=MAX_VOCAB),
            num_kv_shared_layers=shared,
            use_double_wide_mlp=read.boolean("use_double_wide_mlp"),
            # the multimodal wrapper owns lm_head: its flag wins over text_config's
            tie_word_embeddings=top.boolean("tie_word_embeddings", default=tie) if multimodal else tie,
            eos_token_ids=tuple(dict.fromkeys(eos + top.token_ids("eos_token_id"))),
            multimodal=multimodal,
            pad_token_id=pad,
            images_bidirectional=read.value("use_bidirectional_attention", False) == "vision",
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
        from .config_gguf import GGUF_FIELD_KEYS

        table = WeightTable(shapes, f"gemma4: {where}", GGUF_FIELD_KEYS if gguf else None)
        table.layers("num_hidden_layers", self.num_hidden_layers, "model.layers.")
        table.size("vocab_size", self.vocab_size, "model.embed_tokens.weight", 0)
        table.size("hidden_size", self.hidden_size, "model.embed_tokens.weight", 1)
        table.size("intermediate_size", self.intermediate_size, "model.layers.0.mlp.up_proj.weight", 0)
        first = self.layer_types[0]  # layer 0 always computes its own keys and values
        table.size(("num_attention_heads", "head_dim"), self.num_attention_heads * self.head_dim_for(first),
                   "model.layers.0.self_attn.q_proj.weight", 0)
        table.size(("num_key_value_heads", "head_dim"), self.kv_heads_for(first) * self.head_dim_for(first),
                   "model.layers.0.self_attn.k_proj.weight", 0)
        if self.hidden_size_per_layer_input:
            table.size("vocab_size_per_layer_input", self.vocab_size_per_layer_input, "model.embed_tokens_per_layer.weight", 0)
            table.size(("num_hidden_layers", "hidden_size_per_layer_input"), self.num_hidden_layers * self.hidden_size_per_layer_input,
                       "model.embed_tokens_per_layer.weight", 1)
        if not self.tie_word_embeddings and "lm_head.weight" not in shapes:
            raise WeightsError(
                "gemma4: config.json says the output head is not tied to the embedding "
                "('tie_word_embeddings' false), but the checkpoint has no tensor for 'lm_head.weight'"
            )

    @classmethod
    def from_gguf(
        cls, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]], *, rope_freqs: Sequence[float] | None,
    ) -> "Gemma4Config":
        """Parse the metadata of a GGUF file of ``general.architecture`` "gemma4".

        metadata: the file's key/value pairs; tensor_shapes: each tensor's name -> shape (the
        llama.cpp names); rope_freqs: the values of the file's ``rope_freqs.weight`` tensor
        (None when the file has none, which is refused).

        Keys read, with what llama.cpp's converter writes into them (``Gemma4Model``, which
        extends ``Gemma3Model`` and ``TextModel`` in conversion/gemma.py and conversion/base.py;
        names as gguf-py's ``Keys``):

        * ``gemma4.context_length`` (max_position_embeddings), ``.embedding_length``
          (hidden_size), ``.block_count``, ``.attention.head_count``,
          ``.attention.layer_norm_rms_epsilon``, ``.attention.sliding_window``;
        * ``.feed_forward_length``: intermediate_size, or with ``use_double_wide_mlp`` one value
          per layer (2x on the KV-sharing layers);
        * ``.attention.head_count_kv``: num_key_value_heads, or with ``num_global_key_value_heads``
          one value per layer (that count on the global layers);
        * ``.attention.key_length`` / ``.value_length``: ``global_head_dim`` (global layers);
          ``.attention.key_length_swa`` / ``.value_length_swa``: ``head_dim`` (sliding layers);
        * ``.attention.sliding_window_pattern``: one bool per layer, true = sliding;
        * ``.attention.shared_kv_layers`` (num_kv_shared_layers);
        * ``.embedding_length_per_layer_input`` (hidden_size_per_layer_input, 0 = no PLE);
        * ``.rope.freq_base`` (the global layers' theta), ``.rope.freq_base_swa`` (the sliding
          layers'), ``.rope.dimension_count`` (= global head dim: the whole head goes through
          llama.cpp's RoPE, see below), ``.rope.dimension_count_swa`` (= the sliding head dim);
        * ``.final_logit_softcapping`` (absent: no soft-cap); ``.vocab_size`` if present must
          equal token_embd's rows.

        Every required key missing raises naming it; any other ``gemma4.*`` key raises as an
        "unverified GGUF key"; the MoE keys (``.expert_*``, 26B-A4B) are refused by name.

        From the tensors, not the keys:

        * vocab_size: rows of ``token_embd.weight``; vocab_size_per_layer_input: rows of
          ``per_layer_token_embd.weight`` (when PLE is on); tie_word_embeddings: no ``output.weight``;
        * attention_k_eq_v: the global layers that compute their own keys/values have no
          ``attn_v`` (the converter has no key for it; the checkpoint simply has no v_proj);
        * the global layers' "proportional" RoPE: the converter writes it as the extra tensor
          ``rope_freqs`` (``Gemma4Model.generate_extra_tensors``): one factor per channel pair of
          a global head, 1.0 for the pairs that rotate and 1e30 for the others (llama.cpp divides
          each pair's speed by its factor, so 1e30 means "does not rotate"). The number of 1.0s
          gives ``partial_rotary_factor``; anything but 1.0s followed by 1e30s is refused.

        eos: ``tokenizer.ggml.eos_token_id`` and ``tokenizer.ggml.eot_token_id`` when present.
        The norms need no change: Gemma 4's converter adds nothing to them (``norm_shift`` is 0).
        """
        from .config_gguf import config_from_gguf  # (a file of its own, which imports this one)

        return config_from_gguf(cls, metadata, tensor_shapes, rope_freqs)


def _refuse_unimplemented(top: ConfigReader, read: ConfigReader) -> None:
    """ConfigError for every setting that would change the math and that this family does not implement.

    top: the whole config.json; read: the decoder's keys (``text_config`` in the multimodal layout).
    """
    act = read.string("hidden_activation", default=read.string("hidden_act", default=None))
    read.check(act in ("gelu_pytorch_tanh", "gelu_tanh"),
               f"'hidden_activation' is {show(act)}; only 'gelu_pytorch_tanh' (tanh GELU) is implemented")
    read.check(not read.boolean("enable_moe_block"),
               "sets 'enable_moe_block': true; the mixture-of-experts block (26B-A4B) is not implemented")
    bidirectional = read.value("use_bidirectional_attention", False)
    read.check(bidirectional in (False, "vision"),
               f"'use_bidirectional_attention' is {show(bidirectional)}; only causal text attention is implemented "
               f"('vision' only concerns image tokens)")
    read.check(not read.boolean("attention_bias", default=False),
               "sets 'attention_bias': true; attention biases are not implemented")
    read.check(not read.has("attn_logit_softcapping"),
               "sets 'attn_logit_softcapping'; Gemma 4 has no attention soft-cap and this family does not implement one")
    old = [k for k in ("rope_theta", "rope_local_base_freq", "rope_scaling") if read.has(k)]
    if old and not read.has("rope_parameters"):
        raise read.fail(f"has {old[0]!r} but no 'rope_parameters'; Gemma 4 reads RoPE from 'rope_parameters' only "
                        f"(transformers ignores {old[0]!r}), so its meaning is unclear")
    for source in (top, read):
        quantization = source.mapping("quantization_config") or {}
        source.check(not quantization, f"has 'quantization_config' ({show(quantization.get('quant_method', '?'))}); quantized safetensors are not supported")


def _read_layer_types(read: ConfigReader, num_layers: int) -> tuple[str, ...]:
    """``layer_types``, or transformers' default pattern (every 6th layer global) when absent."""
    every_sixth = tuple(SLIDING if (i + 1) % 6 else FULL for i in range(num_layers))
    types = read.strings("layer_types", default=every_sixth, length=num_layers, choices=LAYER_TYPES)
    read.check(types[-1] == FULL, f"'layer_types' ends with {types[-1]!r}; Gemma 4's last layer must be "
                                  f"'full_attention' (transformers would silently change it)")
    return types


def _read_layer_shapes(read: ConfigReader, layer_types: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(head dim, KV heads) per layer type, from either spelling.

    hub / transformers 5.5: ``head_dim`` and ``num_key_value_heads`` for every layer, except
    that global layers use ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads`` (when set).
    transformers 5.24: the same base values, overridden per layer by ``per_layer_config``
    (``{"<layer index>": {"head_dim": ..., "num_key_value_heads": ...}}``).
    """
    base_dim = read.positive_int("head_dim", at_most=MAX_WIDTH)
    base_kv = read.positive_int("num_key_value_heads", at_most=MAX_HEADS)
    per_layer = read.section("per_layer_config")
    if per_layer is None:
        global_kv = read.positive_int("num_global_key_value_heads", default=base_kv, at_most=MAX_HEADS)
        global_dim = read.positive_int("global_head_dim", default=DEFAULT_GLOBAL_HEAD_DIM, at_most=MAX_WIDTH)
        return {SLIDING: (base_dim, base_kv), FULL: (global_dim, global_kv if read.boolean("attention_k_eq_v") else base_kv)}

    shapes: dict[str, set[tuple[int, int]]] = {SLIDING: set(), FULL: set()}
    overrides = {}
    for key in per_layer.raw:
        per_layer.check(key.isdigit() and int(key) < len(layer_types),
                        f"has an entry {show(key)}; expected layer indices 0..{len(layer_types) - 1}")
        value = per_layer.section(key, default={})
        value.refuse_unknown(("head_dim", "num_key_value_heads"), "this family (per layer)")
        overrides[int(key)] = (value.positive_int("head_dim", default=base_dim, at_most=MAX_WIDTH),
                               value.positive_int("num_key_value_heads", default=base_kv, at_most=MAX_HEADS))
    for i, layer_type in enumerate(layer_types):
        shapes[layer_type].add(overrides.get(i, (base_dim, base_kv)))
    for layer_type, found in shapes.items():
        per_layer.check(len(found) <= 1, f"gives the {layer_type} layers different shapes {sorted(found)}; not implemented")
    out = {t: next(iter(found)) if found else (base_dim, base_kv) for t, found in shapes.items()}
    global_dim = read.positive_int("global_head_dim", default=out[FULL][0], at_most=MAX_WIDTH)
    read.check(global_dim == out[FULL][0], "'global_head_dim' and 'per_layer_config' disagree")
    return out


def _check_kv_sharing(read: ConfigReader, layer_types: tuple[str, ...], shared: int, key: str = "num_kv_shared_layers") -> None:
    """Every layer type used by a KV-sharing layer must appear among the layers before them."""
    read.check(shared < len(layer_types), f"{key!r} is {shared}; expected 0 .. {len(layer_types) - 1}")
    producers = set(layer_types[: len(layer_types) - shared])
    missing = sorted(set(layer_types[len(layer_types) - shared :]) - producers)
    if missing:
        raise read.fail(f"{key!r} = {shared} leaves no earlier {missing[0]!r} layer whose keys/values the shared layers could reuse")


def _read_rope(read: ConfigReader) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of the sliding layers and of the global layers, from ``rope_parameters``."""
    params = read.section("rope_parameters", default=DEFAULT_ROPE)
    params.refuse_unknown(LAYER_TYPES, "this family (one RoPE per layer type)")
    return tuple(_rope(ConfigReader(params.mapping(t, default=DEFAULT_ROPE[t]), f"{params.where} {t!r}"))
                 for t in (SLIDING, FULL))


def _rope(rope: ConfigReader) -> RopeConfig:
    rope_type = rope.string("rope_type", default="default", choices=tuple(ROPE_TYPES))
    rope.refuse_unknown(ROPE_TYPES[rope_type], f"RoPE type {rope_type!r}")
    return RopeConfig(
        rope_type=rope_type,
        theta=rope.rope_theta("rope_theta"),
        factor=rope.rope_factor("factor", default=REQUIRED if rope_type == "linear" else 1.0),
        rotary_fraction=rope.number("partial_rotary_factor", default=1.0, at_least=0.0, at_most=1.0),
    )
