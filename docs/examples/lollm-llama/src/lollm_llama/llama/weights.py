"""Loading a llama model: the name maps per format, undoing llama.cpp's Q/K permutation, rope_freqs, and ``load``.

The loader (lollm.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. For Hugging
Face safetensors the model mirrors transformers' module names, so the map is
the identity, written out below as the list of every tensor a llama checkpoint
may hold (the biases only with ``attention_bias`` / ``mlp_bias``). A name not
on the list is an error naming it (hard-fail, never guess).

GGUF files name the same tensors the llama.cpp way (``blk.0.attn_q.weight``,
``token_embd.weight`` …): :data:`GGUF_NAMES`, with the names of gguf-py
(``gguf/constants.py``: ``TENSOR_NAMES`` and ``MODEL_TENSORS[MODEL_ARCH.LLAMA]``).
Two things llama.cpp's converter (``convert_hf_to_gguf.py``, class ``LlamaModel``)
does to a llama besides renaming, both undone here:

1. **The Q/K row permutation.** ggml's llama RoPE rotates *adjacent* channels
   (0,1), (2,3) … of a head, while Hugging Face checkpoints are written for
   "rotate half", which pairs channel ``j`` with ``j + D/2``. So the converter
   reorders the rows of ``q_proj`` (and ``k_proj``; their biases too) inside each
   head: row ``half * D/2 + j`` moves to row ``2 j + half``. Heads are counted
   with H for q and K (the KV heads) for k. :func:`unpermute_rows` puts the rows
   back, so the model keeps one RoPE layout, the one transformers uses.
2. **llama3 RoPE scaling as a tensor.** GGUF metadata has no llama3 scaling
   type: the converter computes each channel pair's divisor from the
   ``rope_scaling`` numbers (1 for fast pairs, ``factor`` for slow ones, a blend
   between) and stores them as ``rope_freqs.weight`` (D/2 float32). :func:`load`
   reads it into the RoPE settings (``RopeConfig.freq_factors``); it is never a
   model parameter.

The tensors of a GGUF are dequantized to float32 one at a time by
:class:`lollm.gguf.GGUFTensorSource` and streamed through the same
:func:`lollm.weights.load_weights`. Because q_proj/k_proj are re-ordered after
reading, they always load as float; the other matrices may stay packed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch

from lollm.checks import tensor_table
from lollm.errors import ConfigError, WeightsError
from lollm.weights import load_weights

from .config import LlamaConfig
from .modeling_llama import LlamaForCausalLM

#: Hugging Face (safetensors) tensor name -> model name; ``{i}`` is the layer index.
HF_NAMES = {
    name: name
    for name in (
        "model.embed_tokens.weight",
        "model.layers.{i}.input_layernorm.weight",
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.q_proj.bias",  # the biases: only with attention_bias
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.weight",
        "model.layers.{i}.self_attn.v_proj.bias",
        "model.layers.{i}.self_attn.o_proj.weight",
        "model.layers.{i}.self_attn.o_proj.bias",
        "model.layers.{i}.post_attention_layernorm.weight",
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.gate_proj.bias",  # the biases: only with mlp_bias
        "model.layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.up_proj.bias",
        "model.layers.{i}.mlp.down_proj.weight",
        "model.layers.{i}.mlp.down_proj.bias",
        "model.norm.weight",
        "lm_head.weight",  # absent when the embeddings are tied
    )
}

#: Tensors some checkpoints carry that the model knowingly does not load:
#: old exports saved RoPE's inv_freq buffer, which the model computes itself.
HF_IGNORED = {"model.layers.{i}.self_attn.rotary_emb.inv_freq"}

#: GGUF (llama.cpp) tensor name -> model name; ``{i}`` is the block index.
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",  # rows permuted: unpermute_rows
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",      # permuted like its rows
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",  # rows permuted (KV heads)
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}

#: The GGUF tensor that is not a model parameter: llama3 RoPE's divisors, read by :func:`load`.
ROPE_FREQS = "rope_freqs.weight"

#: GGUF tensors the name map skips (they are read another way).
GGUF_IGNORED: set[str] = {ROPE_FREQS}

#: Name maps per checkpoint format: (table, ignored templates).
NAME_MAPS = {"safetensors": (HF_NAMES, HF_IGNORED), "gguf": (GGUF_NAMES, GGUF_IGNORED)}

#: The output head falls back to the embedding matrix when the checkpoint has
#: no lm_head.weight ("tied embeddings": Llama 3.2 1B and 3B).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

_LAYER_INDEX = re.compile(r"\.(\d+)\.")

#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): every projection matrix, the embedding and the output
#: head. Norm weights and biases are small vectors that stay float.
QUANTIZABLE = re.compile(r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")

#: The tensors :func:`unpermute_rows` re-orders when they come from a GGUF (weights and biases).
PERMUTED = re.compile(r"model\.layers\.\d+\.self_attn\.(q|k)_proj\.(weight|bias)")


def quantizable(model_name: str) -> bool:
    """Whether ``model_name`` may stay packed (see :data:`QUANTIZABLE`)."""
    return QUANTIZABLE.fullmatch(model_name) is not None


def quantizable_gguf(model_name: str) -> bool:
    """As :func:`quantizable`, less q_proj/k_proj: their rows are re-ordered after reading, so they load float."""
    return quantizable(model_name) and PERMUTED.fullmatch(model_name) is None


def unpermute_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py).

    tensor: (heads * D, C) weight or (heads * D,) bias, rows in ggml's order (inside each
    head: pairs of adjacent rows) -> the same shape, rows in Hugging Face's order (inside
    each head: the first halves of the pairs, then the second halves).
    The converter viewed each head's D rows as (2, D/2) and stored them transposed,
    (D/2, 2); here they are viewed as (D/2, 2) and transposed back.
    """
    rows = tensor.shape[0]
    if heads < 1 or rows % heads or (rows // heads) % 2:
        raise WeightsError(f"llama: cannot unpermute a tensor of {rows} rows into {heads} heads of an even width")
    D = rows // heads
    return tensor.reshape(heads, D // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def gguf_transform(config: LlamaConfig) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """The ``transform`` of :func:`lollm.weights.load_weights` for a GGUF: un-permute q_proj (H heads) and k_proj (K heads)."""

    def transform(model_name: str, tensor: torch.Tensor) -> torch.Tensor:
        match = PERMUTED.fullmatch(model_name)
        if match is None:
            return tensor
        heads = config.num_attention_heads if match.group(1) == "q" else config.num_key_value_heads
        return unpermute_rows(tensor, heads)

    return transform


def read_rope_freqs(weights, config: LlamaConfig) -> LlamaConfig:
    """``config`` with the divisors of ``rope_freqs.weight`` in its RoPE settings (GGUF only).

    The tensor must hold D/2 finite positive numbers, and the metadata may not also
    name a scaling type (two scalings at once): ConfigError / WeightsError naming it.
    """
    shape = tuple(weights.shape(ROPE_FREQS))
    half = config.head_dim // 2
    if shape != (half,):
        raise WeightsError(f"llama: {ROPE_FREQS} has shape {shape}, expected ({half},): one divisor per channel pair")
    if config.rope.rope_type != "default":
        raise ConfigError(f"llama: the GGUF has both {ROPE_FREQS} and llama.rope.scaling.type "
                          f"{config.rope.rope_type!r}; only one RoPE scaling can apply")
    factors = tuple(float(x) for x in weights.read(ROPE_FREQS).float().tolist())
    if not all(math.isfinite(x) and x > 0 for x in factors):
        raise WeightsError(f"llama: {ROPE_FREQS} holds a value that is not a finite positive number")
    rope = dataclasses.replace(config.rope, rope_type="factors", freq_factors=factors)
    return dataclasses.replace(config, rope=rope)


def name_map_for(fmt: str) -> Callable[[str], str | None]:
    """The function file name -> model name (``None``: skip) for checkpoints of format ``fmt``.

    It raises WeightsError naming a tensor it does not know.
    """
    table, ignored = NAME_MAPS[fmt]

    def name_map(file_name: str) -> str | None:
        # "model.layers.12.mlp.up_proj.weight" -> template "model.layers.{i}.mlp.up_proj.weight", i = "12"
        match = _LAYER_INDEX.search(file_name)
        template = file_name if match is None else f"{file_name[:match.start()]}.{{i}}.{file_name[match.end():]}"
        if template in ignored:
            return None
        if template not in table:
            raise WeightsError(f"llama: unexpected tensor {file_name!r} in the {fmt} checkpoint: no llama weight has that name")
        target = table[template]
        return target if match is None else target.format(i=match.group(1))

    return name_map


def load(raw_config: dict, weights, fmt: str, device, dtype: torch.dtype, progress: bool = False) -> LlamaForCausalLM:
    """Build a llama model from a checkpoint (the ``load`` of the llama Family).

    raw_config: config.json as a dict (for "gguf": the file's metadata); weights: a
    TensorSource keyed by the file's names (:class:`lollm.gguf.GGUFTensorSource` for
    GGUF, dequantizing each tensor to float32 when read); fmt: "safetensors" or
    "gguf"; device, dtype: where the weights live. Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape), each naming the key or tensor.
    """
    if fmt not in NAME_MAPS:
        raise ConfigError(f"llama: unknown checkpoint format {fmt!r} (known: {', '.join(NAME_MAPS)})")

    # 1. Parse config.json (either schema) or the GGUF metadata into the numbers that shape the model.
    if fmt == "gguf":
        config = LlamaConfig.from_gguf(raw_config, {name: weights.shape(name) for name in weights.names()})
    else:
        config = LlamaConfig.from_hf(raw_config)

    #    A Llama 3.1+ GGUF carries its llama3 RoPE scaling as the tensor rope_freqs.weight.
    if fmt == "gguf" and ROPE_FREQS in weights:
        config = read_rope_freqs(weights, config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, name_map_for(fmt)), fmt)

    # 3. Build the module tree on the meta device: shapes and dtypes, no memory.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)

    # 4. RoPE's inverse frequencies are not in the checkpoint: compute them on the real device.
    model.model.rotary_emb.materialize(device)

    # 5. Stream the tensors in, one at a time, through the name map (checks every shape).
    #    lm_head shares the embedding only when the config says the two are tied.
    #    When the load asks for quantized weights, the matrices QUANTIZABLE names stay packed.
    tied = TIED if config.tie_word_embeddings else None
    #    A GGUF's q_proj/k_proj rows are put back in Hugging Face's order as they are read.
    gguf = fmt == "gguf"
    load_weights(model, weights, name_map_for(fmt), device=device, dtype=dtype, progress=progress, tied=tied,
                 transform=gguf_transform(config) if gguf else None,
                 quantizable=quantizable_gguf if gguf else quantizable)

    # 6. Inference only: eval mode (no dropout anywhere; set for good measure).
    return model.eval()
