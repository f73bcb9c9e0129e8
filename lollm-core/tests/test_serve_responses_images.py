"""The Responses API's ``input_image`` parts, translated (lollm.serve.responses; no model needed but the toy's).

An ``input_image`` becomes the chat request's ``image_url`` part; a refusal of the chat request names
the Responses field it came from (the instructions and a previous response's messages come first in
the chat request, so its ``messages[k]`` is not ``input[k]``); the store is bounded in bytes, since a
stored conversation holds its images' data: URLs; a model without a tower refuses by name. The image
requests themselves run on a tiny Gemma 3: lollm-gemma/tests/test_gemma3_vision_responses.py.
"""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from lollm.serve.requests import ApiError
from lollm.serve.responses import ResponseStore, chat_body, renamed
from lollm.testing import serving

from _serve_apis import NAME, load_toy, served, toy_site, write_toy  # noqa: F401  (toy_site: a fixture)

URL = "data:image/png;base64,iVBORw0KGgo="


def image(url: str = URL, **more) -> dict:
    return {"type": "input_image", "image_url": url, "detail": "auto", **more}


def test_an_input_image_becomes_an_image_url_part_in_order():
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, image(),
                                                   {"type": "input_text", "text": "b"}]}]}
    chat, conversation = chat_body(body, [])
    assert chat["messages"] == conversation == [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": URL}}, {"type": "text", "text": "b"}]}]
    text_only = chat_body({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}]}, [])[0]
    assert text_only["messages"][0]["content"] == "a"  # without images, the parts stay one string, as before


def test_a_chat_refusal_names_the_responses_field_of_the_image():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    body = {"instructions": "be brief", "input": [
        {"role": "user", "content": "first"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"role": "developer", "content": [{"type": "input_text", "text": "x"}, image()]}]}
    origins: dict[int, str] = {}
    chat, _ = chat_body(body, history, origins)
    k = next(i for i, m in enumerate(chat["messages"]) if isinstance(m["content"], list))
    assert k == 5 and origins[k] == "input[2]" and chat["messages"][k]["role"] == "system"
    error = ApiError(400, f"image 1 of the request (messages[{k}].content[1]): not valid base64",
                     param=f"messages[{k}].content[1].image_url.url")
    moved = renamed(error, origins)
    assert moved.param == "input[2].content[1].image_url"
    assert moved.message == "image 1 of the request (input[2].content[1]): not valid base64"
    assert renamed(ApiError(400, "too long", param="messages"), origins).param == "input"


@pytest.mark.parametrize("part, field", [
    (image("http://example.com/a.png"), "input[0].content[0].image_url"),
    (image(file_id="file-1"), "input[0].content[0].file_id"),
    (image(detail="ultra"), "input[0].content[0].detail"),
    (image(extra=1), "input[0].content[0].extra"),
    ({"type": "input_audio", "input_audio": {}}, "input[0].content[0]"),
])
def test_a_bad_image_part_is_refused_naming_its_field(part, field):
    with pytest.raises(ApiError) as refused:
        chat_body({"input": [{"role": "user", "content": [part]}]}, [])
    assert refused.value.status == 400 and refused.value.param == field


def test_an_assistant_message_holds_no_image():
    with pytest.raises(ApiError) as refused:
        chat_body({"input": [{"role": "assistant", "content": [image()]}]}, [])
    assert refused.value.param == "input[0].content[0]" and "input_text and output_text" in refused.value.message


def test_the_store_is_bounded_in_bytes_and_drops_the_oldest_first():
    store = ResponseStore(size=10, max_bytes=1200)
    big = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400}}]}]
    for ident in ("a", "b", "c"):
        store.put({"id": ident}, big)
    with pytest.raises(ApiError):
        store.get("a")  # three conversations of 502 bytes exceed 1200: the first went
    assert store.get("b")[0] == {"id": "b"} and store.get("c")[0] == {"id": "c"}
    store.put({"id": "huge"}, [{"role": "user", "content": "x" * 2000}])
    with pytest.raises(ApiError):
        store.get("huge")  # larger than the whole bound: not kept (and it pushed out the others)
    assert store._bytes == 0


def test_an_image_sent_to_a_model_without_a_tower_is_a_400_naming_the_model(toy_site, tmp_path):  # noqa: F811
    loaded = load_toy(toy_site, write_toy(tmp_path / "toy", "qwen2.5"))
    with served(loaded) as root:
        png = io.BytesIO()
        Image.new("RGB", (8, 8)).save(png, "PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        body = {"model": NAME, "max_output_tokens": 1, "input": [{"role": "user", "content": [image(url)]}]}
        status, _, answer = serving.post(root + "/v1/responses", body)
    assert status == 400 and answer["error"]["param"] == "input", answer
    assert "model 'toy' has no vision tower" in answer["error"]["message"]
