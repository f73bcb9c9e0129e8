"""Image decoding: bytes, a file or a ``data:`` URL -> one RGB PIL image, with every hostile case refused.

An image is untrusted input: a user's file, or bytes in a request to ``lollm serve``.
Pillow reads the header first and the pixels only on ``load()``, so every size check
below runs on the header, before a single pixel is decompressed:

1. the bytes must open as an image at all (PNG, JPEG, GIF, WebP, BMP ...);
2. the width and height must both be at least 1 (a 0x0 image holds nothing to look at);
3. each side at most :data:`MAX_SIDE` pixels (a 1 x 10^6 strip is a huge width);
4. width x height at most :data:`MAX_PIXELS` (a decompression bomb: a few kilobytes of PNG
   that would decompress to gigabytes);
5. one frame only (an animated GIF or PNG is a video, which lollm does not read);
6. a colour mode we can turn into RGB without guessing: 8-bit RGB, RGBA, grey, palette.
   CMYK (print colours) and 16-bit or float images are refused, not silently squeezed;
7. then the pixels are decoded: a truncated PNG or JPEG fails here;
8. finally the image becomes RGB the way transformers' ``convert_to_rgb`` does it:
   a transparent pixel is laid over white.

Each refusal is one :class:`lollm.errors.ImageError` naming the image (``name``: its path,
or "image 2 of the request") and the rule it broke. Nothing stays open afterwards:
the file is read in full first and Pillow works on an in-memory copy that is closed
on every path out.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

from PIL import Image

from lollm.errors import ImageError

#: The largest width or height accepted, in pixels (a 16K photo; every tower resizes far below it).
MAX_SIDE = 16384
#: The most pixels accepted, width x height: 50 million, 150 MB as RGB bytes. A bigger
#: image is treated as a decompression bomb (Pillow's own warning starts at 89 million).
MAX_PIXELS = 50_000_000
#: The largest encoded image accepted, in bytes (a file or a decoded ``data:`` URL).
MAX_BYTES = 32 * 1024 * 1024

#: Colour modes turned into RGB as they are: 1-bit, 8-bit grey, palette, with or without alpha.
ACCEPTED_MODES = ("RGB", "RGBA", "L", "LA", "P", "PA", "1")


def read_image_file(path: str | os.PathLike[str]) -> Image.Image:
    """The image in file ``path`` as RGB: (see :func:`decode_image`); the error names the path.

    Raises ImageError for a missing or unreadable file, a file over :data:`MAX_BYTES`,
    and every refusal of :func:`decode_image`.
    """
    name = os.fspath(path)
    try:
        size = os.path.getsize(name)
        if size > MAX_BYTES:
            raise ImageError(f"image {name!r} is {size} bytes; at most {MAX_BYTES} are accepted")
        with open(name, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ImageError(f"cannot read image {name!r}: {exc.strerror or exc}") from None
    return decode_image(data, name=repr(name))


def decode_data_url(url: str, *, name: str) -> bytes:
    """The bytes of a ``data:image/...;base64,PAYLOAD`` URL.

    name: how the error names the image ("image 1 of the request").
    Raises ImageError when the URL is not a base64 ``data:`` URL of an ``image/*`` type,
    or its payload is not valid base64, or is over :data:`MAX_BYTES` once decoded.
    """
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ImageError(f"{name}: only data: URLs are accepted (data:image/png;base64,...); lollm fetches nothing "
                         "(no web address or file path is read)")
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise ImageError(f"{name}: the data: URL has no ',' before its payload")
    media_type, _, encoding = header.partition(";")
    if not media_type.startswith("image/"):
        raise ImageError(f"{name}: the data: URL's media type is {media_type or '(none)'!r}; an image/* type is needed")
    if encoding != "base64":
        raise ImageError(f"{name}: the data: URL must be base64-encoded (data:{media_type};base64,...)")
    if len(payload) > MAX_BYTES * 4 // 3 + 4:
        raise ImageError(f"{name}: the data: URL holds more than {MAX_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{name}: the data: URL's payload is not valid base64 ({exc})") from None


def decode_image(data: bytes, *, name: str) -> Image.Image:
    """Encoded image bytes -> a fully decoded RGB ``PIL.Image`` (steps 1-8 of the module docstring).

    name: how errors name the image (a quoted path, or "image 2 of the request").
    Raises ImageError, one per refused case, naming ``name`` and the rule.
    """
    if len(data) > MAX_BYTES:
        raise ImageError(f"{name} is {len(data)} bytes; at most {MAX_BYTES} are accepted")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))  # 1. the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"{name} is a decompression bomb: more than {MAX_PIXELS} pixels") from None
    except (OSError, SyntaxError, ValueError) as exc:
        if png_size(data) is not None and 0 in png_size(data):  # Pillow refuses to open an empty PNG at all
            width, height = png_size(data)
            raise ImageError(f"{name} is {width}x{height}: an image needs at least one pixel") from None
        if "truncated" in str(exc).lower() or signature(data):  # a known format, cut or broken inside its header
            raise ImageError(f"{name} is truncated or corrupt: its {signature(data) or 'image'} header does not "
                             "read to the end") from None
        raise ImageError(f"{name} is not an image lollm can read (PNG, JPEG, GIF, WebP, BMP)") from None
    with image:
        check_header(image, name)  # 2.-6.
        try:
            image.load()  # 7. the pixels
        except (OSError, SyntaxError, ValueError) as exc:
            raise ImageError(f"{name} is truncated or corrupt: {exc}") from None
        return to_rgb(image)  # 8.


def check_header(image: Image.Image, name: str) -> None:
    """Steps 2-6: the size, frame count and colour mode, read from the header (no pixel decoded)."""
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{name} is {width}x{height}: an image needs at least one pixel")
    if width > MAX_SIDE or height > MAX_SIDE:
        raise ImageError(f"{name} is {width}x{height}: each side may be at most {MAX_SIDE} pixels")
    if width * height > MAX_PIXELS:
        raise ImageError(f"{name} is a decompression bomb: {width}x{height} = {width * height} pixels, "
                         f"at most {MAX_PIXELS} are accepted")
    if getattr(image, "n_frames", 1) > 1:
        raise ImageError(f"{name} is animated ({image.n_frames} frames): video is not supported, "
                         "send one frame as a still image")
    if image.mode not in ACCEPTED_MODES:
        kind = "a CMYK" if image.mode == "CMYK" else f"a {image.mode} (16-bit, 32-bit or float)" \
            if image.mode.startswith(("I", "F")) else f"a {image.mode}"
        raise ImageError(f"{name} is {kind} image; accepted are 8-bit RGB, RGBA, grey and palette images "
                         f"(modes {', '.join(ACCEPTED_MODES)}): convert it to 8-bit RGB first")
    tile = getattr(image, "tile", None)  # an image made in memory (not read from a file) has none
    rawmode = tile[0].args if tile else None  # how the file stores a pixel, e.g. "RGB;16B"
    if isinstance(rawmode, str) and ";16" in rawmode:  # a 16-bit RGB PNG opens as mode RGB, dropping 8 bits
        raise ImageError(f"{name} is a 16-bit PNG; accepted are 8-bit images: convert it to 8-bit RGB first")


#: The first bytes of each format Pillow reads here, and its name.
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF", b"BM": "BMP"}


def signature(data: bytes) -> str | None:
    """The format whose signature ``data`` starts with (WebP: ``RIFF....WEBP``), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    return next((fmt for magic, fmt in SIGNATURES.items() if data.startswith(magic)), None)


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk (bytes 16-24 after the 8-byte signature), or None for another format."""
    if len(data) < 24 or not data.startswith(b"\x89PNG\r\n\x1a\n") or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def to_rgb(image: Image.Image) -> Image.Image:
    """Any accepted mode -> RGB, as transformers' ``convert_to_rgb``: transparency composited over white."""
    if image.mode == "RGB":
        return image.copy()
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
