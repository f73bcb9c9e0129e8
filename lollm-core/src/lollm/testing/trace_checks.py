"""Checks of ``lollm trace`` that every family's tests run on its own tiny checkpoints.

A family distribution (or a third-party one) calls these from its tests::

    from lollm.testing import trace_checks
    trace_checks.check_numbers(model, ids)                    # the lens, the attention, the page's data
    trace_checks.check_divergence(folder, layer=2)           # --compare: clean, then a broken layer is named
    with Browser() as browser:
        trace_checks.check_page(browser, "trace.html", trace)  # drawn, clickable, no console error

Each raises AssertionError with a message saying what differs. They need torch,
and (divergence) transformers, and (page) a browser: :mod:`lollm.testing.browser`.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from lollm import attention
from lollm.cli.trace.capture import Trace, capture, compare
from lollm.cli.trace.page import decode_attention, page_data
from lollm.cli.trace.run import reference_for
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.model import CausalLM
from lollm.testing.browser import Browser

#: How close the logit lens of the last hidden state must be to the model's own logits (float32).
LENS_TOLERANCE = 1e-5
#: How close recorded probabilities times V must be to SDPA's output (float32).
ATTENTION_TOLERANCE = 1e-5
#: The largest |Δ| of any hidden state of a correct family against transformers (float32).
DIVERGENCE_TOLERANCE = 1e-4


# ---------------------------------------------------------------------------
# The numbers
# ---------------------------------------------------------------------------
@contextmanager
def _attention_inputs() -> Iterator[list[dict[str, Any]]]:
    """Keep q, k, v and the arguments of every attention call that records (the eager path) inside the block."""
    calls: list[dict[str, Any]] = []
    original = attention.eager_probs

    def spy(q, k, v, **kwargs):
        out, probs = original(q, k, v, **kwargs)
        calls.append({"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone(), "out": out.detach().clone(), **kwargs})
        return out, probs

    attention.eager_probs = spy
    try:
        yield calls
    finally:
        attention.eager_probs = original


def reference_attention(call: dict[str, Any]) -> torch.Tensor:
    """The attention output of one recorded call, computed apart from lollm: (1, H, T, D).

    Without a soft-cap: ``torch.nn.functional.scaled_dot_product_attention`` on K/V heads
    repeated for GQA, with the (T, S) mask built here from the call's start, window and
    key order. With a soft-cap (which SDPA cannot do): the scores, the cap and the softmax
    written out in float64.
    """
    q, k, v = call["q"], call["k"], call["v"]
    H, T, D = q.shape[1], q.shape[2], q.shape[3]
    K, S = k.shape[1], k.shape[2]
    start, window, ring = call["start"], call.get("window"), call.get("ring", False)
    last = start + T - 1
    slots = torch.arange(S)
    key_pos = (last - torch.remainder(last - slots, S)) if ring else slots + (last - S + 1)
    query_pos = torch.arange(start, start + T)[:, None]
    mask = key_pos[None, :] <= query_pos
    if window is not None:
        mask &= key_pos[None, :] > query_pos - window
    k = k.repeat_interleave(H // K, dim=1)
    v = v.repeat_interleave(H // K, dim=1)
    scale = call.get("scale")
    if call.get("softcap") is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=scale)
    scale = D**-0.5 if scale is None else scale
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / call["softcap"]) * call["softcap"]
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v.double()).to(q.dtype)


def check_numbers(model: CausalLM, ids: list[int], *, pieces=None) -> Trace:
    """The numbers a trace shows are right; returns the trace.

    1. the logit lens of the last hidden state equals the model's own logits (a plain
       forward, no recording), and the lens' top tokens are those logits' top tokens;
    2. every recorded attention row sums to 1 and is 0 on hidden keys, and probabilities
       times V equal SDPA's output on the same q, k, v (:func:`reference_attention`);
    3. the page's data holds the same: attention decoded as the page decodes it (within
       the one-byte rounding), the lens' ids and probabilities.
    """
    with torch.inference_mode():
        own = model(torch.tensor([ids]), None)[0].float()  # (T, V)
    with _attention_inputs() as calls:
        trace = capture(model, ids, pieces=pieces)
    # 1. the lens
    assert trace.lens is not None, f"no logit lens: {trace.lens_missing}"
    hidden = trace.hidden[-1][None]
    with torch.inference_mode():
        lens_logits = model.logit_lens(hidden, normed=True)[0].float()
    gap = (lens_logits - own).abs().max().item()
    assert gap <= LENS_TOLERANCE, f"logit lens of the last hidden state differs from the model's logits by {gap:.3e}"
    assert torch.equal(trace.logits, own.cpu()) or (trace.logits - own.cpu()).abs().max() <= LENS_TOLERANCE
    top = torch.softmax(own, dim=-1).topk(5, dim=-1)
    assert torch.allclose(trace.lens.top_probs[-1], top.values.cpu(), atol=1e-6), "the lens' last row is not the model's top 5"
    assert torch.equal(trace.lens.top_ids[-1], top.indices.cpu()) or \
        torch.allclose(trace.lens.top_probs[-1].gather(-1, trace.lens.top_ids[-1]), top.values.cpu(), atol=1e-6)
    # 2. attention: one recorded layer per call, rows sum to 1, probs @ V == SDPA
    assert len(calls) == len(trace.attention) > 0, f"{len(calls)} attention calls, {len(trace.attention)} recorded layers"
    for call, layer in zip(calls, trace.attention):
        probs = layer.probs  # (H, T, T)
        sums = probs.sum(-1)
        assert (sums - 1).abs().max() <= 1e-5, f"layer {layer.layer}: attention rows sum to {sums.min():.6f}..{sums.max():.6f}"
        rows, cols = torch.triu_indices(probs.shape[1], probs.shape[1], offset=1)
        assert probs[:, rows, cols].abs().max() == 0 if rows.numel() else True, f"layer {layer.layer}: weight on a future key"
        if layer.window is not None:
            T = probs.shape[1]
            far = torch.arange(T)[None, :] <= torch.arange(T)[:, None] - layer.window
            assert probs[:, far].abs().max() == 0 if far.any() else True, f"layer {layer.layer}: weight outside the window"
        ref = reference_attention(call)  # (1, H, T, D)
        v = call["v"].repeat_interleave(call["q"].shape[1] // call["v"].shape[1], dim=1)[0].float().cpu()  # (H, S, D)
        # the grid's key columns are positions 0..T-1; the call's keys are those positions in its own order
        mine = probs @ _keys_in_position_order(v, call)  # (H, T, D)
        gap = (mine - ref[0].float().cpu()).abs().max().item()
        assert gap <= ATTENTION_TOLERANCE, f"layer {layer.layer}: probabilities x V differ from SDPA by {gap:.3e}"
    # 3. the page's data
    data = page_data(trace)
    T = len(ids)
    for layer, blob in zip(trace.attention, data["attention"]):
        page = decode_attention(blob["data"], blob["heads"], T)
        gap = (page.sqrt() - layer.probs.sqrt()).abs().max().item()
        assert gap <= 0.5 / 255 + 1e-6, f"layer {layer.layer}: the page's attention is off by {gap:.4f} in sqrt(p)"
        assert blob["window"] == layer.window and blob["layer"] == layer.layer
    assert data["lens"]["top_ids"] == trace.lens.top_ids.tolist()
    page_probs = torch.tensor(data["lens"]["top_probs"])
    assert (page_probs - trace.lens.top_probs).abs().max() <= 5e-5 + 1e-7
    return trace


def _keys_in_position_order(v: torch.Tensor, call: dict[str, Any]) -> torch.Tensor:
    """(H, S, D) values in the call's key order -> (H, T, D) on positions 0..T-1 (the trace's grid)."""
    S = v.shape[1]
    T = call["q"].shape[2]
    start, ring = call["start"], call.get("ring", False)
    last = start + T - 1
    slots = torch.arange(S)
    key_pos = (last - torch.remainder(last - slots, S)) if ring else slots + (last - S + 1)
    out = torch.zeros(v.shape[0], last + 1, v.shape[2])
    out[:, key_pos] = v
    return out


# ---------------------------------------------------------------------------
# The divergence from transformers
# ---------------------------------------------------------------------------
def break_layer(model: CausalLM, layer: int, *, seed: int = 0) -> int:
    """Add noise to every parameter of decoder layer ``layer`` (``...layers.<layer>.`` in its name); returns how many.

    The noise is as large as each parameter's own spread, so the layer's output
    visibly changes while the layers before it stay exact.
    """
    generator = torch.Generator().manual_seed(seed)
    touched = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if f"layers.{layer}." in name and "mtp" not in name:
                scale = param.float().std().item() if param.numel() > 1 else abs(param.item())
                param.add_((scale or 0.1) * torch.randn(param.shape, generator=generator).to(param.dtype))
                touched += 1
    assert touched, f"no parameter of layer {layer} found"
    return touched


def check_divergence(folder: str | Path, ids: list[int], *, layer: int) -> tuple[Trace, Trace]:
    """``--compare`` on a correct model: every |Δ| <= 1e-4 and nothing marked; with ``layer`` broken: that layer marked.

    Loads ``folder`` twice through lollm (float32, CPU) and compares each with the
    parity gate's reference for it (transformers). Returns (clean trace, broken trace).
    """
    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    clean = capture(loaded.model, ids)
    break_layer(loaded.model, layer)
    broken = capture(loaded.model, ids)
    loaded.model = None
    gc.collect()
    reference = reference_for(loaded)
    d = compare(clean, reference)
    assert d.first is None, f"a correct family diverges at hidden state {d.first}: cosines {d.cosine}"
    worst = max(d.max_abs[:-1])
    assert worst <= DIVERGENCE_TOLERANCE, f"a correct family's hidden states differ by up to {worst:.3e}"
    assert all(math.isfinite(c) and c >= d.required for c in d.cosine)
    d = compare(broken, reference)
    assert d.first == layer + 1, (f"layer {layer} was broken, so hidden state {layer + 1} (its output) should be the "
                                  f"first to diverge; the trace marks {d.first} (cosines {d.cosine})")
    return clean, broken


# ---------------------------------------------------------------------------
# The page in a browser
# ---------------------------------------------------------------------------
def check_page(browser: Browser, path: str | Path, trace: Trace, *, click: int | None = None) -> None:
    """The page of ``trace`` at ``path``: drawn without a console error, one lens row per layer,
    and a click on a token updates the logit lens, the attention panel and the family's own panels.

    ``browser``: a :class:`lollm.testing.browser.Browser`; ``click``: the position to click (default: the middle).
    """
    page = browser.open(path)
    assert not page.errors, f"console errors on {path}: {page.errors}"
    assert browser.js("return document.body.dataset.ready") == "true", "the page never finished drawing"
    T = len(trace.ids)
    assert len(browser.texts(".tok")) == T, "one token box per token"
    assert browser.js("return document.body.dataset.pos") == str(T - 1), "the last token is selected at first"
    layer_rows = browser.js("return Array.from(document.querySelectorAll('#lens tr.layer-row'), r => r.dataset.layer)")
    assert layer_rows == [str(i) for i in range(trace.num_layers)], f"lens rows {layer_rows}, want one per layer"

    pos = T // 2 if click is None else click
    browser.click(f'.tok[data-pos="{pos}"]')
    assert browser.js("return document.body.dataset.pos") == str(pos)
    assert browser.js("return document.querySelector('#lens table').dataset.pos") == str(pos), "the lens did not follow the click"
    shown = browser.js("return Array.from(document.querySelectorAll('#lens tr.layer-row, #lens tr.embed-row'), "
                       "r => Array.from(r.querySelectorAll('td.cand'), c => Number(c.dataset.id)))")
    want = trace.lens.top_ids[:, pos].tolist()
    assert shown == want, f"lens after the click shows {shown}, the trace has {want}"

    summary = browser.js("return Object.assign({}, document.getElementById('attn-summary').dataset)")
    assert summary.get("pos") == str(pos), "the attention panel did not follow the click"
    layer = trace.attention[0]
    bars = browser.js("return Chart.getChart(document.getElementById('attn-bars')).data.datasets[0].data")
    expected = layer.probs[:, pos, : pos + 1].mean(0)
    assert len(bars) == pos + 1, f"{len(bars)} bars for the keys 0..{pos}"
    gap = (torch.tensor(bars, dtype=torch.float32) - expected).abs().max().item()
    assert gap <= 0.01, f"attention bars differ from the trace by {gap:.4f}"

    # the layer picked in the lens drives the attention panel
    target = trace.attention[-1].layer
    browser.click(f'#lens tr.layer-row[data-layer="{target}"]')
    assert browser.js("return document.getElementById('attn-summary').dataset.layer") == str(target)

    # every family record is drawn and follows the selected token
    names = sorted({r.name for r in trace.internals})
    drawn = sorted(browser.js("return Array.from(document.querySelectorAll('.family-record'), n => n.dataset.name)"))
    assert drawn == names, f"family panels {drawn}, records {names}"
    for name in names:
        got = browser.js("return document.querySelector(`.family-record[data-name=\"${arguments[0]}\"] [id$='-text']`).dataset.pos", name)
        assert got == str(pos), f"the panel {name!r} shows position {got}, not the clicked {pos}"
    if trace.divergence is not None:
        first = browser.js("const r = document.querySelector('#divergence-table tr.first'); return r ? r.dataset.row : null")
        want_first = None if trace.divergence.first is None else str(trace.divergence.first)
        assert first == want_first, f"the page marks {first} as the first divergence, the trace {want_first}"
    errors = browser.errors()
    assert not errors, f"console errors after clicking: {errors}"
