"""Loading a qwen3_5_moe model: the name map of both checkpoint layouts, the experts' two forms, and ``load``.

The loader (lollm.loader) hands us the checkpoint's tensors under the file's
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

The routed experts come in two forms:

* per expert (the published checkpoints, and what transformers' ``save_pretrained`` writes)::

      model.layers.N.mlp.experts.{e}.gate_proj.weight  (I, C)   for e in 0 .. E-1
      model.layers.N.mlp.experts.{e}.up_proj.weight    (I, C)
      model.layers.N.mlp.experts.{e}.down_proj.weight  (C, I)

* fused (transformers' in-memory layout, which the model uses)::

      model.layers.N.mlp.experts.gate_up_proj  (E, 2I, C)   gate rows first, then up rows
      model.layers.N.mlp.experts.down_proj     (E, C, I)

:class:`FusedExpertsSource` presents a per-expert checkpoint as the fused one:
it lists one fused name per layer instead of the 3E per-expert names and
stacks the experts when that name is read, so ``load_weights`` still streams
one (fused) tensor at a time. Every expert of every layer must be there.

GGUF (llama.cpp's ``general.architecture = "qwen35moe"``) is not supported yet:
``load`` refuses it with a ConfigError naming the architecture.
"""

from __future__ import annotations

import re

import torch

from lollm.checks import tensor_table
from lollm.errors import ConfigError, WeightsError
from lollm.tensor_parallel import Colwise, Reduce, Rowwise, Vocab, sharding
from lollm.weights import load_weights

from .config import Qwen3_5MoeConfig
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

#: Multimodal layout: the decoder's prefix, and the vision tower's (skipped).
LANGUAGE_MODEL_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."

#: The output head falls back to the embedding matrix when the config ties them
#: and the checkpoint has no lm_head.weight (no MoE release does).
TIED = {"lm_head.weight": "model.embed_tokens.weight"}


#: Which model tensors may stay quantized (packed integers) when the load asks for it
#: (docs/quantized-execution.md): the projection matrices of attention, of the Gated DeltaNet
#: (in_proj_qkv, in_proj_z, out_proj) and of the shared expert, the MTP head's, the embedding
#: and the output head. The routed experts are fused 3-D tensors, not nn.Linear, and stay
#: float, as do the router, the decay/write gates (in_proj_a, in_proj_b), conv1d and the norms.
QUANTIZABLE = re.compile(
    r"model\.embed_tokens\.weight|lm_head\.weight|mtp\.fc\.weight|(model|mtp)\.layers\.\d+\.(self_attn\.\w+_proj|mlp\.shared_expert\.\w+_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj))\.weight"
)


def quantizable(model_name: str) -> bool:
    """Whether ``model_name`` may stay packed (see :data:`QUANTIZABLE`)."""
    return QUANTIZABLE.fullmatch(model_name) is not None


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class FusedExpertsSource:
    """A TensorSource view that shows per-expert tensors as the fused ``experts.gate_up_proj`` / ``experts.down_proj``.

    ``names()`` lists every other tensor unchanged and, in place of the 3E
    per-expert tensors of a layer, its two fused names; ``read`` of a fused
    name reads the E experts and stacks them::

        gate_up_proj[e] = concat(gate_proj_e, up_proj_e)   (2I, C)
        down_proj[e]    = down_proj_e                      (C, I)

    A checkpoint already fused passes through unchanged. A layer with both
    forms, a missing expert or an expert index >= num_experts raises
    WeightsError naming the tensor.
    """

    def __init__(self, source, num_experts: int):
        self._source = source
        self._num_experts = num_experts
        self._groups: dict[str, str] = {}  # fused name -> its "...mlp.experts" prefix
        names = source.names()
        present = set(names)
        seen: dict[str, set[tuple[int, str]]] = {}
        self._names: list[str] = []
        for name in names:
            match = _PER_EXPERT.match(name)
            if match is None:
                self._names.append(name)
                continue
            prefix, e = match["prefix"], int(match["e"])
            if e >= num_experts:
                raise WeightsError(f"qwen3_5_moe: tensor {name!r} names expert {e}, but config.json has {num_experts} experts")
            if prefix not in seen:
                seen[prefix] = set()
                for fused in (f"{prefix}.gate_up_proj", f"{prefix}.down_proj"):
                    if fused in present:
                        raise WeightsError(f"qwen3_5_moe: the checkpoint has both {fused!r} and per-expert tensors such as {name!r}")
                    self._groups[fused] = prefix
                    self._names.append(fused)
            seen[prefix].add((e, match["proj"]))
        for prefix, have in seen.items():
            for e in range(num_experts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    if (e, proj) not in have:
                        raise WeightsError(f"qwen3_5_moe: the checkpoint has no tensor {prefix}.{e}.{proj}.weight")

    def names(self) -> list[str]:
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._groups or name in self._source

    def __len__(self) -> int:
        return len(self._names)

    @property
    def fmt(self) -> str:
        return self._source.fmt

    @property
    def quantization(self):
        """What the load asked for (lollm.weights reads it; the fused experts themselves stay float)."""
        return getattr(self._source, "quantization", None)

    @property
    def tensor_parallel(self):
        """This rank's group under --tp (lollm.tensor_parallel reads it), else None."""
        return getattr(self._source, "tensor_parallel", None)

    def read_slice(self, name: str, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """A slice of one tensor (--tp); a fused expert tensor is stacked, then cut (peak: that one tensor)."""
        if self._groups.get(name) is None and hasattr(self._source, "read_slice"):
            return self._source.read_slice(name, dim, ranges)
        whole = self.read(name)
        return torch.cat([whole.narrow(dim, a, b - a) for a, b in ranges], dim=dim).clone()

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape from the file headers; fused: (E, 2I, C) or (E, C, I), every expert alike."""
        prefix = self._groups.get(name)
        if prefix is None:
            return tuple(self._source.shape(name))
        projections = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        shapes = {tuple(self._source.shape(f"{prefix}.{e}.{p}.weight")) for e in range(self._num_experts) for p in projections}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise WeightsError(f"qwen3_5_moe: the experts' tensors under {prefix!r} have unequal or non-2-D shapes {sorted(shapes)}")
        rows, cols = next(iter(shapes))
        return (self._num_experts, rows * len(projections), cols)

    def dtype(self, name: str) -> str:
        """A tensor's stored type from the file headers; fused: the one type every expert's tensors share."""
        prefix = self._groups.get(name)
        if prefix is None:
            return self._source.dtype(name)
        projections = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        types = {self._source.dtype(f"{prefix}.{e}.{p}.weight") for e in range(self._num_experts) for p in projections}
        if len(types) != 1:
            raise WeightsError(f"qwen3_5_moe: the experts' tensors under {prefix!r} are stored as unequal types {sorted(types)}")
        return next(iter(types))

    def read(self, name: str) -> torch.Tensor:
        prefix = self._groups.get(name)
        if prefix is None:
            return self._source.read(name)
        experts = []
        for e in range(self._num_experts):
            if name.endswith("gate_up_proj"):
                gate = self._source.read(f"{prefix}.{e}.gate_proj.weight")
                up = self._source.read(f"{prefix}.{e}.up_proj.weight")
                experts.append(torch.cat((gate, up), dim=0))  # (2I, C)
            else:
                experts.append(self._source.read(f"{prefix}.{e}.down_proj.weight"))  # (C, I)
        return torch.stack(experts)  # (E, 2I, C) or (E, C, I)


def name_map(file_name: str) -> str | None:
    """File name -> model name (``None``: skip, the vision tower). WeightsError for a name it does not know."""
    if file_name.startswith(VISION_PREFIX):
        return None
    name = file_name
    if name.startswith(LANGUAGE_MODEL_PREFIX):  # multimodal layout -> text-only names
        name = "model." + name[len(LANGUAGE_MODEL_PREFIX) :]
    # "model.layers.12.mlp.up_proj.weight" -> template "model.layers.{i}.mlp.up_proj.weight"
    match = _LAYER_INDEX.search(name)
    template = name if match is None else f"{name[:match.start()]}.{{i}}.{name[match.end():]}"
    if template not in HF_NAMES:
        raise WeightsError(f"qwen3_5_moe: unexpected tensor {file_name!r} in the checkpoint: no qwen3_5_moe weight has that name")
    return name


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


def load(raw_config: dict, weights, fmt: str, device, dtype: torch.dtype, progress: bool = False) -> Qwen3_5MoeForCausalLM:
    """Build a qwen3_5_moe model from a checkpoint (the ``load`` of the qwen3_5_moe Family).

    raw_config: config.json as a dict (or GGUF metadata); weights: a TensorSource keyed
    by the file's names; fmt: "safetensors" ("gguf" is refused); device, dtype: where the
    weights live. Returns the model in eval mode, with the MTP head when the
    checkpoint has ``mtp.*`` tensors.

    Raises ConfigError (config.json, GGUF) and WeightsError (a tensor missing,
    unexpected, or of the wrong shape), each naming the key or tensor.
    """
    if fmt == "gguf":
        arch = raw_config.get("general.architecture", "qwen35moe")
        raise ConfigError(
            f"qwen3_5_moe: GGUF architecture {arch!r} is not supported yet (the GGUF name map and the DeltaNet "
            f"tensor conversions are not written); use a safetensors checkpoint"
        )
    if fmt != "safetensors":
        raise ConfigError(f"qwen3_5_moe: unknown checkpoint format {fmt!r} (known: safetensors)")

    # 1. Parse config.json (either layout) into the numbers that shape the model;
    #    present per-expert tensors as the fused ones the model holds.
    config = Qwen3_5MoeConfig.from_hf(raw_config)
    weights = FusedExpertsSource(weights, config.num_experts)
    with_mtp = any(name.startswith("mtp.") for name in weights.names())
    if with_mtp and config.mtp_num_hidden_layers != 1:
        raise ConfigError(
            f"qwen3_5_moe: config.json 'mtp_num_hidden_layers' is {config.mtp_num_hidden_layers}; an MTP head of one layer is implemented"
        )

    # 2. Check those numbers against the tensor table (names and shapes from the file headers,
    #    no data read): nothing is built that the weight files do not back.
    config.check_weights(tensor_table(weights, name_map))

    # 3. Build the module tree on the meta device: shapes and dtypes, no memory.
    #    Under --tp N this rank builds its share: its heads, MLP/expert columns, vocabulary rows (TP_PLAN).
    tp = sharding(weights, TP_PLAN, config)
    if tp is None:
        with torch.device("meta"):
            model = Qwen3_5MoeForCausalLM(config, with_mtp=with_mtp)
    else:
        model = tp.build(Qwen3_5MoeForCausalLM, with_mtp=with_mtp)

    # 4. RoPE's inverse frequencies are not in the checkpoint: compute them on the real device.
    model.model.rotary_emb.materialize(device)

    # 5. Stream the tensors in, one at a time, through the name map (checks every shape).
    tied = TIED if config.tie_word_embeddings else None
    load_weights(model, weights, name_map, device=device, dtype=dtype, progress=progress, tied=tied,
                 quantizable=quantizable)
    return model.eval()

