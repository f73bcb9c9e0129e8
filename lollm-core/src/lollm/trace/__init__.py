"""``lollm trace``: look inside one forward pass. This module is what a family calls.

A trace is one forward pass of a prompt, recorded and drawn as a single HTML
page (``lollm trace MODEL -p PROMPT``; docs/trace.md). Most of it needs
nothing from a family beyond the model contract (:mod:`lollm.model`): the
hidden states, the attention probabilities (recorded by
:func:`lollm.trace.attention.recording`) and the logit lens (``model.logit_lens``).

What is a family's *own* (the gates of a Gated DeltaNet layer, a router's
choice of experts, a final soft-cap) it hands over with one of three calls,
made from inside its forward next to the tensor they show::

    from lollm.trace import record_series, tracing

    beta = torch.sigmoid(b)                                      # (T, Hv)
    if tracing():                                                # False outside `lollm trace`: nothing runs
        record_series(self, "beta (write strength)", beta, note="...", channel="head")

* :func:`record_series`  a value per position for each of N channels: ``(T, N)``, drawn as lines over the tokens;
* :func:`record_choice`  k options picked per position out of E, with their weights: ``(T, k)`` twice
  (a MoE router), drawn per token and as a layer x option count;
* :func:`record_softcap` logits before and after a soft-cap ``cap * tanh(x / cap)``, drawn on the tanh curve.

``module`` is the ``nn.Module`` that records (``self``): the trace names the
record by the module's place in the model (``model.layers.3.linear_attn``), so
a block needs no layer index of its own. Outside :func:`recording_internals`
every call returns at once and :func:`tracing` is False, so the normal path
computes nothing more.

This module imports torch only to detach and copy the tensors handed to it;
the page builder lives in :mod:`lollm.cli.trace.page`, the capture in :mod:`lollm.cli.trace.capture`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

#: How many tokens of each position a soft-cap record keeps (the largest logits before the cap).
SOFTCAP_TOP = 12

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@dataclass
class Internal:
    """One record of a family's own internals.

    where:    the recording module's qualified name in the model (``model.layers.3.mlp``;
              ``""`` for the model itself).
    layer:    the decoder layer, read from ``layers.N`` in ``where``; None outside the layers.
    name:     what is shown, as the family words it (``"beta (write strength)"``).
    kind:     ``"series"``, ``"choice"`` or ``"softcap"`` (how the page draws it).
    note:     one or two sentences for the learner: what the value is and how to read it.
    data:     CPU tensors: series ``values (T, N)`` float32; choice ``indices (T, k)`` int64 and
              ``weights (T, k)`` float32; softcap ``ids, before, after (T, SOFTCAP_TOP)``.
    labels:   series: a name per channel; choice: ``(option word, number of options)``; softcap: ``(cap,)``.
    """

    where: str
    layer: int | None
    name: str
    kind: str
    note: str
    data: dict[str, torch.Tensor]
    labels: tuple[Any, ...] = ()


@dataclass
class InternalsRecording:
    """What one :func:`recording_internals` block collected, in call order."""

    names: dict[int, str]  # id(module) -> qualified name
    records: list[Internal] = field(default_factory=list)

    def add(self, module: Any, name: str, kind: str, note: str, data: dict[str, torch.Tensor], labels: tuple) -> None:
        where = self.names.get(id(module), type(module).__name__)
        match = _LAYER.search(where)
        self.records.append(Internal(where, int(match.group(1)) if match else None, name, kind, note, data, labels))


_recorder: ContextVar[InternalsRecording | None] = ContextVar("lollm_trace_recorder", default=None)


@contextmanager
def recording_internals(model: Any) -> Iterator[InternalsRecording]:
    """``with recording_internals(model) as rec:``: the record_* calls inside append to ``rec.records``.

    ``model`` is the ``nn.Module`` being traced; its ``named_modules()`` give the
    records their names. Outside the block nothing is recorded.
    """
    names = {id(m): name for name, m in model.named_modules()} if hasattr(model, "named_modules") else {}
    rec = InternalsRecording(names)
    token = _recorder.set(rec)
    try:
        yield rec
    finally:
        _recorder.reset(token)


def tracing() -> bool:
    """True inside a trace: guard any work done only to be recorded (``if tracing(): ...``)."""
    return _recorder.get() is not None


def _as_rows(x: torch.Tensor, what: str) -> torch.Tensor:
    """Drop a leading batch dimension of 1: (1, T, N) or (T, N) -> (T, N)."""
    x = x.detach()
    if x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    if x.dim() == 1:
        x = x[:, None]
    if x.dim() != 2:
        raise ValueError(f"lollm.trace: {what} must be (T, N) or (1, T, N), got {tuple(x.shape)}")
    return x


def record_series(module: Any, name: str, values: torch.Tensor, *, note: str = "", channel: str = "head",
                  channels: Sequence[str] | None = None) -> None:
    """Record a value per position for each of N channels: values (T, N), (1, T, N) or (T,).

    channel:  the word for one channel, used as ``"head 0"``, ``"head 1"`` … on the page;
    channels: or a name per channel (its length must be N).
    """
    rec = _recorder.get()
    if rec is None:
        return
    values = _as_rows(values, name).float().cpu().clone()
    N = values.shape[1]
    labels = tuple(channels) if channels is not None else tuple(f"{channel} {i}" for i in range(N))
    if len(labels) != N:
        raise ValueError(f"lollm.trace: {name}: {len(labels)} channel names for {N} channels")
    rec.add(module, name, "series", note, {"values": values}, labels)


def record_choice(module: Any, name: str, indices: torch.Tensor, weights: torch.Tensor, *, options: int,
                  note: str = "", option: str = "expert") -> None:
    """Record k options chosen per position out of ``options``, with their weights: indices and weights (T, k).

    option: the word for one option (``"expert"``), used on the page.
    """
    rec = _recorder.get()
    if rec is None:
        return
    indices = _as_rows(indices, name).long().cpu().clone()
    weights = _as_rows(weights, name).float().cpu().clone()
    if indices.shape != weights.shape:
        raise ValueError(f"lollm.trace: {name}: indices {tuple(indices.shape)} and weights {tuple(weights.shape)} differ")
    rec.add(module, name, "choice", note, {"indices": indices, "weights": weights}, (option, int(options)))


def record_softcap(module: Any, name: str, before: torch.Tensor, after: torch.Tensor, *, cap: float, note: str = "") -> None:
    """Record logits before and after a soft-cap: before, after (T, V) or (1, T, V).

    Only the :data:`SOFTCAP_TOP` largest logits (before the cap) of each position are kept.
    """
    rec = _recorder.get()
    if rec is None:
        return
    before, after = _as_rows(before, name).float(), _as_rows(after, name).float()
    top = before.topk(min(SOFTCAP_TOP, before.shape[-1]), dim=-1)
    data = {"ids": top.indices.cpu(), "before": top.values.cpu(), "after": after.gather(-1, top.indices).cpu()}
    rec.add(module, name, "softcap", note, data, (float(cap),))


__all__ = ["Internal", "InternalsRecording", "recording_internals", "tracing", "record_series", "record_choice",
           "record_softcap", "SOFTCAP_TOP"]
