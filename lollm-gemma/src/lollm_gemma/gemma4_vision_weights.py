"""Weights of the gemma4 vision tower, from a safetensors checkpoint or from llama.cpp's mmproj GGUF.

Safetensors (``Gemma4ForConditionalGeneration``): the tower's tensors are the ones under
``model.vision_tower.`` and ``model.embed_vision.``; our module names are theirs without
``model.``. The decoder's and the audio tower's tensors are not read here.

mmproj GGUF (``convert_hf_to_gguf.py --mmproj``, class ``Gemma4VisionAudioModel``): a file
of architecture ``clip`` whose ``clip.vision.projector_type`` is ``gemma4v``. The converter
renamed every tensor (table :data:`MMPROJ_LAYER_NAMES`) and changed three things, undone here:

* ``patch_embedder.input_proj.weight`` (C, p·p·3) became a convolution kernel
  ``v.patch_embd.weight`` (C, 3, p, p): the pixel order in a patch went from
  (row, column, channel) to (channel, row, column). :func:`unpermute_patch_kernel` turns it back.
* the clip bounds of clipped linears, scalars in the checkpoint, became 1-element tensors.
* config keys it does not write are llama.cpp's constants for gemma4v (clip.cpp): RoPE theta
  100, pooling kernel 3 (unless ``clip.vision.projector.scale_factor`` says otherwise); the head
  width, key/value heads, position table size and the clipping/standardize switches are read
  off the tensors' shapes and presence.

An mmproj file holds no decoder width key that we need: ``clip.vision.projection_dim`` is it.
It holds no token ids either: those come from the text GGUF (or config.json), so the
:class:`VisionConfig` of an mmproj file carries the ids the caller passes. Nor does it hold the
soft-token budget per image: :func:`budget_beside` reads ``max_soft_tokens`` from a
preprocessor_config.json beside the file, else takes the published 280.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .gemma4_vision import Gemma4Vision, VisionConfig

#: Prefix of the tower's names in a transformers checkpoint.
HF_PREFIXES = ("model.vision_tower.", "model.embed_vision.")

#: mmproj name of layer N's tensors -> our name under ``vision_tower.encoder.layers.N.``
MMPROJ_LAYER_NAMES = {
    "ln1.weight": "input_layernorm.weight",
    "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ln2.weight": "pre_feedforward_layernorm.weight",
    "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: mmproj names outside the layers -> ours
MMPROJ_NAMES = {
    "v.position_embd.weight": "vision_tower.patch_embedder.position_embedding_table",
    "v.std_bias": "vision_tower.std_bias",
    "v.std_scale": "vision_tower.std_scale",
    "mm.input_projection.weight": "embed_vision.embedding_projection.weight",
}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


# ---------------------------------------------------------------------------
# Building the module from a state dict
# ---------------------------------------------------------------------------
def build(config: VisionConfig, state: dict[str, torch.Tensor], *, source: str,
          dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Gemma4Vision:
    """A :class:`Gemma4Vision` holding ``state`` (our names), every name matched exactly.

    Raises ValueError naming ``source`` and the missing, unexpected or misshapen tensors.
    """
    model = Gemma4Vision(config)
    want = model.state_dict()
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"{source}: the gemma4 vision tower's tensors do not match: missing {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}, unexpected {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    for name, value in state.items():
        if tuple(value.shape) != tuple(want[name].shape):
            raise ValueError(f"{source}: tensor {name} has shape {tuple(value.shape)}, "
                             f"the config wants {tuple(want[name].shape)}")
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------
# Safetensors
# ---------------------------------------------------------------------------
def safetensors_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The tower's tensors of a checkpoint folder, under our names (``model.`` stripped).

    Reads ``model.safetensors`` or every shard named by ``model.safetensors.index.json``;
    only the tower's tensors are loaded. FileNotFoundError when neither file exists.
    """
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors nor model.safetensors.index.json")
    state = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(HF_PREFIXES):
                    state[name.removeprefix("model.")] = f.get_tensor(name)
    return state


def from_safetensors(folder: str | Path, *, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> Gemma4Vision:
    """The tower and projector of a ``Gemma4ForConditionalGeneration`` checkpoint folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = VisionConfig.from_dict(json.loads(config_path.read_text(encoding="utf-8")), where=str(config_path))
    return build(config, safetensors_state(folder), source=str(folder), dtype=dtype, device=device)


# ---------------------------------------------------------------------------
# mmproj GGUF
# ---------------------------------------------------------------------------
def unpermute_patch_kernel(kernel: torch.Tensor) -> torch.Tensor:
    """The converter's conv kernel back to transformers' linear: (C, 3, p, p) -> (C, p·p·3).

    transformers flattens a patch as (row, column, channel); the convolution reads
    (channel, row, column).
    """
    C = kernel.shape[0]
    return kernel.permute(0, 2, 3, 1).reshape(C, -1)


def mmproj_state(source) -> dict[str, torch.Tensor]:
    """The tensors of a gemma4v mmproj (a lollm.gguf.reader.GGUFTensorSource) under our names.

    Audio tensors (``a.*``, ``mm.a.*``) are skipped. ValueError names a vision tensor
    this map does not know.
    """
    state = {}
    for name in source.names():
        if name.startswith(("a.", "mm.a.")):
            continue  # the audio tower: out of scope
        value = source.read(name).float()
        if name == "v.patch_embd.weight":
            state["vision_tower.patch_embedder.input_proj.weight"] = unpermute_patch_kernel(value)
            continue
        if name in MMPROJ_NAMES:
            state[MMPROJ_NAMES[name]] = value
            continue
        m = re.fullmatch(r"v\.blk\.(\d+)\.(.+)", name)
        if not m:
            raise ValueError(f"{source.file_of(name)}: tensor {name!r} is not one the gemma4 vision tower knows")
        layer, rest = f"vision_tower.encoder.layers.{m.group(1)}.", m.group(2)
        if rest in MMPROJ_LAYER_NAMES:  # a norm's weight
            state[layer + MMPROJ_LAYER_NAMES[rest]] = value
            continue
        base, _, suffix = rest.rpartition(".")  # a clipped linear: its weight or one of its bounds
        if base not in MMPROJ_LAYER_NAMES or suffix not in ("weight", *_CLIP_BOUNDS):
            raise ValueError(f"{source.file_of(name)}: tensor {name!r} is not one the gemma4 vision tower knows")
        if suffix == "weight":
            state[layer + MMPROJ_LAYER_NAMES[base] + ".linear.weight"] = value
        else:
            state[layer + MMPROJ_LAYER_NAMES[base] + "." + suffix] = value.reshape(())  # back to a scalar
    return state


def mmproj_config(source, *, image_token_id: int, boi_token_id: int, eoi_token_id: int,
                  soft_tokens_per_image: int = 280) -> VisionConfig:
    """The tower's config from an mmproj's metadata and tensor shapes, plus llama.cpp's gemma4v constants.

    Raises ValueError when the file is not a gemma4v mmproj, or a key is missing.
    """
    meta, where = source.metadata, f"mmproj GGUF {source.file_of(source.names()[0])}"

    def need(key: str):
        if key not in meta:
            raise ValueError(f"{where}: metadata key {key!r} is missing")
        return meta[key]

    projector = meta.get("clip.vision.projector_type")
    if projector == "gemma4uv":
        raise ValueError(f"{where}: clip.vision.projector_type is 'gemma4uv', the tower of "
                         "Gemma4UnifiedForConditionalGeneration (no transformer layers), which lollm does not implement")
    if projector != "gemma4v":
        raise ValueError(f"{where}: clip.vision.projector_type is {projector!r}, "
                         "not 'gemma4v' (this is not a Gemma 4 vision mmproj)")
    C, H = need("clip.vision.embedding_length"), need("clip.vision.attention.head_count")
    D = source.shape("v.blk.0.attn_q_norm.weight")[0]
    return VisionConfig(
        hidden_size=C, intermediate_size=need("clip.vision.feed_forward_length"),
        num_hidden_layers=need("clip.vision.block_count"), num_attention_heads=H,
        num_key_value_heads=source.shape("v.blk.0.attn_k.weight")[0] // D, head_dim=D,
        rms_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        patch_size=need("clip.vision.patch_size"),
        pooling_kernel_size=int(meta.get("clip.vision.projector.scale_factor", 3)),  # clip.cpp's default 3
        position_embedding_size=source.shape("v.position_embd.weight")[1],
        rope_theta=100.0,  # clip.cpp's constant for gemma4v
        use_clipped_linears="v.blk.0.attn_q.input_min" in source,
        standardize="v.std_bias" in source,
        text_hidden_size=need("clip.vision.projection_dim"),
        soft_tokens_per_image=soft_tokens_per_image,
        image_token_id=image_token_id, boi_token_id=boi_token_id, eoi_token_id=eoi_token_id,
    )


#: The soft tokens per image of every published Gemma 4 (config.json ``vision_soft_tokens_per_image``).
PUBLISHED_SOFT_TOKENS = 280


def budget_beside(folder: Path) -> int:
    """The soft-token budget for an mmproj file in ``folder``: ``max_soft_tokens`` of the
    preprocessor_config.json there (what transformers' Gemma4ImageProcessor saves), else
    :data:`PUBLISHED_SOFT_TOKENS`. ValueError naming the file for a budget the processor refuses."""
    from .gemma4_vision_preprocess import ProcessorConfig

    path = Path(folder) / "preprocessor_config.json"
    if not path.is_file():
        return PUBLISHED_SOFT_TOKENS
    value = json.loads(path.read_text(encoding="utf-8")).get("max_soft_tokens", PUBLISHED_SOFT_TOKENS)
    try:
        return ProcessorConfig(max_soft_tokens=value).max_soft_tokens
    except ValueError as e:
        raise ValueError(f"{path}: 'max_soft_tokens': {e}") from None


def from_mmproj(path: str | Path, *, image_token_id: int, boi_token_id: int, eoi_token_id: int,
                soft_tokens_per_image: int = 280, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> Gemma4Vision:
    """The tower and projector of a gemma4v mmproj GGUF, read by lollm's own GGUF reader.

    The token ids come from the text model (the mmproj has none).
    """
    from lollm.gguf.reader import GGUFTensorSource

    source = GGUFTensorSource(path)
    config = mmproj_config(source, image_token_id=image_token_id, boi_token_id=boi_token_id,
                           eoi_token_id=eoi_token_id, soft_tokens_per_image=soft_tokens_per_image)
    return build(config, mmproj_state(source), source=str(path), dtype=dtype, device=device)
