"""Gemma 4 images through ``lollm parity --image``, ``lollm trace --image`` and chat's ``/image`` (issue 39).

The tiny checkpoint of test_gemma4_vision_decoder.py in its "vision" variant (the 26B/31B rule: an
image's tokens see each other both ways in the sliding layers, so ``mm_token_type_ids`` matters to
the reference), with Gemma 4's image tokens in its tokenizer (test_gemma4_vision_cli.py) and a chat
template that writes ``<|image|>`` per image part.

* ``reference_inputs`` of our pixels equals transformers' ``Gemma4ImageProcessorPil`` output, tensor for
  tensor, at the sizes the preprocessing tests use (several images padded in one batch);
* ``lollm parity --image`` passes with 1 and 2 images of held-out sizes and aspect ratios, and fails
  when our side scatters the images one token off;
* ``lollm trace --image``: the Images section has the image's own grid (rows x cols from the pixels'
  sides), and inside the image the recorded attention is two-way;
* chat: ``/image`` then two turns; each turn's greedy answer equals transformers' ``generate`` on the
  session's own prompt ids and transformers' own processor output.
"""

from __future__ import annotations

import json

import pytest
import torch

from test_gemma4_vision import SIZES, SOFT_TOKENS, drawing, reference_processor
from test_gemma4_vision_cli import IMAGE, with_image_tokens
from test_gemma4_vision_decoder import write_variant
from test_gemma4_vision_engine import TEMPLATE

NEW = 5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = with_image_tokens(write_variant(tmp_path_factory.mktemp("gemma4-vision-entry"), "vision"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def loaded(folder):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    return open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def tower(loaded):
    from lollm.vision.load import open_vision

    return open_vision(loaded)


def saved(tmp_path, sizes) -> list[str]:
    paths = []
    for i, (w, h) in enumerate(sizes):
        paths.append(str(tmp_path / f"p{i}.png"))
        drawing(w, h, seed=40 + i).save(paths[-1])
    return paths


def test_reference_inputs_equal_the_image_processor(tower):
    from lollm.vision.reference import reference_inputs

    images = [drawing(w, h, seed=w * 7 + h) for w, h in SIZES]
    ref = reference_processor()(images=images, return_tensors="pt")
    got = reference_inputs(tower, [tower.preprocess(image) for image in images])
    assert set(got) == {"pixel_values", "image_position_ids"}
    assert torch.equal(got["pixel_values"], ref["pixel_values"]), "pixel_values differ"
    assert torch.equal(got["image_position_ids"], ref["image_position_ids"]), "image_position_ids differ"


@pytest.mark.parametrize("sizes", [[(90, 50)], [(70, 110), (150, 64)]], ids=["1 image", "2 images"])
def test_parity_with_images_passes(folder, tmp_path, sizes):
    from typer.testing import CliRunner

    from lollm.cli import app

    args = ["parity", str(folder), "--json"] + [a for p in saved(tmp_path, sizes) for a in ("--image", p)]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["min_cosine"] >= 0.9999 and report["num_tokens"] > 8 * len(sizes)


def test_parity_fails_with_the_images_one_token_off(folder, tmp_path, monkeypatch):
    import lollm.vision.load as load
    from lollm.proof.parity import run_parity
    from lollm.vision.spec import ImageBatch, PlacedImage

    right = load.place_images

    def one_off(ids, spec, encoded, *, max_context):
        batch = right(ids, spec, encoded, max_context=max_context)
        return ImageBatch([PlacedImage(im.start + 1, im.embeds, im.pixel_hash, im.grid) for im in batch.images])

    monkeypatch.setattr(load, "place_images", one_off)
    report = run_parity(str(folder), images=saved(tmp_path, [(70, 110), (150, 64)]))
    assert not report.passed and report.min_cosine < 0.9999


def test_trace_draws_the_image_grid_and_two_way_attention(folder, tmp_path):
    from PIL import Image

    from lollm.cli.trace.page import decode_attention, page_data
    from lollm.cli.trace.run import run_trace

    (path,) = saved(tmp_path, [(150, 64)])
    result = run_trace(str(folder), prompt="what is it", output=tmp_path / "trace.html", images=[path])
    (view,) = result.trace.images
    positions = reference_processor()(images=[Image.open(path).convert("RGB")], return_tensors="pt")["image_position_ids"][0]
    real = positions[positions[:, 0] >= 0]  # (N, 2) patches' (x, y); the 3 x 3 pooling makes a token
    assert (view.rows, view.cols) == ((int(real[:, 1].max()) + 1) // 3, (int(real[:, 0].max()) + 1) // 3)
    assert view.rows * view.cols == view.end - view.start <= SOFT_TOKENS and view.rows != view.cols
    assert view.width_px > view.height_px  # the picture keeps its landscape aspect
    assert all(0 < share <= 1 and abs(sum(weights) - share) < 1e-5 for _, _, weights, share in view.attention)
    for layer in result.trace.attention:  # every recorded row sums to 1
        assert torch.allclose(layer.probs.sum(-1), torch.ones(layer.probs.shape[:2]), atol=1e-4)
    sliding = [layer for layer in result.trace.attention if layer.window is not None]
    block = sliding[0].probs[:, view.start:view.end, view.start:view.end]  # (H, n, n)
    assert float(block.triu(1).sum()) > 0  # the "vision" rule: image tokens read later image tokens
    page = (tmp_path / "trace.html").read_text()
    assert f"{view.rows} x {view.cols} tokens" in page and "% on the image" in page
    # the page keeps the two-way half of the sliding layers (ahead), none for the causal global layers
    data, T = page_data(result.trace), len(result.trace.ids)
    assert data["image_spans"] == [[view.start, view.end]]
    for layer, stored in zip(result.trace.attention, data["attention"]):
        assert (stored["ahead"] is not None) == (layer.window is not None)
        back = decode_attention(stored["data"], stored["heads"], T, stored["ahead"], [(view.start, view.end)])
        assert (back - layer.probs).abs().max() < 0.01  # one byte per weight, sqrt-spaced


def test_trace_page_shows_the_two_way_attention_in_a_browser(folder, tmp_path):
    """Clicking an image token on a sliding layer: the bars run to the image's last token, the later ones
    (orange) as recorded, and the summary says the layer reads both ways there."""
    from lollm.cli.trace.run import run_trace
    from lollm.testing import trace_checks
    from lollm.testing.browser import Browser

    (path,) = saved(tmp_path, [(150, 64)])
    result = run_trace(str(folder), prompt="what is it", output=tmp_path / "trace.html", images=[path])
    (view,) = result.trace.images
    pos = view.start + 3
    sliding = next(layer for layer in result.trace.attention if layer.window is not None)
    with Browser() as browser:
        trace_checks.check_page(browser, result.path, result.trace, click=len(result.trace.ids) - 2)  # text: causal
        browser.click(f'.tok[data-pos="{pos}"]')
        browser.js("const s = document.getElementById('attn-layer'); s.value = arguments[0]; "
                   "s.dispatchEvent(new Event('change'))", str(sliding.layer))
        bars = browser.js("return Chart.getChart(document.getElementById('attn-bars')).data.datasets[0].data")
        summary = browser.texts("#attn-summary")[0]
    assert len(bars) == view.end  # keys 0 .. the image's last token
    gap = (torch.tensor(bars) - sliding.probs[:, pos, :view.end].mean(0)).abs().max()
    assert gap <= 0.01 and sum(bars[pos + 1:]) > 0
    assert f"keys {pos + 1}..{view.end - 1} (orange) come after it" in summary


def recorded_turns(monkeypatch) -> list[dict]:
    """Each call chat makes to the generate loop, recorded (its prompt ids and ImageBatch) and passed on."""
    import lollm.generate.conversation as conversation

    calls, right = [], conversation.generate

    def recording(model, ids, **kwargs):
        calls.append({"ids": list(ids), "images": kwargs.get("images")})
        return right(model, ids, **kwargs)

    monkeypatch.setattr(conversation, "generate", recording)
    return calls


def test_chat_image_turns_equal_transformers(loaded, folder, tmp_path, monkeypatch):
    """``/image`` then two turns (the second prefills the whole conversation, image included): each turn's
    prompt logits with the placed image equal transformers' on its own processor's pixels, and the greedy
    answer equals its ``generate``. (The tiny model's answers barely depend on the image: the logits do.)"""
    from PIL import Image
    from _gemma_testing import assert_close_logits
    from transformers import Gemma4ForConditionalGeneration

    from lollm.cli.chat import _command
    from lollm.generate.conversation import ChatSession
    from lollm.sampling_params import SamplingParams

    (path,) = saved(tmp_path, [(96, 60)])
    session = ChatSession(loaded, sampling=SamplingParams(temperature=0.0), stop_ids=set(), max_new_tokens=NEW,
                          context=200)
    notes: list[str] = []
    _command(session, f"/image {path}", notes.append)
    assert "1 image(s) go with your next message" in notes[-1]
    calls = recorded_turns(monkeypatch)
    reference = Gemma4ForConditionalGeneration.from_pretrained(str(folder), dtype=torch.float32).eval()
    pixels = reference_processor()(images=[Image.open(path).convert("RGB")], return_tensors="pt")
    for turn, text in enumerate(("what is", "and then?")):
        got = session.reply(text).new_ids
        ids, images = calls[turn]["ids"], calls[turn]["images"]
        assert ids.count(IMAGE) == int(pixels["num_soft_tokens_per_image"][0]) and len(images.images) == 1
        inputs = dict(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                      image_position_ids=pixels["image_position_ids"],
                      mm_token_type_ids=(torch.tensor([ids]) == IMAGE).long())
        with torch.inference_mode():
            assert_close_logits(loaded.model(torch.tensor([ids]), images=images)[0], reference(**inputs).logits[0], ids)
            want = reference.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == want[0, len(ids):].tolist(), text
