"""Loading a llama model: the name maps per format, undoing llama.cpp's Q/K permutation, rope_freqs, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
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

The family's declarations (name maps, tied head, what may stay packed) are data
in :data:`LAYOUTS`, read by :func:`lollm.load.build.build_model` (plugin contract 2,
docs/plugins.md); :func:`load` parses the config, checks it against the tensor
table and hands over, with :func:`gguf_transform` for a GGUF. The tensors of a
GGUF are dequantized to float32 one at a time by :class:`lollm.gguf.GGUFTensorSource`.
Because q_proj/k_proj are re-ordered after reading, they always load as float;
the other matrices may stay packed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.errors import ConfigError, WeightsError
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions

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

#: The output head falls back to the embedding matrix when the checkpoint has
#: no lm_head.weight ("tied embeddings": Llama 3.2 1B and 3B).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): every projection matrix, the embedding and the output
#: head. Norm weights and biases are small vectors that stay float.
QUANTIZABLE = r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight"

#: From a GGUF, less q_proj/k_proj: their rows are re-ordered after reading (:func:`unpermute_rows`), so they load float.
QUANTIZABLE_GGUF = r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\.(self_attn\.(v|o)_proj|mlp\.\w+_proj)\.weight"

#: The tensors :func:`unpermute_rows` re-orders when they come from a GGUF (weights and biases).
PERMUTED = re.compile(r"model\.layers\.\d+\.self_attn\.(q|k)_proj\.(weight|bias)")

#: Everything above, as the data lollm.load.build.build_model reads: one layout per format, since
#: what may stay packed differs. No TP_PLAN: this example runs on one process (no ``--tp``).
LAYOUTS = {
    "safetensors": WeightLayout(
        name_maps={"safetensors": NameMap("llama", "safetensors", HF_NAMES, frozenset(HF_IGNORED))},
        tied=TIED, quantizable=QUANTIZABLE),
    "gguf": WeightLayout(
        name_maps={"gguf": NameMap("llama", "gguf", GGUF_NAMES, frozenset(GGUF_IGNORED))},
        tied=TIED, quantizable=QUANTIZABLE_GGUF),
}


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
    """The ``transform`` of :func:`lollm.load.weights.load_weights` for a GGUF: un-permute q_proj (H heads) and k_proj (K heads)."""

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


def load(checkpoint: Checkpoint, options: LoadOptions) -> LlamaForCausalLM:
    """Build a llama model from a checkpoint (the ``load`` of the llama Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata),
    its ``weights`` a TensorSource keyed by the file's names (:class:`lollm.gguf.GGUFTensorSource`
    for GGUF, dequantizing each tensor to float32 when read), its ``fmt`` "safetensors" or
    "gguf". options: resolved :class:`LoadOptions` (device, dtype, what stays packed).
    Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata, an unknown format) and WeightsError
    (a tensor missing, unexpected, or of the wrong shape), each naming the key or tensor.
    """
    weights, fmt = checkpoint.weights, checkpoint.fmt
    if fmt not in LAYOUTS:
        raise ConfigError(f"llama: unknown checkpoint format {fmt!r} (known: {', '.join(LAYOUTS)})")
    layout = LAYOUTS[fmt]

    # 1. Parse config.json (either schema) or the GGUF metadata into the numbers that shape the model.
    #    A Llama 3.1+ GGUF carries its llama3 RoPE scaling as the tensor rope_freqs.weight.
    if fmt == "gguf":
        config = LlamaConfig.from_gguf(checkpoint.config, {name: weights.shape(name) for name in weights.names()})
        if ROPE_FREQS in weights:
            config = read_rope_freqs(weights, config)
    else:
        config = LlamaConfig.from_hf(checkpoint.config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, layout.name_map(fmt, "llama")), fmt)

    # 3. Build on the meta device, compute RoPE's frequencies, stream the tensors in through the
    #    name map (packed where the layout's pattern and the options allow); lm_head shares the
    #    embedding when the config ties them. A GGUF's q_proj/k_proj rows are put back in Hugging
    #    Face's order as they are read.
    return build_model(LlamaForCausalLM, config, weights, fmt, options, layout, tie=config.tie_word_embeddings,
                       transform=gguf_transform(config) if fmt == "gguf" else None)
