"""Tiny random checkpoints written by transformers itself, for family tests.

A family is tested against transformers on a *real* config.json (from the
hub, so every key of the real model is there) whose dimensions are shrunk so
that the model runs in milliseconds::

    raw = json.loads((hub_configs / "Qwen__Qwen3-0.6B" / "config.json").read_text())
    folder = write_tiny_checkpoint(shrink_config(raw, head_dim=32), tmp_path, schema="hub")
    # folder holds config.json, model.safetensors, generation_config.json

The weights are transformers' own random initialisation (seeded), written
with ``save_pretrained``; parameters that transformers initialises to a
constant (norm scales, biases) are perturbed, so that a swapped norm or a
dropped bias cannot hide behind a 1 or a 0.

transformers is test tooling here (the optional extra ``lollm-core[parity]``):
it is imported inside the functions only, never when this module is imported.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import torch

# Lazy imports below: transformers (lollm-core[parity]) writes the checkpoints, tokenizers (lollm-core[test])
# the tokenizer; optional extras, imported by the functions that need them.

#: The dimensions :func:`shrink_config` sets unless told otherwise.
TINY_DIMENSIONS = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}


#: The ``init_std`` of :func:`write_tiny_checkpoint` that makes a tiny model's logits depend on
#: its RoPE, window and scales far beyond float32 rounding (the conformance kit's sensitivity check).
SENSITIVE_INIT_STD = 0.3
#: A norm epsilon large enough for a wrong one to show in the logits of a tiny model
#: (hub configs say 1e-6, far below the mean square of any hidden state): the conformance
#: kit's sensitivity check perturbs the epsilon and needs the logits to move.
SENSITIVE_NORM_EPS = 0.1


#: The sliding window of :func:`kit_config`: the kit's 72-position prompt crosses it many times.
KIT_WINDOW = 6
#: The experts of :func:`kit_config`'s mixtures: a few narrow ones, more than a token is routed to.
KIT_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "top_k_experts": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48}


def kit_config(raw: dict[str, object]) -> dict[str, object]:
    """A tiny config of the hub config.json ``raw`` that the conformance kit's coverage check passes.

    The decoder only: a multimodal config's ``text_config`` (its token ids added from the top
    level) stands alone. Shrunk by :func:`shrink_config`, then, where the config has the key:

    * every layer kind of ``layer_types`` has a layer (the layers kept are the shortest prefix
      holding each kind), Gemma 3's ``sliding_window_pattern`` becomes 2 (a sliding layer, then
      a global one), at least two layers otherwise (Gemma 2 alternates from layer 0);
    * ``sliding_window`` is :data:`KIT_WINDOW` (6) when the window is in use;
    * ``rms_norm_eps`` is :data:`SENSITIVE_NORM_EPS`; ``query_pre_attn_scalar`` is 2 x ``head_dim``;
    * a mixture keeps :data:`KIT_EXPERTS`; ``head_dim`` leaves 8 turning pairs under a
      ``partial_rotary_factor``, ``global_head_dim`` is twice ``head_dim`` and at least 64;
    * Gemma 4's per-layer inputs (16 wide, the tiny vocabulary), Qwen 3.5's linear-attention
      heads (2 key heads of 16, 4 value heads of 24) and KV-cache sharing (the second half of
      twice the layers) shrink with the rest.

    Write it with ``write_tiny_checkpoint(kit_config(raw), folder, init_std=SENSITIVE_INIT_STD)``
    (docs/conformance-kit.md, "Coverage").
    """
    top = copy.deepcopy(raw)
    text = top.get("text_config")
    if isinstance(text, dict):
        ids = {k: v for k, v in top.items() if k.endswith("_token_id") and k not in text and not isinstance(v, dict)}
        top = {**copy.deepcopy(text), **ids}
    cfg = shrink_config(top)
    full_types = top.get("layer_types")
    if isinstance(full_types, list) and full_types:
        layers = max([cfg["num_hidden_layers"]] + [full_types.index(kind) + 1 for kind in set(full_types)])
        cfg.update(num_hidden_layers=layers, layer_types=full_types[:layers])
    for key in ("sliding_window_pattern", "_sliding_window_pattern"):
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
            cfg[key] = 2
    window = cfg.get("sliding_window")
    if isinstance(window, int) and window > KIT_WINDOW and cfg.get("use_sliding_window", True) is not False:
        cfg["sliding_window"] = KIT_WINDOW
    if isinstance(cfg.get("rms_norm_eps"), float):
        cfg["rms_norm_eps"] = SENSITIVE_NORM_EPS
    if isinstance(cfg.get("query_pre_attn_scalar"), (int, float)) and isinstance(cfg.get("head_dim"), int):
        cfg["query_pre_attn_scalar"] = 2 * cfg["head_dim"]
    if isinstance(cfg.get("num_experts"), int):
        cfg.update({k: v for k, v in KIT_EXPERTS.items() if k in cfg})
    _kit_head_dims(cfg)
    _kit_extras(cfg)
    return cfg


def _kit_head_dims(cfg: dict[str, object]) -> None:
    """Heads wide enough for 8 turning RoPE pairs (``partial_rotary_factor``); a wider global head (Gemma 4)."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    parts = [d.get("partial_rotary_factor", 1.0) for d in rope.values() if isinstance(d, dict)]
    part = min([rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))] + parts)
    if isinstance(cfg.get("head_dim"), int) and part < 1 and "global_head_dim" not in cfg:
        cfg["head_dim"] = max(cfg["head_dim"], int(16 / part + 0.999))
    if isinstance(cfg.get("global_head_dim"), int):
        cfg["global_head_dim"] = max(2 * cfg["head_dim"], int(16 / part + 0.999))


def _kit_extras(cfg: dict[str, object]) -> None:
    """Shrink the keys of Gemma 4 (per-layer inputs, KV sharing) and Qwen 3.5 (linear attention)."""
    if isinstance(cfg.get("hidden_size_per_layer_input"), int) and cfg["hidden_size_per_layer_input"] > 0:
        cfg.update(hidden_size_per_layer_input=16, vocab_size_per_layer_input=cfg["vocab_size"])
    elif "vocab_size_per_layer_input" in cfg:
        cfg["vocab_size_per_layer_input"] = cfg["vocab_size"]
    if isinstance(cfg.get("num_kv_shared_layers"), int) and cfg["num_kv_shared_layers"] > 0:
        n = cfg["num_hidden_layers"]
        cfg.update(num_hidden_layers=2 * n, num_kv_shared_layers=n)
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = cfg["layer_types"] * 2
    if "linear_num_key_heads" in cfg:
        cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)


def shrink_config(raw: dict[str, object], **overrides: object) -> dict[str, object]:
    """A copy of ``raw`` (a config.json dict) with tiny dimensions, every other key kept.

    Sets :data:`TINY_DIMENSIONS`, then ``overrides`` (any key, set verbatim; they
    win over everything). Keys that depend on the new sizes follow, unless
    overridden: ``head_dim`` (when present) becomes ``hidden_size // num_attention_heads``;
    ``layer_types`` (when a list) is cut or repeated to ``num_hidden_layers``; token
    ids (``*_token_id`` / ``*_token_index``) that no longer fit the vocabulary are
    moved to its top (distinct ids stay distinct). A nested ``text_config`` (the
    decoder of a multimodal config) is shrunk the same way; other nested configs
    (vision, audio) are left as they are: shrink them through ``overrides``.
    """
    out = copy.deepcopy(raw)
    _shrink(out, overrides)
    if isinstance(out.get("text_config"), dict) and "text_config" not in overrides:
        _shrink(out["text_config"], {})
        _fix_token_ids(out, out["text_config"]["vocab_size"], overrides)
    return out


def _shrink(cfg: dict[str, object], overrides: dict[str, object]) -> None:
    cfg.update(TINY_DIMENSIONS)
    cfg.update(copy.deepcopy(overrides))
    if "head_dim" in cfg and "head_dim" not in overrides:
        cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
    types = cfg.get("layer_types")
    if isinstance(types, list) and types and "layer_types" not in overrides:
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = [types[i % len(types)] for i in range(n)]
    _fix_token_ids(cfg, cfg["vocab_size"], overrides)


def _fix_token_ids(cfg: dict[str, object], vocab_size: int, overrides: dict[str, object]) -> None:
    """Move token ids >= vocab_size to vocab_size-1, vocab_size-2, ... (in increasing order of the old id)."""
    keys = [k for k in cfg if k.endswith(("_token_id", "_token_index")) and k not in overrides]
    big = sorted({i for k in keys for i in _ids(cfg[k]) if i >= vocab_size})
    new_id = {old: vocab_size - 1 - n for n, old in enumerate(big)}
    for k in keys:
        value = cfg[k]
        if isinstance(value, list):
            cfg[k] = [new_id.get(i, i) for i in value]
        elif isinstance(value, int) and not isinstance(value, bool):
            cfg[k] = new_id.get(value, value)


def _ids(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [i for i in value if isinstance(i, int) and not isinstance(i, bool)]
    return []


def write_tiny_checkpoint(
    raw_config: dict[str, object],
    folder: str | Path,
    *,
    schema: Literal["hub", "transformers5"] = "transformers5",
    seed: int = 0,
    init_std: float | None = None,
    model_class: str | None = None,
) -> Path:
    """Build the transformers model of ``raw_config`` with random float32 weights and save it in ``folder``.

    Writes config.json, model.safetensors and generation_config.json; returns ``folder``.

    schema: how config.json spells RoPE.
      "transformers5": what transformers 5's ``save_pretrained`` writes
                       (``rope_parameters = {"rope_type", "rope_theta", ...}``, plus ``layer_types``).
      "hub":           the form of the published hub files: ``raw_config`` itself with
                       ``rope_theta`` at the top level and the scaling (if any) in
                       ``rope_scaling``, no ``rope_parameters``.
    seed: seeds torch before the model is built, so the same call writes the same weights.
    init_std: when given, every weight matrix (every parameter of 2+ dimensions: embeddings,
              projections, lm_head) is drawn again from N(0, init_std**2). transformers' default
              (std 0.02 in most configs) leaves attention nearly uniform, so the logits of a tiny
              model barely depend on positions or scales and a wrong RoPE can pass a parity
              check; 0.3 (:data:`SENSITIVE_INIT_STD`) makes them depend on both (see
              docs/conformance-kit.md: the conformance kit checks it).
    model_class: the transformers class to build, e.g. ``"Qwen3_5ForConditionalGeneration"`` (default:
              ``AutoModelForCausalLM``'s, which for Qwen3.5 is the text-only model).
    """
    import transformers

    if schema not in ("hub", "transformers5"):
        raise ValueError(f"schema must be 'hub' or 'transformers5', not {schema!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = copy.deepcopy(raw_config)

    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(copy.deepcopy(raw))
    torch.manual_seed(seed)
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = getattr(transformers, model_class)(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            flat = param.reshape(-1)
            if init_std is not None and param.dim() >= 2:
                param.copy_(init_std * torch.randn(param.shape, generator=generator))
            elif flat.numel() and bool((flat == flat[0]).all()):  # a norm scale or a bias: a constant
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)

    config_path = folder / "config.json"
    if schema == "hub":
        config_path.write_text(json.dumps(to_hub_schema(raw), indent=2) + "\n", encoding="utf-8")
    elif "rope_theta" in json.loads(config_path.read_text(encoding="utf-8")):
        raise RuntimeError(f"transformers wrote 'rope_theta' at the top level of {config_path}; expected the 5.x schema")

    generation_path = folder / "generation_config.json"
    if not generation_path.exists():
        ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if raw.get(k) is not None}
        generation_path.write_text(json.dumps(ids, indent=2) + "\n", encoding="utf-8")
    return folder


def to_hub_schema(raw: dict[str, object]) -> dict[str, object]:
    """``raw`` with a flat ``rope_parameters`` moved to ``rope_theta`` (+ ``rope_scaling``), as hub files spell it.

    A config already in the hub form is returned unchanged (a copy). A
    ``rope_parameters`` nested per layer type has no single hub spelling
    (each family names its own keys): ValueError.
    """
    out = copy.deepcopy(raw)
    params = out.pop("rope_parameters", None)
    if params is None:
        return out
    if not isinstance(params, dict) or "rope_theta" not in params or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"cannot write rope_parameters={params!r} in the hub schema")
    params = dict(params)
    out["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", params.get("type", "default")) != "default" or len(params) > 1:
        out["rope_scaling"] = params
    return out


#: ChatML, as Qwen writes it; CHAT_TEMPLATE_THINKING also reads ``enable_thinking`` (Qwen3's way).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT_TEMPLATE_THINKING = CHAT_TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}",
)
CORPUS = [
    "hello world, hello lollm. The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a tiny model that could only say a few words.",
    "numbers 0123456789 and punctuation: !?.,;'\"()[]{}",
]


def _syllable_words() -> list[str]:
    """Made-up words (ka, kato, katomi ...): enough distinct pairs for a BPE of a few hundred merges."""
    syllables = [c + v for c in "bdgklmnprstvz" for v in "aeiou"]
    return [" ".join(syllables[i] + syllables[(i * 7 + j) % len(syllables)] for j in range(12)) for i in range(len(syllables))]


def write_tiny_tokenizer(folder: str | Path, *, vocab_size: int = 320, chat_template: bool = True,
                         thinking: bool = False) -> Path:
    """tokenizer.json (byte-level BPE, special tokens ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
    then ``<think>`` and ``</think>`` as plain added tokens) and tokenizer_config.json, in ``folder``.

    Every one of the 256 bytes is in the vocabulary, so any text encodes; the
    vocabulary has exactly ``vocab_size`` ids (ValueError when the training text
    cannot fill it), so a tiny model of that vocabulary size can emit no id the
    tokenizer does not know. ``chat_template``: ChatML (:data:`CHAT_TEMPLATE`, or
    :data:`CHAT_TEMPLATE_THINKING` with ``thinking``). Needs the ``tokenizers``
    library (``lollm-core[test]``).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,  # room for the two plain added tokens
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10 + _syllable_words() * 3, trainer)
    tok.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the tiny tokenizer has {tok.get_vocab_size()} ids, not the {vocab_size} asked for")
    tok.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "tokenizer_class": "GPT2Tokenizer"}
    if chat_template:
        config["chat_template"] = CHAT_TEMPLATE_THINKING if thinking else CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
