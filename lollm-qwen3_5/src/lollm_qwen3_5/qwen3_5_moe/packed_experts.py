"""Routed experts that keep a GGUF's blocks: one packed linear layer per expert and matrix.

A GGUF stores a layer's routed experts as three 3-D tensors (``ffn_gate_exps``,
``ffn_up_exps`` (E, I, C) and ``ffn_down_exps`` (E, C, I), PyTorch order), each
expert's matrix a contiguous run of quantized blocks. The float model stacks
them into ``experts.gate_up_proj`` and ``experts.down_proj`` (blocks.py,
:class:`~.blocks.Qwen3_5MoeExperts`): dequantized, the 35B-A3B's experts alone
take about 4x the bytes of a Q8_0 file and 8x a Q4_K one.

With a packed load (``--weights auto`` on a GGUF, docs/quantized-execution.md)
:class:`PackedExperts` takes their place instead: expert e's three matrices are
read as their own blocks (``read_raw(name, e, e + 1)``: one expert's rows) and
each becomes the packed linear layer :func:`lollm.load.quantized.linear_from_gguf`
makes for that type (Q8_0 in the file's bits, Q4_K as int4 groups ...). Nothing is
ever dequantized whole, and a token runs only the k experts its router picked,
exactly as the float module does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lollm.errors import WeightsError
from lollm.load.quantized import INT4_TYPES, INT8_TYPES, describe, linear_from_gguf, model_bytes

from .blocks import Qwen3_5MoeExperts

#: The file tensors of one block's routed experts, in the order of PackedExperts' lists.
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


class PackedExperts(nn.Module):
    """E SwiGLU experts, each matrix a packed linear layer (``gate[e]``, ``up[e]``: C -> I; ``down[e]``: I -> C).

    Built empty (a slot with no parameters, so the streaming load skips it), then filled
    by :meth:`fill`. forward as :class:`~.blocks.Qwen3_5MoeExperts`:
    x: (N, C); indices, weights: (N, k) -> (N, C); only the picked experts run.
    """

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()

    def fill(self, source, block: int, num_experts: int) -> list[tuple[str, str]]:
        """Make every expert's three packed layers from block ``block`` of the GGUF ``source``.

        Returns ``(stored type, how it is kept)`` per layer made, for the load summary.
        WeightsError naming the tensor when its type has no packed form.
        """
        made = []
        for leaf, layers in zip(EXPERT_TENSORS, (self.gate, self.up, self.down)):
            name = f"blk.{block}.{leaf}.weight"
            stored, (_, rows, cols) = source.dtype(name), source.shape(name)
            for e in range(num_experts):
                layer = linear_from_gguf(source.read_raw(name, e, e + 1), stored, (rows, cols), None)
                if layer is None:
                    raise WeightsError(f"qwen3_5_moe: {name!r} is stored as {stored}, which has no packed form")
                layers.append(layer)
                made.append((stored, describe(layer)))
        return made

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in indices.unique().tolist():  # every expert some token picked
            token, slot = torch.where(indices == e)  # which tokens, and where e is in their top-k
            xe = x[token]  # (n, C)
            y = self.down[e](F.silu(self.gate[e](xe)) * self.up[e](xe))  # (n, C)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out


def packable(source, blocks: int) -> bool:
    """Whether every routed-expert tensor of blocks 0 .. blocks-1 is of a type with a packed form."""
    return all(source.dtype(f"blk.{i}.{leaf}.weight") in INT4_TYPES + INT8_TYPES
               for i in range(blocks) for leaf in EXPERT_TENSORS)


def with_expert_slots(model_class):
    """``model_class`` whose every :class:`~.blocks.Qwen3_5MoeExperts` is replaced by an empty PackedExperts."""

    def build(config, **kwargs):
        model = model_class(config, **kwargs)
        for name, module in list(model.named_modules()):
            if isinstance(module, Qwen3_5MoeExperts):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, PackedExperts())
        return model

    return build


def fill_experts(model: nn.Module, source, config) -> None:
    """Fill every PackedExperts slot of ``model`` from ``source`` (the MTP layer's: block num_hidden_layers)."""
    summary = model.weights_summary
    for name, module in model.named_modules():
        if isinstance(module, PackedExperts):
            layer = int(name.split(".")[2])  # "model.layers.3.mlp.experts" or "mtp.layers.0.mlp.experts"
            block = layer if name.startswith("model.") else config.num_hidden_layers + layer
            for stored, how in module.fill(source, block, config.num_experts):
                summary.add(stored, how)
    summary.model_bytes = model_bytes(model)
