"""Qwen3.5 and Qwen3.5-MoE images through ``lollm parity --image``, ``lollm trace --image`` and chat's ``/image``.

The lively tiny multimodal checkpoints of test_vision_cli.py (livened tower, small pixel budget, Qwen3.5's
vision tokens in the tokenizer) with a chat template that writes Qwen3.5's placeholder per image part.

* ``reference_inputs`` of our pixels equals transformers' ``Qwen2VLImageProcessorPil`` output (all images'
  patches concatenated, and their grids) at the sizes and budgets the preprocessing tests use;
* ``lollm parity --image`` passes with 1 and 2 images of held-out sizes and aspect ratios (transformers
  computes its M-RoPE positions from ``image_grid_thw`` and ``mm_token_type_ids``), and fails when our
  side scatters the images one token off;
* ``lollm trace --image``: the Images section has the placed image's grid (rows x cols);
* chat: ``/image`` then two turns; the second re-prefills the whole conversation, image included, so its
  M-RoPE positions are built again: each turn's prompt logits and greedy answer equal transformers'.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

import qwen3_5_tiny as tiny
from lollm_qwen3_5.vision_family import Qwen3_5Vision
from lollm_qwen3_5.vision_preprocess import ProcessorConfig
from test_vision_cli import IMAGE, folder  # noqa: F401  (folder: the module fixture, reused)
from test_vision_engine import TEMPLATE
from test_vision_preprocess import QWEN3_5_PREPROCESSOR, SIZES, SMALL_BUDGET, drawing, reference_processor
from test_vision_tower import FAMILIES, MIN_COSINE

NEW = 5


@pytest.fixture(scope="module")
def chat_folder(folder):  # noqa: F811
    """``chat_folder(family)``: the checkpoint of test_vision_cli with the chat template written in."""
    def get(family: str):
        path = folder(family)
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
        return path

    return get


def saved(tmp_path, sizes) -> list[str]:
    paths = []
    for i, (w, h) in enumerate(sizes):
        paths.append(str(tmp_path / f"p{i}.png"))
        drawing(w, h, seed=50 + i).save(paths[-1])
    return paths


@pytest.mark.parametrize("raw", [QWEN3_5_PREPROCESSOR, SMALL_BUDGET], ids=["qwen3_5", "small-budget"])
def test_reference_inputs_equal_the_image_processor(raw):
    """Only the processor's numbers matter here: a tower object without weights."""
    from lollm.vision.reference import reference_inputs

    tower = Qwen3_5Vision(None, ProcessorConfig.from_file_dict(raw), None, torch.float32)
    images = [drawing(w, h, seed=i) for i, (w, h) in enumerate(SIZES)]
    theirs = reference_processor(raw)(images, return_tensors="pt")
    ours = reference_inputs(tower, [tower.preprocess(image) for image in images])
    assert set(ours) == {"pixel_values", "image_grid_thw"}
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert ours["pixel_values"].shape == theirs["pixel_values"].shape
    # the reference normalizes in another order (numpy): equal within float32 rounding, as test_vision_preprocess
    assert torch.allclose(ours["pixel_values"], theirs["pixel_values"].float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("sizes", [[(85, 62)], [(62, 85), (120, 40)]], ids=["1 image", "2 images"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parity_with_images_passes(chat_folder, tmp_path, family, sizes):
    from typer.testing import CliRunner

    from lollm.cli import app

    args = ["parity", str(chat_folder(family)), "--json"] + [a for p in saved(tmp_path, sizes) for a in ("--image", p)]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["min_cosine"] >= MIN_COSINE and report["num_tokens"] > 6 * len(sizes)


def test_parity_fails_with_the_images_one_token_off(chat_folder, tmp_path, monkeypatch):
    import lollm.vision.load as load
    from lollm.proof.parity import run_parity
    from lollm.vision.spec import ImageBatch, PlacedImage

    right = load.place_images

    def one_off(ids, spec, encoded, *, max_context):
        batch = right(ids, spec, encoded, max_context=max_context)
        return ImageBatch([PlacedImage(im.start + 1, im.embeds, im.pixel_hash, im.grid) for im in batch.images])

    monkeypatch.setattr(load, "place_images", one_off)
    report = run_parity(str(chat_folder("qwen3_5")), images=saved(tmp_path, [(62, 85), (120, 40)]))
    assert not report.passed and report.min_cosine < MIN_COSINE


def test_trace_draws_the_placed_grid(chat_folder, tmp_path):
    from lollm.cli.trace.run import run_trace

    (path,) = saved(tmp_path, [(120, 40)])
    result = run_trace(str(chat_folder("qwen3_5")), prompt="what is it", output=tmp_path / "trace.html", images=[path])
    (view,) = result.trace.images
    _, h, w = reference_processor(SMALL_BUDGET)([Image.open(path).convert("RGB")], return_tensors="pt")["image_grid_thw"][0]
    assert (view.rows, view.cols) == (int(h) // 2, int(w) // 2) and view.rows != view.cols  # the 2 x 2 merge
    assert view.width_px > view.height_px
    assert view.attention and all(0 < share <= 1 and abs(sum(weights) - share) < 1e-5
                                  for _, _, weights, share in view.attention)
    assert result.trace.attention  # the full-attention layers recorded their weights
    for layer in result.trace.attention:
        assert torch.allclose(layer.probs.sum(-1), torch.ones(layer.probs.shape[:2]), atol=1e-4)
    page = (tmp_path / "trace.html").read_text()
    assert f"{view.rows} x {view.cols} tokens" in page and "% on the image" in page


def recorded_turns(monkeypatch) -> list[dict]:
    """Each call chat makes to the generate loop, recorded (its prompt ids and ImageBatch) and passed on."""
    import lollm.generate.conversation as conversation

    calls, right = [], conversation.generate

    def recording(model, ids, **kwargs):
        calls.append({"ids": list(ids), "images": kwargs.get("images")})
        return right(model, ids, **kwargs)

    monkeypatch.setattr(conversation, "generate", recording)
    return calls


def assert_close_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    assert cos.min() >= MIN_COSINE, f"min cosine {cos.min():.6f} at position {int(cos.argmin())}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), "argmax differs"


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_image_turns_equal_transformers(chat_folder, tmp_path, monkeypatch, family):
    """``/image`` then two turns: each turn's prompt logits with the placed image equal transformers' (which
    builds its M-RoPE positions from the ids and the grid), and its greedy answer equals ``generate``."""
    from lollm.cli.chat import _command
    from lollm.generate.conversation import ChatSession
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.sampling_params import SamplingParams

    path = chat_folder(family)
    loaded = open_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    (picture,) = saved(tmp_path, [(88, 60)])
    session = ChatSession(loaded, sampling=SamplingParams(temperature=0.0), stop_ids=set(), max_new_tokens=NEW,
                          context=200)
    notes: list[str] = []
    _command(session, f"/image {picture}", notes.append)
    assert "1 image(s) go with your next message" in notes[-1]
    calls = recorded_turns(monkeypatch)
    reference = tiny.reference_class(family, "multimodal").from_pretrained(str(path), dtype=torch.float32).eval()
    pixels = reference_processor(SMALL_BUDGET)([Image.open(picture).convert("RGB")], return_tensors="pt")
    for turn, text in enumerate(("what is", "and then?")):
        got = session.reply(text).new_ids
        ids, images = calls[turn]["ids"], calls[turn]["images"]
        assert ids.count(IMAGE) == int(pixels["image_grid_thw"][0].prod()) // 4 and len(images.images) == 1
        inputs = dict(input_ids=torch.tensor([ids]), pixel_values=pixels["pixel_values"],
                      image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int())
        with torch.inference_mode():
            assert_close_logits(loaded.model(torch.tensor([ids]), images=images)[0], reference(**inputs).logits[0])
            want = reference.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert got == want[0, len(ids):].tolist(), text
