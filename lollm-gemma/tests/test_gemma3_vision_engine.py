"""Images through the batched engine (issue 39): Gemma 3's tiny vision checkpoint of test_gemma3_vision.py.

* an image request batched with text requests (and with another image request) gives the greedy
  tokens it gives alone, and those of the single-sequence loop (lollm.generate.loop), which
  test_gemma3_vision.py holds to transformers: the token budget (20) cuts the prompts into chunks
  and would cut the 16-token images, the blocks (4 positions) end inside them, and the sliding
  window (6) is shorter than an image;
* the prefix cache keys image blocks by the pixel hash: the same prompt ids with the same image
  reuse the blocks past the image, with another image they stop at the first block holding
  an image token.
"""

from __future__ import annotations

import pytest
import torch

from lollm.engine import Engine, EngineConfig
from lollm.errors import GenerationError
from lollm.generate.loop import generate
from lollm.sampling_params import SamplingParams
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.vision.load import open_vision
from lollm.vision.prompt import encode_images, place_images

from test_gemma3_vision import IMAGE, TOKENS, drawing, prompt, tiny_gemma3_vision

GREEDY = SamplingParams(temperature=0.0)
NEW = 6
CONFIG = EngineConfig(kv_blocks=96, block_size=4, max_sequences=4, max_batch_tokens=20)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model

    folder = write_tiny_checkpoint(tiny_gemma3_vision(), tmp_path_factory.mktemp("gemma3-vision-engine"),
                                   init_std=SENSITIVE_INIT_STD)
    loaded = open_model(str(folder), LoadOptions(device="cpu", dtype="float32"))
    return loaded.model, open_vision(loaded)


def placed(ours, ids, images):
    model, tower = ours
    return place_images(ids, tower.spec, encode_images(tower, images), max_context=model.max_context)


def run(model, requests, config=CONFIG, late=()):
    """Run ``[(ids, images or None), ...]`` in one engine (those in ``late`` join after 3 steps).

    Per request its greedy tokens, each with its log-probability: ``[(token, logprob), ...]`` (the tiny
    model's greedy tokens repeat, so the log-probabilities carry the evidence).
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
    model, _ = ours
    one, two = prompt(1), prompt(2)
    first = placed(ours, one, [drawing(50, 30, 1)])
    second = placed(ours, two, [drawing(23, 71, 2), drawing(90, 90, 3)])
    text = [[2, 17, 42, 99, 5, 6, 7, 8, 9, 10, 11], [2] + list(range(40, 70))]
    alone = [run(model, [(one, first)])[0][0], run(model, [(two, second)])[0][0]]
    for got, want in zip(alone, [solo(model, one, first), solo(model, two, second)]):
        assert_same(got, want)
    together, _ = run(model, [(text[0], None), (one, first), (text[1], None), (two, second)], late=(3,))
    # not the same bits: the step's matmuls run over other row counts (text requests show the same 1e-7)
    assert_same(together[1], alone[0])
    assert_same(together[3], alone[1])
    for got, ids in zip([together[0], together[2]], text):
        assert_same(got, solo(model, ids))


def test_the_image_reaches_the_engine(ours):
    """Guards the test above: another image changes the log-probabilities (the engine does not drop the images)."""
    model, _ = ours
    ids = prompt(1)
    a = run(model, [(ids, placed(ours, ids, [drawing(50, 30, 1)]))])[0][0]
    b = run(model, [(ids, placed(ours, ids, [drawing(50, 30, 9)]))])[0][0]
    assert abs(a[0][1] - b[0][1]) > 1e-3


def test_prefix_cache_hits_for_the_same_image_and_misses_for_another(ours):
    model, _ = ours
    ids = prompt(1)  # BOS, 3 text, \n\n, <boi>, then the image at positions 6..21, and 6 more
    assert ids.index(IMAGE) == 6 and ids.count(IMAGE) == TOKENS
    same, other = drawing(50, 30, 1), drawing(50, 30, 9)
    engine = Engine(model, CONFIG)

    def serve(image):
        name = engine.add_request(ids, sampling=GREEDY, max_new_tokens=NEW, images=placed(ours, ids, [image]), logprobs=1)
        req, tokens = engine.requests[name], []
        while engine.has_unfinished():
            tokens += [(o.step.token, o.step.logprobs.logprob) for o in engine.step()]
        return req.cached_tokens, tokens

    cold, cold_tokens = serve(same)
    hit, hit_tokens = serve(same)
    miss, miss_tokens = serve(other)
    assert cold == 0
    # (len - 1) // 4 = 6 full blocks: 24 positions, past the image's end (22): all of them reused
    assert hit == (len(ids) - 1) // 4 * 4 == 24
    assert_same(hit_tokens, cold_tokens)
    # the same ids, another image: only block 0 (positions 0..3) holds no image token
    assert miss == 4
    assert_same(miss_tokens, run(model, [(ids, placed(ours, ids, [other]))])[0][0])
    assert abs(miss_tokens[0][1] - hit_tokens[0][1]) > 1e-3  # and the other image's keys were computed anew


def test_a_cache_hit_never_ends_inside_an_image(ours):
    """Blocks of 8, a prompt whose full blocks end at 16, inside the image (6..21): the hit backs off to nothing."""
    model, _ = ours
    ids = prompt(1)[:23] + [5]  # the image, <eoi> and one token: 24 ids, (24 - 1) // 8 = 2 full blocks
    image = placed(ours, ids, [drawing(50, 30, 1)])
    engine = Engine(model, EngineConfig(kv_blocks=48, block_size=8, max_sequences=2, max_batch_tokens=20))
    for _ in range(2):
        name = engine.add_request(ids, sampling=GREEDY, max_new_tokens=2, images=image)
        req = engine.requests[name]
        while engine.has_unfinished():
            engine.step()
    assert req.cached_tokens == 0  # block 0 (0..7) holds image tokens 6, 7 and block 1 ends inside the image


def test_an_image_larger_than_a_step_is_refused_naming_the_budget(ours):
    model, _ = ours
    ids = prompt(1)
    engine = Engine(model, EngineConfig(kv_blocks=48, block_size=4, max_sequences=2, max_batch_tokens=12))
    with pytest.raises(GenerationError, match="max_batch_tokens"):
        engine.add_request(ids, sampling=GREEDY, max_new_tokens=2, images=placed(ours, ids, [drawing(50, 30, 1)]))
    assert not engine.has_unfinished()


def test_block_names_differ_only_by_the_pixels(ours):
    """The scheduler's block names: same ids, other pixels -> other names from the first image block on."""
    from lollm.engine.scheduler import Request, block_name

    ids = prompt(1)
    a = Request("a", ids, len(ids), 1, None, images=placed(ours, ids, [drawing(50, 30, 1)]))
    b = Request("b", ids, len(ids), 1, None, images=placed(ours, ids, [drawing(50, 30, 9)]))
    assert block_name(b"", a, 0, 4) == block_name(b"", b, 0, 4)
    assert block_name(b"", a, 1, 4) != block_name(b"", b, 1, 4)
    with torch.inference_mode():
        assert a.images.images[0].pixel_hash != b.images.images[0].pixel_hash
