"""A chat prompt with images: the template writes each image's placeholder, which becomes the image's tokens.

Used where images come in as content parts of chat messages (``lollm serve``'s requests,
``LLM.chat``'s conversations): the parts stand as ``{"type": "image"}`` in the messages, the
family's chat template writes its placeholder for each (Gemma 3's: ``<start_of_image>``), and here,
in the rendered text before it is tokenized, each placeholder becomes
``begin_text + image_token * n + end_text`` (:func:`lollm.vision.prompt.expand_placeholders`).
"""

from __future__ import annotations

from lollm.errors import ImageError
from lollm.vision.prompt import expand_placeholders
from lollm.vision.spec import VisionSpec


def encode_chat_with_images(messages: list[dict], counts: list[int], spec: VisionSpec, tokenizer, *, model: str,
                            parse_special: bool, **template_flags: object) -> list[int]:
    """The ids of the chat prompt of ``messages`` (assistant turn opened), each image placeholder expanded.

    counts: each image's number of tokens, in the order the images' parts come in the messages.
    parse_special: as ``Tokenizer.encode_chat`` (False for a network client's text: its special-token
    text stays plain and is hidden from the expansion). template_flags: the template's variables.
    Raises ImageError naming ``model`` when the template wrote another number of placeholders than
    there are images (a template that does not render image parts); the template's own LollmError
    passes through.
    """
    def expand(text: str) -> str:
        found = text.count(spec.placeholder)
        if found != len(counts):
            raise ImageError(f"the chat template of {model!r} wrote {found} image placeholder(s) ({spec.placeholder!r}) "
                             f"for the {len(counts)} image(s) of the messages: its template does not render image "
                             "content parts")
        return expand_placeholders(text, spec, counts)

    return tokenizer.encode_chat(messages, add_generation_prompt=True, parse_special=parse_special, rewrite=expand,
                                 **template_flags)
