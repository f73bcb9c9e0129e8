"""Loading a qwen3 model: the name map per format, tied embeddings, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. For Hugging
Face safetensors the model mirrors transformers' module names, so the map
is the identity, written out below as the list of every tensor a qwen3
checkpoint holds. A name that is not on the list is an error naming it
(hard-fail, never guess).

GGUF files name the same tensors the llama.cpp way (``blk.0.attn_q.weight``,
``token_embd.weight`` …): :data:`GGUF_NAMES` is the second table, beside
:data:`HF_NAMES` in :data:`LAYOUT`. The names are gguf-py's
(``gguf/constants.py``: ``TENSOR_NAMES`` and ``MODEL_TENSORS[MODEL_ARCH.QWEN3]``;
``tensor_mapping.py`` maps the Hugging Face names to them).

What llama.cpp's converter does to qwen3 tensors besides renaming: nothing.
``conversion/qwen.py`` ``Qwen3Model`` (a ``Qwen2Model``) does not permute the
Q/K rows (only the ``LlamaModel`` family does, for ggml's interleaved RoPE;
qwen3 runs with NEOX, "rotate half", RoPE) and does not shift the QK-norm
weights (``attn_q_norm``/``attn_k_norm`` are stored as they are, unlike
Gemma's +1), so everything loads as it is. There is no real Qwen3 GGUF here:
this is read in the converter and tested on tiny random qwen3 GGUFs written
the converter's way and compared with transformers loading the same file.
A tied model has no ``output.weight`` in the file: lm_head then shares the
embedding (:data:`TIED`), as for safetensors without ``lm_head.weight``.

The tensors of a GGUF are dequantized to float32 one at a time by
:class:`lollm.gguf.GGUFTensorSource` and streamed through the same
:func:`lollm.load.weights.load_weights`, which converts each to the target dtype
and drops it before reading the next: a GGUF load peaks near one copy of the
model (plus the memory-mapped file's pages).
"""

from __future__ import annotations

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.load.tensor_parallel import Colwise, Rowwise, Vocab

from .config import Qwen3Config
from .modeling_qwen3 import Qwen3ForCausalLM

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
        "model.layers.{i}.self_attn.q_norm.weight",  # QK-norm: (head_dim,)
        "model.layers.{i}.self_attn.k_norm.weight",
        # biases exist only with "attention_bias": true (the model then has slots for them)
        "model.layers.{i}.self_attn.q_proj.bias",
        "model.layers.{i}.self_attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.bias",
        "model.layers.{i}.self_attn.o_proj.bias",
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
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",  # not permuted (NEOX RoPE)
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",  # QK-norm: (head_dim,), no +1 shift
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    # biases exist only with "attention_bias": true (from_gguf sets it when they are present)
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embeddings are tied
}

#: GGUF tensors knowingly skipped: none. (``rope_freqs.weight``, which gguf-py lists
#: for qwen3, would rescale RoPE's frequencies: unmapped, so it raises.)
GGUF_IGNORED: set[str] = set()

#: The output head falls back to the embedding matrix when the checkpoint has
#: no lm_head.weight ("tied embeddings": Qwen3-0.6B, -1.7B, -4B).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): every projection matrix, the embedding and the output
#: head. Norm weights (q_norm, k_norm and the layer norms) stay float.
QUANTIZABLE = r"model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight"


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

#: Everything above, as the data lollm.load.build.build_model reads.
LAYOUT = WeightLayout(
    name_maps={
        "safetensors": NameMap("qwen3", "safetensors", HF_NAMES, frozenset(HF_IGNORED)),
        "gguf": NameMap("qwen3", "gguf", GGUF_NAMES, frozenset(GGUF_IGNORED)),
    },
    tied=TIED,
    tp_plan=TP_PLAN,
    quantizable=QUANTIZABLE,
)


def load(checkpoint: Checkpoint, options: LoadOptions) -> Qwen3ForCausalLM:
    """Build a qwen3 model from a checkpoint (the ``load`` of the qwen3 Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata),
    its ``weights`` a TensorSource keyed by the file's names (:class:`lollm.gguf.GGUFTensorSource`
    for GGUF), its ``fmt`` "safetensors" or "gguf". options: resolved :class:`LoadOptions`
    (device, dtype, what stays packed, this rank's tensor-parallel group). Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape), each naming the key or tensor.
    """
    weights, fmt = checkpoint.weights, checkpoint.fmt
    name_map = LAYOUT.name_map(fmt, "qwen3")

    # 1. Parse config.json (either schema) or the GGUF metadata into the numbers that shape the model.
    if fmt == "gguf":
        config = Qwen3Config.from_gguf(checkpoint.config, {name: weights.shape(name) for name in weights.names()})
    else:
        config = Qwen3Config.from_hf(checkpoint.config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, name_map), fmt)

    # 3. Build on the meta device (this rank's share under --tp: TP_PLAN), compute RoPE's
    #    frequencies, stream the tensors in through the name map (packed where QUANTIZABLE
    #    and the options allow); lm_head shares the embedding when the config ties them.
    return build_model(Qwen3ForCausalLM, config, weights, fmt, options, LAYOUT, tie=config.tie_word_embeddings)
