"""The gemma4 config from a GGUF file's metadata: :meth:`Gemma4Config.from_gguf`, step by step.

llama.cpp's converter (conversion/gemma.py ``Gemma4Model``) writes the decoder's numbers as
``gemma4.*`` keys; this file reads them back into a :class:`config.Gemma4Config` (what each key
holds is listed in ``Gemma4Config.from_gguf``'s docstring), checking each as config.py checks
config.json. Split from config.py to keep each file short; no torch here either.

One thing a text GGUF never says is how image tokens attend (transformers'
``use_bidirectional_attention``): :data:`IMAGE_ATTENTION_BY_WIDTH` below decides it from the
text width, as llama.cpp does, for the published checkpoints only.
"""

from __future__ import annotations

from typing import Any, Sequence

from lollm.errors import ConfigError
from lollm.load.checks import MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, ConfigReader, show

from .config import FULL, SLIDING, Gemma4Config, RopeConfig, _check_kv_sharing

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


def _gguf_per_layer(read: ConfigReader, key: str, num_layers: int) -> list[int]:
    """A key written either as one number or as one number per layer, as a per-layer list."""
    value = read.value(key)
    if isinstance(value, list):
        read.check(len(value) == num_layers and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_WIDTH for v in value),
                   f"{key!r} is {show(value)}: neither a number nor {num_layers} numbers (one per layer)")
        return list(value)
    return [read.positive_int(key, at_most=MAX_WIDTH)] * num_layers


def _one_per_type(read: ConfigReader, values: list[int], layer_types: tuple[str, ...], key: str) -> dict[str, int]:
    """The single value each layer type has in ``values``; ConfigError if a type has two."""
    out: dict[str, set[int]] = {SLIDING: set(), FULL: set()}
    for value, layer_type in zip(values, layer_types):
        out[layer_type].add(value)
    for layer_type, found in out.items():
        read.check(len(found) <= 1, f"{key!r} gives the {layer_type} layers different values {sorted(found)}; not implemented")
    return {t: next(iter(v)) for t, v in out.items() if v}


#: Config fields -> the GGUF keys they come from, for error messages.
GGUF_FIELD_KEYS = {
    "num_hidden_layers": "gemma4.block_count",
    "hidden_size": "gemma4.embedding_length",
    "intermediate_size": "gemma4.feed_forward_length",
    "num_attention_heads": "gemma4.attention.head_count",
    "num_key_value_heads": "gemma4.attention.head_count_kv",
    "head_dim": "gemma4.attention.key_length(_swa)",
    "vocab_size": "gemma4.vocab_size",
    "hidden_size_per_layer_input": "gemma4.embedding_length_per_layer_input",
    "vocab_size_per_layer_input": "per_layer_token_embd.weight rows",
}


def _gguf_key(name: str) -> str:
    """``"block_count"`` -> ``"gemma4.block_count"``: a key as the file spells it."""
    return f"{GGUF_ARCH}.{name}"


def config_from_gguf(cls, metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
               rope_freqs: Sequence[float] | None) -> Gemma4Config:
    """:meth:`Gemma4Config.from_gguf`, in named steps: the keys, the layers, the heads, RoPE, the embeddings."""
    _check_gguf_keys(metadata)
    read = ConfigReader(metadata, "gemma4: GGUF metadata")
    layer_types, shared = _gguf_layers(read)
    num_layers = len(layer_types)
    heads = read.positive_int(_gguf_key("attention.head_count"), at_most=MAX_HEADS)
    global_dim, swa_dim, kv = _gguf_heads(read, heads, layer_types)
    intermediate, double_wide = _gguf_mlp_width(read, num_layers, shared)
    rope_local, rope_global = _gguf_rope(read, global_dim, swa_dim, rope_freqs)
    ple, ple_vocab = _gguf_per_layer_embeddings(read, tensor_shapes)
    k_eq_v = _gguf_k_eq_v(layer_types, num_layers - shared, tensor_shapes)
    vocab = _gguf_vocab(read, tensor_shapes)
    width = read.positive_int(_gguf_key("embedding_length"), at_most=MAX_WIDTH)
    eos = [read.token_ids(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return cls(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv.get(SLIDING, kv[FULL]),
        head_dim=swa_dim,
        global_head_dim=global_dim,
        global_num_key_value_heads=kv[FULL],
        attention_k_eq_v=k_eq_v,
        max_position_embeddings=read.positive_int(_gguf_key("context_length"), at_most=MAX_CONTEXT),
        rms_norm_eps=read.number(_gguf_key("attention.layer_norm_rms_epsilon"), above=0.0, at_most=1.0),
        sliding_window=read.positive_int(_gguf_key("attention.sliding_window"), at_most=MAX_CONTEXT),
        layer_types=layer_types,
        rope_local=rope_local,
        rope_global=rope_global,
        final_logit_softcapping=read.number(_gguf_key("final_logit_softcapping"), default=None, above=0.0),
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=ple_vocab,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        eos_token_ids=tuple(dict.fromkeys(i for ids in eos for i in ids)),
        multimodal=False,
        pad_token_id=read.integer("tokenizer.ggml.padding_token_id", default=None, at_most=vocab - 1),
        # no key holds use_bidirectional_attention: the published checkpoints' rule by width (None: unknown)
        images_bidirectional=images_bidirectional_for_width(width),
    )


# ---------------------------------------------------------------------------
# How image tokens attend: a rule by text width, since no GGUF key says it
# ---------------------------------------------------------------------------
#: The text width (``gemma4.embedding_length``, = ``hidden_size``) of each published Gemma 4 ->
#: (its name, whether its sliding layers let an image's tokens see each other both ways).
#:
#: Why a table: transformers reads ``use_bidirectional_attention`` from config.json (null on
#: E2B/E4B: image tokens attend causally, like text; ``"vision"`` on 26B-A4B: bidirectional
#: inside each image, in the sliding layers only), but llama.cpp's converter writes no key for
#: it. llama.cpp decides at run time from the width instead (tools/mtmd/mtmd.cpp,
#: ``mtmd_decode_use_non_causal``: projector ``gemma4v`` is causal for n_embd 1536 and 2560,
#: bidirectional for any other; ``gemma4uv``, the unified tower lollm does not implement, is
#: always bidirectional). lollm takes the same rule, but only for the widths it can check
#: against a published config.json, and refuses images for any other width (text still runs).
#: gemma-4-31B is not listed: its config.json could not be checked here.
IMAGE_ATTENTION_BY_WIDTH: dict[int, tuple[str, bool]] = {
    1536: ("gemma-4-E2B", False),      # config.json: use_bidirectional_attention null; llama.cpp: causal
    2560: ("gemma-4-E4B", False),      # llama.cpp: causal (mtmd.cpp names this width)
    2816: ("gemma-4-26B-A4B", True),   # config.json: "vision"; llama.cpp: bidirectional
}


def images_bidirectional_for_width(width: int) -> bool | None:
    """Whether a GGUF decoder of this text width attends both ways inside an image; None when the
    width is no published checkpoint's (:data:`IMAGE_ATTENTION_BY_WIDTH`), so images are refused."""
    known = IMAGE_ATTENTION_BY_WIDTH.get(width)
    return None if known is None else known[1]


def require_image_rule(width: int, where: str) -> bool:
    """:func:`images_bidirectional_for_width`, or ConfigError naming ``where``, the width and the table.

    Called before any image is encoded for a GGUF model (its mmproj's ``clip.vision.projection_dim``
    is the text width), so the refusal comes first and says how to proceed.
    """
    rule = images_bidirectional_for_width(width)
    if rule is None:
        table = ", ".join(f"{w} ({name}: {'bidirectional' if both else 'causal'})"
                          for w, (name, both) in IMAGE_ATTENTION_BY_WIDTH.items())
        raise ConfigError(
            f"gemma4: {where}: images with a GGUF model of text width {width} are refused: no GGUF key says how "
            f"its image tokens attend (use_bidirectional_attention), and lollm knows the rule only for the "
            f"published widths {table} (lollm_gemma/gemma4/config_gguf.py, IMAGE_ATTENTION_BY_WIDTH). Use the "
            f"safetensors checkpoint, whose config.json says it")
    return rule


def _check_gguf_keys(metadata: dict[str, Any]) -> None:
    """Refuse another architecture, the MoE keys and any ``gemma4.*`` key not in :data:`GGUF_KEYS`, by name."""
    arch = metadata.get("general.architecture")
    if arch != GGUF_ARCH:
        raise ConfigError(f"gemma4: GGUF general.architecture is {show(arch)}, expected {GGUF_ARCH!r}")
    prefix = f"{arch}."
    for key in sorted(k for k in metadata if k.startswith(prefix)):
        short = key[len(prefix):]
        if short in GGUF_MOE_KEYS:
            raise ConfigError(f"gemma4: GGUF metadata sets {key!r} = {show(metadata[key])}; the mixture-of-experts block (26B-A4B) is not implemented")
        if short not in GGUF_KEYS:
            raise ConfigError(f"gemma4: unverified GGUF key {key!r} (= {show(metadata[key])}); this family does not know what it changes")


def _gguf_layers(read: ConfigReader) -> tuple[tuple[str, ...], int]:
    """Each layer's type (the converter always writes one bool per layer: true = sliding) and the number of KV-sharing layers."""
    num_layers = read.positive_int(_gguf_key("block_count"), at_most=MAX_LAYERS)
    pattern_key = _gguf_key("attention.sliding_window_pattern")
    pattern = read.value(pattern_key)
    read.check(isinstance(pattern, list) and len(pattern) == num_layers and all(isinstance(b, bool) for b in pattern),
               f"{pattern_key!r} is {show(pattern)}, not {num_layers} booleans (one per layer)")
    layer_types = tuple(SLIDING if b else FULL for b in pattern)
    read.check(layer_types[-1] == FULL, f"{pattern_key!r} makes the last layer sliding; Gemma 4's last layer must be global")
    shared = read.integer(_gguf_key("attention.shared_kv_layers"), at_most=MAX_LAYERS)
    _check_kv_sharing(read, layer_types, shared, _gguf_key("attention.shared_kv_layers"))
    return layer_types, shared


def _gguf_heads(read: ConfigReader, heads: int, layer_types: tuple[str, ...]) -> tuple[int, int, dict[str, int]]:
    """The head widths, key_length (global) and key_length_swa (sliding), values as wide as keys; the KV heads per layer type."""
    global_dim = read.positive_int(_gguf_key("attention.key_length"), at_most=MAX_WIDTH)
    swa_dim = read.positive_int(_gguf_key("attention.key_length_swa"), at_most=MAX_WIDTH)
    for name, expected in (("attention.value_length", global_dim), ("attention.value_length_swa", swa_dim)):
        value = read.positive_int(_gguf_key(name), default=expected, at_most=MAX_WIDTH)
        read.check(value == expected, f"{_gguf_key(name)!r} ({value}) differs from the key width ({expected}); not implemented")
    read.check(global_dim % 2 == 0 and swa_dim % 2 == 0, f"head widths {global_dim} and {swa_dim}: RoPE needs even widths")
    kv_key = _gguf_key("attention.head_count_kv")
    kv = _one_per_type(read, _gguf_per_layer(read, kv_key, len(layer_types)), layer_types, kv_key)
    for layer_type, kv_heads in kv.items():
        read.check(heads % kv_heads == 0, f"{_gguf_key('attention.head_count')!r} ({heads}) is not a multiple of the {kv_heads} KV heads of the {layer_type} layers")
    return global_dim, swa_dim, kv


def _gguf_rope(read: ConfigReader, global_dim: int, swa_dim: int, rope_freqs: Sequence[float] | None) -> tuple[RopeConfig, RopeConfig]:
    """The RoPE of the sliding and of the global layers. The dimension counts must be the whole
    heads: the global layers' partial RoPE is written as the rope_freqs tensor instead."""
    for name, expected in (("rope.dimension_count", global_dim), ("rope.dimension_count_swa", swa_dim)):
        value = read.positive_int(_gguf_key(name), default=expected, at_most=MAX_WIDTH)
        read.check(value == expected, f"{_gguf_key(name)!r} ({value}) is not the head width ({expected}); partial RoPE there is not implemented")
    rope_local = RopeConfig("default", read.rope_theta(_gguf_key("rope.freq_base_swa")))
    rope_global = RopeConfig("proportional", read.rope_theta(_gguf_key("rope.freq_base")),
                             rotary_fraction=_rotary_fraction(rope_freqs, global_dim))
    return rope_local, rope_global


def _gguf_mlp_width(read: ConfigReader, num_layers: int, shared: int) -> tuple[int, bool]:
    """The MLP width: one number, or per layer with the KV-sharing layers doubled (use_double_wide_mlp)."""
    key = _gguf_key("feed_forward_length")
    widths = _gguf_per_layer(read, key, num_layers)
    base = widths[0]
    double_wide = widths != [base] * num_layers
    read.check(not double_wide or (shared > 0 and widths == [base] * (num_layers - shared) + [2 * base] * shared),
               f"{key!r} is {show(widths)}; only one width, or one doubled on the KV-sharing layers, is implemented")
    return base, double_wide


def _gguf_per_layer_embeddings(read: ConfigReader, tensor_shapes: dict[str, tuple[int, ...]]) -> tuple[int, int]:
    """The per-layer embeddings' width (0: none) and vocabulary (the rows of ``per_layer_token_embd.weight``)."""
    key = _gguf_key("embedding_length_per_layer_input")
    ple = read.integer(key, at_most=MAX_WIDTH)
    if not ple:
        return 0, 0
    read.check("per_layer_token_embd.weight" in tensor_shapes, f"{key!r} is {ple} but the file has no 'per_layer_token_embd.weight'")
    return ple, tensor_shapes["per_layer_token_embd.weight"][0]


def _gguf_k_eq_v(layer_types: tuple[str, ...], first_shared: int, tensor_shapes: dict[str, tuple[int, ...]]) -> bool:
    """Values are keys on the global layers when those layers have no attn_v (the larger Gemma 4s)."""
    own_full = [i for i in range(first_shared) if layer_types[i] == FULL]
    has_v = {i for i in own_full if f"blk.{i}.attn_v.weight" in tensor_shapes}
    if has_v and len(has_v) != len(own_full):
        missing = sorted(set(own_full) - has_v)
        raise ConfigError(f"gemma4: GGUF file has 'attn_v' on some global layers but not on layer {missing[0]}; not implemented")
    return bool(own_full) and not has_v


def _gguf_vocab(read: ConfigReader, tensor_shapes: dict[str, tuple[int, ...]]) -> int:
    """The vocabulary: token_embd's rows (the converter trims it), equal to ``gemma4.vocab_size`` if present."""
    if "token_embd.weight" not in tensor_shapes:
        raise ConfigError("gemma4: the GGUF file has no 'token_embd.weight'")
    vocab = tensor_shapes["token_embd.weight"][0]
    file_vocab = read.positive_int(_gguf_key("vocab_size"), default=vocab, at_most=MAX_VOCAB)
    read.check(file_vocab == vocab, f"{_gguf_key('vocab_size')!r} ({file_vocab}) differs from token_embd.weight's {vocab} rows")
    return vocab


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
