"""Loading a gemma4 model: the name map per format and layout, tied embeddings, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. The model
mirrors transformers' module names, so for a ``gemma4_text`` checkpoint the
map is the identity, written out below as the list of every tensor such a
checkpoint may hold. A name that is not on the list is an error naming it
(hard-fail, never guess).

Three kinds of names need a word:

* ``model.layers.N.layer_scalar`` is a *buffer* (a fixed per-layer scale), not a
  parameter; it is in the checkpoint and loaded like a weight.
* The KV-sharing layers have no k_proj / v_proj / k_norm of their own.
  Checkpoints may still carry them (transformers lists them as "ignored on
  load"); for those layers, and only those, they are skipped by name
  (shared_kv_names.py; :func:`layout_for` reads which layers share from the config).
* A multimodal ``gemma4`` checkpoint (gemma-4-E2B-it as published) holds the
  decoder under ``model.language_model.*`` beside the vision and audio towers
  (``model.vision_tower.*``, ``model.audio_tower.*``) and their projections into
  the text space (``model.embed_vision.*``, ``model.embed_audio.*``). We load the
  decoder only: its prefix is mapped back to ``model.*`` (:data:`MULTIMODAL_NAMES`) and the four tower
  prefixes are skipped by name; anything else unknown still raises.

GGUF files (llama.cpp's converter, ``Gemma4Model`` in conversion/gemma.py) name the
same tensors the llama.cpp way (:data:`GGUF_NAMES`, as gguf-py's ``tensor_mapping.py``
gives them for ``MODEL_ARCH.GEMMA4``: ``blk.0.attn_q.weight``, ``per_layer_token_embd.weight``,
``blk.0.layer_output_scale.weight`` …). What differs from Gemma 2 and 3:

* **no +1 on the norms.** ``Gemma4Model.norm_shift`` returns 0: Gemma 4's RMSNorm
  computes ``x · w`` already, so the weights are loaded as they are.
* **one extra tensor, ``rope_freqs.weight``**, that no HF checkpoint has: the global
  layers' proportional RoPE written as per-pair frequency factors (1.0 rotates, 1e30
  does not). ``Gemma4Config.from_gguf`` reads it into ``partial_rotary_factor``; the
  RoPE tables are then computed like for safetensors, so the tensor itself is skipped.
* ``layer_scalar`` is named ``blk.N.layer_output_scale.weight`` (the converter appends
  ``.weight`` before mapping), shape (1,) as in the checkpoint.
* the embedding is trimmed to the tokenizer's vocabulary, and there is no ``output.weight``
  (tied): the vocabulary size is read from ``token_embd.weight``'s rows.

Attention Q/K rows are *not* permuted (llama.cpp runs Gemma with NEOX RoPE).
"""

from __future__ import annotations

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.load.tensor_parallel import Colwise, Rowwise, Vocab

from .config import Gemma4Config
from .modeling_gemma4 import Gemma4ForCausalLM
from .shared_kv_names import KV_SHARED_UNUSED, SkipSharedKV

#: Hugging Face (safetensors) tensor name -> model name; ``{i}`` is the layer index.
HF_NAMES = {
    name: name
    for name in (
        "model.embed_tokens.weight",
        "model.embed_tokens_per_layer.weight",
        "model.per_layer_model_projection.weight",
        "model.per_layer_projection_norm.weight",
        "model.layers.{i}.input_layernorm.weight",
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.q_norm.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.k_norm.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
        "model.layers.{i}.self_attn.o_proj.weight",
        "model.layers.{i}.post_attention_layernorm.weight",
        "model.layers.{i}.pre_feedforward_layernorm.weight",
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight",
        "model.layers.{i}.post_feedforward_layernorm.weight",
        "model.layers.{i}.per_layer_input_gate.weight",
        "model.layers.{i}.per_layer_projection.weight",
        "model.layers.{i}.post_per_layer_input_norm.weight",
        "model.layers.{i}.layer_scalar",
        "model.norm.weight",
        "lm_head.weight",  # absent when the embeddings are tied
    )
}

#: The multimodal layout (``gemma4``): the decoder's tensors under ``model.language_model.``
#: (the head, when there is one, stays ``lm_head.weight``) ...
MULTIMODAL_NAMES = {
    ("model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name): name
    for name in HF_NAMES
}
#: ... and these prefixes hold the towers, which this text family does not load.
MULTIMODAL_SKIPPED = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

#: llama.cpp (GGUF) tensor name -> model name (gguf-py tensor_mapping.py, MODEL_ARCH.GEMMA4).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.inp_gate.weight": "model.layers.{i}.per_layer_input_gate.weight",
    "blk.{i}.proj.weight": "model.layers.{i}.per_layer_projection.weight",
    "blk.{i}.post_norm.weight": "model.layers.{i}.post_per_layer_input_norm.weight",
    "blk.{i}.layer_output_scale.weight": "model.layers.{i}.layer_scalar",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent in Gemma 4 files: tied to token_embd
}

#: GGUF tensors with no slot in the model, skipped by name: ``rope_freqs`` is read by
#: ``Gemma4Config.from_gguf`` (proportional RoPE), the tables are computed from the config.
GGUF_SKIPPED = ("rope_freqs.weight",)

#: The name map of each (format, multimodal) layout a gemma4 checkpoint comes in (the second
#: field is how an error names the checkpoint: its layout, then its format).
NAME_MAPS = {
    ("safetensors", False): NameMap("gemma4", "text (model_type 'gemma4_text') safetensors", HF_NAMES),
    ("safetensors", True): NameMap("gemma4", "multimodal (model_type 'gemma4') safetensors", MULTIMODAL_NAMES,
                                   ignored_prefixes=MULTIMODAL_SKIPPED),
    ("gguf", False): NameMap("gemma4", "gguf", GGUF_NAMES, ignored=frozenset(GGUF_SKIPPED)),
}

#: Tensor-parallel split under ``--tp N`` (docs/tensor-parallel.md): module -> how it is cut.
#: Attention by whole heads (q by query heads; k, v by KV heads (sliding and global layers count theirs apart), each rank keeping the KV
#: heads its query heads read, shared by several ranks when N exceeds them); o_proj by the
#: same heads on its input side, then one all-reduce. The GeGLU MLP: gate and up by columns,
#: down by rows, one all-reduce. Embedding and (tied) head by vocabulary rows. Norms replicated.
TP_PLAN = {
    "model.embed_tokens": Vocab(),
    # per-layer embeddings (PLE): the (vocab_per_layer, L*P) table by rows too, like the token embedding;
    # the small C -> L*P projection and the per-layer gates stay whole on every rank
    "model.embed_tokens_per_layer": Vocab(),
    "model.layers.*.self_attn.q_proj": Colwise("num_attention_heads"),
    "model.layers.*.self_attn.k_proj": Colwise("num_key_value_heads", "global_num_key_value_heads", replicate=True),
    "model.layers.*.self_attn.v_proj": Colwise("num_key_value_heads", "global_num_key_value_heads", replicate=True),
    "model.layers.*.self_attn.o_proj": Rowwise("num_attention_heads"),
    "model.layers.*.mlp.gate_proj": Colwise("intermediate_size"),
    "model.layers.*.mlp.up_proj": Colwise("intermediate_size"),
    "model.layers.*.mlp.down_proj": Rowwise("intermediate_size"),
    "lm_head": Vocab(),
}


#: The output head falls back to the embedding matrix when the checkpoint has no lm_head.weight.
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): every projection matrix, both embeddings (the main one and
#: the per-layer table) and the output head. Norms, layer scalars and rope_freqs stay float.
QUANTIZABLE = (
    r"model\.embed_tokens(_per_layer)?\.weight|lm_head\.weight|model\.per_layer_model_projection\.weight"
    r"|model\.layers\.\d+\.((self_attn|mlp)\.\w+_proj|per_layer_input_gate|per_layer_projection)\.weight"
)


def layout_for(config: Gemma4Config) -> WeightLayout:
    """The :class:`WeightLayout` of a checkpoint with this config: the name maps of its layout
    (text or multimodal, :data:`NAME_MAPS`), each skipping the KV-sharing layers' unused tensors."""
    sharing = frozenset(i for i in range(config.num_hidden_layers) if config.kv_source(i) != i)
    name_maps = {
        fmt: SkipSharedKV(names, KV_SHARED_UNUSED[fmt, multimodal], sharing)
        for (fmt, multimodal), names in NAME_MAPS.items()
        if multimodal == config.multimodal
    }
    return WeightLayout(name_maps, tied=TIED, tp_plan=TP_PLAN, quantizable=QUANTIZABLE)


def load(checkpoint: Checkpoint, options: LoadOptions) -> Gemma4ForCausalLM:
    """Build a gemma4 text decoder from a checkpoint (the ``load`` of the gemma4 Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata),
    its ``weights`` a TensorSource keyed by the file's names, its ``fmt`` "safetensors" or
    "gguf". options: resolved :class:`LoadOptions` (device, dtype, what stays packed, this
    rank's tensor-parallel group). Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata, an unknown format) and WeightsError
    (a tensor missing, unexpected, or of the wrong shape), each naming the key or tensor.
    """
    weights, fmt = checkpoint.weights, checkpoint.fmt

    # 1. Parse config.json (either layout) or the GGUF metadata into the numbers that shape
    #    the model. GGUF: some numbers come from tensors (vocabularies, tying, k_eq_v, and the
    #    proportional RoPE written as the small rope_freqs tensor).
    if fmt == "gguf":
        names = set(weights.names())
        shapes = {name: tuple(weights.shape(name)) for name in names}
        rope_freqs = weights.read("rope_freqs.weight").float().flatten().tolist() if "rope_freqs.weight" in names else None
        config = Gemma4Config.from_gguf(checkpoint.config, shapes, rope_freqs=rope_freqs)
    else:
        config = Gemma4Config.from_hf(checkpoint.config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back. The config says
    #    which layout names the tensors and which layers share their keys/values.
    layout = layout_for(config)
    config.check_weights(tensor_table(weights, layout.name_map(fmt, "gemma4")), fmt)

    # 3. Build on the meta device (this rank's share under --tp: TP_PLAN), compute RoPE's
    #    frequencies and the embedding scales, stream the tensors in through the name map
    #    (the layer_scalar buffers are filled like the weights; packed where QUANTIZABLE allows).
    return build_model(Gemma4ForCausalLM, config, weights, fmt, options, layout, tie=config.tie_word_embeddings)
