"""Loading a qwen3_5 model: the name map of both checkpoint layouts, tied embeddings, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. Qwen3.5
checkpoints come in two layouts:

* text-only (``Qwen3_5ForCausalLM``): ``model.embed_tokens.weight``,
  ``model.layers.N....``, ``model.norm.weight``, ``lm_head.weight``. The model
  mirrors these names, so the map is the identity (:data:`HF_NAMES`).
* multimodal (``Qwen3_5ForConditionalGeneration``, the published one): the
  decoder under ``model.language_model.``, the vision tower under
  ``model.visual.``. The decoder names lose their ``language_model.`` part; the
  vision tower is skipped by name (lollm reads text only).

Both may carry the MTP head as ``mtp.*`` at the top level; when they do, the
model is built with its draft head (``has_draft_head``). Any other name is an
error naming the tensor (hard-fail, never guess).

The family's declarations (name map, tied head, :data:`TP_PLAN`, :data:`QUANTIZABLE`)
are data in :data:`LAYOUT`, read by :func:`lollm.load.build.build_model` (plugin contract 2,
docs/plugins.md); :func:`load` parses the config, checks it and hands over.

GGUF (llama.cpp's ``general.architecture = "qwen35"``, as its converter writes it):
the metadata is read by :func:`.config.config_from_gguf`, and the tensors through
:class:`.gguf_weights.ConvertedGGUF`, which undoes the converter's changes (norms
``+1``, ``-exp(A_log)``, the squeezed conv, the value-head order) and maps the names
(:func:`.gguf_weights.gguf_name_map`, MTP block included). docs/qwen3_5.md, "From GGUF".
"""

from __future__ import annotations

import dataclasses

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.errors import ConfigError
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.load.tensor_parallel import Colwise, Rowwise, Vocab

from .config import Qwen3_5Config, config_from_gguf
from .gguf_weights import ConvertedGGUF, gguf_name_map
from .modeling_qwen3_5 import Qwen3_5ForCausalLM

#: Every tensor name of a text-only qwen3_5 checkpoint (``{i}``: a layer index). Identity map.
HF_NAMES = {
    name: name
    for name in (
        "model.embed_tokens.weight",
        "model.layers.{i}.input_layernorm.weight",
        "model.layers.{i}.post_attention_layernorm.weight",
        # Gated DeltaNet layers
        "model.layers.{i}.linear_attn.in_proj_qkv.weight",
        "model.layers.{i}.linear_attn.in_proj_z.weight",
        "model.layers.{i}.linear_attn.in_proj_b.weight",
        "model.layers.{i}.linear_attn.in_proj_a.weight",
        "model.layers.{i}.linear_attn.conv1d.weight",
        "model.layers.{i}.linear_attn.A_log",
        "model.layers.{i}.linear_attn.dt_bias",
        "model.layers.{i}.linear_attn.norm.weight",
        "model.layers.{i}.linear_attn.out_proj.weight",
        # gated full-attention layers (biases only with attention_bias: true)
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.q_proj.bias",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.k_proj.bias",
        "model.layers.{i}.self_attn.v_proj.weight",
        "model.layers.{i}.self_attn.v_proj.bias",
        "model.layers.{i}.self_attn.o_proj.weight",
        "model.layers.{i}.self_attn.o_proj.bias",
        "model.layers.{i}.self_attn.q_norm.weight",
        "model.layers.{i}.self_attn.k_norm.weight",
        # SwiGLU MLP
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
        "model.layers.{i}.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",  # absent when the embeddings are tied
        # the MTP draft head (see mtp.py)
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
        "mtp.layers.{i}.input_layernorm.weight",
        "mtp.layers.{i}.post_attention_layernorm.weight",
        "mtp.layers.{i}.self_attn.q_proj.weight",
        "mtp.layers.{i}.self_attn.q_proj.bias",
        "mtp.layers.{i}.self_attn.k_proj.weight",
        "mtp.layers.{i}.self_attn.k_proj.bias",
        "mtp.layers.{i}.self_attn.v_proj.weight",
        "mtp.layers.{i}.self_attn.v_proj.bias",
        "mtp.layers.{i}.self_attn.o_proj.weight",
        "mtp.layers.{i}.self_attn.o_proj.bias",
        "mtp.layers.{i}.self_attn.q_norm.weight",
        "mtp.layers.{i}.self_attn.k_norm.weight",
        "mtp.layers.{i}.mlp.gate_proj.weight",
        "mtp.layers.{i}.mlp.up_proj.weight",
        "mtp.layers.{i}.mlp.down_proj.weight",
    )
}

#: Multimodal layout: the decoder's names lose their ``language_model.`` part
#: (``model.language_model.layers.{i}.…`` -> ``model.layers.{i}.…``); ``mtp.*`` and lm_head are alike.
LANGUAGE_MODEL_NAMES = {
    "model.language_model." + name[len("model."):]: name for name in HF_NAMES if name.startswith("model.")
}

#: The multimodal layout's vision tower, skipped whole (lollm reads text only).
VISION_PREFIX = "model.visual."

#: The output head falls back to the embedding matrix when the config ties them
#: and the checkpoint has no lm_head.weight (Qwen3.5-0.8B ... 9B).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): the projection matrices of attention, of the Gated DeltaNet
#: (in_proj_qkv, in_proj_z, out_proj) and of the MLPs, the MTP head's, the embedding and the
#: output head. Small matrices that steer the recurrence (in_proj_a, in_proj_b: decay and
#: write strength per head), conv1d and the norms stay float.
QUANTIZABLE = (
    r"model\.embed_tokens\.weight|lm_head\.weight|mtp\.fc\.weight|(model|mtp)\.layers\.\d+\."
    r"(self_attn\.\w+_proj|mlp\.\w+_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight"
)

_QK = ("linear_num_key_heads", "linear_key_head_dim")  # a DeltaNet q or k part: Hk heads of Dk channels
_V = ("linear_num_value_heads", "linear_value_head_dim")  # the v part: Hv heads of Dv channels

#: Tensor-parallel split under ``--tp N`` (docs/tensor-parallel.md): module or parameter -> how it is cut.
#: Column splits (Colwise) need no communication; each row split (Rowwise) ends with one
#: all-reduce, so every token mixer and every MLP costs one. Norms are replicated.
TP_PLAN = {
    "model.embed_tokens": Vocab(),
    # gated full attention (and the MTP head's layer: "*layers" covers model.layers and mtp.layers):
    # q_proj holds each head's queries and output gate side by side, so whole heads keep both
    "*layers.*.self_attn.q_proj": Colwise("num_attention_heads"),
    "*layers.*.self_attn.k_proj": Colwise("num_key_value_heads", replicate=True),
    "*layers.*.self_attn.v_proj": Colwise("num_key_value_heads", replicate=True),
    "*layers.*.self_attn.o_proj": Rowwise("num_attention_heads"),
    # Gated DeltaNet by heads: Hk/N query/key heads and the Hv/N value heads that read them (value
    # head j reads key head j // (Hv/Hk), so contiguous runs keep each group whole). in_proj_qkv and
    # the depthwise conv run over q | k | v channels: each part is cut apart. The conv window and
    # the recurrent state in the cache then hold this rank's channels and heads only.
    "model.layers.*.linear_attn.in_proj_qkv": Colwise(_QK, _QK, _V),
    "model.layers.*.linear_attn.conv1d": Colwise(_QK, _QK, _V),
    "model.layers.*.linear_attn.in_proj_z": Colwise("linear_num_value_heads"),
    "model.layers.*.linear_attn.in_proj_b": Colwise("linear_num_value_heads"),
    "model.layers.*.linear_attn.in_proj_a": Colwise("linear_num_value_heads"),
    "model.layers.*.linear_attn.A_log": Colwise("linear_num_value_heads"),
    "model.layers.*.linear_attn.dt_bias": Colwise("linear_num_value_heads"),
    "model.layers.*.linear_attn.out_proj": Rowwise("linear_num_value_heads"),
    # SwiGLU MLP: gate and up by columns, down by rows (one all-reduce)
    "*layers.*.mlp.gate_proj": Colwise("intermediate_size"),
    "*layers.*.mlp.up_proj": Colwise("intermediate_size"),
    "*layers.*.mlp.down_proj": Rowwise("intermediate_size"),
    "lm_head": Vocab(),
}


#: Everything above, as the data lollm.load.build.build_model reads. A GGUF's name map depends on
#: the number of layers (the MTP block follows them): :func:`load` adds it per file.
LAYOUT = WeightLayout(
    name_maps={
        "safetensors": NameMap("qwen3_5", "safetensors", {**HF_NAMES, **LANGUAGE_MODEL_NAMES},
                               ignored_prefixes=(VISION_PREFIX,)),
    },
    tied=TIED,
    tp_plan=TP_PLAN,
    quantizable=QUANTIZABLE,
)


def load(checkpoint: Checkpoint, options: LoadOptions) -> Qwen3_5ForCausalLM:
    """Build a qwen3_5 model from a checkpoint (the ``load`` of the qwen3_5 Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata), its
    ``weights`` a TensorSource keyed by the file's names, its ``fmt`` "safetensors" or "gguf".
    options: resolved :class:`LoadOptions` (device, dtype, what stays packed, this rank's
    tensor-parallel group). Returns the model in eval mode, with the MTP head when the
    checkpoint has one (``mtp.*`` tensors; GGUF: ``qwen35.nextn_predict_layers``).

    Raises ConfigError (config.json / GGUF metadata) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape), each naming the key or tensor.
    """
    weights, fmt, layout = checkpoint.weights, checkpoint.fmt, LAYOUT

    # 1. Parse config.json (either layout) or the GGUF metadata into the numbers that shape the
    #    model. GGUF: the tensors as transformers holds them (ConvertedGGUF), named per file.
    if fmt == "gguf":
        config = config_from_gguf(checkpoint.config, {name: weights.shape(name) for name in weights.names()})
        if config.mtp_num_hidden_layers > 1:
            raise ConfigError(f"qwen3_5: GGUF qwen35.nextn_predict_layers is {config.mtp_num_hidden_layers}; "
                              f"an MTP head of one layer is implemented")
        weights = ConvertedGGUF(weights, config)
        layout = dataclasses.replace(LAYOUT, name_maps={"gguf": gguf_name_map(config)},
                                     quantizable=weights.quantizable(QUANTIZABLE))
        with_mtp = config.mtp_num_hidden_layers > 0
    else:
        config = Qwen3_5Config.from_hf(checkpoint.config)
        with_mtp = any(name.startswith("mtp.") for name in weights.names())
        if with_mtp and config.mtp_num_hidden_layers != 1:
            raise ConfigError(f"qwen3_5: config.json 'mtp_num_hidden_layers' is {config.mtp_num_hidden_layers}; "
                              f"an MTP head of one layer is implemented")

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, layout.name_map(fmt, "qwen3_5")), fmt)

    # 3. Build on the meta device (this rank's share under --tp: TP_PLAN), with the MTP head when
    #    the checkpoint has one; compute RoPE's frequencies; stream the tensors in through the name
    #    map (packed where QUANTIZABLE and the options allow); lm_head shares the embedding when tied.
    return build_model(Qwen3_5ForCausalLM, config, weights, fmt, options, layout,
                       tie=config.tie_word_embeddings, with_mtp=with_mtp)
