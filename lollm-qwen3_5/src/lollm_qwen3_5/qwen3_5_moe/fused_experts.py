"""The routed experts' two forms in a checkpoint, and :class:`FusedExpertsSource`, which shows one as the other.

Qwen3.5-MoE checkpoints store the routed experts of a layer in one of two forms:

* per expert (the published checkpoints, and what transformers' ``save_pretrained`` writes)::

      model.layers.N.mlp.experts.{e}.gate_proj.weight  (I, C)   for e in 0 .. E-1
      model.layers.N.mlp.experts.{e}.up_proj.weight    (I, C)
      model.layers.N.mlp.experts.{e}.down_proj.weight  (C, I)

* fused (transformers' in-memory layout, which the model uses)::

      model.layers.N.mlp.experts.gate_up_proj  (E, 2I, C)   gate rows first, then up rows
      model.layers.N.mlp.experts.down_proj     (E, C, I)

:class:`FusedExpertsSource` presents a per-expert checkpoint as the fused one:
it lists one fused name per layer instead of the 3E per-expert names and
stacks the experts when that name is read, so :func:`lollm.load.weights.load_weights`
still streams one (fused) tensor at a time. Every expert of every layer must be
there. ``weights.load`` wraps the checkpoint's tensors in it before anything
else reads them.
"""

from __future__ import annotations

import re

import torch

from lollm.errors import WeightsError

#: "model.layers.3.mlp.experts.7.up_proj.weight": prefix "model.layers.3.mlp.experts", e 7, proj "up_proj".
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
