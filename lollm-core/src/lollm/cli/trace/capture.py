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
   (:func:`lollm.trace.attention.recording`), one (H, T, S) tensor per layer;
4. what the family records of its own internals (:mod:`lollm.trace`).

:func:`compare` adds the divergence from a reference (transformers, as in the
parity gate): the cosine and max |Δ| of each hidden state, and the first that
falls below the gate's standard. All of it stays in float32 on the CPU; the
page builder (:mod:`lollm.cli.trace.page`) decides what to round and how.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lollm.errors import LollmError
from lollm.generate import memory
from lollm.trace import Internal, recording_internals
from lollm.trace.attention import AttentionRecord, recording

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
    images: list[Any] = field(default_factory=list)  # lollm.cli.trace.images.ImageView per image of the prompt


def _on_position_grid(record: AttentionRecord, T: int) -> torch.Tensor:
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
            device: torch.device | str = "cpu", images: Any = None) -> Trace:
    """Run ``ids`` once through ``model`` (no cache) and record what a trace shows.

    model:  a :class:`lollm.model.CausalLM` on ``device``; ``model.logit_lens`` is optional
            (without it the trace has no lens, and says why).
    ids:    the prompt's token ids (at least one).
    pieces: the tokenizer's ``pieces`` (readable text of each id); None: ids as text.
    images: the prompt's ImageBatch (``lollm trace --image``), given to the forward; None: text.
    Raises LollmError when the model hands back hidden states that do not follow the contract.
    """
    if not ids:
        raise LollmError("lollm trace: the prompt has no tokens")
    device = torch.device(device)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    hidden: list[torch.Tensor] = []
    with torch.inference_mode(), recording() as attn, recording_internals(model) as own:
        extra = {} if images is None else {"images": images}
        logits = model(input_ids, None, hidden_states=hidden, **extra)[0].float().cpu()  # (T, V)
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


@dataclass
class CaptureShape:
    """What a capture of T tokens holds per token, measured on a one-token forward (:func:`capture_shape`).

    heads:     attention heads over all recorded layers (each keeps a T x T grid);
    max_heads: the most heads of one layer (its scores exist twice while it runs);
    states:    hidden states (L+1), each T x ``width``;
    vocab:     the logits' width (the lens reads every state through it, one at a time).
    """

    heads: int
    max_heads: int
    states: int
    width: int
    vocab: int

    def bytes(self, T: int) -> int:
        """About the most bytes a capture of T tokens and its page hold at once (float32 everywhere).

        Attention: each weight recorded, then placed on the position grid (8 bytes), plus
        the running layer's scores and softmax (8 bytes a weight) and the page's index
        tables (16 bytes per grid cell); hidden states on the device and their CPU copies;
        the model's logits and, per lens row, its logits, softmax and comparison (16 bytes a logit).
        """
        return 8 * self.heads * T * T + 8 * self.max_heads * T * T + 16 * T * T \
            + 8 * self.states * T * self.width + 16 * T * self.vocab

    def most_tokens(self, budget: int) -> int:
        """The longest prompt whose :meth:`bytes` stays within ``budget`` (0 when none does)."""
        a = 8 * self.heads + 8 * self.max_heads + 16
        b = 8 * self.states * self.width + 16 * self.vocab
        T = int((-b + math.sqrt(b * b + 4 * a * max(budget, 0))) / (2 * a))
        while T > 0 and self.bytes(T) > budget:  # float rounding, either way
            T -= 1
        while self.bytes(T + 1) <= budget:
            T += 1
        return T


def capture_shape(model: Any, device: torch.device | str = "cpu") -> CaptureShape:
    """Run one token through ``model`` (no cache) and read off what a longer capture would keep per token."""
    hidden: list[torch.Tensor] = []
    with torch.inference_mode(), recording() as attn:
        model(torch.zeros(1, 1, dtype=torch.long, device=device), None, hidden_states=hidden)
    heads = [int(r.probs.shape[1]) for r in attn.records]
    width = int(hidden[0].shape[-1]) if hidden else 0
    return CaptureShape(sum(heads), max(heads, default=0), len(hidden), width, int(model.vocab_size))


def _size(n: float) -> str:
    """Bytes in words: ``1.5 GiB``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"


def check_capture(model: Any, ids: list[int], *, max_tokens: int, device: torch.device | str = "cpu") -> None:
    """Refuse, before :func:`capture` runs, a prompt the trace cannot take. Raises LollmError naming the limit:

    1. more tokens than the model's context (``model.max_context`` positions);
    2. more than ``max_tokens`` (``--max-tokens``: the page keeps T² attention weights per head);
    3. a capture whose memory (:meth:`CaptureShape.bytes`, measured on a one-token forward)
       is more than the memory free on the CPU, where everything captured is kept
       (:func:`lollm.generate.memory.free_memory`); on a GPU also the attention the forward
       records there (4 bytes a weight) against that device's free memory.
    """
    T = len(ids)
    if T > model.max_context:
        raise LollmError(f"lollm trace: the prompt is {T} tokens, more than the model's context of "
                         f"{model.max_context} positions: give a shorter prompt")
    if T > max_tokens:
        raise LollmError(f"lollm trace: the prompt is {T} tokens, more than --max-tokens {max_tokens} "
                         f"(the page stores every attention weight, T² per head): shorten it or raise --max-tokens")
    device = torch.device(device)
    shape = capture_shape(model, device)
    cpu = torch.device("cpu")
    per_weight = 4 * (shape.heads + 2 * shape.max_heads)  # bytes per T² on a GPU: records, scores and softmax
    budgets = [(cpu, shape.bytes(T), shape.most_tokens)]
    if device.type != "cpu":
        budgets.append((device, per_weight * T * T, lambda free: int(math.sqrt(free / max(per_weight, 1)))))
    for where, need, most in budgets:
        free = memory.free_memory(where)
        if free is not None and need > free:
            fit = most(free)
            raise LollmError(f"lollm trace: capturing {T} tokens needs about {_size(need)} on {where} (attention: "
                             f"{shape.heads} heads × {T}² weights in float32), but {_size(free)} are free: give a "
                             f"prompt of at most about {fit} tokens (--max-tokens {max(fit, 1)} refuses longer ones)")


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
