"""Loading a qwen2 model: the name map per format, tied embeddings, and ``load``.

The loader (lollm.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. For Hugging
Face safetensors the model mirrors transformers' module names, so the map
is the identity, written out below as the list of every tensor a qwen2
checkpoint holds. A name that is not on the list is an error naming it
(hard-fail, never guess).

GGUF files name the same tensors the llama.cpp way (``blk.0.attn_q.weight``,
``token_embd.weight`` …): :data:`GGUF_NAMES` is the second table, beside
:data:`HF_NAMES` in :data:`NAME_MAPS`. The names are gguf-py's
(``gguf/constants.py``: ``TENSOR_NAMES`` and ``MODEL_TENSORS[MODEL_ARCH.QWEN2]``;
``tensor_mapping.py`` maps the Hugging Face names to them).

What llama.cpp's converter does to qwen2 tensors besides renaming: nothing.
``conversion/qwen.py`` ``Qwen2Model`` does not permute the Q/K rows (only the
``LlamaModel`` family does, for ggml's interleaved RoPE; qwen2 runs with NEOX,
"rotate half", RoPE), so attn_q/attn_k weights and biases load as they are.
Measured, not only read: on the Qwen2.5-Coder GGUF every dequantized
``attn_q``/``attn_k`` weight and bias equals transformers' ``q_proj``/``k_proj``
exactly (docs/gguf.md, section 4), and ``lollm parity`` on that file passes.
A tied model has no ``output.weight`` in the file: lm_head then shares the
embedding (:data:`TIED`), as for safetensors without ``lm_head.weight``.

The tensors of a GGUF are dequantized to float32 one at a time by
:class:`lollm.gguf.GGUFTensorSource` and streamed through the same
:func:`lollm.weights.load_weights`, which converts each to the target dtype
and drops it before reading the next: a GGUF load peaks near one copy of the
model (plus the memory-mapped file's pages).
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from lollm.checks import tensor_table
from lollm.errors import ConfigError, WeightsError
from lollm.tensor_parallel import Colwise, Rowwise, Vocab, sharding
from lollm.weights import load_weights

from .config import Qwen2Config
from .modeling_qwen2 import Qwen2ForCausalLM

#: Hugging Face (safetensors) tensor name -> model name; ``{i}`` is the layer index.
HF_NAMES = {
    name: name
    for name in (
        "model.embed_tokens.weight",
        "model.layers.{i}.input_layernorm.weight",
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.q_proj.bias",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.weight",
        "model.layers.{i}.self_attn.v_proj.bias",
        "model.layers.{i}.self_attn.o_proj.weight",
        "model.layers.{i}.post_attention_layernorm.weight",
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight",
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
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",  # not permuted (NEOX RoPE)
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",  # not permuted (NEOX RoPE)
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}

#: GGUF tensors knowingly skipped: none. (``rope_freqs.weight``, which gguf-py lists
#: for qwen2, would rescale RoPE's frequencies: unmapped, so it raises.)
GGUF_IGNORED: set[str] = set()

#: Name maps per checkpoint format: (table, ignored templates).
NAME_MAPS = {"safetensors": (HF_NAMES, HF_IGNORED), "gguf": (GGUF_NAMES, GGUF_IGNORED)}

#: The output head falls back to the embedding matrix when the checkpoint has
#: no lm_head.weight ("tied embeddings": Qwen2.5-0.5B, -1.5B, -3B).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

#: Tensor-parallel split under ``--tp N`` (docs/tensor-parallel.md): module -> how it is cut.
#: Attention by whole heads (q by query heads; k, v by KV heads, each rank keeping the KV
#: heads its query heads read, shared by several ranks when N exceeds them); o_proj by the
#: same heads on its input side, then one all-reduce. The MLP: gate and up by columns, down by
#: rows, one all-reduce. Embedding and head by vocabulary rows. Norms are replicated.
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

_LAYER_INDEX = re.compile(r"\.(\d+)\.")

#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): every projection matrix, the embedding and the output
#: head. Norm weights and biases are small vectors that stay float.
QUANTIZABLE = re.compile(r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight")


def quantizable(model_name: str) -> bool:
    """Whether ``model_name`` may stay packed (see :data:`QUANTIZABLE`)."""
    return QUANTIZABLE.fullmatch(model_name) is not None


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
            raise WeightsError(f"qwen2: unexpected tensor {file_name!r} in the {fmt} checkpoint: no qwen2 weight has that name")
        target = table[template]
        return target if match is None else target.format(i=match.group(1))

    return name_map


def load(raw_config: dict, weights, fmt: str, device, dtype: torch.dtype, progress: bool = False) -> Qwen2ForCausalLM:
    """Build a qwen2 model from a checkpoint (the ``load`` of the qwen2 Family).

    raw_config: config.json as a dict (for "gguf": the file's metadata); weights: a
    TensorSource keyed by the file's names (:class:`lollm.gguf.GGUFTensorSource` for
    GGUF, dequantizing each tensor to float32 when read); fmt: "safetensors" or
    "gguf"; device, dtype: where the weights live. Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape), each naming the key or tensor.
    """
    if fmt not in NAME_MAPS:
        raise ConfigError(f"qwen2: unknown checkpoint format {fmt!r} (known: {', '.join(NAME_MAPS)})")

    # 1. Parse config.json (either schema) or the GGUF metadata into the numbers that shape the model.
    if fmt == "gguf":
        config = Qwen2Config.from_gguf(raw_config, {name: weights.shape(name) for name in weights.names()})
    else:
        config = Qwen2Config.from_hf(raw_config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, name_map_for(fmt)), fmt)

    # 3. Build the module tree on the meta device: shapes and dtypes, no memory.
    #    Under --tp N this rank builds its share: H/N heads, F/N MLP columns, V/N vocabulary rows (TP_PLAN).
    tp = sharding(weights, TP_PLAN, config)
    if tp is None:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
    else:
        model = tp.build(Qwen2ForCausalLM)

    # 4. RoPE's inverse frequencies are not in the checkpoint: compute them on the real device.
    model.model.rotary_emb.materialize(device)

    # 5. Stream the tensors in, one at a time, through the name map (checks every shape).
    #    lm_head shares the embedding only when the config says the two are tied.
    #    When the load asks for quantized weights, the matrices QUANTIZABLE names stay packed.
    tied = TIED if config.tie_word_embeddings else None
    load_weights(model, weights, name_map_for(fmt), device=device, dtype=dtype, progress=progress, tied=tied,
                 quantizable=quantizable)

    # 6. Inference only: eval mode (no dropout anywhere; set for good measure).
    return model.eval()
