"""Qwen3.5 images through the Python API: ``LLM.generate`` with an :class:`lollm.ImagePrompt` (issue 39).

The lively tiny multimodal checkpoint of test_vision_cli.py (a dynamic-resolution tower, M-RoPE in the
decoder). An image prompt batched with two text prompts gives ``lollm run --image``'s prompt ids and
greedy ids (which test_vision_cli.py holds to transformers' ``generate``), and each text prompt its
tokens alone: in one engine step the image sequence turns by M-RoPE, the text ones by 1-D RoPE.
"""

from __future__ import annotations

import json

import pytest

from lollm import ImagePrompt, LLM, SamplingParams

from test_vision_cli import IMAGE, folder, lollm, picture  # noqa: F401  (folder, picture: module fixtures)

NEW = 6
GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("family", ["qwen3_5"])
def test_an_image_prompt_among_text_prompts_gives_lollm_run_image(family, folder, picture):  # noqa: F811
    path = folder(family)
    llm = LLM(str(path), device="cpu", dtype="float32")
    texts = ["tell me a story", "name three rivers"]
    done = llm.generate([texts[0], ImagePrompt("what is this?", [str(picture)]), texts[1]], GREEDY, max_new_tokens=NEW)
    assert done[1].prompt_ids.count(IMAGE) == 6 and all(c.batched for c in done)

    ran = lollm("run", str(path), "--image", str(picture), "-p", "what is this?", "-n", str(NEW),
                "--temperature", "0", "--json", "--device", "cpu", "--dtype", "float32")
    assert ran.exit_code == 0, ran.output
    out = json.loads(ran.stdout.strip().splitlines()[-1])
    assert out["prompt_ids"] == done[1].prompt_ids and out["ids"] == done[1].token_ids
    alone = llm.generate(texts, GREEDY, max_new_tokens=NEW)
    assert [c.token_ids for c in alone] == [done[0].token_ids, done[2].token_ids]
