"""Qwen3.5 images through the batched engine (issue 39): the lively tiny checkpoints of test_vision_decoder.

In an engine step every sequence turns by its own positions: M-RoPE for a sequence with images
(its decode steps too, whose positions stay shifted by the images before them), 1-D RoPE for a
text sequence of the same step. The engine hands a sequence's images in every step it runs.

* an image request batched with text requests (and a second image request joining late) gives the
  greedy tokens it gives alone, and those of the single-sequence loop (lollm.generate.loop), which
  test_vision_decoder.py holds to transformers: the token budget (16) cuts the prompts into chunks,
  and 6 decode steps follow the images;
* the prefix cache keys image blocks by the pixel hash: the same prompt with the same image reuses
  blocks past the image, with another image it stops before the image;
* ``lollm serve`` answers a Qwen3.5 image request (one openai SDK call) with the loop's answer.
"""

from __future__ import annotations

import base64
import io
import json

import pytest

from lollm.engine import Engine, EngineConfig
from lollm.generate.loop import generate
from lollm.sampling_params import SamplingParams
from lollm.vision.prompt import encode_images, place_images

from test_vision_cli import IMAGE, folder  # noqa: F401  (folder: the module fixture, reused)
from test_vision_decoder import case, lively  # noqa: F401  (lively: the module fixture, reused)
from test_vision_preprocess import drawing
from test_vision_tower import FAMILIES

GREEDY = SamplingParams(temperature=0.0)
NEW = 6
CONFIG = EngineConfig(kv_blocks=160, block_size=4, max_sequences=4, max_batch_tokens=16)


def placed(tower, model, ids, images):
    return place_images(ids, tower.spec, encode_images(tower, images), max_context=model.max_context)


def prompt_of(lively, family, n_images, seed=0):  # noqa: F811
    """(model, ids, placed ImageBatch) of test_vision_decoder's prompt with ``n_images`` drawings."""
    folder, model, tower, _ = lively(family)
    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    ids, _, images, _ = case(raw, n_images)
    if seed:
        images = [drawing(im.width, im.height, seed=seed + k) for k, im in enumerate(images)]
    return model, ids, placed(tower, model, ids, images)


def run(model, requests, config=CONFIG, late=()):
    """Run ``[(ids, images or None), ...]`` in one engine (those in ``late`` join after 3 steps).

    Per request its greedy tokens, each with its log-probability: ``[(token, logprob), ...]``.
    """
    engine = Engine(model, config)
    names, out = {}, {}

    def add(i):
        ids, images = requests[i]
        names[engine.add_request(ids, sampling=GREEDY, max_new_tokens=NEW, images=images, logprobs=1)] = i
    for i in range(len(requests)):
        if i not in late:
            add(i)
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(names[o.request_id], []).append((o.step.token, o.step.logprobs.logprob))
        steps += 1
        if steps == 3:
            for i in late:
                add(i)
    return [out[i] for i in range(len(requests))]


def solo(model, ids, images=None):
    """The single-sequence loop's greedy tokens and log-probabilities (lollm.generate.loop.generate)."""
    result = generate(model, ids, max_new_tokens=NEW, sampling=GREEDY, images=images, logprobs=1)
    return [(lp.token, lp.logprob) for lp in result.logprobs]


def assert_same(got, want):
    """The same tokens, log-probabilities within 1e-4 (the engine's attention sums in another order)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4, (got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_image_requests_batched_with_text_give_their_tokens_alone(lively, family):  # noqa: F811
    model, one, first = prompt_of(lively, family, 1)
    _, two, second = prompt_of(lively, family, 2)
    text = [[1, 17, 42, 99, 5, 6, 7, 8, 9, 10, 11], [1] + list(range(40, 70))]
    alone = [run(model, [(one, first)])[0], run(model, [(two, second)])[0]]
    for got, want in zip(alone, [solo(model, one, first), solo(model, two, second)]):
        assert_same(got, want)
    assert len({t for t, _ in alone[1]}) > 1, "a constant continuation would not show the positions"
    together = run(model, [(text[0], None), (one, first), (text[1], None), (two, second)], late=(3,))
    assert_same(together[1], alone[0])
    assert_same(together[3], alone[1])
    for got, ids in zip([together[0], together[2]], text):
        assert_same(got, solo(model, ids))


def test_decode_steps_without_the_images_lose_the_shift(lively, monkeypatch):  # noqa: F811
    """The mutant: the engine passes images only in the steps that hold image positions (as it did for
    Gemma). The decode steps then turn by unshifted positions and the log-probabilities move."""
    import lollm.engine.engine as engine_module

    model, ids, images = prompt_of(lively, "qwen3_5", 2)
    want = solo(model, ids, images)
    forward = engine_module.Engine._forward

    def only_inside(self, plan):
        kept = {req.request_id: req.images for req, _ in plan}
        for req, n in plan:
            if req.images is not None and not req.images.within(req.computed, n):
                req.images = None
        try:
            return forward(self, plan)
        finally:
            for req, _ in plan:
                req.images = kept[req.request_id]

    monkeypatch.setattr(engine_module.Engine, "_forward", only_inside)
    got = run(model, [(ids, images)])[0]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_for_the_same_image_and_misses_for_another(lively, family):  # noqa: F811
    model, ids, same = prompt_of(lively, family, 1)
    _, _, other = prompt_of(lively, family, 1, seed=90)
    image = same.images[0]
    engine = Engine(model, CONFIG)

    def serve(images):
        name = engine.add_request(ids, sampling=GREEDY, max_new_tokens=NEW, images=images, logprobs=1)
        req, tokens = engine.requests[name], []
        while engine.has_unfinished():
            tokens += [(o.step.token, o.step.logprobs.logprob) for o in engine.step()]
        return req.cached_tokens, tokens

    cold, cold_tokens = serve(same)
    hit, hit_tokens = serve(same)
    miss, miss_tokens = serve(other)
    assert cold == 0
    # every full block (13 ids, blocks of 4: 12 positions) is reused, past the image's end (10) ...
    assert hit == (len(ids) - 1) // 4 * 4 >= image.end, (hit, image.end)
    assert_same(hit_tokens, cold_tokens)  # ... and the text after it keeps its shifted positions
    # another image: nothing from the image on (a recurrent model resumes only at a block with a
    # snapshot, and this prompt's one chunk left none before the image)
    assert miss <= image.start, (miss, image.start)
    assert_same(miss_tokens, run(model, [(ids, other)])[0])
    assert abs(miss_tokens[0][1] - hit_tokens[0][1]) > 1e-3


# --- lollm serve: one openai SDK call -------------------------------------------------------------
NAME, CONTEXT = "tiny-qwen3_5-vision", 160
#: ChatML whose user content may be a list of parts; an image part is Qwen3.5's placeholder.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def openai_image(img) -> dict:
    """An OpenAI ``image_url`` content part carrying ``img`` (a PIL image) as a PNG ``data:`` URL."""
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}


def test_serve_answers_an_image_request_as_the_loop(folder):  # noqa: F811
    """The lively checkpoint with Qwen3.5's vision tokens and a chat template: the server's engine gives
    the single-sequence loop's greedy tokens on the prompt built by hand (template, expansion, tokenizer)."""
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.serve.app import create_app
    from lollm.serve.model_server import ModelServer
    from lollm.testing import serving
    from lollm.vision.load import open_vision
    from lollm.vision.prompt import expand_placeholders

    path = folder("qwen3_5")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    loaded = open_model(str(path), LoadOptions(device="cpu", dtype="float32"))
    tower, image = open_vision(loaded), drawing(88, 60, seed=7)
    server = ModelServer(loaded, name=NAME, context=CONTEXT)
    assert server.engine_loop is not None  # the batched engine serves the image
    try:
        with serving.app_in_thread(create_app(server)) as root:
            reply = serving.openai_client(root + "/v1").chat.completions.create(
                model=NAME, max_tokens=NEW, temperature=0, logprobs=True,
                messages=[{"role": "user", "content": [{"type": "text", "text": "what is"}, openai_image(image)]}])
    finally:
        server.close()
    rendered = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "image"}]}])
    encoded = encode_images(tower, [image])
    ids = loaded.tokenizer.encode(expand_placeholders(rendered, tower.spec, [e.embeds.shape[0] for e in encoded]),
                                  add_special_tokens=False)
    assert ids.count(IMAGE) == 6
    result = generate(loaded.model, ids, max_new_tokens=NEW, sampling=GREEDY, stop_ids=set(server.stop_ids),
                      tokenizer=loaded.tokenizer, images=place_images(ids, tower.spec, encoded, max_context=CONTEXT),
                      logprobs=1)
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].message.content == result.text
    got, want = [item.logprob for item in reply.choices[0].logprobs.content], [lp.logprob for lp in result.logprobs]
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
