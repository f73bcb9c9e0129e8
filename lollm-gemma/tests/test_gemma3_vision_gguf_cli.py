"""A Gemma 3 GGUF with its mmproj file through ``lollm chat``, ``lollm trace`` and ``lollm parity`` (issue 39).

The tiny checkpoint of test_gemma3_vision.py with a SentencePiece tokenizer (llama.cpp's converter
reads no tiny byte-level BPE) whose ids 509..511 are Gemma 3's image tokens, a chat template that
renders image parts as ``<start_of_image>``, and the tower under its published names; llama.cpp's own
converter writes the text GGUF and the mmproj GGUF (never a writer of ours). Then:

* ``lollm trace --image --mmproj`` gives the safetensors checkpoint's logits at every position;
* ``lollm chat --mmproj`` with ``/image`` answers as the safetensors checkpoint does;
* ``lollm parity --mmproj`` (and a GGUF with ``--image``) is refused by name: transformers reads no mmproj;
* a GGUF given an image without ``--mmproj``, and an mmproj file given as the model, say what to do;
* a chat turn the template cannot render (no image parts) leaves the conversation as it was, its images dropped;
* ``lollm trace --image`` takes ``--system`` and ``--compare`` (transformers' whole model on the same pixels).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from typer.testing import CliRunner

from _gemma_testing import assert_close_logits
from lollm.errors import ImageError, LollmError, UnknownModelType
from lollm.load.options import LoadOptions
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.testing.tiny_vision import published_spelling

from test_converter_gguf_gemma import CORPUS
from test_gemma3_vision import BOI, EOI, IMAGE, TOKENS, tiny_gemma3_vision

CPU = LoadOptions(device="cpu", dtype="float32")
IMAGE_TOKENS = {BOI: "<start_of_image>", EOI: "<end_of_image>", IMAGE: "<image_soft_token>"}
#: Gemma 3's turn layout, short: an image part is its placeholder, <start_of_image>.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}{{ p['text'] }}"
            "{% endif %}{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}model: {% endif %}")
#: The same without image parts: it renders a message's text only.
TEXT_ONLY_TEMPLATE = TEMPLATE.replace("<start_of_image>", "")


def write_tokenizer(folder: Path, template: str) -> None:
    """Gemma's SentencePiece tokenizer of 509 pieces, the image tokens at 509..511 (tokenizer.json, and the
    ``added_tokens_decoder`` llama.cpp's converter reads beside tokenizer.model), and ``template``."""
    from transformers import AutoTokenizer

    from lollm.testing.converter import write_sentencepiece_tokenizer

    write_sentencepiece_tokenizer(folder, CORPUS, style="gemma", vocab_size=509, max_characters=120)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values())})
    assert [tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS.values()] == list(IMAGE_TOKENS)
    tokenizer.save_pretrained(str(folder))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    config["added_tokens_decoder"] = {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False,
                                               "rstrip": False, "single_word": False} for i, t in IMAGE_TOKENS.items()}
    path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(safetensors folder, text GGUF, mmproj GGUF, a picture, another picture); both conversions side by side."""
    from lollm.testing.converter import convert

    root = tmp_path_factory.mktemp("gemma3-gguf-cli")
    config = tiny_gemma3_vision()
    # as every published Gemma 3 but the 27B: a GGUF has no key for it, and llama.cpp takes head_dim
    config["text_config"]["query_pre_attn_scalar"] = config["text_config"]["head_dim"]
    folder = write_tiny_checkpoint(config, root / "source", init_std=SENSITIVE_INIT_STD)
    write_tokenizer(folder, TEMPLATE)
    published_spelling(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({  # gemma-3-4b-it's, at the tiny sizes
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor", "image_seq_length": TOKENS,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": 64, "width": 64}, "do_normalize": True, "do_rescale": True, "do_resize": True}))
    jobs = [(root / "model-f32.gguf", ()), (root / "mmproj-f32.gguf", ("--mmproj",))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each conversion is a child process
        list(pool.map(lambda job: convert(folder, job[0], "f32", job[1]), jobs))
    pictures = []
    for name, colour in (("boat.png", (20, 90, 200)), ("other.png", (200, 40, 10))):
        img = Image.new("RGB", (70, 40), colour)
        ImageDraw.Draw(img).polygon([(10, 30), (60, 30), (50, 38), (20, 38)], fill=(120, 60, 20))
        img.save(root / name)
        pictures.append(root / name)
    return folder, root / "model-f32.gguf", root / "mmproj-f32.gguf", *pictures


def lollm(*args: str, input: str | None = None):
    from lollm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def traced(model: Path, picture: Path, out: Path, **kwargs):
    from lollm.cli.trace.run import run_trace

    return run_trace(str(model), prompt="what is this?", output=out, options=CPU, images=[str(picture)], **kwargs).trace


def test_trace_with_mmproj_gives_the_safetensors_logits(files, tmp_path):
    folder, gguf, mmproj, boat, other = files
    want = traced(folder, boat, tmp_path / "a.html")
    got = traced(gguf, boat, tmp_path / "b.html", mmproj=str(mmproj))
    assert got.ids == want.ids and want.ids.count(IMAGE) == TOKENS
    assert_close_logits(got.logits, want.logits, want.ids)
    elsewhere = traced(gguf, other, tmp_path / "c.html", mmproj=str(mmproj))  # the image reaches the logits
    assert not torch.allclose(elsewhere.logits, got.logits, atol=1e-4)
    done = lollm("trace", gguf, "--mmproj", mmproj, "--image", boat, "-p", "hi", "-o", tmp_path / "d.html",
                 "--device", "cpu")
    assert done.exit_code == 0, done.output
    assert (tmp_path / "d.html").stat().st_size > 0


def chat_output(model: Path, picture: Path, *extra: str) -> str:
    done = lollm("chat", model, *extra, "--temperature", "0", "-n", "4", "--device", "cpu",
                 input=f"/image '{picture}'\nwhat is this?\n")
    assert done.exit_code == 0, done.output
    assert "1 image(s) go with your next message" in done.output and "error" not in done.output, done.output
    return done.stdout


def test_chat_with_mmproj_answers_as_the_safetensors_checkpoint(files):
    folder, gguf, mmproj, boat, _ = files
    assert chat_output(gguf, boat, "--mmproj", mmproj) == chat_output(folder, boat)


def test_a_gguf_given_an_image_without_mmproj_is_told_to_pass_one(files, tmp_path):
    _, gguf, _, boat, _ = files
    with pytest.raises(ImageError, match=r"is a GGUF, and a GGUF keeps no vision tower in its own file: the gemma3 "
                                         r"tower is a separate mmproj file, given with --mmproj FILE.*--mmproj writes"):
        lollm("run", gguf, "--image", boat, "-p", "hi", "-n", "1", "--device", "cpu")
    done = lollm("chat", gguf, "--device", "cpu", input=f"/image {boat}\n")
    assert "error: model" in done.output and "given with --mmproj FILE" in done.output, done.output


def test_run_names_a_missing_mmproj_file(files, tmp_path):
    _, gguf, _, boat, _ = files
    with pytest.raises(LollmError, match=r"--mmproj .*gone.gguf: no such file \(the mmproj GGUF"):
        lollm("run", gguf, "--mmproj", tmp_path / "gone.gguf", "--image", boat, "-p", "hi", "--device", "cpu")


def test_chat_refuses_an_mmproj_beside_a_family_without_images(files, tmp_path):
    from _gemma_testing import tiny_gemma2

    from lollm.testing.tiny import write_tiny_tokenizer

    folder = write_tiny_checkpoint(tiny_gemma2(), tmp_path / "gemma2")
    write_tiny_tokenizer(folder, vocab_size=512)
    with pytest.raises(LollmError, match=r"--mmproj .*mmproj-f32.gguf: .*gemma2 is of the family gemma2, which reads "
                                         r"no images"):
        lollm("chat", folder, "--mmproj", files[2], "--device", "cpu", input="hi\n")


def test_an_mmproj_file_given_as_the_model_says_it_goes_with_mmproj(files):
    _, _, mmproj, _, _ = files
    with pytest.raises(UnknownModelType, match=r"this GGUF is an mmproj file \(general.architecture 'clip'\): it holds "
                                               r"a vision tower.*beside it with --mmproj FILE"):
        lollm("run", mmproj, "-p", "hi", "-n", "1", "--device", "cpu")


def test_parity_refuses_an_mmproj_by_name(files):
    folder, gguf, mmproj, boat, _ = files
    for args in (("--mmproj", mmproj, "--image", boat), ("--image", boat)):
        with pytest.raises(LollmError, match=r"lollm parity --image compares with transformers on the same weights, "
                                             r"and transformers reads no mmproj file.*safetensors checkpoint"):
            lollm("parity", gguf, *args)


def test_trace_image_takes_system_and_compare(files, tmp_path):
    folder, gguf, mmproj, boat, _ = files
    plain = traced(folder, boat, tmp_path / "a.html")
    trace = traced(folder, boat, tmp_path / "b.html", system="be brief", compare_reference=True)
    assert len(trace.ids) > len(plain.ids) and trace.ids[-len(plain.ids) + 1:] == plain.ids[1:]  # the system turn first
    assert trace.divergence.first is None and min(trace.divergence.cosine) > 0.9999  # transformers, same pixels
    with pytest.raises(LollmError, match="lollm trace --image --compare compares with transformers"):
        traced(gguf, boat, tmp_path / "c.html", mmproj=str(mmproj), compare_reference=True)


def test_a_failed_chat_turn_leaves_the_conversation_as_it_was(files, tmp_path):
    from lollm.generate.conversation import ChatSession
    from lollm.load.pipeline import open_model
    from lollm.sampling_params import SamplingParams
    from lollm.vision.image import read_image_file

    folder = Path(shutil.copytree(files[0], tmp_path / "text-only-template"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEXT_ONLY_TEMPLATE}))
    session = ChatSession(open_model(str(folder), CPU), sampling=SamplingParams(temperature=0.0), stop_ids=set(),
                          max_new_tokens=2)
    session.attach_image(read_image_file(str(files[3])))
    with pytest.raises(ImageError, match=r"wrote 0 image placeholder.*the 1 image\(s\) attached for this message "
                                         r"were dropped with it; the conversation is as it was"):
        session.reply("what is this?")
    assert session.messages == [] and session.pending == []
    result = session.reply("hello")  # the next message goes through
    assert len(result.new_ids) == 2 and [m["role"] for m in session.messages] == ["user", "assistant"]
