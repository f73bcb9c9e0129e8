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
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"gemma3: config.json has model_type {model_type!r}, expected one of {MODEL_TYPES}")
        multimodal = model_type == "gemma3"
        if multimodal:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("gemma3: config.json of model_type 'gemma3' has no 'text_config' object")
            where = "text_config"
        else:
            text = raw
            where = "config.json"
        cfg = {**TEXT_DEFAULTS, **text}

        _refuse_unimplemented(raw, cfg, where)

        hidden = _required(cfg, "hidden_size", int, where)
        heads = _required(cfg, "num_attention_heads", int, where)
        kv_heads = _required(cfg, "num_key_value_heads", int, where)
        if heads % kv_heads:
            raise ConfigError(f"gemma3: {where} 'num_attention_heads' ({heads}) is not a multiple of 'num_key_value_heads' ({kv_heads})")
        num_layers = _required(cfg, "num_hidden_layers", int, where)
        window = _required(cfg, "sliding_window", int, where)
        if window < 1:
            raise ConfigError(f"gemma3: {where} 'sliding_window' is {window}; it must be >= 1")
        rope_local, rope_global = _read_rope(cfg, where)

        # end-of-sequence ids: the decoder's own, plus the multimodal wrapper's
        eos: list[int] = []
        for source in (text, raw) if multimodal else (raw,):
            value = source.get("eos_token_id")
            for i in [] if value is None else [value] if isinstance(value, int) else value:
                if i not in eos:
                    eos.append(i)
        tie = raw.get("tie_word_embeddings", cfg["tie_word_embeddings"]) if multimodal else cfg["tie_word_embeddings"]
        return cls(
            vocab_size=_required(cfg, "vocab_size", int, where),
            hidden_size=hidden,
            intermediate_size=_required(cfg, "intermediate_size", int, where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_required(cfg, "head_dim", int, where),
            max_position_embeddings=_required(cfg, "max_position_embeddings", int, where),
            rms_norm_eps=float(_required(cfg, "rms_norm_eps", (int, float), where)),
            query_pre_attn_scalar=float(_required(cfg, "query_pre_attn_scalar", (int, float), where)),
            sliding_window=window,
            layer_types=_read_layer_types(text, num_layers, where),
            rope_local=rope_local,
            rope_global=rope_global,
            tie_word_embeddings=bool(tie),
            eos_token_ids=tuple(eos),
            multimodal=multimodal,
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


def _refuse_unimplemented(raw: dict[str, Any], cfg: dict[str, Any], where: str) -> None:
    """ConfigError for every setting that would change the math and that this family does not implement."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"gemma3: {where} 'hidden_activation' is {act!r}; only 'gelu_pytorch_tanh' (tanh GELU) is implemented")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(
                f"gemma3: {where} sets {key!r} = {cfg[key]!r}; Gemma 3 has no soft-caps (that is Gemma 2) "
                f"and this family does not implement them"
            )
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"gemma3: {where} sets 'use_bidirectional_attention'; only causal attention is implemented")
    if cfg.get("attention_bias"):
        raise ConfigError(f"gemma3: {where} sets 'attention_bias': true; attention biases are not implemented")
    for source in (raw, cfg):
        if source.get("quantization_config"):
            method = source["quantization_config"].get("quant_method", "?")
            raise ConfigError(f"gemma3: config.json has 'quantization_config' ({method}); quantized safetensors are not supported")


def _required(cfg: dict[str, Any], key: str, kind, where: str) -> Any:
    """``cfg[key]``; ConfigError naming the key when it is missing, null or of the wrong type."""
    value = cfg.get(key)
    if value is None:
        raise ConfigError(f"gemma3: {where} has no {key!r}, which the model needs")
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"gemma3: {where} {key!r} is {value!r}, not a number of the expected kind")
    return value


def _read_layer_types(text: dict[str, Any], num_layers: int, where: str) -> tuple[str, ...]:
    """Which layers are sliding-window and which global, from either schema.

    transformers 5: an explicit ``layer_types`` list. hub: ``sliding_window_pattern`` N
    means layer i is global when ``(i + 1) % N == 0`` (every N-th layer), sliding
    otherwise; absent, N is 6 (transformers' default). Some files carry both (the
    pattern then as ``_sliding_window_pattern``); they must agree.
    """
    patterns = {k: text[k] for k in ("sliding_window_pattern", "_sliding_window_pattern") if text.get(k) is not None}
    for key, value in patterns.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"gemma3: {where} {key!r} is {value!r}, not a positive integer")

    def from_pattern(n: int) -> tuple[str, ...]:
        return tuple(SLIDING if (i + 1) % n else FULL for i in range(num_layers))

    types = text.get("layer_types")
    if types is None:
        if "sliding_window_pattern" not in patterns and patterns.get("_sliding_window_pattern", 6) != 6:
            # transformers ignores the private spelling and would use 6: refuse to pick one
            raise ConfigError(f"gemma3: {where} has '_sliding_window_pattern' but neither 'sliding_window_pattern' nor 'layer_types'")
        return from_pattern(patterns.get("sliding_window_pattern", TEXT_DEFAULTS["sliding_window_pattern"]))
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(f"gemma3: {where} 'layer_types' must be a list of {num_layers} entries (one per layer)")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ConfigError(f"gemma3: {where} 'layer_types' holds {unknown[0]!r}; implemented: {', '.join(LAYER_TYPES)}")
    for key, value in patterns.items():
        if tuple(types) != from_pattern(value):
            raise ConfigError(f"gemma3: {where} 'layer_types' and {key!r} ({value}) disagree")
    return tuple(types)


def _read_rope(cfg: dict[str, Any], where: str) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of the sliding-window layers and of the global layers, from either schema.

    transformers 5: ``rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}``.
    hub: ``rope_local_base_freq`` (sliding), ``rope_theta`` (global) and ``rope_scaling``,
    which applies to the global layers only.
    """
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if params is not None:
        per_type = isinstance(params, dict) and set(params) <= set(LAYER_TYPES)
        if not per_type or not all(v is None or isinstance(v, dict) for v in params.values()):
            raise ConfigError(
                f"gemma3: {where} 'rope_parameters' must map each layer type ({', '.join(LAYER_TYPES)}) "
                f"to its RoPE settings; found keys {sorted(params) if isinstance(params, dict) else params!r}"
            )
        local = dict(params.get(SLIDING) or {})
        glob = dict(params.get(FULL) or {})
        if scaling is not None and any(glob.get(k) != v for k, v in scaling.items()):
            raise ConfigError(f"gemma3: {where} has both 'rope_parameters' and 'rope_scaling' and they differ; cannot tell which one holds")
        name_local, name_global = f"rope_parameters.{SLIDING}", f"rope_parameters.{FULL}"
    else:
        local = {}
        glob = dict(scaling or {})
        name_local, name_global = "rope_local_base_freq", "rope_scaling"
    local.setdefault("rope_theta", cfg["rope_local_base_freq"])
    glob.setdefault("rope_theta", cfg["rope_theta"])
    return _rope(local, f"{where} {name_local!r}"), _rope(glob, f"{where} {name_global!r}")


def _rope(params: dict[str, Any], where: str) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"gemma3: {where} has RoPE type {rope_type!r}, which is not implemented "
            f"(implemented: {', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(set(params) - ROPE_TYPES[rope_type])
    if unknown:
        raise ConfigError(f"gemma3: {where} has {unknown[0]!r}, which RoPE type {rope_type!r} does not implement")
    factor = params.get("factor")
    if rope_type == "linear" and not isinstance(factor, (int, float)):
        raise ConfigError(f"gemma3: {where}: RoPE type 'linear' needs a numeric 'factor'")
    theta = params["rope_theta"]
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"gemma3: {where} 'rope_theta' is {theta!r}, not a number")
    return RopeConfig(rope_type=rope_type, theta=float(theta), factor=None if factor is None else float(factor))


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


def gguf_key(metadata: dict[str, Any], arch: str, key: str, kind, *, required: bool = True) -> Any:
    """``metadata[f"{arch}.{key}"]``, checked; ConfigError naming the key when required and missing."""
    full = f"{arch}.{key}"
    value = metadata.get(full)
    if value is None:
        if required:
            raise ConfigError(f"gemma3: GGUF metadata has no {full!r}, which the model needs")
        return None
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"gemma3: GGUF metadata {full!r} is {value!r}, not of the expected kind")
    return value


def _from_gguf(cls, metadata: dict[str, Any], vocab_size: int, tie_word_embeddings: bool) -> "Gemma3Config":
    arch = metadata.get("general.architecture")
    if arch != "gemma3":
        raise ConfigError(f"gemma3: GGUF general.architecture is {arch!r}, expected 'gemma3'")
    prefix = f"{arch}."
    for key in sorted(k for k in metadata if k.startswith(prefix)):
        short = key[len(prefix):]
        if short in GGUF_REFUSED:
            raise ConfigError(f"gemma3: GGUF metadata sets {key!r} = {metadata[key]!r}; Gemma 3 has no soft-caps and this family does not implement them")
        if short not in GGUF_KEYS:
            raise ConfigError(f"gemma3: unverified GGUF key {key!r} (= {metadata[key]!r}); this family does not know what it changes")

    def get(key, kind=int, required=True):
        return gguf_key(metadata, arch, key, kind, required=required)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv")
    if heads % kv_heads:
        raise ConfigError(f"gemma3: GGUF '{arch}.attention.head_count' ({heads}) is not a multiple of '{arch}.attention.head_count_kv' ({kv_heads})")
    head_dim = get("attention.key_length")
    value_dim = get("attention.value_length", required=False)
    if value_dim is not None and value_dim != head_dim:
        raise ConfigError(f"gemma3: GGUF '{arch}.attention.value_length' ({value_dim}) differs from '{arch}.attention.key_length' ({head_dim}); not implemented")
    rope_dims = get("rope.dimension_count", required=False)
    if rope_dims is not None and rope_dims != head_dim:
        raise ConfigError(f"gemma3: GGUF '{arch}.rope.dimension_count' ({rope_dims}) is not the head width ({head_dim}); partial RoPE is not implemented")
    num_layers = get("block_count")
    window = get("attention.sliding_window")
    if window < 1:
        raise ConfigError(f"gemma3: GGUF '{arch}.attention.sliding_window' is {window}; it must be >= 1")
    file_vocab = get("vocab_size", required=False)
    if file_vocab is not None and file_vocab != vocab_size:
        raise ConfigError(f"gemma3: GGUF '{arch}.vocab_size' ({file_vocab}) differs from token_embd.weight's {vocab_size} rows")

    # which layers slide: llama.cpp's set_swa_pattern(n) makes layer i sliding when i % n < n - 1
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", GGUF_SWA_PATTERN)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        layer_types = tuple(SLIDING if i % pattern < pattern - 1 else FULL for i in range(num_layers))
    elif isinstance(pattern, (list, tuple)) and len(pattern) == num_layers and all(isinstance(b, bool) for b in pattern):
        layer_types = tuple(SLIDING if b else FULL for b in pattern)  # one bool per layer: true = sliding
    else:
        raise ConfigError(f"gemma3: GGUF '{arch}.attention.sliding_window_pattern' is {pattern!r}: neither a positive integer nor {num_layers} booleans")

    # RoPE: the global layers read rope.freq_base and any linear scaling; the sliding ones use 10000
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = get("rope.scaling.factor", (int, float), required=False)
    if scaling == "linear":
        if factor is None:
            raise ConfigError(f"gemma3: GGUF '{arch}.rope.scaling.type' is 'linear' but '{arch}.rope.scaling.factor' is missing")
        rope_global = RopeConfig("linear", float(get("rope.freq_base", (int, float))), float(factor))
    elif scaling == "none":
        if factor is not None and factor != 1.0:
            raise ConfigError(f"gemma3: GGUF '{arch}.rope.scaling.factor' is {factor} but '{arch}.rope.scaling.type' is not 'linear'")
        rope_global = RopeConfig("default", float(get("rope.freq_base", (int, float))))
    else:
        raise ConfigError(f"gemma3: GGUF '{arch}.rope.scaling.type' is {scaling!r}; implemented: 'none', 'linear'")
    base_swa = get("rope.freq_base_swa", (int, float), required=False)
    rope_local = RopeConfig("default", float(GGUF_ROPE_BASE_SWA if base_swa is None else base_swa))

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
        layer_types=layer_types,
        rope_local=rope_local,
        rope_global=rope_global,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        multimodal=False,
    )
