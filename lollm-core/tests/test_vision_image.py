"""Hostile images (issue 39, item 5): each case is one ImageError naming the image, and nothing stays open.

The images are made here: with Pillow where Pillow can write them, and byte by byte
(:func:`png`) where it refuses to (a 0x0 PNG, a bomb's header, a 16-bit RGB PNG).
"""

from __future__ import annotations

import base64
import io
import os
import struct
import zlib

import pytest
from PIL import Image

from lollm.errors import ImageError, LollmError
from lollm.vision import image as vimage
from lollm.vision.image import MAX_PIXELS, MAX_SIDE, decode_data_url, decode_image, read_image_file


def png(width: int, height: int, *, depth: int = 8, color_type: int = 2, rows: bytes | None = None) -> bytes:
    """A PNG written by hand (PNG spec, section 11.2): signature, IHDR, one IDAT, IEND.

    color_type 2 is RGB; ``rows`` defaults to zero pixels, each row led by filter byte 0.
    """
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    if rows is None:
        rows = (b"\x00" + bytes(width * 3 * depth // 8)) * height
    ihdr = struct.pack(">IIBBBBB", width, height, depth, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def photo(width: int = 40, height: int = 30) -> Image.Image:
    """A small drawing with a gradient, so that codecs have something to compress."""
    img = Image.new("RGB", (width, height))
    img.frombytes(bytes(v for y in range(height) for x in range(width)
                        for v in (x * 6 % 256, y * 8 % 256, (x + y) * 3 % 256)))
    return img


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def refused(data: bytes, *words: str) -> str:
    """decode_image(data) must raise ImageError naming the image and containing each of ``words``."""
    with pytest.raises(ImageError) as info:
        decode_image(data, name="image 2 of the request")
    message = str(info.value)
    assert "image 2 of the request" in message
    for word in words:
        assert word in message, message
    return message


def test_accepts_png_jpeg_and_converts_to_rgb():
    img = photo()
    out = decode_image(encoded(img, "PNG"), name="a")
    assert out.mode == "RGB" and out.size == (40, 30) and out.tobytes() == img.tobytes()
    assert decode_image(encoded(img, "JPEG"), name="a").size == (40, 30)
    grey = decode_image(encoded(img.convert("L"), "PNG"), name="a")
    assert grey.mode == "RGB" and grey.getpixel((3, 2))[0] == img.convert("L").getpixel((3, 2))


def test_transparency_is_laid_over_white_as_transformers_does():
    rgba = Image.new("RGBA", (4, 4), (255, 0, 0, 0))  # fully transparent red
    out = decode_image(encoded(rgba, "PNG"), name="a")
    assert out.getpixel((0, 0)) == (255, 255, 255)


def test_decompression_bomb_is_refused_from_the_header():
    side = int(MAX_PIXELS**0.5) + 10  # each side fine, the product too large
    assert side <= MAX_SIDE
    rows = b""  # the IDAT is never read: the header alone refuses it
    refused(png(side, side, rows=rows), "decompression bomb", f"{side}x{side}")


def test_pillows_own_bomb_limit_becomes_the_same_error():
    refused(png(MAX_SIDE, MAX_SIDE, rows=b""), "decompression bomb")


def test_huge_width_is_refused():
    refused(png(MAX_SIDE + 1, 1, rows=b""), f"{MAX_SIDE + 1}x1", f"at most {MAX_SIDE}")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_file_is_refused(fmt):
    data = encoded(photo(64, 64), fmt)
    refused(data[: len(data) // 2], "truncated")


def test_cmyk_is_refused():
    refused(encoded(photo().convert("CMYK"), "JPEG"), "CMYK")


def test_16_bit_grey_is_refused():
    refused(encoded(Image.new("I;16", (5, 4)), "PNG"), "16-bit")


def test_16_bit_rgb_png_is_refused():
    refused(png(3, 2, depth=16), "16-bit")


def test_animated_gif_is_refused():
    frames = [photo().convert("P"), photo(40, 30).transpose(Image.Transpose.FLIP_LEFT_RIGHT).convert("P")]
    data = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    refused(data, "animated", "2 frames", "video")


def test_zero_by_zero_is_refused():
    refused(png(0, 0, rows=b""), "0x0")


def test_not_an_image_is_refused():
    refused(b"GIF89a but not really", "not an image")


def test_data_url_roundtrip_and_bad_base64():
    data = encoded(photo(), "PNG")
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert decode_data_url(url, name="image 1 of the request") == data
    with pytest.raises(ImageError, match="image 1 of the request.*not valid base64"):
        decode_data_url("data:image/png;base64,iVBOR!!!", name="image 1 of the request")
    with pytest.raises(ImageError, match="only data: URLs.*fetches nothing"):
        decode_data_url("https://example.com/cat.png", name="image 1 of the request")
    with pytest.raises(ImageError, match="image/\\* type"):
        decode_data_url("data:text/plain;base64,aGk=", name="image 1 of the request")


def test_file_errors_name_the_path_and_leave_nothing_open(tmp_path):
    good = tmp_path / "good.png"
    good.write_bytes(encoded(photo(), "PNG"))
    bad = tmp_path / "cut.jpg"
    bad.write_bytes(encoded(photo(64, 64), "JPEG")[:300])
    before = open_fds()
    assert read_image_file(good).size == (40, 30)
    for _ in range(3):
        with pytest.raises(ImageError, match="cut.jpg.*truncated"):
            read_image_file(bad)
    with pytest.raises(ImageError, match="missing.png"):
        read_image_file(tmp_path / "missing.png")
    assert open_fds() == before


def test_image_error_is_a_lollm_error():
    assert issubclass(ImageError, LollmError)
    assert vimage.ACCEPTED_MODES[0] == "RGB"
