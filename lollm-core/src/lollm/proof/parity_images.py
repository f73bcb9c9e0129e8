"""``lollm parity --image FILE``: the parity gate on the image path (docs/vision.md, "lollm parity").

Both models read the same ids and the same pixels:

1. ours: the family's tower (:func:`lollm.vision.load.open_vision`) preprocesses and encodes each
   image; the prompt gets one placeholder per image (in front of the text, or where the prompt
   writes the family's placeholder), expanded to the image's tokens; the decoder runs with
   ``images=``;
2. the reference: transformers' ``AutoModelForImageTextToText`` (the whole
   ``*ForConditionalGeneration``) on the same ids, with ``pixel_values`` = our pixels (the
   preprocessing is proven equal to transformers' image processor, tensor for tensor, by each
   family's tests) and ``token_type_ids`` marking the image tokens (Gemma 3's bidirectional mask reads them).

A tower with a dynamic resolution (Qwen3.5: patches of several images concatenated, a grid per
image) needs its family's own reference inputs: refused, by name, until a family provides them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lollm.errors import LollmError
from lollm.vision.spec import ImageBatch, VisionSpec


@dataclass
class ImagePrompt:
    """What both sides of an image parity run read (and ``lollm trace --image``): ids, our placed images, the
    pixels, the image token's id, the tower's spec."""

    ids: list[int]
    images: ImageBatch
    pixels: torch.Tensor  # (n_images, 3, H, W) float32, our preprocessing
    image_token_id: int
    spec: VisionSpec  # the tower's numbers (mean and std: lollm trace draws the pixels back)


def image_prompt(loaded, paths: list[str], prompt: str, *, chat: bool, model: str) -> ImagePrompt:
    """The parity prompt with the images of ``paths`` (each checked by lollm.vision.image) for ``loaded``.

    Raises ImageError for a hostile image, a model without a tower, a prompt the images make longer
    than the context; LollmError for a tower with a dynamic resolution (no reference inputs yet).
    """
    from lollm.vision.image import read_image_file
    from lollm.vision.load import open_vision, prepare_prompt
    from lollm.vision.prompt import require_tower

    images = [read_image_file(path) for path in paths]
    tower = require_tower(open_vision(loaded), model)
    if tower.spec.image_size is None:
        raise LollmError(f"--image: {model}'s tower has a dynamic resolution (its images' patches are "
                         "concatenated, each with its grid): the reference's inputs for it are not built yet")
    placeholder = tower.spec.placeholder
    text = prompt if placeholder in prompt else " ".join([placeholder] * len(images) + [prompt])
    if chat:
        text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    ready = prepare_prompt(text, images, tower, loaded.tokenizer, model=model, max_context=loaded.model.max_context,
                           add_special_tokens=not chat)
    pixels = torch.stack([tower.preprocess(image) for image in images])
    return ImagePrompt(ready.ids, ready.images, pixels, tower.spec.image_token_id, tower.spec)


def image_reference(checkpoint, dtype: torch.dtype, prompt: ImagePrompt):
    """transformers' ``AutoModelForImageTextToText`` on the checkpoint's folder, as a Reference of ``prompt``.

    Returns ``run(ids) -> (logits (T, V) float, hidden states)``: the ids must be ``prompt.ids``.
    LollmError when transformers is missing or refuses the checkpoint (a GGUF: its tower is in an
    mmproj file transformers does not read).
    """
    try:
        from transformers import AutoModelForImageTextToText
    except ImportError:
        raise LollmError("the reference needs transformers: pip install 'lollm-core[parity]'") from None
    if checkpoint.fmt != "safetensors":
        raise LollmError(f"lollm parity --image compares a safetensors checkpoint (the whole *ForConditionalGeneration); "
                         f"{checkpoint.spec} is {checkpoint.fmt}")
    try:
        model = AutoModelForImageTextToText.from_pretrained(str(checkpoint.path), dtype=dtype).eval()
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError ... for checkpoints it refuses
        raise LollmError(f"transformers could not load the image reference from {checkpoint.path}: "
                         f"{type(exc).__name__}: {exc}") from None

    @torch.inference_mode()
    def run(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model(input_ids=ids, pixel_values=prompt.pixels.to(dtype), token_type_ids=(ids == prompt.image_token_id).long(),
                    output_hidden_states=True, use_cache=False)
        return out.logits[0].float(), [h.float() for h in out.hidden_states]

    return run
