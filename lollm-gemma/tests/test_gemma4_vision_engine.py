"""Gemma 4 images through the batched engine (issue 39): the tiny checkpoint of test_gemma4_vision_decoder.py.

Both mask rules: "e2b" (images causal, like text) and "vision" (26B/31B: on the sliding layers an
image's tokens see each other both ways, in the paged path too: blocks.attend_images_in_step).

* an image request batched with text requests (and with another image request) gives the greedy
  tokens it gives alone, and those of the single-sequence loop (lollm.generate.loop), which
  test_gemma4_vision_decoder.py holds to transformers: the token budget (72) cuts the prompts
  into chunks, the blocks (4 positions) end inside the images (60-66 tokens each), the sliding
  window (6) is shorter than an image, and the KV-sharing layers read their source's pools;
* the prefix cache keys image blocks by the pixel hash: the same prompt with the same image reuses
  the blocks past the image, with another image it stops at the first block holding an image token;
* ``lollm serve`` answers a Gemma 4 image request (one openai SDK call) with the loop's answer.
"""

from __future__ import annotations

import json

import pytest

from lollm.engine import Engine, EngineConfig
from lollm.generate.loop import generate
from lollm.sampling_params import SamplingParams
from lollm.vision.load import open_vision

from test_gemma4_vision import drawing
from test_gemma4_vision_decoder import image_prompt, write_variant

GREEDY = SamplingParams(temperature=0.0)
NEW = 6
CONFIG = EngineConfig(kv_blocks=160, block_size=4, max_sequences=4, max_batch_tokens=72)


@pytest.fixture(scope="module", params=["e2b", "vision"])
def ours(request, tmp_path_factory):
    """(our decoder, our VisionTower), fp32 on the CPU, for each mask rule."""
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    folder = write_variant(tmp_path_factory.mktemp(f"gemma4-engine-{request.param}"), request.param)
    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    assert loaded.model.config.images_bidirectional == (request.param == "vision")
    return loaded.model, open_vision(loaded)


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
    return [out[i] for i in range(len(requests))], engine


def solo(model, ids, images=None):
    """The single-sequence loop's greedy tokens and log-probabilities (lollm.generate.loop.generate)."""
    result = generate(model, ids, max_new_tokens=NEW, sampling=GREEDY, images=images, logprobs=1)
    return [(lp.token, lp.logprob) for lp in result.logprobs]


def assert_same(got, want):
    """The same tokens, log-probabilities within 1e-4 (the engine's attention sums in another order)."""
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) < 1e-4, (got, want)


def test_image_requests_batched_with_text_give_their_tokens_alone(ours):
    model, tower = ours
    one, first = image_prompt(tower, [drawing(70, 40, 1)])
    two, second = image_prompt(tower, [drawing(40, 60, 2), drawing(90, 90, 3)])
    text = [[2, 17, 42, 99, 5, 6, 7, 8, 9, 10, 11], [2] + list(range(40, 70))]
    alone = [run(model, [(one, first)])[0][0], run(model, [(two, second)])[0][0]]
    for got, want in zip(alone, [solo(model, one, first), solo(model, two, second)]):
        assert_same(got, want)
    together, _ = run(model, [(text[0], None), (one, first), (text[1], None), (two, second)], late=(3,))
    assert_same(together[1], alone[0])
    assert_same(together[3], alone[1])
    for got, ids in zip([together[0], together[2]], text):
        assert_same(got, solo(model, ids))


def test_the_image_and_its_mask_reach_the_engine(ours):
    """Guards the test above: another image changes the log-probabilities (the engine does not drop the
    images); on "vision", so does the other mask rule (the two-way mask is not skipped in the paged path)."""
    import dataclasses

    model, tower = ours
    ids, image = image_prompt(tower, [drawing(70, 40, 1)])
    a = run(model, [(ids, image)])[0][0]
    assert abs(a[0][1] - run(model, [(ids, image_prompt(tower, [drawing(70, 40, 9)])[1])])[0][0][0][1]) > 1e-3
    right = model.config
    model.config = dataclasses.replace(right, images_bidirectional=not right.images_bidirectional)
    try:
        other_rule = run(model, [(ids, image)])[0][0]
    finally:
        model.config = right
    assert abs(a[0][1] - other_rule[0][1]) > 1e-3


def test_prefix_cache_hits_for_the_same_image_and_misses_for_another(ours):
    model, tower = ours
    ids, same = image_prompt(tower, [drawing(70, 40, 1)])
    begin, end = same.images[0].start, same.images[0].end
    assert (begin, len(ids)) == (9, 82) and end < 80  # <bos>, 7 text, <|image>, then the image; 82 ids
    other = image_prompt(tower, [drawing(70, 40, 9)])[1]
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
    assert hit == (len(ids) - 1) // 4 * 4 == 80  # 20 full blocks, past the image's end: all reused
    assert_same(hit_tokens, cold_tokens)
    assert miss == begin // 4 * 4 == 8  # the same ids, another image: blocks 0 and 1 hold no image token
    assert_same(miss_tokens, run(model, [(ids, other)])[0][0])
    assert abs(miss_tokens[0][1] - hit_tokens[0][1]) > 1e-3


# --- lollm serve: one openai SDK call -------------------------------------------------------------
NAME, CONTEXT = "tiny-gemma4-vision", 160
#: ChatML whose user content may be a list of parts; an image part is Gemma 4's placeholder <|image|>.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<|image|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_serve_answers_an_image_request_as_the_loop(tmp_path):
    """The "e2b" checkpoint with Gemma 4's image tokens and a chat template: the server's engine gives the
    single-sequence loop's greedy tokens on the prompt built by hand (template, expansion, tokenizer)."""
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.serve.app import create_app
    from lollm.serve.model_server import ModelServer
    from lollm.testing import serving
    from lollm.vision.prompt import encode_images, expand_placeholders, place_images

    from test_gemma3_vision_engine_entry_points import openai_image, picture
    from test_gemma4_vision_cli import with_image_tokens

    folder = with_image_tokens(write_variant(tmp_path, "e2b"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    tower, image = open_vision(loaded), picture(1)
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
    result = generate(loaded.model, ids, max_new_tokens=NEW, sampling=GREEDY, stop_ids=set(server.stop_ids),
                      tokenizer=loaded.tokenizer, images=place_images(ids, tower.spec, encoded, max_context=CONTEXT),
                      logprobs=1)
    assert reply.usage.prompt_tokens == len(ids) and reply.choices[0].message.content == result.text
    got, want = [item.logprob for item in reply.choices[0].logprobs.content], [lp.logprob for lp in result.logprobs]
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
