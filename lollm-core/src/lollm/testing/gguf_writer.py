"""A tiny checkpoint as a GGUF file, written the way llama.cpp's converter writes it.

The conformance kit's GGUF mode (``gguf_types`` on
:class:`~lollm.testing.conformance.FamilyConformance`) runs a family on the GGUF
of its tiny safetensors checkpoint. :func:`write_tiny_gguf` does what
``convert_hf_to_gguf.py`` does for the architectures lollm's first-party
families serve:

* the tensor names come from gguf-py's ``TensorNameMap`` (the converter's own
  table, independent of the family's map);
* the metadata keys are the ones the converter's ``set_gguf_parameters`` writes
  for that architecture (``{arch}.block_count``, ``.attention.head_count_kv``,
  ``.rope.freq_base``, the RoPE scaling, the sliding window, the soft-caps ...);
* the converter's quirks: Gemma's norms store ``1 + weight`` (``modify_tensors``
  adds 1 to every ``*norm.weight``), the tied ``lm_head`` of Gemma is not written;
  no Q/K permutation (that is the converter's ``LlamaModel`` only, and none of
  these architectures);
* 1-D tensors (norms, biases) stay F32; every 2-D tensor is stored in the type
  asked for (``F32``, ``F16``, ``Q8_0``, ``Q4_0``, quantized by
  ``gguf.quants.quantize``), or in F16 when its rows are not a whole number of
  quantization blocks (the converter's fallback);
* a byte-level BPE vocabulary of the checkpoint's vocabulary size (``gpt2``
  model, :func:`lollm.testing.tiny_gguf.byte_level_vocab`), so the file carries a
  working tokenizer.

``reference_dir`` also writes the weights *as the GGUF holds them* (dequantized,
the converter's +1 undone) as a safetensors checkpoint under the Hugging Face
names, with the same config.json: transformers on that folder is the reference
for a quantized file, so that the kit's fp32 bounds still hold (quantization
error is then the same on both sides).

A config the file cannot carry is refused (ValueError naming the key), never
written into a file that would load as another model: e.g. a Gemma
``query_pre_attn_scalar`` other than ``head_dim`` (llama.cpp derives the scale
from ``head_dim``), or a layer pattern other than the one llama.cpp derives.

``gguf``, ``safetensors`` and ``transformers`` (to read config.json in either
schema) are test tooling (``lollm-core[parity]``), imported inside the function.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lollm.testing.tiny_gguf import byte_level_vocab

# Lazy imports below: gguf and transformers (optional extras, lollm-core[parity]).
if TYPE_CHECKING:  # their classes only name types here
    from gguf import GGUFWriter
    from transformers import PretrainedConfig

__all__ = ["GGUF_TYPES", "SUPPORTED", "write_tiny_gguf"]

#: The ggml types a tiny GGUF can be written in.
GGUF_TYPES = ("F32", "F16", "Q8_0", "Q4_0")
#: config.json ``model_type`` -> GGUF ``general.architecture``.
SUPPORTED = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3"}


def write_tiny_gguf(checkpoint_dir: str | Path, out: str | Path, ggml_type: str = "F32", *,
                    reference_dir: str | Path | None = None) -> Path:
    """Write the safetensors checkpoint in ``checkpoint_dir`` as the GGUF file ``out``; return ``out``.

    ggml_type: one of :data:`GGUF_TYPES`, the type of every 2-D tensor (see the module docstring).
    reference_dir: when given, a folder with config.json and model.safetensors holding the
    weights exactly as the GGUF stores them, under the checkpoint's own names.
    Raises ValueError for an unknown type, a ``model_type`` not in :data:`SUPPORTED`, or a
    config value a GGUF of that architecture cannot carry (naming the key).
    """
    import gguf
    from transformers import AutoConfig

    if ggml_type not in GGUF_TYPES:
        raise ValueError(f"ggml_type must be one of {', '.join(GGUF_TYPES)}, not {ggml_type!r}")
    folder, out = Path(checkpoint_dir), Path(out)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"{folder / 'config.json'}: model_type {model_type!r} has no tiny GGUF writer "
                         f"(supported: {', '.join(SUPPORTED)})")
    arch = SUPPORTED[model_type]
    cfg = AutoConfig.from_pretrained(str(folder))  # both config.json schemas, read the same way

    # 1. Refuse what a GGUF of this architecture cannot say.
    rope = _checked_rope(folder, arch, cfg)

    # 2. The metadata, as the converter's set_gguf_parameters writes it.
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, folder, arch, cfg, raw, rope)

    # 3. The tensors: gguf-py's names, the converter's quirks, the type asked for.
    stored = _write_tensors(writer, folder, arch, cfg, ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    # 4. The reference: the same numbers under the checkpoint's names.
    if reference_dir is not None:
        ref = Path(reference_dir)
        ref.mkdir(parents=True, exist_ok=True)
        for extra in ("config.json", "generation_config.json"):
            if (folder / extra).is_file():
                shutil.copy(folder / extra, ref / extra)
        save_file(stored, str(ref / "model.safetensors"))
    return out


def _head_dim(cfg: PretrainedConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _checked_rope(folder: Path, arch: str, cfg: PretrainedConfig) -> dict[str, object]:
    """Step 1: raise ValueError for what a GGUF of ``arch`` cannot carry; return the RoPE parameters it writes."""
    rope = _rope(cfg)
    if arch.startswith("gemma") and float(cfg.query_pre_attn_scalar) != float(_head_dim(cfg)):
        raise ValueError(f"{folder}: query_pre_attn_scalar {cfg.query_pre_attn_scalar} differs from head_dim "
                         f"{_head_dim(cfg)}; a {arch} GGUF does not carry it (llama.cpp derives the scale from "
                         f"head_dim), so the file would be another model")
    if arch == "gemma3":
        derived = ["sliding_attention" if i % 6 < 5 else "full_attention" for i in range(cfg.num_hidden_layers)]
        if list(cfg.layer_types) != derived:
            raise ValueError(f"{folder}: layer_types {list(cfg.layer_types)} differ from the pattern llama.cpp "
                             f"derives for gemma3 (every 6th layer global)")
        local = rope.get("sliding_attention", {})
        if local.get("rope_theta", 10000.0) != 10000.0 or local.get("rope_type", "default") != "default":
            raise ValueError(f"{folder}: the sliding layers' RoPE {local} is not llama.cpp's (base 10000, unscaled)")
        rope = rope.get("full_attention", {})
    if arch in ("qwen2", "qwen3") and getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{folder}: use_sliding_window is true; the converter writes no sliding window for {arch}")
    return rope


def _write_metadata(writer: GGUFWriter, folder: Path, arch: str, cfg: PretrainedConfig, raw: dict[str, object],
                    rope: dict[str, object]) -> None:
    """Step 2: the architecture's numbers, RoPE, soft-caps and a byte-level vocabulary, as the converter writes them."""
    import gguf

    gemma = arch.startswith("gemma")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    if "head_dim" in raw or "head_dim" in raw.get("text_config", {}) or gemma:
        writer.add_key_length(_head_dim(cfg))
        writer.add_value_length(_head_dim(cfg))
    if arch != "gemma2":
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    scaling = rope.get("rope_type", "default")
    if scaling == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    elif scaling == "yarn" and arch in ("qwen2", "qwen3"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
    elif scaling != "default":
        raise ValueError(f"{folder}: RoPE scaling {scaling!r} has no tiny GGUF spelling for {arch}")
    if gemma:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(float(cfg.attn_logit_softcapping))
        writer.add_final_logit_softcapping(float(cfg.final_logit_softcapping))
    tokens, merges, types = byte_level_vocab(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)


def _write_tensors(writer: GGUFWriter, folder: Path, arch: str, cfg: PretrainedConfig,
                   ggml_type: str) -> dict[str, torch.Tensor]:
    """Step 3: every tensor under gguf-py's name in the type asked for; returns what the file holds, as float32."""
    import gguf

    gemma = arch.startswith("gemma")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), cfg.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    stored: dict[str, torch.Tensor] = {}
    for hf_name, value in load_file(str(folder / "model.safetensors")).items():
        if gemma and hf_name == "lm_head.weight":
            continue  # tied: the converter does not write it
        shift = np.float32(1.0 if gemma and hf_name.endswith("norm.weight") else 0.0)  # Gemma's norms stored as 1 + w
        array = value.float().numpy() + shift
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{folder}: gguf-py has no {arch} name for the tensor {hf_name!r}")
        kind = qtype if array.ndim >= 2 else gguf.GGMLQuantizationType.F32
        if array.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:
            kind = gguf.GGMLQuantizationType.F16
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
            held = array
        elif kind == gguf.GGMLQuantizationType.F16:
            half = array.astype(np.float16)
            writer.add_tensor(name, half)
            held = half.astype(np.float32)
        else:
            packed = gguf.quants.quantize(array, kind)
            writer.add_tensor(name, packed, raw_dtype=kind)
            held = gguf.quants.dequantize(packed, kind).reshape(array.shape)
        stored[hf_name] = torch.from_numpy(np.ascontiguousarray(held - shift))
    return stored


def _rope(cfg: PretrainedConfig) -> dict[str, object]:
    """transformers 5's ``rope_parameters`` of a config (flat, or one dict per layer type)."""
    params = getattr(cfg, "rope_parameters", None)
    if not isinstance(params, dict):
        return {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    return dict(params)
