"""From a family's declarations to a loaded model: the mechanism every family's ``load`` shares.

A family's ``load`` (plugin contract 2, docs/plugins.md) does the part that is
the family's own: parse the config, check it against the tensor table. Then
it hands :func:`build_model` the model class and a :class:`WeightLayout`, the
family's declarations as data:

* :class:`NameMap` per checkpoint format: file tensor name -> model name,
  written as templates with ``{i}`` for the layer index, and the templates
  knowingly skipped. A name on neither list is an error (hard-fail, never guess).
* the tied tensors (``lm_head.weight`` shares ``model.embed_tokens.weight``
  when the checkpoint has no head of its own);
* the tensor-parallel plan (docs/tensor-parallel.md);
* which model tensors may stay packed (a regular expression over model names,
  docs/quantized-execution.md).

:func:`build_model` then does, in order:

1. build the module tree on the meta device (shapes, no memory), or this
   rank's share of it under ``--tp`` (:class:`lollm.load.tensor_parallel.Sharding`),
   with ``nn.init``'s random fills skipped (:func:`on_meta`);
2. compute the buffers no checkpoint holds: every submodule that defines
   ``materialize(device, dtype)`` (RoPE's inverse frequencies, scales) is called;
3. stream the weights in through the name map (:func:`lollm.load.weights.load_weights`),
   keeping packed what the options and the quantizable pattern allow;
4. return the model in eval mode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import nn

from lollm.errors import ConfigError, LollmError, WeightsError
from lollm.load.meta import on_meta
from lollm.load.options import LoadOptions
from lollm.load.process_group import TensorParallelError
from lollm.load.tensor_parallel import Sharding
from lollm.load.weights import load_weights


#: ".12." in "model.layers.12.mlp.up_proj.weight": the first layer index of a tensor name.
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_template(name: str) -> tuple[str, str | None]:
    """``"model.layers.12.mlp.up_proj.weight"`` -> (``"model.layers.{i}.mlp.up_proj.weight"``, ``"12"``).

    A name with no layer index comes back unchanged, with ``None``.
    """
    match = _LAYER_INDEX.search(name)
    if match is None:
        return name, None
    return f"{name[:match.start()]}.{{i}}.{name[match.end():]}", match.group(1)


@dataclass(frozen=True)
class NameMap:
    """Where each tensor of one checkpoint format goes in the model: a table, as data.

    family:  the family's name, for error messages.
    fmt:     the checkpoint format, ``"safetensors"`` or ``"gguf"``.
    table:   file name template -> model name template; ``{i}`` is the layer index,
             e.g. ``"blk.{i}.attn_q.weight" -> "model.layers.{i}.self_attn.q_proj.weight"``.
    ignored: file name templates the model knowingly does not load (an old export's
             ``rotary_emb.inv_freq``); their tensors are skipped.
    ignored_prefixes: whole subtrees knowingly skipped (a vision tower: ``"model.visual."``).

    Called with a file name it returns the model name, or None for a skipped tensor;
    it raises WeightsError naming a tensor it does not know.
    """

    family: str
    fmt: str
    table: Mapping[str, str]
    ignored: frozenset[str] = frozenset()
    ignored_prefixes: tuple[str, ...] = ()

    def __call__(self, file_name: str) -> str | None:
        template, index = layer_template(file_name)
        if template in self.ignored or file_name.startswith(self.ignored_prefixes):
            return None
        if template not in self.table:
            raise WeightsError(f"{self.family}: unexpected tensor {file_name!r} in the {self.fmt} checkpoint: "
                               f"no {self.family} weight has that name")
        target = self.table[template]
        return target if index is None else target.format(i=index)


@dataclass(frozen=True)
class WeightLayout:
    """What a family declares about its weights, for :func:`build_model`.

    name_maps:   format -> :class:`NameMap` (or any callable file name -> model name or None,
                 raising WeightsError for an unknown name), one per format the family loads.
    tied:        ``{target: source}`` model names shared when the checkpoint has no ``target``
                 tensor and the config ties them (``{"lm_head.weight": "model.embed_tokens.weight"}``).
    tp_plan:     module pattern -> :mod:`lollm.load.tensor_parallel` spec; empty: no ``--tp``.
    quantizable: regular expression over model names (full match) of the tensors that may stay
                 packed: weights of ``nn.Linear`` and ``nn.Embedding`` modules only.
    grouped:     model names whose 5- to 8-bit GGUF matrices keep a scale per group of 32
                 (see :func:`lollm.load.weights.load_weights`).
    """

    name_maps: Mapping[str, Callable[[str], str | None]]
    tied: Mapping[str, str] = field(default_factory=dict)
    tp_plan: Mapping[str, Any] = field(default_factory=dict)
    quantizable: str = ""
    grouped: tuple[str, ...] = ("lm_head.weight",)

    def name_map(self, fmt: str, family: str = "this family") -> Callable[[str], str | None]:
        """The name map for checkpoints of format ``fmt``; ConfigError when the family has none."""
        if fmt not in self.name_maps:
            raise ConfigError(f"{family}: unknown checkpoint format {fmt!r} (known: {', '.join(self.name_maps)})")
        return self.name_maps[fmt]

    def may_pack(self, model_name: str) -> bool:
        """Whether ``model_name`` matches :attr:`quantizable` (nothing does when it is empty)."""
        return bool(self.quantizable) and re.fullmatch(self.quantizable, model_name) is not None


def build_model(model_class: Callable[..., nn.Module], config: Any, weights: Any, fmt: str, options: LoadOptions,
                layout: WeightLayout, *, tie: bool = False, transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                **model_kwargs: Any) -> nn.Module:
    """Build ``model_class(config, **model_kwargs)`` and fill it from ``weights``: steps 1-4 of the module docstring.

    config:    the family's parsed config (already checked against the tensor table).
    weights:   a :class:`lollm.load.loader.TensorSource` keyed by the file's names (the family may wrap it).
    fmt:       ``"safetensors"`` or ``"gguf"``: picks the name map.
    options:   resolved :class:`LoadOptions` (device, dtype, quantization, tensor_parallel).
    tie:       share :attr:`WeightLayout.tied` tensors (the config's ``tie_word_embeddings``).
    transform: ``(model_name, tensor) -> tensor``, a converter quirk the family undoes at load.

    Returns the model in eval mode with ``weights_summary`` set. Raises LollmError for
    unresolved options, TensorParallelError for ``--tp`` with packed weights or an uneven
    split, and WeightsError naming the tensor (see :func:`lollm.load.weights.load_weights`).
    """
    if not options.resolved:
        raise LollmError("build_model needs resolved LoadOptions (lollm.load.pipeline.prepare)")
    device, dtype = options.torch_device, options.torch_dtype

    # 1. The module tree on the meta device: shapes and dtypes, no memory (this rank's share under --tp).
    sharding = _sharding(options, layout, config)
    if sharding is None:
        with on_meta():
            model = model_class(config, **model_kwargs)
    else:
        model = sharding.build(model_class, **model_kwargs)

    # 2. Buffers no checkpoint holds (RoPE's inverse frequencies, scales), computed on the real device.
    for module in model.modules():
        if hasattr(module, "materialize"):
            module.materialize(device, dtype)

    # 3. The weights, one tensor at a time, through the name map; packed where the options and layout allow.
    load_weights(model, weights, layout.name_map(fmt), device=device, dtype=dtype, progress=options.progress,
                 tied=layout.tied if tie else None, transform=transform, quantizable=layout.may_pack,
                 quantization=options.quantization, sharding=sharding, grouped=layout.grouped)

    # 4. Inference only: eval mode (no dropout anywhere; set for good measure).
    return model.eval()


def _sharding(options: LoadOptions, layout: WeightLayout, config: Any) -> Sharding | None:
    """The :class:`Sharding` of this load under ``--tp``, or None on one process."""
    group = options.tensor_parallel
    if group is None:
        return None
    if not layout.tp_plan:
        return None  # open_model names the family that declares no plan
    if options.quantization is not None and options.quantization.packs:
        raise TensorParallelError("--tp runs float weights; use --weights float (packed/quantized weights are not split)")
    return Sharding(layout.tp_plan, config, group)
