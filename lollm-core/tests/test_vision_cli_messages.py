"""The words a new user meets with images (trial of issue 39): each refusal says what went wrong and what to do.

The GGUF cases with files from llama.cpp's converter (a GGUF given an image without ``--mmproj``,
an mmproj given as the model, ``lollm chat/trace --mmproj``) are in
lollm-gemma/tests/test_gemma3_vision_gguf_cli.py; here the messages that need no model.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image

from lollm.cli.chat import _attach
from lollm.errors import ImageError, LollmError, UnknownModelType
from lollm.vision.image import decode_data_url, decode_image
from lollm.vision.prompt import expand_placeholders
from lollm.vision.spec import VisionSpec

#: Qwen3.5's prompt format: the placeholder wraps the image token.
QWEN_LIKE = VisionSpec(image_size=None, patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, merge=2,
                       image_token="<|image_pad|>", image_token_id=9,
                       placeholder="<|vision_start|><|image_pad|><|vision_end|>",
                       begin_text="<|vision_start|>", end_text="<|vision_end|>")
#: Gemma 4's: the placeholder is the image token itself.
GEMMA4_LIKE = VisionSpec(image_size=None, patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, merge=3,
                         image_token="<|image|>", image_token_id=9, placeholder="<|image|>", begin_text="<|image>",
                         end_text="<image|>")


def test_a_cmyk_image_is_a_cmyk_image():
    buf = io.BytesIO()
    Image.new("CMYK", (8, 8)).save(buf, "JPEG")
    with pytest.raises(ImageError, match=r"^'cmyk.jpg' is a CMYK image; accepted are"):
        decode_image(buf.getvalue(), name="'cmyk.jpg'")


def test_a_url_is_refused_in_words_true_of_the_server_and_of_python():
    with pytest.raises(ImageError, match=r"only data: URLs are accepted .*; lollm fetches nothing \(no web address"):
        decode_data_url("https://example.com/cat.png", name="image 1")


def test_the_image_token_written_alone_is_named_with_the_placeholder_to_write():
    with pytest.raises(ImageError, match=r"the prompt holds the image token '<\|image_pad\|>' 1 time\(s\) outside a "
                                         r"placeholder: write the placeholder '<\|vision_start\|><\|image_pad\|>"
                                         r"<\|vision_end\|>' \(one per image, or none\), not the image token"):
        expand_placeholders("<|image_pad|> what is this?", QWEN_LIKE, [4])
    # the placeholder itself holds the image token: it is no stray one
    out = expand_placeholders("<|vision_start|><|image_pad|><|vision_end|> what?", QWEN_LIKE, [2])
    assert out == "<|vision_start|><|image_pad|><|image_pad|><|vision_end|> what?"
    # where the placeholder is the image token (Gemma 4), the count rule alone applies
    assert expand_placeholders("<|image|> hi", GEMMA4_LIKE, [2]) == "<|image><|image|><|image|><image|> hi"


class Session:
    """What ``/image`` calls: attach_image, here recording the image it was given."""

    def __init__(self):
        self.got = []

    def attach_image(self, image) -> int:
        self.got.append(image)
        return len(self.got)


@pytest.mark.parametrize("written", ["'{path}'", '"{path}"', "{path}", "~/{name}", "'~/{name}'"])
def test_image_command_strips_quotes_and_expands_home(tmp_path, monkeypatch, written):
    monkeypatch.setenv("HOME", str(tmp_path))
    path = tmp_path / "my photo.png"
    Image.new("RGB", (5, 4), (1, 2, 3)).save(path)
    notes, session = [], Session()
    _attach(session, written.format(path=path, name=path.name), notes.append)
    assert notes == [f"(image {path} attached: 1 image(s) go with your next message)"]
    assert session.got[0].size == (5, 4)


def test_image_command_with_a_missing_file_notes_the_path_it_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    notes = []
    _attach(Session(), "'~/gone.png'", notes.append)
    assert len(notes) == 1 and notes[0].startswith(f"error: cannot read image '{tmp_path / 'gone.png'}'"), notes


def test_an_mmproj_architecture_is_named_as_such():
    from lollm.load.plugins import get_registry

    with pytest.raises(UnknownModelType, match=r"this GGUF is an mmproj file \(general.architecture 'clip'\): it "
                                               r"holds a vision tower, not a model. Give the text model's GGUF"):
        get_registry().route(gguf_architecture="clip")


def lollm(*args: str):
    from typer.testing import CliRunner

    from lollm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("command", ["chat", "trace"])
def test_a_missing_mmproj_file_is_named_before_anything_loads(tmp_path, command):
    """(``lollm run`` checks it with the checkpoint's config, before the weights: test_gemma3_vision_gguf_cli.py.)"""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # never read: the flag is checked first
    extra = ("--image", "x.png", "-p", "hi") if command == "trace" else ()
    with pytest.raises(LollmError, match=r"--mmproj .*gone.gguf: no such file \(the mmproj GGUF"):
        lollm(command, model, "--mmproj", tmp_path / "gone.gguf", *extra)


def test_trace_mmproj_goes_with_image(tmp_path):
    mmproj = tmp_path / "mmproj.gguf"
    mmproj.write_bytes(b"GGUF")
    with pytest.raises(LollmError, match="--mmproj holds a vision tower: it goes with --image"):
        lollm("trace", tmp_path / "model.gguf", "--mmproj", mmproj, "-p", "hi", "-o", tmp_path / "t.html")


@pytest.mark.parametrize("command", ["chat", "trace", "parity"])
def test_every_image_command_lists_mmproj(command):
    done = lollm(command, "--help")
    assert "--mmproj FILE" in done.output, done.output
