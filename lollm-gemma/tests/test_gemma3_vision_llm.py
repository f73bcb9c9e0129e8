"""Images through the Python API: ``LLM.generate`` with :class:`lollm.ImagePrompt` (issue 39).

The tiny Gemma 3 with a vision tower and a chat template of test_gemma3_vision_engine_entry_points.py.
An image prompt batched with text prompts in one call gives the tokens and log-probabilities of

* ``lollm run --image`` on the same picture and text (the same prompt ids, the same greedy ids), and
* lollm's single-sequence loop on those ids and images (held to transformers by test_gemma3_vision.py);

the engine kept between calls reuses the image's blocks for the same pixels only; every hostile
image is one ImageError naming the prompt and the image, raised before the tower runs.
"""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image
from typer.testing import CliRunner

from lollm import ImagePrompt, LLM, SamplingParams
from lollm.errors import GenerationError, ImageError
from lollm.generate.loop import generate
from lollm.testing.tiny import write_tiny_checkpoint, write_tiny_tokenizer
from lollm.vision import load as vision_load
from lollm.vision.prompt import encode_images, expand_placeholders, place_images

from test_gemma3_vision import IMAGE, TOKENS
from test_gemma3_vision_engine_entry_points import folder, picture, png_b64  # noqa: F401 (a fixture)

NEW = 6
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def llm(folder):  # noqa: F811
    return LLM(str(folder), device="cpu", dtype="float32")


def loop_logprobs(llm, ids: list[int], images: list) -> list[float]:
    """The single-sequence loop's greedy log-probabilities on ``ids`` with ``images`` placed in them."""
    tower = llm._vision()
    placed = place_images(ids, tower.spec, encode_images(tower, images), max_context=llm.model.max_context)
    result = generate(llm.model, ids, max_new_tokens=NEW, sampling=GREEDY, stop_ids=llm.stop_ids,
                      tokenizer=llm.tokenizer, images=placed, logprobs=1)
    return [lp.logprob for lp in result.logprobs]


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def test_an_image_prompt_among_text_prompts_gives_lollm_run_image_and_the_loop(llm, folder, tmp_path):  # noqa: F811
    path = tmp_path / "boat.png"
    picture(1).save(path)
    prompts = ["tell me a story", ImagePrompt("what is this?", [str(path)]), "name three rivers",
               ImagePrompt("and this?", [png(picture(2, (33, 90)))])]
    done = llm.generate(prompts, GREEDY, max_new_tokens=NEW, logprobs=1)
    assert [c.batched for c in done] == [True] * 4 and done[1].prompt is prompts[1]
    image_ids = done[1].prompt_ids
    assert image_ids.count(IMAGE) == TOKENS and done[0].prompt_ids.count(IMAGE) == 0

    from lollm.cli import app

    ran = CliRunner().invoke(app, ["run", str(folder), "--image", str(path), "-p", "what is this?", "-n", str(NEW),
                                   "--temperature", "0", "--json", "--device", "cpu", "--dtype", "float32"],
                             catch_exceptions=False)
    assert ran.exit_code == 0, ran.output
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out["prompt_ids"] == image_ids and out["ids"] == done[1].token_ids

    # the tiny model's greedy text repeats: the log-probabilities carry the evidence
    assert close([lp.logprob for lp in done[1].logprobs], loop_logprobs(llm, image_ids, [Image.open(path).convert("RGB")]))
    alone = llm.generate(ImagePrompt("what is this?", [picture(1)]), GREEDY, max_new_tokens=NEW, logprobs=1)[0]
    assert alone.prompt_ids == image_ids and close([lp.logprob for lp in alone.logprobs],
                                                   [lp.logprob for lp in done[1].logprobs])
    text_alone = llm.generate("tell me a story", GREEDY, max_new_tokens=NEW)[0]
    assert text_alone.token_ids == done[0].token_ids
    only_image = llm.generate(ImagePrompt("", [picture(1)]), GREEDY, max_new_tokens=1)[0]  # no text: the image alone
    assert only_image.prompt_ids.count(IMAGE) == TOKENS


def test_the_kept_engine_reuses_an_image_only_for_the_same_pixels(llm):
    def cached(img) -> int:
        return llm.generate(ImagePrompt("describe it in a word", [img]), GREEDY, max_new_tokens=1)[0].cached_tokens

    first = cached(picture(6))
    again, other = cached(picture(6)), cached(picture(7))
    assert first == 0 and again > TOKENS and other == 0  # the image starts in block 0


def test_placeholders_in_the_text_go_where_written_and_must_match_the_images(llm):
    done = llm.generate(ImagePrompt("first <start_of_image> then <start_of_image> end", [picture(1), picture(2)]),
                        GREEDY, max_new_tokens=1)[0]
    ids = done.prompt_ids
    first, second = ids.index(IMAGE), len(ids) - 1 - ids[::-1].index(IMAGE)
    assert ids.count(IMAGE) == 2 * TOKENS and second - first + 1 > 2 * TOKENS  # two runs, text between them
    before, between = llm.tokenizer.decode(ids[:first]), llm.tokenizer.decode(ids[first + TOKENS:second - TOKENS + 1])
    assert "first" in before and "then" not in before and "then" in between
    with pytest.raises(ImageError, match=r"prompts\[0\]: the prompt holds 1 image placeholder\(s\).* but 2 image"):
        llm.generate(ImagePrompt("only <start_of_image> here", [picture(1), picture(2)]), max_new_tokens=1)


def hostile_cases(tmp_path) -> list[tuple[object, str]]:
    """(an image as a caller may give it, what its ImageError says)."""
    cut = tmp_path / "cut.png"
    picture(1).save(cut)
    cut.write_bytes(cut.read_bytes()[:60])
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    gif = tmp_path / "anim.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    return [(str(cut), "cut.png.*truncated"), (cut.read_bytes(), "truncated"), (str(tmp_path / "missing.png"), "missing.png"),
            (Image.new("CMYK", (8, 8)), "CMYK"), (Image.new("I;16", (8, 8)), "16-bit"), (Image.open(gif), "animated"),
            (Image.new("RGB", (0, 0)), "0x0"), (b"not an image", "not an image"), (12, "is a int")]


def test_a_hostile_image_is_an_image_error_naming_it_before_anything_runs(llm, tmp_path, monkeypatch):
    def tower_must_not_run(*args, **kwargs):
        raise AssertionError("the tower ran before every image was checked")

    monkeypatch.setattr(vision_load, "encode_images", tower_must_not_run)
    for image, words in hostile_cases(tmp_path):
        with pytest.raises(ImageError, match=r"prompts\[2\]\.images\[1\].*" + words):
            llm.generate(["a text", ImagePrompt("good", [picture(1)]), ImagePrompt("bad", [picture(2), image])],
                         max_new_tokens=1)
    with pytest.raises(GenerationError, match=r"prompts\[0\]\.images must be a list"):
        llm.generate(ImagePrompt("one", picture(1)), max_new_tokens=1)
    with pytest.raises(GenerationError, match=r"prompts\[0\] is empty"):
        llm.generate(ImagePrompt("", []), max_new_tokens=1)
    with pytest.raises(GenerationError, match=r"prompts\[0\]\.text must be a str"):
        llm.generate(ImagePrompt(None, [picture(1)]), max_new_tokens=1)
    with pytest.raises(GenerationError, match="parse_special=True"):
        llm.generate(ImagePrompt("one", [picture(1)]), max_new_tokens=1, parse_special=False)


def test_a_model_without_a_tower_is_an_image_error_naming_it(tmp_path):
    from _gemma_testing import tiny_gemma3_1b

    folder = write_tiny_checkpoint(tiny_gemma3_1b(), tmp_path / "gemma3-1b")  # noqa: F811
    write_tiny_tokenizer(folder, vocab_size=512)
    text_only = LLM(str(folder), device="cpu", dtype="float32")
    with pytest.raises(ImageError, match="model .*gemma3-1b has no vision tower"):
        text_only.generate(["hi", ImagePrompt("what is this?", [picture(1)])], max_new_tokens=1)
    assert text_only.generate(ImagePrompt("no images: a text prompt", []), max_new_tokens=1)[0].prompt_tokens > 0


def test_chat_with_image_parts_gives_the_loop_on_the_templates_prompt(llm):
    """``LLM.chat``: the template writes the placeholder for each image part (a PIL image, or OpenAI's data: URL);
    a conversation with images batched with a text one gives the loop's log-probabilities on the prompt made by
    hand (the template's text, the placeholder expanded, tokenized)."""
    image = picture(3, (40, 52))
    parts = [{"type": "text", "text": "what is"}, {"type": "image", "image": image}]
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(image)}}
    done = llm.chat([[{"role": "user", "content": "hello"}], [{"role": "user", "content": parts}],
                     [{"role": "user", "content": [parts[0], url]}]], GREEDY, max_new_tokens=NEW, logprobs=1)
    tower = llm._vision()
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [parts[0], {"type": "image"}]}])
    ids = llm.tokenizer.encode(expand_placeholders(rendered, tower.spec, [TOKENS]), add_special_tokens=False)
    assert done[1].prompt_ids == done[2].prompt_ids == ids and done[0].prompt_ids.count(IMAGE) == 0
    expected = loop_logprobs(llm, ids, [image])
    assert close([lp.logprob for lp in done[1].logprobs], expected) and close([lp.logprob for lp in done[2].logprobs], expected)


def test_chat_refuses_a_hostile_image_part_by_name_before_anything_runs(llm, monkeypatch):
    def tower_must_not_run(*args, **kwargs):
        raise AssertionError("the tower ran before every image was checked")

    monkeypatch.setattr(llm, "_vision", tower_must_not_run)
    good = {"type": "image", "image": picture(1)}
    for part, words in [({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "only data: URLs"),
                        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}, "not valid base64"),
                        ({"type": "image", "image": Image.new("CMYK", (4, 4))}, "CMYK")]:
        with pytest.raises(ImageError, match=r"conversations\[1\]\[0\]\.content\[1\].*" + words):
            llm.chat([[{"role": "user", "content": [good]}], [{"role": "user", "content": [good, part]}]], max_new_tokens=1)
