"""``lollm serve``'s image parts (OpenAI ``image_url``): data: URLs only, every hostile image a 400 naming the part."""

from __future__ import annotations

import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image

from lollm.family import Capabilities
from lollm.serve.requests import IMAGE_MARK, ApiError, read_messages, refuse_images


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


def test_image_parts_are_decoded_and_marked_in_the_text():
    images: list = []
    messages = read_messages(user({"type": "text", "text": "what is"}, image_part(data_url(png_bytes())),
                                  {"type": "text", "text": "and"}, image_part(data_url(png_bytes((5, 5)), "image/png"))),
                             images)
    assert messages[0]["content"] == f"what is\n{IMAGE_MARK}\nand\n{IMAGE_MARK}"
    assert [im.size for im in images] == [(12, 8), (5, 5)] and images[0].getpixel((0, 0)) == (200, 30, 40)


def test_without_a_collector_image_parts_stay_refused():
    with pytest.raises(ApiError, match="only text parts"):
        read_messages(user(image_part(data_url(png_bytes()))))


def test_other_urls_are_refused_naming_the_rule():
    error = refused(user(image_part("https://example.com/cat.png")), "only data: URLs", "fetches nothing")
    assert error.param == "messages[0].content[0].image_url.url"


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


def test_refuse_images_names_the_model_and_the_missing_piece():
    text_only = SimpleNamespace(family=SimpleNamespace(family=SimpleNamespace(capabilities=Capabilities())))
    with pytest.raises(ApiError, match="model 'tiny' has no vision tower") as info:
        refuse_images("tiny", text_only)
    assert info.value.status == 400
    seeing = SimpleNamespace(family=SimpleNamespace(family=SimpleNamespace(capabilities=Capabilities(vision=True))))
    with pytest.raises(ApiError, match="does not run image requests yet") as info:
        refuse_images("tiny", seeing)
    assert info.value.status == 501
