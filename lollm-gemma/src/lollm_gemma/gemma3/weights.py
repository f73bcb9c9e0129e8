"""Loading a gemma3 model: the name map per format and layout, tied embeddings, and ``load``.

The loader (lollm.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. The model
mirrors transformers' module names, so for a ``gemma3_text`` checkpoint the
map is the identity, written out below as the list of every tensor such a
checkpoint holds. A name that is not on the list is an error naming it
(hard-fail, never guess).

A multimodal ``gemma3`` checkpoint (Gemma 3 4B/12B/27B) holds the same decoder
beside a SigLIP vision tower and its projector, under one of two spellings:

    published files, and transformers 5's save_pretrained   transformers 4.52-4.57's save_pretrained
    language_model.model.layers.0.mlp.up_proj.weight        model.language_model.layers.0.mlp.up_proj.weight
    language_model.lm_head.weight (tied: usually absent)    lm_head.weight
    vision_tower.vision_model.* , multi_modal_projector.*   model.vision_tower.* , model.multi_modal_projector.*

We load the decoder only: both decoder prefixes are mapped back to ``model.*``
and the vision prefixes are skipped by name; anything else unknown still raises.

GGUF files name the same tensors the llama.cpp way (``blk.0.attn_q.weight``,
``token_embd.weight`` …) and llama.cpp's converter bakes Gemma's ``+1`` into the
norm weights. That map (a table beside :data:`HF_NAMES` in :data:`NAME_MAPS`)
and ``Gemma3Config.from_gguf`` come with the GGUF reader; until then ``load``
refuses ``fmt="gguf"``.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from lollm.errors import ConfigError, WeightsError
from lollm.weights import load_weights

from .config import Gemma3Config
from .modeling_gemma3 import Gemma3ForCausalLM

#: Hugging Face (safetensors) tensor name -> model name; ``{i}`` is the layer index.
HF_NAMES = {
    name: name
    for name in (
        "model.embed_tokens.weight",
        "model.layers.{i}.input_layernorm.weight",
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
        "model.layers.{i}.self_attn.o_proj.weight",
        "model.layers.{i}.self_attn.q_norm.weight",
        "model.layers.{i}.self_attn.k_norm.weight",
        "model.layers.{i}.post_attention_layernorm.weight",
        "model.layers.{i}.pre_feedforward_layernorm.weight",
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight",
        "model.layers.{i}.post_feedforward_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",  # absent when the embeddings are tied (every Gemma 3)
    )
}

#: The multimodal layout: decoder prefix in the file -> prefix in the model.
MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
}
#: ... and these prefixes hold the vision tower, which this text family does not load.
MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

#: Name maps per checkpoint format (a "gguf" entry comes with the GGUF reader).
NAME_MAPS = {"safetensors": HF_NAMES}

#: The output head falls back to the embedding matrix when the checkpoint has no lm_head.weight.
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def name_map_for(fmt: str, multimodal: bool) -> Callable[[str], str | None]:
    """The function file name -> model name (``None``: skip) for checkpoints of format ``fmt``.

    It raises WeightsError naming a tensor it does not know.
    """
    table = NAME_MAPS[fmt]
    layout = "multimodal (model_type 'gemma3')" if multimodal else "text (model_type 'gemma3_text')"

    def name_map(file_name: str) -> str | None:
        name = file_name
        if multimodal:
            if name.startswith(MULTIMODAL_SKIPPED):
                return None  # the vision tower: not part of the text decoder
            prefix = next((p for p in MULTIMODAL_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                name = MULTIMODAL_PREFIXES[prefix] + name[len(prefix) :]
            elif name != "lm_head.weight":
                raise WeightsError(f"gemma3: unexpected tensor {file_name!r} in the {layout} {fmt} checkpoint")
        # "model.layers.12.mlp.up_proj.weight" -> template "model.layers.{i}.mlp.up_proj.weight", i = "12"
        match = _LAYER_INDEX.search(name)
        template = name if match is None else f"{name[:match.start()]}.{{i}}.{name[match.end():]}"
        if template not in table:
            raise WeightsError(f"gemma3: unexpected tensor {file_name!r} in the {layout} {fmt} checkpoint: no gemma3 weight has that name")
        target = table[template]
        return target if match is None else target.format(i=match.group(1))

    return name_map


def load(raw_config: dict, weights, fmt: str, device, dtype: torch.dtype, progress: bool = False) -> Gemma3ForCausalLM:
    """Build a gemma3 model from a checkpoint (the ``load`` of the gemma3 Family).

    raw_config: config.json as a dict; weights: a TensorSource keyed by the file's
    names; fmt: "safetensors" ("gguf" is refused for now); device, dtype: where the
    weights live. Returns the model in eval mode.

    Raises ConfigError (config.json) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape), each naming the key or tensor.
    """
    if fmt == "gguf":
        # the seam for the GGUF work: Gemma3Config.from_gguf + a "gguf" entry in NAME_MAPS
        raise ConfigError("GGUF for gemma3 not supported yet (use a safetensors checkpoint)")
    if fmt not in NAME_MAPS:
        raise ConfigError(f"gemma3: unknown checkpoint format {fmt!r} (known: {', '.join(NAME_MAPS)})")

    # 1. Parse config.json (either layout, either schema) into the numbers that shape the model.
    config = Gemma3Config.from_hf(raw_config)

    # 2. Build the module tree on the meta device: shapes and dtypes, no memory.
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)

    # 3. What is not in the checkpoint: RoPE frequencies and the embedding scale.
    model.materialize(device, dtype)

    # 4. Stream the tensors in, one at a time, through the name map (checks every shape).
    load_weights(
        model, weights, name_map_for(fmt, config.multimodal),
        device=device, dtype=dtype, progress=progress, tied=TIED,
    )

    # 5. Inference only: eval mode (no dropout anywhere; set for good measure).
    return model.eval()
