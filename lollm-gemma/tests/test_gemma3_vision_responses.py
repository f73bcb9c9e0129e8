"""Images through OpenAI's Responses API (``input_image`` parts) with the official ``openai`` SDK (issue 39).

The tiny Gemma 3 server of test_gemma3_vision_engine_entry_points.py (the batched engine, a chat
template that writes ``<start_of_image>`` for an image part). A Responses request with an
``input_image`` is the chat completion it means: the same answer, the same prompt tokens, and
the same prompt blocks (the prefix cache names image blocks by their pixels, so a hit shows the
same ids and the same image). Each refusal is a 400 in the Responses shape naming the part.
"""

from __future__ import annotations

import pytest

from lollm.testing import serving

from test_gemma3_vision_engine_entry_points import (NAME, NEW, folder, loaded, openai_image, picture,  # noqa: F401
                                                    png_b64, server)


def input_image(img, detail: str = "auto") -> dict:
    return {"type": "input_image", "image_url": "data:image/png;base64," + png_b64(img), "detail": detail}


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


@pytest.fixture(scope="module")
def client(server):  # noqa: F811
    return serving.openai_client(server.root + "/v1")


def test_input_image_gives_the_chat_completions_answer(client):
    image = picture(11, (52, 30))
    chat = client.chat.completions.create(model=NAME, max_tokens=NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is"}, openai_image(image)]}])
    reply = client.responses.create(model=NAME, max_output_tokens=NEW, temperature=0,
                                    input=user({"type": "input_text", "text": "what is"}, input_image(image)))
    n = chat.usage.prompt_tokens
    assert reply.output_text == chat.choices[0].message.content and reply.usage.input_tokens == n
    assert reply.usage.input_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 16  # the chat's blocks: same ids, pixels
    other = client.responses.create(model=NAME, max_output_tokens=1, temperature=0,
                                    input=user({"type": "input_text", "text": "what is"}, input_image(picture(12))))
    assert other.usage.input_tokens == n and other.usage.input_tokens_details.cached_tokens == 0


def test_a_streamed_response_with_an_image_gives_the_same_text(client):
    parts = user(input_image(picture(13)), {"type": "input_text", "text": "and this?"})
    whole = client.responses.create(model=NAME, max_output_tokens=NEW, temperature=0, input=parts)
    events = list(client.responses.create(model=NAME, max_output_tokens=NEW, temperature=0, input=parts, stream=True))
    final = events[-1].response  # response.incomplete: the answer ran to max_output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.usage.input_tokens == whole.usage.input_tokens


def test_a_previous_response_keeps_its_image(client):
    first = client.responses.create(model=NAME, max_output_tokens=2, temperature=0,
                                    input=user({"type": "input_text", "text": "look"}, input_image(picture(14))))
    then = client.responses.create(model=NAME, max_output_tokens=2, temperature=0, previous_response_id=first.id,
                                   input="and now?")
    assert then.usage.input_tokens > first.usage.input_tokens + 16  # the image's 16 tokens are in it again


def png_bytes_cut() -> str:
    import base64

    return base64.b64encode(base64.b64decode(png_b64(picture(1)))[:60]).decode()


REFUSED = [
    ({"type": "input_image", "image_url": "https://example.com/cat.png", "detail": "auto"},
     "input[0].content[1].image_url", "fetches nothing"),
    ({"type": "input_image", "file_id": "file-123", "detail": "auto"}, "input[0].content[1].file_id", "keeps no files"),
    ({**input_image(picture(1)), "detail": "ultra"}, "input[0].content[1].detail", "must be one of auto, low, high"),
    ({"type": "input_image", "image_url": "data:image/png;base64,@@@@", "detail": "auto"},
     "input[0].content[1].image_url", "image 1 of the request (input[0].content[1]): the data: URL's payload is not valid"),
    ({"type": "input_image", "image_url": "data:image/png;base64," + png_bytes_cut(), "detail": "auto"},
     "input[0].content[1].image_url", "truncated"),
    ({"type": "input_file", "file_data": "x"}, "input[0].content[1]", "only input_text, output_text and input_image"),
]


@pytest.mark.parametrize("part, field, words", REFUSED, ids=[r[1] + ":" + r[2][:12] for r in REFUSED])
def test_a_refused_image_is_a_400_in_the_responses_shape_naming_the_part(server, part, field, words):  # noqa: F811
    body = {"model": NAME, "max_output_tokens": 1, "input": user({"type": "input_text", "text": "hi"}, part)}
    status, _, answer = serving.post(server.root + "/v1/responses", body)
    assert status == 400 and answer["error"]["param"] == field and words in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_more_images_than_the_context_holds_is_a_400_naming_input(server):  # noqa: F811
    body = {"model": NAME, "max_output_tokens": 1, "input": user(*[input_image(picture(i)) for i in range(7)])}
    status, _, answer = serving.post(server.root + "/v1/responses", body)
    assert status == 400 and answer["error"]["param"] == "input", answer
    assert answer["error"]["code"] == "context_length_exceeded" and "7 image(s) take 112 tokens" in answer["error"]["message"]
