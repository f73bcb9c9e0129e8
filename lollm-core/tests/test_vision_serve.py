"""``lollm serve``'s image parts (OpenAI ``image_url``, Anthropic ``image`` blocks): data: URLs (base64 sources)
only, every hostile image a 400 naming the part. The image requests themselves run on a tiny Gemma 3 with a
tower: lollm-gemma/tests/test_gemma3_vision_engine_entry_points.py."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from lollm.serve.messages import chat_messages
from lollm.serve.requests import ApiError, read_messages


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png_bytes(size=(12, 8), color=(200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def refused(messages, *words, status=400) -> ApiError:
    with pytest.raises(ApiError) as info:
        read_messages(messages, [])
    assert info.value.status == status
    for word in words:
        assert word in info.value.message, info.value.message
    return info.value


def test_image_parts_are_decoded_and_left_as_image_parts_for_the_template():
    images: list = []
    messages = read_messages(user({"type": "text", "text": "what is"}, image_part(data_url(png_bytes())),
                                  {"type": "text", "text": "and"}, image_part(data_url(png_bytes((5, 5)), "image/png"))),
                             images)
    assert messages[0]["content"] == [{"type": "text", "text": "what is"}, {"type": "image"},
                                      {"type": "text", "text": "and"}, {"type": "image"}]
    assert [im.size for im in images] == [(12, 8), (5, 5)] and images[0].getpixel((0, 0)) == (200, 30, 40)


def test_text_parts_alone_stay_one_string():
    assert read_messages(user({"type": "text", "text": "a"}, {"type": "text", "text": "b"}), [])[0]["content"] == "a\nb"


def test_without_a_collector_image_parts_stay_refused():
    with pytest.raises(ApiError, match="only text parts"):
        read_messages(user(image_part(data_url(png_bytes()))))


def test_other_urls_are_refused_naming_the_rule():
    error = refused(user(image_part("https://example.com/cat.png")), "only data: URLs", "fetches nothing")
    assert error.param == "messages[0].content[0].image_url.url"


@pytest.mark.parametrize("detail", ["auto", "low", "high"])
def test_openai_details_are_accepted_without_effect(detail):
    """As the Responses API's input_image: each tower reads at its own resolution, whatever ``detail`` asks."""
    accepted: list = []
    read_messages(user({"type": "image_url", "image_url": {"url": data_url(png_bytes()), "detail": detail}}), accepted)
    assert [im.size for im in accepted] == [(12, 8)]


def test_an_unknown_detail_is_refused_naming_it():
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes()), "detail": "ultra"}}
    error = refused(user(part), "detail must be one of auto, low, high", "'ultra'")
    assert error.param == "messages[0].content[0].image_url.detail"


def test_bad_base64_truncated_and_animated_images_are_400s():
    refused(user(image_part("data:image/png;base64,@@@@")), "image 1 of the request", "not valid base64")
    refused(user(image_part(data_url(png_bytes()[:40]))), "truncated")
    frames = [Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    refused(user({"type": "text", "text": "x"}, image_part(data_url(buf.getvalue(), "image/gif"))),
            "image 1 of the request (messages[0].content[1])", "animated")


@pytest.mark.parametrize("part,word", [({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "audio"),
                                       ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"}}, "video")])
def test_audio_and_video_are_refused_by_name(part, word):
    refused(user(part), f"{word} input is not supported")


def anthropic(*blocks) -> dict:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


def test_anthropic_base64_image_blocks_become_data_url_parts():
    data = base64.b64encode(png_bytes()).decode()
    out = chat_messages(anthropic({"type": "text", "text": "what is"},
                                  {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}))
    assert out == [{"role": "user", "content": [{"type": "text", "text": "what is"},
                                                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]
    images: list = []
    read_messages(out, images)
    assert [im.size for im in images] == [(12, 8)]


@pytest.mark.parametrize("source,where", [({"type": "url", "url": "https://example.com/cat.png"}, "source"),
                                          ({"type": "base64", "media_type": "image/png"}, "source"),
                                          ({"type": "base64", "media_type": "image/png", "data": "", "x": 1}, "source.x")])
def test_anthropic_url_sources_and_broken_blocks_are_400s_naming_the_rule(source, where):
    with pytest.raises(ApiError) as info:
        chat_messages(anthropic({"type": "image", "source": source}))
    assert info.value.status == 400 and info.value.param == f"messages[0].content[0].{where}"
    if source["type"] == "url":
        assert "only base64 image sources" in info.value.message and "fetches nothing" in info.value.message
