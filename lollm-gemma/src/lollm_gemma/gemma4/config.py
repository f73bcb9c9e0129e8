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
from typing import Any, Sequence

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
        return _from_gguf(cls, metadata, tensor_shapes, rope_freqs)


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


# ---------------------------------------------------------------------------
# GGUF (llama.cpp's converter, conversion/gemma.py ``Gemma4Model``)
# ---------------------------------------------------------------------------
GGUF_ARCH = "gemma4"

#: The gemma4.* keys the converter writes for a dense Gemma 4 text decoder (see ``from_gguf``).
GGUF_KEYS = (
    "context_length",                    # max_position_embeddings
    "embedding_length",                  # hidden_size
    "block_count",                       # num_hidden_layers
    "feed_forward_length",               # intermediate_size: a number, or one per layer
    "attention.head_count",              # num_attention_heads
    "attention.head_count_kv",           # KV heads: a number, or one per layer
    "attention.layer_norm_rms_epsilon",  # rms_norm_eps
    "attention.key_length",              # global_head_dim
    "attention.value_length",            # global_head_dim
    "attention.key_length_swa",          # head_dim (sliding layers)
    "attention.value_length_swa",        # head_dim (sliding layers)
    "attention.sliding_window",          # sliding_window
    "attention.sliding_window_pattern",  # one bool per layer: true = sliding
    "attention.shared_kv_layers",        # num_kv_shared_layers
    "embedding_length_per_layer_input",  # hidden_size_per_layer_input
    "rope.freq_base",                    # theta of the global layers
    "rope.freq_base_swa",                # theta of the sliding layers
    "rope.dimension_count",              # = global head dim
    "rope.dimension_count_swa",          # = sliding head dim
    "final_logit_softcapping",           # the logit soft-cap, when the model has one
    "vocab_size",                        # (optional) = token_embd rows
)
#: Keys the converter writes for the mixture-of-experts models (26B-A4B), not implemented here.
GGUF_MOE_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length", "expert_gating_func")
#: ``rope_freqs`` value of a channel pair that does not rotate (``Gemma4Model.generate_extra_tensors``).
GGUF_UNROTATED_FREQ_FACTOR = 1e30


def _gguf_get(metadata: dict[str, Any], key: str, kind, *, required: bool = True) -> Any:
    """``metadata["gemma4." + key]``, checked; ConfigError naming the key when required and missing."""
    full = f"{GGUF_ARCH}.{key}"
    value = metadata.get(full)
    if value is None:
        if required:
            raise ConfigError(f"gemma4: GGUF metadata has no {full!r}, which the model needs")
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"gemma4: GGUF metadata {full!r} is {value!r}, not of the expected kind")
    return value


def _gguf_per_layer(metadata: dict[str, Any], key: str, num_layers: int) -> list[int]:
    """A key written either as one number or as one number per layer, as a per-layer list."""
    full = f"{GGUF_ARCH}.{key}"
    value = metadata.get(full)
    if value is None:
        raise ConfigError(f"gemma4: GGUF metadata has no {full!r}, which the model needs")
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * num_layers
    if isinstance(value, (list, tuple)) and len(value) == num_layers and \
            all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise ConfigError(f"gemma4: GGUF metadata {full!r} is {value!r}: neither a number nor {num_layers} numbers (one per layer)")


def _one_per_type(values: list[int], layer_types: tuple[str, ...], layers: range, key: str) -> dict[str, int]:
    """The single value each layer type has in ``values`` (over ``layers``); ConfigError if a type has two."""
    out: dict[str, set[int]] = {SLIDING: set(), FULL: set()}
    for i in layers:
        out[layer_types[i]].add(values[i])
    for layer_type, found in out.items():
        if len(found) > 1:
            raise ConfigError(f"gemma4: GGUF '{GGUF_ARCH}.{key}' gives the {layer_type} layers different values {sorted(found)}; not implemented")
    return {t: next(iter(v)) for t, v in out.items() if v}


def _from_gguf(cls, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
               rope_freqs: Sequence[float] | None) -> Gemma4Config:
    arch = metadata.get("general.architecture")
    if arch != GGUF_ARCH:
        raise ConfigError(f"gemma4: GGUF general.architecture is {arch!r}, expected {GGUF_ARCH!r}")
    prefix = f"{arch}."
    for key in sorted(k for k in metadata if k.startswith(prefix)):
        short = key[len(prefix):]
        if short in GGUF_MOE_KEYS:
            raise ConfigError(f"gemma4: GGUF metadata sets {key!r} = {metadata[key]!r}; the mixture-of-experts block (26B-A4B) is not implemented")
        if short not in GGUF_KEYS:
            raise ConfigError(f"gemma4: unverified GGUF key {key!r} (= {metadata[key]!r}); this family does not know what it changes")

    def get(key, kind=int, required=True):
        return _gguf_get(metadata, key, kind, required=required)

    where = "GGUF metadata"
    num_layers = get("block_count")
    heads = get("attention.head_count")

    # which layers slide: the converter always writes one bool per layer
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if pattern is None:
        raise ConfigError(f"gemma4: GGUF metadata has no '{arch}.attention.sliding_window_pattern', which the model needs")
    if not (isinstance(pattern, (list, tuple)) and len(pattern) == num_layers and all(isinstance(b, bool) for b in pattern)):
        raise ConfigError(f"gemma4: GGUF '{arch}.attention.sliding_window_pattern' is {pattern!r}, not {num_layers} booleans (one per layer)")
    layer_types = tuple(SLIDING if b else FULL for b in pattern)
    if layer_types[-1] != FULL:
        raise ConfigError(f"gemma4: GGUF '{arch}.attention.sliding_window_pattern' makes the last layer sliding; Gemma 4's last layer must be global")
    shared = get("attention.shared_kv_layers")
    _check_kv_sharing(layer_types, shared, f"{where} ('{arch}.attention.shared_kv_layers')")
    first_shared = num_layers - shared

    # head widths: key_length (global) and key_length_swa (sliding); values equally wide
    global_dim, swa_dim = get("attention.key_length"), get("attention.key_length_swa")
    for key, expected in (("attention.value_length", global_dim), ("attention.value_length_swa", swa_dim)):
        value = get(key, required=False)
        if value is not None and value != expected:
            raise ConfigError(f"gemma4: GGUF '{arch}.{key}' ({value}) differs from the key width ({expected}); not implemented")
    kv = _one_per_type(_gguf_per_layer(metadata, "attention.head_count_kv", num_layers), layer_types, range(num_layers), "attention.head_count_kv")
    for layer_type, kv_heads in kv.items():
        if heads % kv_heads:
            raise ConfigError(f"gemma4: GGUF '{arch}.attention.head_count' ({heads}) is not a multiple of the {kv_heads} KV heads of the {layer_type} layers")

    # MLP width: one number, or per layer with the KV-sharing layers doubled (use_double_wide_mlp)
    widths = _gguf_per_layer(metadata, "feed_forward_length", num_layers)
    base = widths[0]
    if widths == [base] * num_layers:
        double_wide = False
    elif shared and widths == [base] * first_shared + [2 * base] * shared:
        double_wide = True
    else:
        raise ConfigError(f"gemma4: GGUF '{arch}.feed_forward_length' is {widths}; only one width, or one doubled on the KV-sharing layers, is implemented")

    # RoPE: dimension counts must be the whole heads (the global layers' partial RoPE is rope_freqs)
    for key, expected in (("rope.dimension_count", global_dim), ("rope.dimension_count_swa", swa_dim)):
        value = get(key, required=False)
        if value is not None and value != expected:
            raise ConfigError(f"gemma4: GGUF '{arch}.{key}' ({value}) is not the head width ({expected}); partial RoPE there is not implemented")
    rope_local = RopeConfig("default", float(get("rope.freq_base_swa", (int, float))))
    rope_global = RopeConfig("proportional", float(get("rope.freq_base", (int, float))),
                             rotary_fraction=_rotary_fraction(rope_freqs, global_dim))

    # per-layer embeddings
    ple = get("embedding_length_per_layer_input")
    ple_vocab = 0
    if ple:
        if "per_layer_token_embd.weight" not in tensor_shapes:
            raise ConfigError(f"gemma4: GGUF '{arch}.embedding_length_per_layer_input' is {ple} but the file has no 'per_layer_token_embd.weight'")
        ple_vocab = tensor_shapes["per_layer_token_embd.weight"][0]

    # values are keys on the global layers when those layers have no attn_v (the larger Gemma 4s)
    has_v = {i for i in range(first_shared) if layer_types[i] == FULL and f"blk.{i}.attn_v.weight" in tensor_shapes}
    own_full = [i for i in range(first_shared) if layer_types[i] == FULL]
    if has_v and len(has_v) != len(own_full):
        missing = sorted(set(own_full) - has_v)
        raise ConfigError(f"gemma4: GGUF file has 'attn_v' on some global layers but not on layer {missing[0]}; not implemented")
    k_eq_v = bool(own_full) and not has_v

    if "token_embd.weight" not in tensor_shapes:
        raise ConfigError("gemma4: the GGUF file has no 'token_embd.weight'")
    vocab = tensor_shapes["token_embd.weight"][0]
    file_vocab = get("vocab_size", required=False)
    if file_vocab is not None and file_vocab != vocab:
        raise ConfigError(f"gemma4: GGUF '{arch}.vocab_size' ({file_vocab}) differs from token_embd.weight's {vocab} rows")
    window = get("attention.sliding_window")
    if window < 1:
        raise ConfigError(f"gemma4: GGUF '{arch}.attention.sliding_window' is {window}; it must be >= 1")
    cap = get("final_logit_softcapping", (int, float), required=False)
    if cap is not None and cap <= 0:
        raise ConfigError(f"gemma4: GGUF '{arch}.final_logit_softcapping' is {cap}; expected a positive number")

    eos = [metadata[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if isinstance(metadata.get(k), int)]
    return cls(
        vocab_size=vocab,
        hidden_size=get("embedding_length"),
        intermediate_size=base,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv.get(SLIDING, kv[FULL]),
        head_dim=swa_dim,
        global_head_dim=global_dim,
        global_num_key_value_heads=kv[FULL],
        attention_k_eq_v=k_eq_v,
        max_position_embeddings=get("context_length"),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", (int, float))),
        sliding_window=window,
        layer_types=layer_types,
        rope_local=rope_local,
        rope_global=rope_global,
        final_logit_softcapping=None if cap is None else float(cap),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_vocab,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        multimodal=False,
    )


def _rotary_fraction(rope_freqs: Sequence[float] | None, head_dim: int) -> float:
    """``partial_rotary_factor`` of the global layers from the ``rope_freqs`` tensor's values.

    The converter writes ``[1.0] * n + [1e30] * (head_dim / 2 - n)``: n channel pairs rotate.
    """
    if rope_freqs is None:
        raise ConfigError(
            "gemma4: the GGUF file has no 'rope_freqs.weight'; llama.cpp's converter writes it to mark "
            "which channel pairs of the global layers rotate (proportional RoPE), and without it we will not guess"
        )
    values = [float(v) for v in rope_freqs]
    pairs = head_dim // 2
    rotating = sum(1 for v in values if v == 1.0)
    expected = [1.0] * rotating + [GGUF_UNROTATED_FREQ_FACTOR] * (pairs - rotating)
    if len(values) != pairs or any(v != e and not (e == GGUF_UNROTATED_FREQ_FACTOR and v >= e * 0.999) for v, e in zip(values, expected)):
        raise ConfigError(
            f"gemma4: GGUF 'rope_freqs.weight' is not {pairs} factors of 1.0 (pairs that rotate) followed by 1e30 "
            f"(pairs that do not); other frequency factors are not implemented"
        )
    fraction = 2 * rotating / head_dim
    if int(fraction * head_dim // 2) != rotating:  # blocks.rope_inverse_frequencies must rotate the same pairs
        raise ConfigError(f"gemma4: GGUF 'rope_freqs.weight' rotates {rotating} of {pairs} pairs, which proportional RoPE cannot express")
    return fraction
