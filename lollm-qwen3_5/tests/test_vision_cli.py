"""``lollm run --image`` on a tiny Qwen3.5 (dense and MoE) with a vision tower: the tokens equal transformers' greedy generation.

The lively tiny multimodal checkpoint of test_vision_decoder, with a tokenizer whose ids 507..511
are Qwen3.5's vision tokens (``<|vision_end|>`` 507, ``<|vision_start|>`` 508, ``<|video_pad|>`` 509,
``<|image_pad|>`` 510, as qwen3_5_tiny numbers them, and one more to fill the 512 rows), so the
prompt goes the whole way: placeholder, chat template, expansion, tokenizer, tower, scatter,
M-RoPE, prefill and decode steps. The reference is transformers' ``generate`` on its own
processor's pixels and the prompt ids lollm printed.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image, ImageDraw
from typer.testing import CliRunner

import qwen3_5_tiny as tiny
from lollm.testing.tiny import write_tiny_tokenizer
from test_vision_preprocess import SMALL_BUDGET, reference_processor
from test_vision_tower import FAMILIES, liven_vision_weights

VISION_TOKENS = ["<|vision_end|>", "<|vision_start|>", "<|video_pad|>", "<|image_pad|>", "<|box_start|>"]
VISION_END, VISION_START, IMAGE = 507, 508, 510


def with_vision_tokens(folder):
    """The tiny tokenizer (507 ids) plus Qwen3.5's vision tokens as the special ids 507..511, in ``folder``."""
    from tokenizers import AddedToken, Tokenizer

    write_tiny_tokenizer(folder, vocab_size=507)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS])
    assert [tok.token_to_id(t) for t in VISION_TOKENS] == list(range(507, 512))
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_checkpoint):
    """``folder(family)``: the lively tiny multimodal checkpoint, livened tower, small pixel budget, vision tokens."""
    made = {}

    def get(family: str):
        if family not in made:
            out = tmp_path_factory.mktemp(f"vision-cli-{family}")
            shutil.copytree(tiny_checkpoint(family, "multimodal", lively=True), out, dirs_exist_ok=True)
            (out / "preprocessor_config.json").write_text(json.dumps(SMALL_BUDGET), encoding="utf-8")
            liven_vision_weights(out)
            raw = json.loads((out / "config.json").read_text(encoding="utf-8"))
            assert (raw["vision_end_token_id"], raw["vision_start_token_id"], raw["image_token_id"]) == (
                VISION_END, VISION_START, IMAGE)
            made[family] = with_vision_tokens(out)
        return made[family]

    return get


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    """A 88 x 60 drawing of a boat (a 2 x 3 token grid under the small budget)."""
    path = tmp_path_factory.mktemp("pictures") / "boat.png"
    img = Image.new("RGB", (88, 60), (20, 90, 200))
    ImageDraw.Draw(img).polygon([(10, 40), (78, 40), (66, 55), (22, 55)], fill=(120, 60, 20))
    ImageDraw.Draw(img).line((44, 5, 44, 40), fill=(250, 250, 250), width=3)
    img.save(path)
    return path


def lollm(*args: str):
    from lollm.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_run_with_an_image_equals_transformers_greedy(family, folder, picture):
    path = folder(family)
    done = lollm("run", str(path), "--image", str(picture), "-p", "what is this?", "-n", "6",
                 "--temperature", "0", "--json", "--device", "cpu", "--dtype", "float32")
    assert done.exit_code == 0, done.output
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ids = out["prompt_ids"]
    first, n = ids.index(IMAGE), ids.count(IMAGE)
    assert n == 6 and ids[first - 1] == VISION_START and ids[first + n] == VISION_END

    reference = tiny.reference_class(family, "multimodal").from_pretrained(str(path), dtype=torch.float32).eval()
    processed = reference_processor(SMALL_BUDGET)([Image.open(picture).convert("RGB")], return_tensors="pt")
    with torch.inference_mode():
        ref = reference.generate(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                                 image_grid_thw=processed["image_grid_thw"],
                                 mm_token_type_ids=(torch.tensor([ids]) == IMAGE).int(),
                                 max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out["ids"] == ref[0, len(ids):].tolist()


def test_families_lists_vision_for_both():
    from lollm.cli import app

    done = CliRunner().invoke(app, ["families"], env={"COLUMNS": "250"}, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    rows = {cells[1].strip(): cells[-2] for cells in (line.split("\u2502") for line in done.output.splitlines())
            if len(cells) > 3}  # the table's rows: | family | ... | capabilities |
    for family in FAMILIES:
        assert "vision" in rows[family], rows[family]


def test_an_mmproj_file_from_llama_cpp_gives_the_safetensors_tower(folder, picture, tmp_path):
    """What core's ``open_vision`` does for a GGUF model given ``--mmproj``: the mmproj file (llama.cpp's
    converter) as a checkpoint of its own, with the text model's tokenizer, through the family's
    ``load_vision``: the same spec and embeddings as the safetensors tower. The pixel budget comes
    from the preprocessor_config.json beside the mmproj file (the file itself carries none)."""
    import dataclasses

    from lollm.load.loader import load_gguf
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.testing.converter import convert
    from lollm.vision.load import open_vision
    from lollm.vision.prompt import encode_images

    path = folder("qwen3_5")
    mmproj = convert(path, tmp_path / "mmproj-f32.gguf", "f32", ("--mmproj",))
    shutil.copy(path / "preprocessor_config.json", tmp_path / "preprocessor_config.json")
    loaded = open_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    checkpoint = dataclasses.replace(load_gguf(mmproj), _tokenizer=loaded.tokenizer)
    from_gguf = loaded.family.family.resolve("vision")(checkpoint, loaded.options)
    from_safetensors = open_vision(loaded)
    assert from_gguf.spec == from_safetensors.spec and from_gguf.spec.image_token_id == IMAGE
    image = Image.open(picture).convert("RGB")
    (a,), (b,) = encode_images(from_safetensors, [image]), encode_images(from_gguf, [image])
    assert a.grid == b.grid == (1, 2, 3) and a.pixel_hash == b.pixel_hash
    assert torch.allclose(a.embeds, b.embeds, atol=1e-5), f"max |diff| {(a.embeds - b.embeds).abs().max():.3g}"
