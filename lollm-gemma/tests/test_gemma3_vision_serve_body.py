"""What a new user's trial of images through ``lollm serve`` found (session 50): photos, the log, /v1/models.

The tiny Gemma 3 with a vision tower of test_gemma3_vision_engine_entry_points.py (its chat template
writes ``<start_of_image>`` for an image part), served in this process through Starlette's TestClient:

* an ordinary photo (a 1.1 MB JPEG, 1.5 MB as base64) is answered, though the body is past the
  text-only limit of the same context (lollm.serve.requests.body_limit: 1 MiB + 64 B a position);
  a body past the limit with images is a 413 that names its parts, images included;
* behind one server with a text model (Gemma 3 1B), the body is read up to the larger limit, then the
  text model refuses the photo with its own limit;
* /v1/models says ``vision: true``;
* the log says why a request was refused (status, code, message), and a request line says ``images=N``.
"""

from __future__ import annotations

import base64
import io
import json
import logging

import numpy as np
import pytest
from PIL import Image

from lollm.serve.app import banner, create_app
from lollm.serve.model_server import ModelServer
from lollm.serve.requests import IMAGE_BODY_BYTES, body_limit

from test_gemma3_vision_engine_entry_points import NAME, folder, loaded, openai_image, picture  # noqa: F401 (fixtures)

CONTEXT = 128


def photo_data_url() -> str:
    """A 1280 x 960 JPEG of noise (a photo's worth of detail): about 1.1 MB, 1.5 MB as a base64 data: URL."""
    pixels = np.random.default_rng(0).integers(0, 256, (960, 1280, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def client(loaded):  # noqa: F811 (the imported fixture)
    from starlette.testclient import TestClient

    server = ModelServer(loaded, name=NAME, context=CONTEXT)
    try:
        with TestClient(create_app(server)) as client:
            client.server = server
            yield client
    finally:
        server.close()


def ask(client, content: list[dict], max_tokens: int = 2):
    return client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": max_tokens, "temperature": 0,
                                                     "messages": [{"role": "user", "content": content}]})


def test_a_photo_past_the_text_limit_is_answered(client):
    url = photo_data_url()
    body = json.dumps({"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": url}}]}]}).encode()
    assert 1_400_000 < len(body) < 1_700_000 and len(body) > body_limit(CONTEXT)  # a text-only server's 413
    assert client.server.reads_images and client.server.max_body_bytes == body_limit(CONTEXT) + IMAGE_BODY_BYTES
    reply = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > 16  # the image's 16 tokens and the text


def test_a_body_past_the_image_allowance_is_a_413_naming_images(client):
    limit = client.server.max_body_bytes
    data = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "y" * limit}]}).encode()
    reply = client.post("/v1/chat/completions", content=data, headers={"Content-Type": "application/json"})
    assert reply.status_code == 413, reply.text
    error = reply.json()["error"]
    assert error["code"] == "request_too_large" and f"{limit:,} bytes" in error["message"]
    assert "64 bytes per position" in error["message"] and "48 MiB for images" in error["message"]


def test_v1_models_and_the_banner_say_the_model_reads_images(client):
    (entry,) = client.get("/v1/models").json()["data"]
    assert entry["id"] == NAME and entry["vision"] is True and entry["chat"] is True
    assert banner(client.server, "gemma3 on cpu", "127.0.0.1", 8000)[-1] == (
        "images: image_url parts as data: URLs, bodies up to 49.0 MiB; the vision tower from its checkpoint, "
        "loaded on the first image")


def test_the_log_says_why_a_request_was_refused_and_how_many_images_a_request_held(client, caplog):
    caplog.set_level(logging.INFO, logger="lollm.serve.server")
    refused = ask(client, [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert refused.status_code == 400
    lines = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("POST /v1/chat/completions: refused 400 invalid_request_error")
    assert refused.json()["error"]["message"][:100] in lines[0]
    caplog.clear()
    assert ask(client, [openai_image(picture(1)), openai_image(picture(2))]).status_code == 200
    assert ask(client, [{"type": "text", "text": "hello"}]).status_code == 200
    requests = [r.getMessage() for r in caplog.records if "generated" in r.getMessage()]
    assert len(requests) == 2 and "images=2," in requests[0] and "images=" not in requests[1], requests


def test_several_models_read_up_to_the_largest_limit_then_each_checks_its_own(loaded, tmp_path):  # noqa: F811
    """A vision model and a text one (Gemma 3 1B: the family reads images, the checkpoint has no tower) behind one
    server: the body is read up to the vision model's limit, then the text model refuses the photo with its own."""
    from starlette.testclient import TestClient

    from _gemma_testing import tiny_gemma3_1b
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.serve.models import ModelEntry, ServedModels
    from lollm.testing.tiny import write_tiny_checkpoint, write_tiny_tokenizer

    folder = write_tiny_checkpoint(tiny_gemma3_1b(), tmp_path / "text")
    write_tiny_tokenizer(folder)
    text = ModelServer(open_model(str(folder), LoadOptions(device="cpu", dtype="float32")), name="text", context=CONTEXT)
    vision = ModelServer(loaded, name=NAME, context=CONTEXT)
    assert not text.reads_images and text.max_body_bytes == body_limit(CONTEXT)
    entries = [ModelEntry(s.name, s.name, 0, load=lambda s=s: s, images=s.reads_images) for s in (text, vision)]
    models = ServedModels(entries, max_body_bytes=max(s.max_body_bytes for s in (text, vision)))
    photo = [{"type": "image_url", "image_url": {"url": photo_data_url()}}]
    try:
        models.load_first()
        with TestClient(create_app(models)) as client:
            listed = {m["id"]: m["vision"] for m in client.get("/v1/models").json()["data"]}
            assert listed == {"text": False, NAME: True}
            replies = {name: client.post("/v1/chat/completions", json={"model": name, "max_tokens": 1, "messages": [
                {"role": "user", "content": photo}]}) for name in ("text", NAME)}
    finally:
        text.close()
        vision.close()
    assert replies[NAME].status_code == 200, replies[NAME].text
    assert replies["text"].status_code == 413, replies["text"].text
    refused = replies["text"].json()["error"]["message"]
    assert f"{body_limit(CONTEXT):,} bytes" in refused and "images" not in refused, refused
