"""``lollm serve MODEL.gguf --mmproj FILE``, and a folder's mmproj file paired with its GGUF model (session 50).

The tiny Gemma 3 with a vision tower of test_gemma3_vision_gguf.py, with a SentencePiece tokenizer
(llama.cpp's converter reads Gemma's tokenizer.model) plus the three image tokens, and a chat template
that writes ``<start_of_image>`` for an image part; converted by llama.cpp's own converter into a text
GGUF and ``--mmproj`` (``mmproj-model.gguf``, the name the converter gives). Then:

* ``lollm serve model.gguf --mmproj mmproj-model.gguf`` answers an image request as lollm serves the
  safetensors checkpoint it came from (the same prompt tokens, the same greedy text), and /v1/models
  says ``vision``; the text GGUF alone refuses the image, naming --mmproj;
* ``lollm serve FOLDER`` pairs a folder's mmproj file with its one GGUF model, or by llama.cpp's name
  (``mmproj-NAME.gguf`` with ``NAME.gguf``), and refuses what it cannot pair;
* ``--mmproj`` with several models, or with a safetensors model, is refused by name before a load.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from lollm.errors import LollmError
from lollm.serve.app import banner, create_app
from lollm.serve.model_server import ModelServer
from lollm.testing import serving
from lollm.testing.tiny import SENSITIVE_INIT_STD, write_tiny_checkpoint
from lollm.testing.tiny_vision import published_spelling

from test_converter_gguf_gemma import CORPUS
from test_gemma3_vision import TOKENS, tiny_gemma3_vision
from test_gemma3_vision_engine_entry_points import TEMPLATE, openai_image

IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def write_source(folder: Path) -> Path:
    """The tiny Gemma 3 vision checkpoint, its SentencePiece tokenizer (509 pieces, the image tokens at 509..511),
    the chat template, the tower in the published spelling, and preprocessor_config.json (the mmproj converter's)."""
    from tokenizers import AddedToken, Tokenizer

    from lollm.testing.converter import write_sentencepiece_tokenizer

    write_tiny_checkpoint(tiny_gemma3_vision(), folder, init_std=SENSITIVE_INIT_STD)
    write_sentencepiece_tokenizer(folder, CORPUS, style="gemma", vocab_size=509, max_characters=120)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in IMAGE_TOKENS])
    assert [tok.token_to_id(t) for t in IMAGE_TOKENS] == [509, 510, 511]  # config.json's image ids
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    added = {str(509 + i): {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                            "single_word": False} for i, t in enumerate(IMAGE_TOKENS)}  # the converter reads these
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE,
                                                              "added_tokens_decoder": added}))
    published_spelling(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({  # gemma-3-4b-it's, at the tiny sizes
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor", "image_seq_length": TOKENS,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "rescale_factor": 1 / 255,
        "size": {"height": 64, "width": 64}, "do_normalize": True, "do_rescale": True, "do_resize": True}))
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the safetensors source folder, model.gguf, mmproj-model.gguf), the two conversions side by side."""
    from lollm.testing.converter import convert

    source = write_source(tmp_path_factory.mktemp("gemma3-serve-src"))
    site = tmp_path_factory.mktemp("gemma3-serve-gguf")
    jobs = [(site / "model.gguf", ()), (site / "mmproj-model.gguf", ("--mmproj",))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # each conversion is a child process
        list(pool.map(lambda job: convert(source, job[0], "f32", job[1]), jobs))
    return source, site / "model.gguf", site / "mmproj-model.gguf"


def drawing() -> Image.Image:
    img = Image.new("RGB", (90, 50), (30, 120, 200))
    ImageDraw.Draw(img).ellipse([(10, 5), (60, 45)], fill=(200, 80, 20))
    return img


MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "what is"}, openai_image(drawing())]}]


def chat(post, model: str) -> tuple[int, dict]:
    """POST the image request (greedy, 6 tokens) through ``post(path, body)``; (status, JSON answer)."""
    return post("/chat/completions", {"model": model, "max_tokens": 6, "temperature": 0, "messages": MESSAGES})


def test_serve_gguf_with_mmproj_answers_as_the_safetensors_checkpoint(files):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from starlette.testclient import TestClient

    source, gguf, mmproj = files
    server = ModelServer(open_model(str(source), LoadOptions(device="cpu", dtype="float32")), name="m", context=128)
    try:
        with TestClient(create_app(server)) as client:
            status, want = chat(lambda path, body: (r := client.post("/v1" + path, json=body)).status_code and
                                (r.status_code, r.json()), "m")
    finally:
        server.close()
    assert status == 200, want
    with serving.run_server(gguf, "--mmproj", str(mmproj), "--ctx-size", "128") as base:
        status, got = chat(lambda path, body: serving.http(base + path, json.dumps(body).encode()), "model")
        assert status == 200, got
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] > TOKENS
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        (entry,) = serving.http(base + "/models")[1]["data"]
        assert entry["id"] == "model" and entry["vision"] is True


def test_the_text_gguf_alone_refuses_an_image_naming_mmproj(files):
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from starlette.testclient import TestClient

    _, gguf, _ = files
    server = ModelServer(open_model(str(gguf), LoadOptions(device="cpu", dtype="float32")), name="model", context=128)
    try:
        assert not server.reads_images and not any(line.startswith("images:") for line in banner(server, "g", "h", 1))
        with TestClient(create_app(server)) as client:
            reply = client.post("/v1/chat/completions", json={"model": "model", "max_tokens": 2, "messages": MESSAGES})
            assert client.get("/v1/models").json()["data"][0]["vision"] is False
    finally:
        server.close()
    message = reply.json()["error"]["message"]
    assert reply.status_code == 400 and "a GGUF keeps no vision tower" in message and "--mmproj FILE" in message, message


def test_a_folder_pairs_its_mmproj_files_or_refuses_them(tmp_path):
    from lollm.cli.serve_command import ModelSpec, model_specs

    def folder(name: str, files: list[str]) -> Path:
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_bytes(b"")
        return tmp_path / name

    one = folder("one", ["gemma-3-4b-it-Q4_K_M.gguf", "mmproj-F16.gguf"])  # one model: its one mmproj, any name
    assert model_specs(None, [str(one)]) == [ModelSpec(str(one / "gemma-3-4b-it-Q4_K_M.gguf"), str(one / "mmproj-F16.gguf"))]
    two = folder("two", ["a.gguf", "b.gguf", "mmproj-b.gguf"])  # several: mmproj-NAME.gguf with NAME.gguf
    assert model_specs(None, [str(two)]) == [ModelSpec(str(two / "a.gguf")),
                                             ModelSpec(str(two / "b.gguf"), str(two / "mmproj-b.gguf"))]
    with pytest.raises(LollmError, match=r"2 mmproj files for m.gguf \(mmproj-BF16.gguf, mmproj-F16.gguf\)"):
        model_specs(None, [str(folder("twice", ["m.gguf", "mmproj-F16.gguf", "mmproj-BF16.gguf"]))])
    with pytest.raises(LollmError, match=r"mmproj-NAME.gguf with NAME.gguf .* holds no c.gguf \(a.gguf, b.gguf\)"):
        model_specs(None, [str(folder("stray", ["a.gguf", "b.gguf", "mmproj-c.gguf"]))])


def test_mmproj_with_several_models_or_a_safetensors_model_is_refused(files, tmp_path):
    from typer.testing import CliRunner

    from lollm.cli import app

    source, gguf, mmproj = files
    port = str(serving.free_port())
    def refused(*args: str) -> str:  # the command's LollmError (its message; lollm's main prints it as "error: ...")
        result = CliRunner().invoke(app, ["serve", *args, "--port", port])
        assert isinstance(result.exception, LollmError), result.output
        return str(result.exception)

    assert "--mmproj serves one model; 2 were given" in refused(str(gguf), str(source), "--mmproj", str(mmproj))
    assert "an mmproj file goes with a GGUF model" in refused(str(source), "--mmproj", str(mmproj))
    paired = shutil.copytree(gguf.parent, tmp_path / "paired")
    assert "has its mmproj file already" in refused(str(paired), "--mmproj", str(mmproj))
