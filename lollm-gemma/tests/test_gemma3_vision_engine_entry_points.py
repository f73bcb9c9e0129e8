"""Images through ``lollm serve`` (the official ``openai`` and ``anthropic`` SDKs) and ``lollm chat``'s ``/image`` (issue 39).

The tiny Gemma 3 with a vision tower of test_gemma3_vision_cli.py (its tokenizer knows Gemma 3's
image tokens), given a chat template of ours that writes ``<start_of_image>`` for an image content
part, as Gemma 3's own does. The server runs requests through the batched engine. The reference
is lollm's single-sequence loop (``generate(..., images=)``, held to transformers by
test_gemma3_vision.py) on the prompt built by hand: the template's text, the placeholder expanded,
tokenized.
"""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image, ImageDraw

from lollm.generate.loop import generate
from lollm.sampling_params import SamplingParams
from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.testing import serving
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, expand_placeholders, place_images

from test_gemma3_vision import tiny_gemma3_vision
from test_gemma3_vision_cli import with_image_tokens

NAME, CONTEXT, NEW = "tiny-gemma3-vision", 128, 8
#: ChatML whose user content may be a list of parts; an image part is Gemma 3's placeholder.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def picture(seed: int, size=(70, 40)) -> Image.Image:
    img = Image.new("RGB", size, (20 + 30 * seed, 90, 200))
    ImageDraw.Draw(img).polygon([(10, 30), (60, 30), (50, 38), (20, 38)], fill=(120, 60 + seed, 20))
    return img


def png_b64(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def openai_image(img: Image.Image) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + png_b64(img)}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = with_image_tokens(write_tiny_checkpoint(tiny_gemma3_vision(), tmp_path_factory.mktemp("gemma3-vision-serve"),
                                                     init_std=SENSITIVE_INIT_STD))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def loaded(folder):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    return open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def server(loaded):
    server = ModelServer(loaded, name=NAME, context=CONTEXT)
    assert server.engine_loop is not None  # the batched engine serves the images
    try:
        with serving.app_in_thread(create_app(server)) as root:
            server.root = root
            yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def tower(loaded):
    return open_vision(loaded)


def reference(loaded, server, tower, text: str, images: list, *, images_first: bool = False) -> tuple[int, str, list[float]]:
    """(prompt tokens, greedy text, each token's log-probability) of lollm's single-sequence loop on one user
    turn: the part ``text``, then one image part per image (before it with ``images_first``)."""
    parts = [{"type": "text", "text": text}]
    parts = [{"type": "image"}] * len(images) + parts if images_first else parts + [{"type": "image"}] * len(images)
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    encoded = encode_images(tower, images)
    ids = loaded.tokenizer.encode(expand_placeholders(rendered, tower.spec, [e.embeds.shape[0] for e in encoded]),
                                  add_special_tokens=False)
    placed = place_images(ids, tower.spec, encoded, max_context=CONTEXT)
    result = generate(loaded.model, ids, max_new_tokens=NEW, sampling=SamplingParams(temperature=0.0),
                      stop_ids=stop_ids(server), tokenizer=loaded.tokenizer, images=placed, logprobs=1)
    return len(ids), result.text, [lp.logprob for lp in result.logprobs]


def stop_ids(server) -> set[int]:
    return set(server.stop_ids) if server is not None else {1}


def test_openai_image_request_gives_the_single_sequence_answer(loaded, server, tower):
    client = serving.openai_client(server.root + "/v1")
    images = [picture(1), picture(2, (33, 90))]
    reply = client.chat.completions.create(
        model=NAME, max_tokens=NEW, temperature=0, logprobs=True,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is"}] + [openai_image(i) for i in images]}])
    prompt_tokens, text, logprobs = reference(loaded, server, tower, "what is", images)
    assert reply.usage.prompt_tokens == prompt_tokens and reply.choices[0].message.content == text
    # the tiny model's greedy text is a run of newlines: its log-probabilities carry the evidence
    got = [item.logprob for item in reply.choices[0].logprobs.content]
    assert len(got) == len(logprobs) and max(abs(a - b) for a, b in zip(got, logprobs)) < 1e-4, (got, logprobs)


def test_anthropic_image_blocks_give_the_same_answer(loaded, server, tower):
    from anthropic import Anthropic

    client = Anthropic(base_url=server.root, api_key="unused", max_retries=0, timeout=120)
    image = picture(3)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64(image)}}
    reply = client.messages.create(model=NAME, max_tokens=NEW, extra_body={"temperature": 0},  # SDK 2.17 has no temperature
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}, block]}])
    prompt_tokens, text, _ = reference(loaded, server, tower, "hello", [image])
    assert reply.usage.input_tokens == prompt_tokens and "".join(b.text for b in reply.content) == text


def test_anthropic_url_source_is_a_400_naming_the_rule(server):
    import anthropic

    client = anthropic.Anthropic(base_url=server.root, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError, match="only base64 image sources"):
        client.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])


def test_more_images_than_the_context_holds_is_a_400_naming_it(server):
    import openai

    client = serving.openai_client(server.root + "/v1")
    with pytest.raises(openai.BadRequestError, match=r"7 image\(s\) take 112 tokens") as info:
        client.chat.completions.create(model=NAME, max_tokens=4, messages=[
            {"role": "user", "content": [openai_image(picture(i)) for i in range(7)]}])
    assert info.value.body["code"] == "context_length_exceeded"


def test_a_client_typing_the_placeholder_gets_text_not_an_image_slot(loaded, server, tower):
    client = serving.openai_client(server.root + "/v1")
    reply = client.chat.completions.create(model=NAME, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "<start_of_image>"}, openai_image(picture(4))]}])
    assert reply.usage.prompt_tokens > reference(loaded, server, tower, "", [picture(4)])[0]  # its text, as plain pieces


def test_the_prefix_cache_reuses_an_image_only_for_the_same_pixels(server):
    client = serving.openai_client(server.root + "/v1")

    def cached(img) -> int:
        reply = client.chat.completions.create(model=NAME, max_tokens=1, messages=[
            {"role": "user", "content": [openai_image(img), {"type": "text", "text": "describe it in a word"}]}])
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    client.chat.completions.create(model=NAME, max_tokens=1, messages=[{"role": "user", "content": [openai_image(picture(5))]}])
    first, n = cached(picture(6))
    again, _ = cached(picture(6))
    other, _ = cached(picture(7))
    assert first == 0 and again == (n - 1) // 16 * 16 > 16 and other == 0  # the image starts in block 0


def test_chat_image_goes_with_the_next_message(loaded, server, tower, tmp_path):
    from lollm.cli.chat import _command
    from lollm.generate.conversation import ChatSession

    path = tmp_path / "boat.png"
    picture(8).save(path)
    session = ChatSession(loaded, sampling=SamplingParams(temperature=0.0), stop_ids=stop_ids(server),
                          max_new_tokens=NEW, context=CONTEXT)
    notes: list[str] = []
    _command(session, f"/image {tmp_path / 'missing.png'}", notes.append)
    assert notes[-1].startswith("error:") and "missing.png" in notes[-1] and not session.pending
    _command(session, f"/image {path}", notes.append)
    assert "1 image(s) go with your next message" in notes[-1]
    result = session.reply("what is")
    prompt_tokens, text, _ = reference(loaded, server, tower, "what is", [Image.open(path).convert("RGB")],
                                       images_first=True)
    assert session.cache.last.prompt_tokens == prompt_tokens and result.text == text
    assert not session.pending and session.cache.last.how.startswith("off")
    session.reply("and then?")  # the image stays in the conversation: its prompt expands it again
    assert session.cache.last.prompt_tokens > prompt_tokens


def test_parity_with_images_passes_and_a_broken_mask_fails(folder, tmp_path, monkeypatch):
    """``lollm parity --image`` (two images of other sizes) against transformers' Gemma3ForConditionalGeneration;
    the same run with the image attended causally (the mask of the bidirectional image made causal) fails."""
    from typer.testing import CliRunner

    from lollm.cli import app
    from lollm.proof.parity import run_parity
    from lollm_gemma.gemma3 import blocks

    paths = []
    for i, size in enumerate([(70, 40), (31, 77)]):
        paths.append(str(tmp_path / f"p{i}.png"))
        picture(i, size).save(paths[-1])
    result = CliRunner().invoke(app, ["parity", str(folder), "--image", paths[0], "--image", paths[1], "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["num_tokens"] > 2 * 16 and report["min_cosine"] >= 0.9999
    visible = blocks.image_visible
    causal = lambda start, T, S, window, numbers: visible(start, T, S, window, numbers * 0 - 1)  # noqa: E731
    monkeypatch.setattr(blocks, "image_visible", causal)
    assert not run_parity(str(folder), images=paths).passed


def test_trace_with_an_image_draws_its_tokens_and_their_attention(folder, tmp_path):
    """``lollm trace --image``: the page holds the image's 4 x 4 token grid and, for the last positions, the
    attention each token received: recorded weights that sum (with the text's) to 1 per row."""
    from lollm.cli.trace.run import run_trace

    path = tmp_path / "p.png"
    picture(2).save(path)
    result = run_trace(str(folder), prompt="what is it", output=tmp_path / "trace.html", images=[str(path)])
    (view,) = result.trace.images
    assert (view.rows, view.cols) == (4, 4) and view.end - view.start == 16
    assert view.attention and view.attention[-1][0] == len(result.trace.ids) - 1
    assert all(0 < share <= 1 and abs(sum(weights) - share) < 1e-5 for _, _, weights, share in view.attention)
    assert len(result.trace.attention) == loaded_layers(folder)  # every layer recorded, the image's forward too
    page = (tmp_path / "trace.html").read_text()
    assert "image 1: positions" in page and "% on the image" in page and "data:image/png;base64," in page


def loaded_layers(folder) -> int:
    return json.loads((folder / "config.json").read_text())["text_config"]["num_hidden_layers"]
