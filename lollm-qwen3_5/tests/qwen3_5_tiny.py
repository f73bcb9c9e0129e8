"""Tiny random Qwen3.5 checkpoints for the tests, written by transformers from the real hub configs.

lollm.testing.tiny.shrink_config shrinks the generic keys (hidden size,
heads ...) but not Qwen3.5's DeltaNet and MoE keys inside the nested
``text_config``, so this helper shrinks them itself. Every other key of the
real config.json (rope_parameters with mrope, layer_types, attn_output_gate,
mtp_num_hidden_layers ...) is kept, so the tiny model takes the same code paths
as the real one.

Layouts:
  "text":       Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (flat config, model.* names)
  "multimodal": Qwen3_5ForConditionalGeneration / ...Moe... (text_config, model.language_model.*,
                plus a tiny vision tower under model.visual.*)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from lollm.cli.hub_configs import hub_configs_dir

REPO = Path(__file__).resolve().parents[2]
HUB_CONFIGS = hub_configs_dir()

#: hub config folder of each family's reference checkpoint
HUB = {"qwen3_5": "Qwen__Qwen3.5-0.8B", "qwen3_5_moe": "Qwen__Qwen3.5-35B-A3B"}

#: For generation tests: untied output heads (Qwen3.5-27B, 35B-A3B) and larger random
#: weights. A tiny random model with tied embeddings and transformers' default init
#: (std 0.02) greedily repeats one token forever, which would hide a wrong cache
#: rollback; these settings give varied continuations.
LIVELY = {"hub": {"qwen3_5": "Qwen__Qwen3.5-27B", "qwen3_5_moe": "Qwen__Qwen3.5-35B-A3B"}, "initializer_range": 0.1}

TINY_TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 8,  # layers 3 and 7 are full attention
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # rotary_dim = 8 with partial_rotary_factor 0.25
    "intermediate_size": 96,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # each query/key head serves two value heads, as in the 35B
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,  # Dk != Dv: a swapped axis cannot hide
    "vocab_size": 512,
}
TINY_MOE = {
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}
TINY_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "num_position_embeddings": 16}


def hub_config(family: str, hub_name: str | None = None) -> dict:
    return json.loads((HUB_CONFIGS / (hub_name or HUB[family]) / "config.json").read_text(encoding="utf-8"))


def tiny_config(family: str, layout: str, hub_name: str | None = None, **text_overrides) -> dict:
    """The config.json dict of a tiny model of ``family`` in ``layout`` ("text" or "multimodal")."""
    raw = hub_config(family, hub_name)
    text = copy.deepcopy(raw["text_config"])
    text.update(TINY_TEXT)
    if family == "qwen3_5_moe":
        text.pop("intermediate_size")
        text.update(TINY_MOE)
    text.update(text_overrides)
    n = text["num_hidden_layers"]
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = [text["layer_types"][i % len(text["layer_types"])] for i in range(n)]
    vocab = text["vocab_size"]
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if isinstance(text.get(key), int) and text[key] >= vocab:
            text[key] = vocab - 1
    if layout == "text":
        text["model_type"] = f"{family}_text"
        text["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return text
    out = copy.deepcopy(raw)
    out["text_config"] = text
    out["vision_config"].update(TINY_VISION, out_hidden_size=text["hidden_size"])
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        out[key] = vocab - 2 - ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"].index(key)
    return out


def reference_class(family: str, layout: str):
    import transformers

    name = {
        ("qwen3_5", "text"): "Qwen3_5ForCausalLM",
        ("qwen3_5", "multimodal"): "Qwen3_5ForConditionalGeneration",
        ("qwen3_5_moe", "text"): "Qwen3_5MoeForCausalLM",
        ("qwen3_5_moe", "multimodal"): "Qwen3_5MoeForConditionalGeneration",
    }[family, layout]
    return getattr(transformers, name)


def write_tiny(
    family: str, layout: str, folder: Path, *, seed: int = 0, mtp: bool = False, lively: bool = False, **text_overrides
) -> Path:
    """Write a tiny random checkpoint with transformers (config.json + model.safetensors); return ``folder``.

    Constant-initialised parameters (norm weights, dt_bias) are perturbed so that a
    wrong norm form or a dropped parameter cannot hide behind a 0 or a 1.
    ``mtp``: also add ``mtp.*`` tensors named and shaped as a real Qwen3.5 checkpoint's.
    ``lively``: the settings of :data:`LIVELY` (varied greedy continuations).
    """
    import torch
    import transformers

    hub_name = None
    if lively:
        hub_name = LIVELY["hub"][family]
        text_overrides = {"initializer_range": LIVELY["initializer_range"], **text_overrides}
    raw = tiny_config(family, layout, hub_name, **text_overrides)
    config = transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(copy.deepcopy(raw))
    torch.manual_seed(seed)
    model = reference_class(family, layout)(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            flat = param.reshape(-1)
            if flat.numel() and bool((flat == flat[0]).all()):
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    folder = Path(folder)
    model.save_pretrained(folder)
    if mtp:
        add_mtp_tensors(folder, seed=seed + 2)
    return folder


def mtp_tensor_shapes(text: dict) -> dict[str, tuple[int, ...]]:
    """The ``mtp.*`` tensors of a real Qwen3.5 checkpoint, with their shapes for the config ``text``.

    Names as vLLM's and SGLang's qwen3_5_mtp loaders read them (and as listed in
    hub-configs/Qwen__Qwen3.5-0.8B/SOURCE.md); the MoE head's experts per expert.
    """
    C, H, K, D = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    p = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (C, 2 * C),
        "mtp.pre_fc_norm_embedding.weight": (C,),
        "mtp.pre_fc_norm_hidden.weight": (C,),
        "mtp.norm.weight": (C,),
        p + "input_layernorm.weight": (C,),
        p + "post_attention_layernorm.weight": (C,),
        p + "self_attn.q_proj.weight": (2 * H * D, C),  # queries + output gates
        p + "self_attn.k_proj.weight": (K * D, C),
        p + "self_attn.v_proj.weight": (K * D, C),
        p + "self_attn.o_proj.weight": (C, H * D),
        p + "self_attn.q_norm.weight": (D,),
        p + "self_attn.k_norm.weight": (D,),
    }
    if "num_experts" in text:
        E, I, Is = text["num_experts"], text["moe_intermediate_size"], text["shared_expert_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = (E, C)
        for e in range(E):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (I, C)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (I, C)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (C, I)
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = (Is, C)
        shapes[p + "mlp.shared_expert.up_proj.weight"] = (Is, C)
        shapes[p + "mlp.shared_expert.down_proj.weight"] = (C, Is)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, C)
    else:
        F = text["intermediate_size"]
        shapes[p + "mlp.gate_proj.weight"] = (F, C)
        shapes[p + "mlp.up_proj.weight"] = (F, C)
        shapes[p + "mlp.down_proj.weight"] = (C, F)
    return shapes


def add_mtp_tensors(folder: Path, *, seed: int = 0) -> None:
    """Add random ``mtp.*`` tensors to ``folder/model.safetensors`` (norm weights small, matrices ~N(0, 0.05))."""
    import torch
    from safetensors.torch import load_file, save_file

    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = raw.get("text_config", raw)
    tensors = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for name, shape in mtp_tensor_shapes(text).items():
        scale = 0.1 if len(shape) == 1 else 0.05
        tensors[name] = (scale * torch.randn(shape, generator=generator)).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def random_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    import torch

    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
