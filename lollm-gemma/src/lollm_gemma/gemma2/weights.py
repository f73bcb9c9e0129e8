"""Loading a gemma2 model: the name map per format, tied embeddings, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. For Hugging
Face safetensors the model mirrors transformers' module names, so the map
is the identity, written out below as the list of every tensor a gemma2
checkpoint holds. A name that is not on the list is an error naming it
(hard-fail, never guess).

GGUF files (llama.cpp's converter, ``Gemma2Model``) name the same tensors the
llama.cpp way (:data:`GGUF_NAMES`, as in gguf-py's ``tensor_mapping.py``), write no
``output.weight`` (tied), and store every norm weight as ``w + 1`` (``modify_tensors``:
every HF name ending in ``norm.weight``; HF Gemma 2's RMSNorm computes ``x · (1 + w)``,
llama.cpp ``x · w``). :func:`undo_gguf_norm_shift` subtracts that 1 again. Q/K rows
are not permuted (llama.cpp runs Gemma 2 with NEOX RoPE).
"""

from __future__ import annotations

import torch

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.errors import WeightsError
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.load.tensor_parallel import Colwise, Rowwise, Vocab

from .config import Gemma2Config
from .modeling_gemma2 import Gemma2ForCausalLM

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
        "model.layers.{i}.post_attention_layernorm.weight",
        "model.layers.{i}.pre_feedforward_layernorm.weight",
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight",
        "model.layers.{i}.post_feedforward_layernorm.weight",
        "model.norm.weight",
        "lm_head.weight",  # absent when the embeddings are tied (every Gemma 2)
    )
}

#: llama.cpp (GGUF) tensor name -> model name (gguf-py tensor_mapping.py, MODEL_ARCH.GEMMA2).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # the converter skips lm_head: tied to token_embd
}

#: What llama.cpp's converter added to every norm weight (``Gemma2Model.modify_tensors``).
GGUF_NORM_SHIFT = 1.0


def undo_gguf_norm_shift(model_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``w + 1`` back to ``w`` for every norm weight (model names ending in ``norm.weight``,
    the converter's own test on the same HF names); other tensors as they are."""
    return tensor - GGUF_NORM_SHIFT if model_name.endswith("norm.weight") else tensor


#: Tensor-parallel split under ``--tp N`` (docs/tensor-parallel.md): module -> how it is cut.
#: Attention by whole heads (q by query heads; k, v by KV heads, each rank keeping the KV
#: heads its query heads read, shared by several ranks when N exceeds them); o_proj by the
#: same heads on its input side, then one all-reduce. The GeGLU MLP: gate and up by columns,
#: down by rows, one all-reduce. Embedding and (tied) head by vocabulary rows. Norms replicated.
TP_PLAN = {
    "model.embed_tokens": Vocab(),
    "model.layers.*.self_attn.q_proj": Colwise("num_attention_heads"),
    "model.layers.*.self_attn.k_proj": Colwise("num_key_value_heads", replicate=True),
    "model.layers.*.self_attn.v_proj": Colwise("num_key_value_heads", replicate=True),
    "model.layers.*.self_attn.o_proj": Rowwise("num_attention_heads"),
    "model.layers.*.mlp.gate_proj": Colwise("intermediate_size"),
    "model.layers.*.mlp.up_proj": Colwise("intermediate_size"),
    "model.layers.*.mlp.down_proj": Rowwise("intermediate_size"),
    "lm_head": Vocab(),
}


#: The output head falls back to the embedding matrix when the checkpoint has no lm_head.weight.
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): every projection matrix, the embedding and the output
#: head. The norm weights stay float (the GGUF ones pass through undo_gguf_norm_shift).
QUANTIZABLE = r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight"

#: Everything above, as the data lollm.load.build.build_model reads.
LAYOUT = WeightLayout(
    name_maps={
        "safetensors": NameMap("gemma2", "safetensors", HF_NAMES),
        "gguf": NameMap("gemma2", "gguf", GGUF_NAMES),
    },
    tied=TIED,
    tp_plan=TP_PLAN,
    quantizable=QUANTIZABLE,
)


def load(checkpoint: Checkpoint, options: LoadOptions) -> Gemma2ForCausalLM:
    """Build a gemma2 model from a checkpoint (the ``load`` of the gemma2 Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata),
    its ``weights`` a TensorSource keyed by the file's names, its ``fmt`` "safetensors" or
    "gguf". options: resolved :class:`LoadOptions` (device, dtype, what stays packed, this
    rank's tensor-parallel group). Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata, an unknown format) and WeightsError
    (a tensor missing, unexpected, or of the wrong shape), each naming the key or tensor.
    """
    weights, fmt = checkpoint.weights, checkpoint.fmt
    name_map = LAYOUT.name_map(fmt, "gemma2")

    # 1. Parse config.json (either schema) or the GGUF metadata into the numbers that shape
    #    the model. GGUF: the vocabulary is token_embd's rows, tied when output.weight is absent.
    if fmt == "gguf":
        if "token_embd.weight" not in weights.names():
            raise WeightsError("gemma2: the GGUF file has no 'token_embd.weight'")
        config = Gemma2Config.from_gguf(
            checkpoint.config, vocab_size=weights.shape("token_embd.weight")[0],
            tie_word_embeddings="output.weight" not in weights.names(),
        )
    else:
        config = Gemma2Config.from_hf(checkpoint.config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, name_map), fmt)

    # 3. Build on the meta device (this rank's share under --tp: TP_PLAN), compute RoPE's
    #    frequencies and the embedding scale, stream the tensors in through the name map
    #    (GGUF norms shifted back by 1; packed where QUANTIZABLE and the options allow).
    return build_model(Gemma2ForCausalLM, config, weights, fmt, options, LAYOUT, tie=config.tie_word_embeddings,
                       transform=undo_gguf_norm_shift if fmt == "gguf" else None)
