"""A learner's tiny Qwen3.5 vision checkpoints (lollm.testing.tiny_vision, docs/vision.md "Try it without a real checkpoint").

For qwen3_5 and qwen3_5_moe, the folder :func:`write_tiny_vision_checkpoint` writes is a checkpoint every command
takes: Qwen3.5's own chat template renders an image content part as ``<|vision_start|><|image_pad|><|vision_end|>``
(one special token each), ``lollm run --image`` places the image's tokens, and ``lollm parity --image`` passes against
transformers. Its byte-level BPE tokenizer has no GGUF form: llama.cpp's converter does not recognise a tiny
pre-tokenizer (docs/vision.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lollm.testing.tiny_vision import drawing, write_tiny_vision_checkpoint

FAMILIES = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-vision-picture") / "picture.png"
    drawing(96, 64, 5).save(path)
    return path


@pytest.fixture(scope="module", params=FAMILIES)
def made(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_tiny_vision_checkpoint(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


def lollm(*args: str) -> str:
    """What the command printed (it must exit 0)."""
    from lollm.cli import app

    done = CliRunner().invoke(app, list(args), catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return done.stdout


def run(model: str, picture: Path, *extra: str) -> dict:
    """``lollm run --json``'s record (its last line) for one image and greedy decoding."""
    return json.loads(lollm("run", model, "--image", str(picture), *extra, "-p", "what is this?", "-n", "6", "--temperature", "0",
                 "--json", "--device", "cpu", "--dtype", "float32").strip().splitlines()[-1])


def test_the_chat_template_renders_an_image_as_its_special_tokens(made):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.vision.load import open_vision

    family, folder = made
    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    spec = open_vision(loaded).spec
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    assert spec.image_token_id == config.get("image_token_index", config.get("image_token_id"))
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is this?"}]}], add_generation_prompt=True)
    assert text.count(spec.placeholder) == 1, text
    placeholder = loaded.tokenizer.encode(spec.placeholder, add_special_tokens=False)
    special = {v for k, v in config.items() if k.endswith(("_token_id", "_token_index")) and isinstance(v, int)}
    assert placeholder and set(placeholder) <= special, f"{spec.placeholder!r} is {placeholder}, not the config's ids"
    assert loaded.tokenizer.vocab_size == config["text_config"]["vocab_size"]  # every id the model can emit has a token


def test_run_and_parity_with_an_image(made, picture):
    family, folder = made
    out = run(str(folder), picture)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    image_id = config.get("image_token_index", config.get("image_token_id"))
    assert out["prompt_ids"].count(image_id) > 0 and len(out["ids"]) == 6
    report = json.loads(lollm("parity", str(folder), "--image", str(picture), "--json"))
    assert report["passed"] and report["min_cosine"] >= 0.9999

