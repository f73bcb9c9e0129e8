"""Loading a gemma3 model: the name map per format and layout, tied embeddings, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
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
(:data:`MULTIMODAL_LAYOUT`, its table spelt out from :data:`HF_NAMES` by :func:`prefixed`)
and the vision prefixes are skipped by name; anything else unknown still raises.

GGUF files (llama.cpp's converter) name the same tensors the llama.cpp way
(:data:`GGUF_NAMES`: ``blk.0.attn_q.weight``, ``token_embd.weight`` …, as in gguf-py's
``tensor_mapping.py``) and change two things we undo here:

* **norm weights carry Gemma's +1.** HF Gemma's RMSNorm computes ``x · (1 + w)``; the
  converter stores ``w + 1`` for every tensor whose HF name ends in ``norm.weight``
  (``Gemma3Model.norm_shift``: input/post-attention/pre-/post-feedforward norms, the
  final norm, and the ``q_norm``/``k_norm`` of QK-norm) so that llama.cpp can compute
  ``x · w``. We subtract 1 from exactly those tensors (:func:`undo_gguf_norm_shift`).
* **the embedding is trimmed** to the tokenizer's real vocabulary, and there is no
  ``output.weight`` (tied): the vocabulary size is read from ``token_embd.weight``'s rows.

Attention Q/K rows are *not* permuted for Gemma (llama.cpp runs it with NEOX RoPE).
"""

from __future__ import annotations

from typing import Mapping

import torch

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.errors import WeightsError
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.load.tensor_parallel import Colwise, Rowwise, Vocab

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

#: The multimodal layout: decoder prefix in the file -> prefix in the model ...
MULTIMODAL_PREFIXES = {
    "language_model.model.": "model.",
    "model.language_model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "lm_head.": "lm_head.",  # transformers 4.52-4.57 keep the head at the top
}
#: ... and these prefixes hold the vision tower, which this text family does not load.
MULTIMODAL_SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def prefixed(table: Mapping[str, str], prefixes: Mapping[str, str]) -> dict[str, str]:
    """The file -> model table of a checkpoint that nests the same tensors under other prefixes.

    ``{"model.norm.weight": "model.norm.weight"}`` with ``{"language_model.model.": "model."}``
    gives ``{"language_model.model.norm.weight": "model.norm.weight"}``: each model name that
    starts with a prefix's model side, spelt with its file side instead.
    """
    return {
        file_prefix + target[len(model_prefix):]: target
        for file_prefix, model_prefix in prefixes.items()
        for target in table.values()
        if target.startswith(model_prefix)
    }


#: llama.cpp (GGUF) tensor name -> model name (gguf-py tensor_mapping.py, MODEL_ARCH.GEMMA3).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent in Gemma 3 files: tied to token_embd
}

#: What llama.cpp's converter added to every norm weight (``Gemma3Model.norm_shift``).
GGUF_NORM_SHIFT = 1.0


def undo_gguf_norm_shift(model_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The GGUF quirk undone: ``w + 1`` back to ``w`` for every norm weight, other tensors as they are.

    The converter's test is "HF name ends in ``norm.weight``"; our model names are the
    HF names, so the same test picks the same tensors (q_norm and k_norm included).
    """
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

#: Everything above, as the data lollm.load.build.build_model reads: the text layout (``gemma3_text``,
#: and every GGUF) ... (a NameMap's second field is how an error names the checkpoint: layout and format)
LAYOUT = WeightLayout(
    name_maps={
        "safetensors": NameMap("gemma3", "text (model_type 'gemma3_text') safetensors", HF_NAMES),
        "gguf": NameMap("gemma3", "gguf", GGUF_NAMES),
    },
    tied=TIED,
    tp_plan=TP_PLAN,
    quantizable=QUANTIZABLE,
)
#: ... and the multimodal one (``gemma3``): the decoder under its prefixes, the vision tower skipped.
MULTIMODAL_LAYOUT = WeightLayout(
    name_maps={
        "safetensors": NameMap("gemma3", "multimodal (model_type 'gemma3') safetensors",
                               prefixed(HF_NAMES, MULTIMODAL_PREFIXES), ignored_prefixes=MULTIMODAL_SKIPPED),
    },
    tied=TIED,
    tp_plan=TP_PLAN,
    quantizable=QUANTIZABLE,
)


def load(checkpoint: Checkpoint, options: LoadOptions) -> Gemma3ForCausalLM:
    """Build a gemma3 model from a checkpoint (the ``load`` of the gemma3 Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata),
    its ``weights`` a TensorSource keyed by the file's names, its ``fmt`` "safetensors" or
    "gguf". options: resolved :class:`LoadOptions` (device, dtype, what stays packed, this
    rank's tensor-parallel group). Returns the model in eval mode.

    Raises ConfigError (config.json / GGUF metadata, an unknown format) and WeightsError
    (a tensor missing, unexpected, or of the wrong shape), each naming the key or tensor.
    """
    weights, fmt = checkpoint.weights, checkpoint.fmt

    # 1. Parse config.json (either layout, either schema) or the GGUF metadata into the numbers
    #    that shape the model. GGUF: the vocabulary is token_embd's rows, tied when output.weight is absent.
    if fmt == "gguf":
        if "token_embd.weight" not in weights.names():
            raise WeightsError("gemma3: the GGUF file has no 'token_embd.weight'")
        config = Gemma3Config.from_gguf(
            checkpoint.config, vocab_size=weights.shape("token_embd.weight")[0],
            tie_word_embeddings="output.weight" not in weights.names(),
        )
    else:
        config = Gemma3Config.from_hf(checkpoint.config)

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back. The config's
    #    model_type says which layout names the tensors.
    layout = MULTIMODAL_LAYOUT if config.multimodal else LAYOUT
    config.check_weights(tensor_table(weights, layout.name_map(fmt, "gemma3")), fmt)

    # 3. Build on the meta device (this rank's share under --tp: TP_PLAN), compute RoPE's
    #    frequencies and the embedding scale, stream the tensors in through the name map
    #    (GGUF norms shifted back by 1; packed where QUANTIZABLE and the options allow).
    return build_model(Gemma3ForCausalLM, config, weights, fmt, options, layout, tie=config.tie_word_embeddings,
                       transform=undo_gguf_norm_shift if fmt == "gguf" else None)
