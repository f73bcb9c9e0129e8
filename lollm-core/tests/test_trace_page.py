"""``lollm trace`` in core alone: the recorder, the capture, the page and its data, in a real browser.

The model here is a small fake written in this file (attention through
lollm.attention.attend, one sliding-window layer, every kind of family record,
a soft-capped head), so the whole page (every panel kind) is exercised where
no family is installed. Each family's own tests run the same checks on its
tiny checkpoints (lollm.testing.trace_checks).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from lollm.attention import attend
from lollm.testing import trace_checks
from lollm.testing.browser import Browser
from lollm.trace import record_choice, record_series, record_softcap, recording_internals, tracing
from lollm.cli.trace.capture import Trace, capture, compare
from lollm.cli.trace.page import decode_attention, encode_attention, page_data, render, visible, write_page
from lollm.cli.trace.run import model_label

VENDOR = Path(__import__("lollm.cli.trace", fromlist=["x"]).__file__).parent / "vendor"
CAP = 5.0


class FakeLayer(nn.Module):
    """Pre-norm attention (GQA 4/2) + MLP; layer 1 slides with a window of 3; records a series and a choice."""

    def __init__(self, C: int, idx: int):
        super().__init__()
        self.idx, self.window = idx, (3 if idx == 1 else None)
        self.q, self.k, self.v, self.o = nn.Linear(C, C), nn.Linear(C, C // 2), nn.Linear(C, C // 2), nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.router = nn.Linear(C, 6)

    def forward(self, x):
        T = x.shape[1]
        h = self.norm(x)
        q = self.q(h).view(1, T, 4, -1).transpose(1, 2)
        k = self.k(h).view(1, T, 2, -1).transpose(1, 2)
        v = self.v(h).view(1, T, 2, -1).transpose(1, 2)
        out = attend(q, k, v, start=0, window=self.window, layer=self.idx)
        x = x + self.o(out.transpose(1, 2).reshape(1, T, -1))
        gate = torch.sigmoid(h[..., :2])
        if tracing():
            record_series(self, "gate", gate, note="two gates per token", channel="gate")
        w, i = torch.softmax(self.router(h), -1).topk(2, dim=-1)
        record_choice(self, "experts", i, w, options=6, note="two of six experts")
        return x


class FakeLM(nn.Module):
    """A model that follows lollm.model.CausalLM (no cache) and LensModel, with a final soft-cap."""

    def __init__(self, V: int = 40, C: int = 16, L: int = 3):
        super().__init__()
        torch.manual_seed(0)
        self.vocab_size, self.max_context, self.num_layers, self.eos_token_ids = V, 64, L, ()
        self.embed = nn.Embedding(V, C)
        self.layers = nn.ModuleList(FakeLayer(C, i) for i in range(L))
        self.norm = nn.LayerNorm(C)
        self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, input_ids, cache=None, *, logits_to_keep=0, hidden_states=None):
        x = self.embed(input_ids)
        if hidden_states is not None:
            hidden_states.append(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if hidden_states is not None and i < len(self.layers) - 1:
                hidden_states.append(x)
        x = self.norm(x)
        if hidden_states is not None:
            hidden_states.append(x)
        before = self.lm_head(x)
        logits = torch.tanh(before / CAP) * CAP
        record_softcap(self, "soft-cap", before, logits, cap=CAP, note="capped")
        return logits

    def logit_lens(self, hidden, *, normed=False):
        return torch.tanh(self.lm_head(hidden if normed else self.norm(hidden)) / CAP) * CAP


class NoLens(FakeLM):
    """A family that gives no logit lens (hasattr(model, "logit_lens") is False)."""

    @property
    def logit_lens(self):
        raise AttributeError("this family has no logit_lens")


PIECES = {0: "<s>", 1: " the", 2: "\n", 3: "</script><script>window.pwned=1</script>", 4: "é", 5: "中文"}


def pieces(ids):
    return [PIECES.get(i, f"t{i}") for i in ids]


IDS = [0, 1, 5, 2, 3, 4, 6, 7, 1, 8, 9]


@pytest.fixture(scope="module")
def fake_trace() -> Trace:
    model = FakeLM().eval()
    trace = capture(model, IDS, pieces=pieces)
    trace.meta = {"model": "fake", "family": "fake", "format": "safetensors", "dtype": "float32"}
    return trace


@pytest.fixture(scope="module")
def browser():
    with Browser() as b:
        yield b


# -- the recorder --------------------------------------------------------------


def test_records_are_noops_outside_a_trace():
    layer = FakeLayer(16, 0)
    assert not tracing()
    record_series(layer, "x", torch.zeros(2, 3, 4, 5))  # a wrong shape is not even looked at
    with recording_internals(nn.ModuleDict({"layers": nn.ModuleList([layer])})) as rec:
        assert tracing()
        record_series(layer, "gate", torch.ones(1, 5, 2))
        with pytest.raises(ValueError, match="gate2"):
            record_series(layer, "gate2", torch.zeros(2, 3, 4, 5))
    assert not tracing()
    assert [(r.where, r.layer, r.name, tuple(r.data["values"].shape)) for r in rec.records] == [("layers.0", 0, "gate", (5, 2))]


def test_capture_keeps_what_the_page_needs(fake_trace):
    t = fake_trace
    assert len(t.hidden) == 4 and t.num_layers == 3
    assert [a.layer for a in t.attention] == [0, 1, 2] and [a.window for a in t.attention] == [None, 3, None]
    assert {(r.name, r.kind) for r in t.internals} == {("gate", "series"), ("experts", "choice"), ("soft-cap", "softcap")}
    assert [r.layer for r in t.internals if r.name == "gate"] == [0, 1, 2]
    assert t.lens.top_ids.shape == (4, len(IDS), 5) and t.lens.next_probs.shape == (4, len(IDS) - 1)
    # the real next token's rank and probability agree with the model's own output in the last row
    probs = torch.softmax(t.logits, -1)
    nxt = torch.tensor(IDS[1:])
    assert torch.allclose(t.lens.next_probs[-1], probs[:-1].gather(-1, nxt[:, None])[:, 0])
    assert t.vocab[3] == PIECES[3]


def test_numbers_of_the_fake_model():
    trace_checks.check_numbers(FakeLM().eval(), IDS, pieces=pieces)


def test_the_numbers_check_can_fail():
    """A lens that forgets the soft-cap is caught."""
    model = FakeLM().eval()
    model.logit_lens = lambda hidden, normed=False: model.lm_head(hidden if normed else model.norm(hidden))
    with pytest.raises(AssertionError, match="logit lens"):
        trace_checks.check_numbers(model, IDS, pieces=pieces)


def test_a_model_without_a_lens_still_gets_a_page(tmp_path):
    trace = capture(NoLens().eval(), IDS, pieces=pieces)
    assert trace.lens is None and "logit_lens" in trace.lens_missing
    assert page_data(trace)["lens"] is None
    write_page(trace, tmp_path / "t.html")


def test_divergence_marks_the_first_state_below_the_gate(fake_trace):
    ref_hidden = [h.clone()[None] for h in fake_trace.hidden]
    ref_hidden[2] += 0.5  # the output of layer 1 differs, and everything after it
    ref_hidden[3] += 0.5
    d = compare(fake_trace, lambda ids: (fake_trace.logits.clone(), ref_hidden))
    assert d.first == 2 and d.cosine[0] == pytest.approx(1.0) and d.max_abs[1] == 0.0 and d.max_abs[2] == pytest.approx(0.5, rel=1e-5)
    d = compare(fake_trace, lambda ids: (fake_trace.logits.clone(), [h[None] for h in fake_trace.hidden]))
    assert d.first is None and max(d.max_abs) == 0.0


# -- the page ------------------------------------------------------------------


def test_attention_bytes_round_trip():
    probs = torch.softmax(torch.randn(3, 7, 7).masked_fill(torch.ones(7, 7).triu(1).bool(), float("-inf")), -1)
    back = decode_attention(encode_attention(probs), 3, 7)
    assert (back.sqrt() - probs.sqrt()).abs().max() <= 0.5 / 255 + 1e-6
    assert back.triu(1).abs().max() == 0


def test_the_page_is_self_contained(fake_trace, tmp_path):
    html = render(fake_trace)
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", html), "the page must load nothing"
    assert "http://" not in html.split("/*!")[0] and "sourceMappingURL" not in html
    assert html.count("</script>") == 3  # data, vendor, our script: the token "</script>" is escaped
    data = json.loads(re.search(r'<script id="trace-data" type="application/json">(.*?)</script>', html, re.S).group(1))
    assert data["tokens"][4]["piece"] == PIECES[3]
    assert data == json.loads(json.dumps(page_data(fake_trace)))


def test_vendored_library_is_the_recorded_one():
    table = (VENDOR / "README.md").read_text()
    for name in ("chart.umd.min.js", "chartjs-chart-matrix.min.js"):
        digest = hashlib.sha256((VENDOR / name).read_bytes()).hexdigest()
        assert digest in table, f"{name}: sha256 {digest} is not the one recorded in vendor/README.md"
    assert "MIT" in (VENDOR / "LICENSE.chart.js.md").read_text() and "MIT" in (VENDOR / "LICENSE.chartjs-chart-matrix.md").read_text()


def test_write_page_refuses_a_missing_folder(fake_trace, tmp_path):
    from lollm.errors import LollmError

    with pytest.raises(LollmError, match="does not exist"):
        write_page(fake_trace, tmp_path / "no" / "t.html")
    assert not list(tmp_path.iterdir())


def test_the_page_in_a_browser(fake_trace, tmp_path, browser):
    trace = fake_trace
    compare(trace, lambda ids: (trace.logits.clone(), [h[None] + (0.3 if i >= 2 else 0) for i, h in enumerate(trace.hidden)]))
    path = tmp_path / "fake.html"
    write_page(trace, path)
    trace_checks.check_page(browser, path, trace, click=6)
    assert browser.js("return window.pwned === undefined"), "a token's text ran as script"
    assert PIECES[3] in browser.texts(".tok .piece")[4]
    # the sliding layer shows its window: at position 6 with W = 3, keys 0..3 are outside
    browser.js("const s = document.getElementById('attn-layer'); s.value = '1'; s.dispatchEvent(new Event('change'))")
    outside = browser.js("return Chart.getChart(document.getElementById('attn-bars')).data.datasets[1].data")
    assert [v is not None for v in outside] == [True] * 4 + [False] * 3
    assert "keys 0..3 are outside" in browser.texts("#attn-summary")[0]
    # the choice table and the soft-cap points follow the token
    rows = browser.js("return Array.from(document.querySelectorAll('.family-record[data-name=\"experts\"] tbody tr')).length")
    assert rows == 3
    points = browser.js("return Chart.getChart(document.querySelector('.family-record[data-name=\"soft-cap\"] canvas')).data.datasets[2].data")
    softcap = next(r for r in trace.internals if r.kind == "softcap")
    assert [p["id"] for p in points] == softcap.data["ids"][6].tolist()


def test_the_browser_check_can_fail(fake_trace, tmp_path, browser):
    """A page whose script breaks is caught by check_page (console error, nothing drawn)."""
    path = tmp_path / "broken.html"
    path.write_text(render(fake_trace).replace("renderTokens();\n", "renderTokens(); undefinedFunction();\n", 1))
    with pytest.raises(AssertionError, match="console errors|never finished"):
        trace_checks.check_page(browser, path, fake_trace)


# -- the first view, the model's name, the fonts (issue 24, item 7) ----------------------------


def test_the_first_view_needs_no_script(fake_trace, tmp_path, browser):
    """With every script removed the page still shows its header, every token and the selected one."""
    html = re.sub(r"<script\b.*?</script>", "", render(fake_trace), flags=re.S)
    assert "<script" not in html
    path = tmp_path / "no-script.html"
    path.write_text(html, encoding="utf-8")
    browser.open(path, timeout=0.5)  # nothing will say it is ready: no script runs
    T = len(fake_trace.ids)
    assert browser.js("return document.body.dataset.ready") is None
    assert browser.texts(".tok .piece") == [visible(p) for p in pieces(IDS)]
    assert browser.texts(".tok sub") == [str(i) for i in IDS]
    assert browser.js("return document.querySelector('.tok.selected').dataset.pos") == str(T - 1)
    assert browser.texts("#meta")[0].split() == ["model", "fake", "family", "fake", "format", "safetensors", "dtype",
                                                 "float32", "tokens", str(T), "layers", str(fake_trace.num_layers)]
    assert browser.texts("#selected")[0].startswith(f"Selected: position {T - 1}, id {IDS[-1]}, ")
    assert browser.js("return window.pwned === undefined"), "a token's text became a script"


def test_the_script_keeps_the_first_view(fake_trace, tmp_path, browser):
    """Scripts on: the boxes Python wrote are the ones clicked (no second set), and the header is unchanged."""
    path = tmp_path / "t.html"
    write_page(fake_trace, path)
    first = re.search(r'<div id="meta">(.*?)</div>', render(fake_trace), re.S).group(1)
    browser.open(path)
    assert len(browser.texts(".tok")) == len(IDS)
    assert browser.js("return document.getElementById('meta').innerHTML") == first
    browser.click('.tok[data-pos="2"]')
    assert browser.js("return Array.from(document.querySelectorAll('.tok.selected'), n => n.dataset.pos)") == ["2"]


def test_the_page_names_the_model_by_its_folder_or_file(tmp_path):
    folder = tmp_path / "Qwen2.5-0.5B-Instruct"
    folder.mkdir()
    (tmp_path / "m.Q4_K_M.gguf").write_bytes(b"")
    assert model_label(folder) == "Qwen2.5-0.5B-Instruct"
    assert model_label(f"{folder}/") == "Qwen2.5-0.5B-Instruct"
    assert model_label(tmp_path / "m.Q4_K_M.gguf") == "m.Q4_K_M.gguf"
    assert model_label("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"  # a Hub repo id, not a path


def test_a_chinese_token_is_drawn(fake_trace, tmp_path, browser):
    """The token "中文" is drawn with real glyphs in the page's own font stack, not as boxes.

    The CJK font comes from Debian's fonts-wqy-zenhei (.ci/run installs it). The
    check draws the token's text on a canvas with the token's computed font and
    compares it with a code point that no font has (U+0378, unassigned): a missing
    glyph draws the same box for both; a CJK font draws two different shapes.
    """
    path = tmp_path / "t.html"
    write_page(fake_trace, path)
    browser.open(path)
    stack = browser.js("return getComputedStyle(document.querySelector('.tok .piece')).fontFamily")
    for family in ("WenQuanYi Zen Hei", "Noto Sans CJK SC", "Noto Color Emoji"):
        assert family in stack, f"the tokens' font stack lacks {family}: {stack}"
    fonts = subprocess.run(["fc-list", ":lang=zh", "family"], capture_output=True, text=True, check=True).stdout
    assert fonts.strip(), "no CJK font here: apt-get install fonts-wqy-zenhei (as .ci/run does)"
    assert browser.texts('.tok[data-pos="2"] .piece') == ["中文"]
    drawn = browser.js(_DRAW, '.tok[data-pos="2"] .piece', "中文", "\u0378\u0378")
    assert drawn["inked"] > 0, "the Chinese token draws nothing"
    assert drawn["differs"], "the Chinese token draws as missing-glyph boxes"


# draw the text of arguments[1] and arguments[2] with the computed font of the element arguments[0]: ink and difference
_DRAW = """
const font = getComputedStyle(document.querySelector(arguments[0])).font;
function pixels(text) {
  const c = document.createElement("canvas"); c.width = 120; c.height = 40;
  const g = c.getContext("2d"); g.font = font; g.fillStyle = "#000"; g.textBaseline = "top"; g.fillText(text, 2, 4);
  return g.getImageData(0, 0, c.width, c.height).data;
}
const a = pixels(arguments[1]), b = pixels(arguments[2]);
let inked = 0, differs = false;
for (let k = 3; k < a.length; k += 4) { if (a[k] > 0) inked++; if (a[k] !== b[k]) differs = true; }
return { inked, differs };
"""
