"""Tensor parallelism: one model split across N processes, Megatron-style (docs/tensor-parallel.md).

``torchrun --nproc-per-node N -m lollm run --tp N …`` starts N copies of lollm.
Each copy (a *rank*) joins one ``torch.distributed`` process group (NCCL on
GPUs, gloo on CPUs: the transport PyTorch ships, nothing of our own) and
builds the same model with only its share of the weights:

* a **column-split** linear (:class:`Colwise`) keeps a slice of the *output*
  features: the rank computes those outputs from the whole input, no
  communication (attention's q/k/v by whole heads, an MLP's gate and up);
* a **row-split** linear (:class:`Rowwise`) keeps the matching slice of the
  *input* features, so its output is a partial sum: one ``all_reduce`` (sum)
  gives every rank the full output (attention's o_proj, an MLP's down);
* a **vocabulary-split** embedding or output head (:class:`Vocab`) keeps a
  range of rows (token ids): the embedding looks up the ids it holds, zeros the
  others and all-reduces; the head's logits are all-gathered.

A column split followed by a row split needs no communication in between, so
each attention block and each MLP costs one all-reduce (Shoeybi et al. 2019,
"Megatron-LM", section 3).

A family declares its split as data beside its weight map, a ``TP_PLAN`` dict
(in the spirit of transformers' ``base_model_tp_plan``) from a module or
parameter name pattern (``fnmatch``: ``model.layers.*.mlp.up_proj``) to one of
the specs below. The specs name the config fields they divide
(``Colwise("num_attention_heads")``): :meth:`Sharding.local_config` turns the
family's config into this rank's (H/N heads, F/N MLP width …), so the
family's modules are built at their local sizes and read their local head
counts as they always do; :meth:`Sharding.prepare` then shrinks the vocabulary
tables and installs the collectives; :func:`lollm.load.weights.load_weights` reads
each split tensor's slice only (safetensors' ``get_slice``), so a rank's
resident weights are 1/N of the split tensors plus the replicated ones (norms,
routers, small projections).

Why not ``torch.distributed.tensor.parallelize_module``: its ``ColwiseParallel``
and ``RowwiseParallel`` turn each parameter into a DTensor by distributing a
tensor every rank already holds in full (or receives from rank 0), where lollm
streams each rank's slice straight from the file; GQA's replicated KV heads
(N larger than the KV heads) are not an even ``Shard`` placement; and DTensor's
per-op dispatch costs more than a tiny decode step. The same two collectives
(``all_reduce`` after a row split, ``all_gather`` after the vocabulary head)
are called here directly, from forward hooks; docs/tensor-parallel.md shows the
DTensor spelling of the same plan.

Errors (:class:`TensorParallelError`): ``--tp`` without torchrun's environment,
an inconsistent one (a rank outside the world size, a negative value),
ranks that do not all meet within the rendezvous timeout, a timeout variable
that is no number of seconds, a world size that is not ``--tp``, a backend
torch was built without, a split that does not divide a config field (naming
it), packed weights.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lollm.load.meta import on_meta
from lollm.load.process_group import Group, TensorParallelError
# Moved to lollm.load.process_group; still importable from here until lollm-core 0.3 (docs/plugins.md, 10).
from lollm.load.process_group import check_launch, current, init, shutdown  # noqa: F401


# ---------------------------------------------------------------------------
# The specs a family's TP_PLAN is written in
# ---------------------------------------------------------------------------
Units = "str | tuple[str, str | int]"


@dataclass(frozen=True)
class Colwise:
    """Split the output features (``dim``, 0 for ``nn.Linear.weight`` and biases) in whole units.

    ``segments``: the dim is these segments one after another, each a config
    field counting its units (``"num_attention_heads"``: the dim holds that many
    equal blocks) or ``(count_field, width_field_or_int)`` when the segments of a
    fused tensor differ in width (DeltaNet's ``in_proj_qkv`` = q, k, v). Each
    segment is split into N equal runs of whole units and the rank keeps its run
    of every segment. ``replicate``: when N is a multiple of the count (GQA's KV
    heads), ranks share units: rank r keeps unit ``r * count // N``.
    """

    segments: tuple = ()
    dim: int = 0
    replicate: bool = False

    def __init__(self, *segments, dim: int = 0, replicate: bool = False):
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "replicate", replicate)


@dataclass(frozen=True)
class Rowwise:
    """Split the input features (``dim``, -1: ``nn.Linear.weight``'s columns) in whole units.

    The module's output is then a partial sum: with ``reduce`` (the default) an
    all-reduce of the module's output follows; ``reduce=False`` when a
    :class:`Reduce` further up sums several partial results at once (an MoE
    block's experts and shared expert). A bias is kept by rank 0 only (zeros
    elsewhere), so the sum adds it once.
    """

    segments: tuple = ()
    dim: int = -1
    reduce: bool = True

    def __init__(self, *segments, dim: int = -1, reduce: bool = True):
        object.__setattr__(self, "segments", segments)
        object.__setattr__(self, "dim", dim)
        object.__setattr__(self, "reduce", reduce)


@dataclass(frozen=True)
class Vocab:
    """Split an ``nn.Embedding`` or an output ``nn.Linear`` by rows (token ids) into N contiguous ranges.

    An embedding becomes a :class:`VocabParallelEmbedding` (masked lookup +
    all-reduce); a head's logits ``(…, V/N)`` are all-gathered to ``(…, V)``.
    """


@dataclass(frozen=True)
class Reduce:
    """The module's output is a sum of partial results (row-split pieces inside it): all-reduce it."""


SPECS = (Colwise, Rowwise, Vocab, Reduce)


# ---------------------------------------------------------------------------
# Applying a plan
# ---------------------------------------------------------------------------
def _ranges(size: int, world: int) -> list[tuple[int, int]]:
    """``size`` rows in ``world`` contiguous ranges, the first ``size % world`` one row longer."""
    base, extra = divmod(size, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (r < extra)
        out.append((start, stop))
        start = stop
    return out


@dataclass
class Sharding:
    """A family's ``TP_PLAN`` resolved against its config for this rank.

    plan: pattern -> spec (see the module docstring); config: the family's full
    config dataclass; group: this rank's :class:`Group`.
    """

    plan: Mapping[str, Any]
    config: Any
    group: Group
    #: model tensor name -> (dim, [(start, stop), …] of the full tensor along dim), filled by prepare
    slices: dict[str, tuple[int, list[tuple[int, int]]]] = field(default_factory=dict)
    #: model tensor names of row-split biases this rank zeroes (only rank 0 keeps them)
    zero_bias: set[str] = field(default_factory=set)
    #: plan patterns that matched nothing in the model built (optional modules this checkpoint lacks)
    unmatched: list[str] = field(default_factory=list)

    def __post_init__(self):
        for pattern, spec in self.plan.items():
            if not isinstance(spec, SPECS):
                raise TensorParallelError(f"TP_PLAN[{pattern!r}] is {spec!r}: use Colwise, Rowwise, Vocab or Reduce")

    # -- config -----------------------------------------------------------------
    def _count(self, key: str) -> int:
        value = getattr(self.config, key, None)
        if not isinstance(value, int) or isinstance(value, bool):
            raise TensorParallelError(f"TP_PLAN names config field {key!r}, which {type(self.config).__name__} does not have as an integer")
        return value

    def _split_count(self, key: str, replicate: bool) -> int:
        count, n = self._count(key), self.group.world
        if count % n == 0:
            return count // n
        if replicate and n % count == 0:
            return 1
        also = " or a multiple of it (ranks then share its units)" if replicate else ""
        raise TensorParallelError(f"--tp {n} does not divide {key} = {count} of this model: use a --tp that divides it{also}")

    @property
    def _local(self):
        if not hasattr(self, "_local_cache"):
            self._local_cache = self.local_config()
        return self._local_cache

    def local_config(self):
        """The config this rank builds: every field a spec splits, divided by N (1 where replicated).

        Raises TensorParallelError naming the first field N does not divide.
        """
        changes: dict[str, int] = {}
        for spec in self.plan.values():
            if isinstance(spec, (Colwise, Rowwise)):
                for seg in spec.segments:
                    key = seg if isinstance(seg, str) else seg[0]
                    if key not in changes:
                        changes[key] = self._split_count(key, isinstance(spec, Colwise) and spec.replicate)
        return dataclasses.replace(self.config, **changes)

    # -- one tensor ---------------------------------------------------------------
    def _sizes(self, spec, config) -> list[int] | None:
        """The segment sizes of a fused tensor under ``config`` (None: one segment, the whole dim)."""
        if not any(isinstance(seg, tuple) for seg in spec.segments):
            return None
        sizes = []
        for seg in spec.segments:
            if not isinstance(seg, tuple):
                raise TensorParallelError(f"{spec}: give every segment of a fused tensor as (count_field, width)")
            count = getattr(config, seg[0])
            width = seg[1] if isinstance(seg[1], int) else getattr(config, seg[1])
            sizes.append(count * width)
        return sizes

    def _segment_ranges(self, spec, full: int, local: int, name: str) -> list[tuple[int, int]]:
        """This rank's ranges of a dim of ``full`` features, of which it keeps ``local``.

        Per segment (the whole dim, or each part of a fused tensor): the segment is
        C = full / local equal chunks of whole units (the local config divided the
        unit counts), and rank r keeps chunk ``r * C // N``: chunk r when C = N,
        and a chunk shared by N / C ranks when C < N (GQA's KV heads).
        """
        n, r = self.group.world, self.group.rank
        full_sizes = self._sizes(spec, self.config) or [full]
        local_sizes = self._sizes(spec, self._local) or [local]
        if sum(full_sizes) != full or sum(local_sizes) != local:
            raise TensorParallelError(f"{name}: the TP_PLAN segments {spec.segments} do not add up to its {full} features")
        out, offset = [], 0
        for f, l in zip(full_sizes, local_sizes):
            if l == 0 or f % l or n % (f // l):
                raise TensorParallelError(f"{name}: {l} of {f} features per rank is not an even split over --tp {n}")
            chunks = f // l
            chunk = r * chunks // n
            out.append((offset + chunk * l, offset + (chunk + 1) * l))
            offset += f
        return out

    def _resize(self, model: nn.Module, name: str, dim: int, ranges: list[tuple[int, int]]) -> None:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        old = module._parameters[leaf]
        shape = list(old.shape)
        dim = dim % len(shape)
        shape[dim] = sum(b - a for a, b in ranges)
        module._parameters[leaf] = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"), requires_grad=False)
        self.slices[name] = (dim, ranges)

    def _matches(self, name: str) -> list:
        return [spec for pattern, spec in self.plan.items() if fnmatch.fnmatchcase(name, pattern)]

    # -- the model ---------------------------------------------------------------
    def build(self, cls, *args, **kwargs) -> nn.Module:
        """Build this rank's share of ``cls(config, *args, **kwargs)`` on the meta device (no memory).

        The model is built from :meth:`local_config`, so layers whose size follows
        a split config field (heads, MLP width) come out at their local sizes; the
        full model is built on the meta device too, only to learn every tensor's
        full shape. Then each tensor the plan splits is cut to this rank's slice
        (the vocabulary tables and the fused expert tensors are resized here) and
        the collectives are hooked in. :func:`lollm.load.weights.load_weights` fills it.

        Patterns that match nothing in this model are listed in ``unmatched`` (a
        checkpoint may lack an optional module; the family tests check that
        each pattern matches on a checkpoint that has everything). Raises
        TensorParallelError for a config field N does not divide.
        """
        with on_meta():
            full = cls(self.config, *args, **kwargs)
            full_shapes = {n: tuple(p.shape) for n, p in full.named_parameters(remove_duplicate=False)}
            names = set(full_shapes) | {n for n, _ in full.named_modules() if n}
            del full
            model = cls(self._local, *args, **kwargs)
        # a pattern may match nothing in one checkpoint (gemma4's PLE table, a v_proj some layers lack)
        self.unmatched = [p for p in self.plan if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        for name, module in list(model.named_modules()):
            for spec in self._matches(name) if name else []:
                self._apply_module(model, name, module, spec, full_shapes)
        for name in list(dict(model.named_parameters(remove_duplicate=False))):
            for spec in self._matches(name):
                if isinstance(spec, (Colwise, Rowwise)):
                    self._apply_tensor(model, name, spec, full_shapes[name])
        model.tensor_parallel = self
        return model

    def _apply_tensor(self, model: nn.Module, name: str, spec, full_shape: tuple[int, ...]) -> None:
        module_name, _, leaf = name.rpartition(".")
        local_shape = tuple(model.get_submodule(module_name)._parameters[leaf].shape) if module_name else None
        if isinstance(spec, Rowwise) and len(full_shape) == 1:
            # a bias of a row-split layer: whole on rank 0, zero elsewhere (added once by the sum)
            if self.group.rank != 0:
                self.zero_bias.add(name)
            return
        dim = (spec.dim if not (leaf == "bias" and isinstance(spec, Colwise)) else 0) % len(full_shape)
        local = local_shape[dim] if local_shape is not None and len(local_shape) == len(full_shape) else full_shape[dim]
        if not spec.segments:
            # a spec that names no config field (a tensor no field sizes): N equal parts
            if full_shape[dim] % self.group.world:
                raise TensorParallelError(f"{name}: --tp {self.group.world} does not divide its {full_shape[dim]} features")
            local = full_shape[dim] // self.group.world
        ranges = self._segment_ranges(spec, full_shape[dim], local, name)
        self._resize(model, name, dim, ranges)

    def _apply_module(self, model: nn.Module, name: str, module: nn.Module, spec, full_shapes) -> None:
        group = self.group
        if isinstance(spec, Colwise):
            for leaf in ("weight", "bias"):
                if module._parameters.get(leaf) is not None:
                    self._apply_tensor(model, f"{name}.{leaf}", spec, full_shapes[f"{name}.{leaf}"])
        elif isinstance(spec, Rowwise):
            for leaf in ("weight", "bias"):
                if module._parameters.get(leaf) is not None:
                    self._apply_tensor(model, f"{name}.{leaf}", spec, full_shapes[f"{name}.{leaf}"])
            if spec.reduce:
                module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))
        elif isinstance(spec, Reduce):
            module.register_forward_hook(lambda _m, _args, out: group.all_reduce(out))
        elif isinstance(spec, Vocab):
            rows = full_shapes[f"{name}.weight"][0]
            ranges = _ranges(rows, group.world)
            if isinstance(module, nn.Embedding):
                new = VocabParallelEmbedding(rows, module.embedding_dim, ranges, group, module.weight.dtype)
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
                self.slices[f"{name}.weight"] = (0, [ranges[group.rank]])
            elif isinstance(module, nn.Linear):
                if module.bias is not None:
                    self._resize(model, f"{name}.bias", 0, [ranges[group.rank]])
                self._resize(model, f"{name}.weight", 0, [ranges[group.rank]])
                sizes = [b - a for a, b in ranges]
                module.register_forward_hook(lambda _m, _args, out: group.all_gather_last(out, sizes))
            else:
                raise TensorParallelError(f"TP_PLAN: Vocab() on {name!r}, a {type(module).__name__}: only nn.Embedding and nn.Linear split by rows")

    # -- reading ---------------------------------------------------------------------
    def read(self, source, file_name: str, target: str, transform=None) -> torch.Tensor:
        """This rank's part of tensor ``file_name`` (model name ``target``), as the model slot expects it.

        A split tensor is read by slice (``source.read_slice`` when the source
        has it and no ``transform`` needs the whole tensor), so the full tensor is
        never in memory; other tensors are read whole. ``transform`` (a family's
        converter fix-up) runs on the whole tensor before slicing.
        """
        if target in self.slices:
            dim, ranges = self.slices[target]
            if transform is None and hasattr(source, "read_slice"):
                return source.read_slice(file_name, dim, ranges)
            tensor = source.read(file_name)
            if transform is not None:
                tensor = transform(target, tensor)
            return torch.cat([tensor.narrow(dim, a, b - a) for a, b in ranges], dim=dim).clone()
        tensor = source.read(file_name)
        if transform is not None:
            tensor = transform(target, tensor)
        if target in self.zero_bias:
            tensor = torch.zeros_like(tensor)
        return tensor

    def sharded_bytes(self, model: nn.Module) -> tuple[int, int]:
        """(bytes of this rank's split tensors, bytes of its replicated ones): what each rank holds."""
        split = rest = 0
        seen: set[int] = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name in self.slices:
                split += p.numel() * p.element_size()
            else:
                rest += p.numel() * p.element_size()
        return split, rest


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by rows: this rank holds ids ``[start, stop)``.

    ids: (…) int64 -> (…, C). Ids outside the range look up row 0 and are
    zeroed; the all-reduce then adds the one rank's row that holds each id.
    ``weight``: (stop - start, C), filled by the load like any parameter.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, ranges: list[tuple[int, int]], group: Group, dtype):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.start, self.stop = ranges[group.rank]
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.stop - self.start, embedding_dim, dtype=dtype, device="meta"), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return self.group.all_reduce(out)
