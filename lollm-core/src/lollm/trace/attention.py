"""Recording attention probabilities: what :func:`lollm.attention.attend` hands ``lollm trace``.

Inside ``with recording() as rec:`` every :func:`lollm.attention.attend` call computes its
probabilities explicitly and appends an :class:`AttentionRecord` to ``rec.records``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionRecord:
    """What one attention call looked at.

    layer:           the ``layer`` the family passed (its decoder-layer index; a name such
                     as ``"mtp.0"`` for a layer outside the main stack).
    probs:           (1, H, T, S) float32; row (h, i) is query i's weights over the S keys
                     of head h, summing to 1 (0 on hidden keys).
    query_positions: (T,) int64, the positions of the T queries.
    key_positions:   (S,) int64, the position of each key column (see :func:`key_positions`).
    window:          the sliding window of the call, None for a global layer.
    """

    layer: Any
    probs: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    window: int | None


@dataclass
class AttentionRecording:
    """The records of every :func:`attend` call made inside :func:`recording`, in call order."""

    records: list[AttentionRecord] = field(default_factory=list)


_recorder: ContextVar[AttentionRecording | None] = ContextVar("lollm_attention_recorder", default=None)


def active_recording() -> AttentionRecording | None:
    """The recording of the innermost :func:`recording` block around this call, None outside any.

    :func:`lollm.attention.attend` asks it on every call: None costs nothing more.
    """
    return _recorder.get()


@contextmanager
def recording() -> Iterator[AttentionRecording]:
    """``with recording() as rec:``: every :func:`attend` inside records its probabilities in ``rec.records``.

    The calls run the eager arithmetic (the probabilities must exist to be
    recorded), whatever backend is picked; their outputs equal the backend's
    within float rounding. Outside the block nothing is recorded or computed.
    """
    rec = AttentionRecording()
    token = _recorder.set(rec)
    try:
        yield rec
    finally:
        _recorder.reset(token)
