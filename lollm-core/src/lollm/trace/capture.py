"""One forward pass, recorded: the numbers a trace page shows.

:func:`capture` runs the prompt once through the model (no cache, every
position at once, as the parity gate does) and keeps:

1. the hidden states, in transformers' ``output_hidden_states`` order (the
   embeddings, the output of each layer but the last, the final-normed output
   of the last layer);
2. the logit lens: each hidden state read through the final norm and the
   output head (``model.logit_lens``), softmaxed; per position the top 5 next
   tokens and the probability and rank of the token that really comes next;
3. the attention probabilities of every attention call
   (:func:`lollm.attention.recording`), one (H, T, S) tensor per layer;
4. what the family records of its own internals (:mod:`lollm.trace`).

:func:`compare` adds the divergence from a reference (transformers, as in the
parity gate): the cosine and max |Δ| of each hidden state, and the first that
falls below the gate's standard. All of it stays in float32 on the CPU; the
page builder (:mod:`lollm.trace.page`) decides what to round and how.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lollm import attention
from lollm.errors import LollmError
from lollm.trace import Internal, recording_internals

#: Next tokens the logit lens keeps per layer and position.
LENS_TOP = 5


@dataclass
class AttentionLayer:
    """The attention probabilities of one layer, on the grid of positions.

    probs:  (H, T, T) float32: row i of head h holds the weights of the query at
            position i over the keys at positions 0..T-1 (0 on hidden keys); key
            columns are reordered to position order whatever order the layer read them in.
    window: the sliding window W of the layer (keys ``i - W < j <= i`` are visible), None for a global one.
    """

    layer: int
    probs: torch.Tensor
    window: int | None


@dataclass
class LogitLens:
    """The logit lens, one row per hidden state (the embeddings, then one per layer).

    top_ids, top_probs: (L+1, T, LENS_TOP): the most likely next tokens of each row and position.
    next_probs, next_ranks: (L+1, T-1): probability and rank (0 = top) of the prompt's own next token.
    """

    top_ids: torch.Tensor
    top_probs: torch.Tensor
    next_probs: torch.Tensor
    next_ranks: torch.Tensor


@dataclass
class Divergence:
    """Ours against a reference, per hidden state (L+1 entries), then the logits.

    cosine:    (L+2,) float64: the smallest cosine over positions;
    max_abs:   (L+2,) float64: the largest |Δ| of any element;
    required:  the cosine a state must reach (the parity gate's standard);
    first:     index of the first state below ``required``, or None.
    """

    cosine: list[float]
    max_abs: list[float]
    required: float
    first: int | None
    reference: str = "transformers"


@dataclass
class Trace:
    """Everything one traced forward pass produced (see the module docstring)."""

    ids: list[int]
    pieces: list[str]
    num_layers: int
    logits: torch.Tensor  # (T, V) float32: the model's own output
    hidden: list[torch.Tensor]  # L+1 of (T, C) float32
    lens: LogitLens | None
    lens_missing: str  # why there is no lens, when ``lens`` is None
    attention: list[AttentionLayer]
    internals: list[Internal]
    vocab: dict[int, str] = field(default_factory=dict)  # pieces of every id the page names
    divergence: Divergence | None = None
    meta: dict[str, Any] = field(default_factory=dict)


def _on_position_grid(record: attention.AttentionRecord, T: int) -> torch.Tensor:
    """(1, H, Tq, S) probabilities with their key positions -> (H, T, T), keys in position order."""
    probs = record.probs[0].float().cpu()  # (H, Tq, S)
    H = probs.shape[0]
    grid = torch.zeros(H, T, T)
    rows = record.query_positions.cpu().long()
    cols = record.key_positions.cpu().long()
    keep = (cols >= 0) & (cols < T)
    grid[:, rows[:, None], cols[keep][None, :]] = probs[:, :, keep]
    return grid


def _logit_lens(model: Any, hidden: list[torch.Tensor], ids: list[int], device: torch.device) -> LogitLens:
    """Every hidden state ((1, T, C) each) through ``model.logit_lens``; softmax; the top tokens and the real next token's place."""
    T = len(ids)
    nxt = torch.tensor(ids[1:], dtype=torch.long)  # (T-1,)
    top_ids, top_probs, next_probs, next_ranks = [], [], [], []
    last = len(hidden) - 1
    for i, h in enumerate(hidden):
        logits = model.logit_lens(h.to(device), normed=(i == last))[0].float().cpu()  # (T, V)
        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(LENS_TOP, dim=-1)
        top_ids.append(top.indices)
        top_probs.append(top.values)
        p_next = probs[:-1].gather(-1, nxt[:, None])  # (T-1, 1)
        next_probs.append(p_next[:, 0])
        next_ranks.append((probs[:-1] > p_next).sum(-1))
        del logits, probs
    if T == 1:
        empty = torch.zeros(len(hidden), 0)
        return LogitLens(torch.stack(top_ids), torch.stack(top_probs), empty, empty.long())
    return LogitLens(torch.stack(top_ids), torch.stack(top_probs), torch.stack(next_probs), torch.stack(next_ranks))


def _texts(ids: list[int], to_text: Callable[[list[int]], list[str]]) -> dict[int, str]:
    """id -> readable text; an id the tokenizer lacks (a model's vocabulary is often padded past it) reads ``<unused_N>``."""
    try:
        return dict(zip(ids, to_text(ids)))
    except LollmError:
        out = {}
        for i in ids:
            try:
                out[i] = to_text([i])[0]
            except LollmError:
                out[i] = f"<unused_{i}>"
        return out


def capture(model: Any, ids: list[int], *, pieces: Callable[[list[int]], list[str]] | None = None,
            device: torch.device | str = "cpu") -> Trace:
    """Run ``ids`` once through ``model`` (no cache) and record what a trace shows.

    model:  a :class:`lollm.model.CausalLM` on ``device``; ``model.logit_lens`` is optional
            (without it the trace has no lens, and says why).
    ids:    the prompt's token ids (at least one).
    pieces: the tokenizer's ``pieces`` (readable text of each id); None: ids as text.
    Raises LollmError when the model hands back hidden states that do not follow the contract.
    """
    if not ids:
        raise LollmError("lollm trace: the prompt has no tokens")
    device = torch.device(device)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    hidden: list[torch.Tensor] = []
    with torch.inference_mode(), attention.recording() as attn, recording_internals(model) as own:
        logits = model(input_ids, None, hidden_states=hidden)[0].float().cpu()  # (T, V)
        num_layers = int(getattr(model, "num_layers", len(hidden) - 1))
        if len(hidden) != num_layers + 1:
            raise LollmError(f"lollm trace: the model handed back {len(hidden)} hidden states for {num_layers} layers "
                             f"(the contract, lollm.model.CausalLM.forward, asks for num_layers + 1)")
        if hasattr(model, "logit_lens"):
            lens, missing = _logit_lens(model, hidden, ids, device), ""
        else:
            lens, missing = None, f"{type(model).__name__} has no logit_lens method (lollm.model.CausalLM.logit_lens)"
    hidden_cpu = [h[0].float().cpu() for h in hidden]
    T = len(ids)
    layers = [AttentionLayer(r.layer, _on_position_grid(r, T), r.window) for r in attn.records
              if r.probs.shape[2] == T]  # a layer that read only part of the queries (none today) is left out
    to_text = pieces or (lambda xs: [str(x) for x in xs])
    named = set(ids)
    if lens is not None:
        named.update(lens.top_ids.unique().tolist())
    for rec in own.records:
        if rec.kind == "softcap":
            named.update(rec.data["ids"].unique().tolist())
    vocab = _texts(sorted(named), to_text)
    return Trace(ids=list(ids), pieces=to_text(list(ids)), num_layers=num_layers, logits=logits, hidden=hidden_cpu,
                 lens=lens, lens_missing=missing, attention=layers, internals=own.records, vocab=vocab)


def compare(trace: Trace, reference: Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]], *,
            required: float = 0.99999, name: str = "transformers") -> Divergence:
    """The divergence of ``trace`` from ``reference(ids (1, T)) -> (logits (T, V), hidden_states)``; stored in the trace.

    Per hidden state (and the logits last): the smallest cosine over positions and
    the largest |Δ|, both in float64. ``first`` is the first state whose cosine is
    below ``required`` (the parity gate's standard: 0.99999 in float32).
    Raises LollmError when the reference hands back another number of hidden states.
    """
    ids = torch.tensor([trace.ids], dtype=torch.long)
    ref_logits, ref_hidden = reference(ids)
    if len(ref_hidden) != len(trace.hidden):
        raise LollmError(f"lollm trace --compare: the reference has {len(ref_hidden)} hidden states, "
                         f"ours {len(trace.hidden)}")
    ours = trace.hidden + [trace.logits]
    theirs = [h.reshape(h.shape[-2], h.shape[-1]) for h in ref_hidden] + [ref_logits.reshape(trace.logits.shape)]
    cosine, max_abs = [], []
    for a, b in zip(ours, theirs):
        a, b = a.double(), b.double().cpu()
        cosine.append(float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()))
        max_abs.append(float((a - b).abs().max()))
    first = next((i for i, c in enumerate(cosine) if c < required), None)
    trace.divergence = Divergence(cosine, max_abs, required, first, name)
    return trace.divergence
