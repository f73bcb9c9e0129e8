"""Loading a qwen3_5_moe model: the name map of both checkpoint layouts, the experts' two forms, and ``load``.

The loader (lollm.load.loader) hands us the checkpoint's tensors under the file's
own names; this module says where each one goes in the model. Qwen3.5
checkpoints come in two layouts:

* text-only (``Qwen3_5MoeForCausalLM``): ``model.embed_tokens.weight``,
  ``model.layers.N....``, ``model.norm.weight``, ``lm_head.weight``. The model
  mirrors these names, so the map is the identity (:data:`HF_NAMES`).
* multimodal (``Qwen3_5MoeForConditionalGeneration``, the published one): the
  decoder under ``model.language_model.``, the vision tower under
  ``model.visual.``. The decoder names lose their ``language_model.`` part; the
  vision tower is skipped by name (lollm reads text only).

Both may carry the MTP head as ``mtp.*`` at the top level; when they do, the
model is built with its draft head (``has_draft_head``). Any other name is an
error naming the tensor (hard-fail, never guess).

The routed experts come per expert in the published checkpoints and fused in
the model (``experts.gate_up_proj`` (E, 2I, C), ``experts.down_proj`` (E, C, I)):
:class:`~.fused_experts.FusedExpertsSource` (fused_experts.py) shows the first
as the second, so the name map below lists the fused names only.

The family's declarations (name map, tied head, :data:`TP_PLAN`, :data:`QUANTIZABLE`)
are data in :data:`LAYOUT`, read by :func:`lollm.load.build.build_model` (plugin contract 2,
docs/plugins.md); :func:`load` parses the config, checks it and hands over.

GGUF (llama.cpp's ``general.architecture = "qwen35moe"``, as its converter writes it):
the metadata is read by :func:`.config.config_from_gguf`, and the tensors through
:class:`.gguf_weights.ConvertedGGUF`, which undoes the converter's changes (norms
``+1``, ``-exp(A_log)``, the squeezed conv, the value-head order), stacks each layer's
``ffn_gate_exps`` and ``ffn_up_exps`` into ``experts.gate_up_proj`` and maps the names
(:func:`.gguf_weights.gguf_name_map`, MTP block included). docs/qwen3_5_moe.md, "From GGUF".
A packed load (``--weights auto``) of a GGUF whose experts are quantized keeps each
expert's blocks: :mod:`.packed_experts`.
"""

from __future__ import annotations

import dataclasses

from lollm.load.build import NameMap, WeightLayout, build_model
from lollm.load.checks import tensor_table
from lollm.errors import ConfigError
from lollm.load.loader import Checkpoint
from lollm.load.options import LoadOptions
from lollm.load.tensor_parallel import Colwise, Reduce, Rowwise, Vocab

from .config import Qwen3_5MoeConfig, config_from_gguf
from .fused_experts import FusedExpertsSource
from .gguf_weights import FUSED, ConvertedGGUF, gguf_name_map
from .packed_experts import fill_experts, packable, with_expert_slots
from .modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

#: Every tensor name of a text-only qwen3_5_moe checkpoint, experts fused (``{i}``: a layer index). Identity map.
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
        # sparse MoE: router, fused experts, gated shared expert
        "model.layers.{i}.mlp.gate.weight",
        "model.layers.{i}.mlp.experts.gate_up_proj",
        "model.layers.{i}.mlp.experts.down_proj",
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "model.layers.{i}.mlp.shared_expert.up_proj.weight",
        "model.layers.{i}.mlp.shared_expert.down_proj.weight",
        "model.layers.{i}.mlp.shared_expert_gate.weight",
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
        "mtp.layers.{i}.mlp.gate.weight",
        "mtp.layers.{i}.mlp.experts.gate_up_proj",
        "mtp.layers.{i}.mlp.experts.down_proj",
        "mtp.layers.{i}.mlp.shared_expert.gate_proj.weight",
        "mtp.layers.{i}.mlp.shared_expert.up_proj.weight",
        "mtp.layers.{i}.mlp.shared_expert.down_proj.weight",
        "mtp.layers.{i}.mlp.shared_expert_gate.weight",
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
#: and the checkpoint has no lm_head.weight (no MoE release does).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}

#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): the projection matrices of attention, of the Gated DeltaNet
#: (in_proj_qkv, in_proj_z, out_proj) and of the shared expert, the MTP head's, the embedding
#: and the output head. The routed experts are fused 3-D tensors, not nn.Linear, and stay
#: float, as do the router, the decay/write gates (in_proj_a, in_proj_b), conv1d and the norms.
QUANTIZABLE = (
    r"model\.embed_tokens\.weight|lm_head\.weight|mtp\.fc\.weight|(model|mtp)\.layers\.\d+\."
    r"(self_attn\.\w+_proj|mlp\.shared_expert\.\w+_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight"
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
    # MoE: every expert split like a SwiGLU MLP (each rank holds 1/N of every expert's width, see
    # docs/tensor-parallel.md for why not whole experts per rank); gate_up_proj (E, 2I, C) is gate | up
    # along dim 1, down_proj (E, C, I) splits its last dim. The shared expert the same way. The
    # router and the shared expert's gate stay whole. The routed and shared partial sums are added
    # first, then one all-reduce of the block's output.
    "*layers.*.mlp.experts.gate_up_proj": Colwise(("moe_intermediate_size", 1), ("moe_intermediate_size", 1), dim=1),
    "*layers.*.mlp.experts.down_proj": Rowwise("moe_intermediate_size", reduce=False),
    "*layers.*.mlp.shared_expert.gate_proj": Colwise("shared_expert_intermediate_size"),
    "*layers.*.mlp.shared_expert.up_proj": Colwise("shared_expert_intermediate_size"),
    "*layers.*.mlp.shared_expert.down_proj": Rowwise("shared_expert_intermediate_size", reduce=False),
    "*layers.*.mlp": Reduce(),
    "lm_head": Vocab(),
}


#: Everything above, as the data lollm.load.build.build_model reads. A GGUF's name map depends on
#: the number of layers (the MTP block follows them): :func:`load` adds it per file.
LAYOUT = WeightLayout(
    name_maps={
        "safetensors": NameMap("qwen3_5_moe", "safetensors", {**HF_NAMES, **LANGUAGE_MODEL_NAMES},
                               ignored_prefixes=(VISION_PREFIX,)),
    },
    tied=TIED,
    tp_plan=TP_PLAN,
    quantizable=QUANTIZABLE,
)


def load(checkpoint: Checkpoint, options: LoadOptions) -> Qwen3_5MoeForCausalLM:
    """Build a qwen3_5_moe model from a checkpoint (the ``load`` of the qwen3_5_moe Family, plugin contract 2).

    checkpoint: its ``config`` is config.json as a dict (for "gguf": the file's metadata), its
    ``weights`` a TensorSource keyed by the file's names (experts per expert or fused), its
    ``fmt`` "safetensors" or "gguf". options: resolved :class:`LoadOptions` (device, dtype,
    what stays packed, this rank's tensor-parallel group). Returns the model in eval mode,
    with the MTP head when the checkpoint has one (``mtp.*`` tensors; GGUF:
    ``qwen35moe.nextn_predict_layers``).

    Raises ConfigError (config.json / GGUF metadata) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape, an expert missing), each naming the key or tensor.
    """
    fmt, layout = checkpoint.fmt, LAYOUT

    # 1. Parse config.json (either layout) or the GGUF metadata into the numbers that shape the
    #    model; present the experts as the fused tensors the model holds. GGUF: the tensors as
    #    transformers holds them (ConvertedGGUF), named per file.
    if fmt == "gguf":
        source = checkpoint.weights
        config = config_from_gguf(checkpoint.config, {name: source.shape(name) for name in source.names()})
        if config.mtp_num_hidden_layers > 1:
            raise ConfigError(f"qwen3_5_moe: GGUF qwen35moe.nextn_predict_layers is {config.mtp_num_hidden_layers}; "
                              f"an MTP head of one layer is implemented")
        weights = ConvertedGGUF(source, config)
        layout = dataclasses.replace(LAYOUT, name_maps={"gguf": gguf_name_map(config)},
                                     quantizable=weights.quantizable(QUANTIZABLE))
        with_mtp = config.mtp_num_hidden_layers > 0
    else:
        config = Qwen3_5MoeConfig.from_hf(checkpoint.config)
        weights = FusedExpertsSource(checkpoint.weights, config.num_experts)
        with_mtp = any(name.startswith("mtp.") for name in weights.names())
        if with_mtp and config.mtp_num_hidden_layers != 1:
            raise ConfigError(f"qwen3_5_moe: config.json 'mtp_num_hidden_layers' is {config.mtp_num_hidden_layers}; "
                              f"an MTP head of one layer is implemented")

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, layout.name_map(fmt, "qwen3_5_moe")), fmt)

    # 3. Build on the meta device (this rank's share under --tp: TP_PLAN), with the MTP head when
    #    the checkpoint has one; compute RoPE's frequencies; stream the tensors in through the name
    #    map (packed where QUANTIZABLE and the options allow); lm_head shares the embedding when tied.
    #    A packed GGUF load with quantized experts: each expert's blocks go into PackedExperts
    #    slots after the stream, which skips the expert tensors.
    blocks = config.num_hidden_layers + (config.mtp_num_hidden_layers if with_mtp else 0)
    if fmt == "gguf" and options.quantization is not None and options.quantization.mode == "gguf" and packable(weights, blocks):
        layout = dataclasses.replace(layout, name_maps={"gguf": _skipping_experts(layout.name_map(fmt))})
        model = build_model(with_expert_slots(Qwen3_5MoeForCausalLM), config, weights, fmt, options, layout,
                            tie=config.tie_word_embeddings, with_mtp=with_mtp)
        fill_experts(model, weights, config)
        return model
    return build_model(Qwen3_5MoeForCausalLM, config, weights, fmt, options, layout,
                       tie=config.tie_word_embeddings, with_mtp=with_mtp)


def _skipping_experts(name_map):
    """``name_map`` with the routed experts' tensors skipped (None): PackedExperts reads them itself."""
    fused, down = FUSED.removeprefix("blk.{i}."), "ffn_down_exps.weight"

    def skip(gguf_name: str):
        return None if gguf_name.endswith((fused, down)) else name_map(gguf_name)

    return skip
