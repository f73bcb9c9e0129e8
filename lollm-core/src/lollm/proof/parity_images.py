"""``lollm parity --image FILE``: the parity gate on the image path (docs/vision.md, "lollm parity").

Both models read the same ids and the same pixels:

1. ours: the family's tower (:func:`lollm.vision.load.open_vision`) preprocesses and encodes each
   image; the prompt gets one placeholder per image (in front of the text, or where the prompt
   writes the family's placeholder), expanded to the image's tokens; the decoder runs with
   ``images=``;
2. the reference: transformers' ``AutoModelForImageTextToText`` (the whole
   ``*ForConditionalGeneration``) on the same ids, with the image inputs built from *our* pixels as
   the family's image processor lays them out (:func:`lollm.vision.reference.reference_inputs`: Gemma 3
   stacks them; Gemma 4 pads each image's patches and gives their positions; Qwen3.5 concatenates
   every image's patches and gives each grid, from which transformers computes its M-RoPE positions).
   The preprocessing itself is proven equal to transformers' image processor, tensor for tensor, by
   each family's tests. The image tokens are marked for the reference under the names its forward
   takes (:func:`lollm.vision.reference.token_type_inputs`: ``token_type_ids`` for Gemma 3's
   bidirectional mask, ``mm_token_type_ids`` for Gemma 4's mask rule and Qwen3.5's positions).
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
    pixels: list[torch.Tensor]  # one (3, H, W) float32 per image, our preprocessing (sizes differ: Gemma 4, Qwen3.5)
    image_token_id: int
    spec: VisionSpec  # the tower's numbers (mean and std: lollm trace draws the pixels back)
    reference_inputs: dict[str, torch.Tensor]  # the image keyword arguments of transformers' forward


def image_prompt(loaded, paths: list[str], prompt: str, *, chat: bool, model: str, mmproj: str | None = None,
                 system: str | None = None, template_flags: dict | None = None) -> ImagePrompt:
    """The parity prompt with the images of ``paths`` (each checked by lollm.vision.image) for ``loaded``.

    mmproj: a GGUF model's tower file (``lollm trace --mmproj``; :func:`lollm.vision.load.open_vision`).
    system, template_flags: a system message before the user's, and the template's variables
    (``enable_thinking``), with ``chat`` (``lollm trace --image --system``).

    Raises ImageError for a hostile image, a model without a tower, a prompt the images make longer
    than the context.
    """
    from lollm.vision.image import read_image_file
    from lollm.vision.load import open_vision, prepare_prompt
    from lollm.vision.prompt import require_tower
    from lollm.vision.reference import reference_inputs

    images = [read_image_file(path) for path in paths]
    tower = require_tower(open_vision(loaded, mmproj), model)
    placeholder = tower.spec.placeholder
    text = prompt if placeholder in prompt else " ".join([placeholder] * len(images) + [prompt])
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        text = loaded.tokenizer.apply_chat_template(messages, **(template_flags or {}))
    ready = prepare_prompt(text, images, tower, loaded.tokenizer, model=model, max_context=loaded.model.max_context,
                           add_special_tokens=not chat)
    pixels = [tower.preprocess(image) for image in images]
    return ImagePrompt(ready.ids, ready.images, pixels, tower.spec.image_token_id, tower.spec,
                       reference_inputs(tower, pixels))


def refuse_gguf_images(model: str, command: str = "lollm parity --image") -> None:
    """LollmError: ``command`` (parity's, trace's ``--compare``) has no image reference for a GGUF ``model``.

    The gate's reference reads the very weights lollm reads (a text GGUF: transformers on the same file,
    lollm.proof.parity.reference_weights), and transformers reads no mmproj file. The way to go: the
    safetensors checkpoint the files were converted from; that a GGUF plus its mmproj give that
    checkpoint's logits is the families' tests' to prove (docs/vision.md, "From GGUF").
    """
    raise LollmError(f"{command} compares with transformers on the same weights, and transformers reads no mmproj "
                     f"file, so {model} (a GGUF, its tower in an mmproj file) has no image reference: compare the "
                     "safetensors checkpoint the GGUF was converted from instead; without images, the GGUF's text "
                     "path has its reference (transformers reads the text GGUF)")


def image_reference(checkpoint, dtype: torch.dtype, prompt: ImagePrompt):
    """transformers' ``AutoModelForImageTextToText`` on the checkpoint's folder, as a Reference of ``prompt``.

    Returns ``run(ids) -> (logits (T, V) float, hidden states)``: the ids must be ``prompt.ids``.
    LollmError when transformers is missing or refuses the checkpoint (a GGUF: its tower is in an
    mmproj file transformers does not read).
    """
    from lollm.vision.reference import token_type_inputs

    try:
        from transformers import AutoModelForImageTextToText
    except ImportError:
        raise LollmError("the reference needs transformers: pip install 'lollm-core[parity]'") from None
    if checkpoint.fmt != "safetensors":
        refuse_gguf_images(checkpoint.spec)  # lollm trace --compare refuses before its forward pass
    try:
        model = AutoModelForImageTextToText.from_pretrained(str(checkpoint.path), dtype=dtype).eval()
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError ... for checkpoints it refuses
        raise LollmError(f"transformers could not load the image reference from {checkpoint.path}: "
                         f"{type(exc).__name__}: {exc}") from None

    @torch.inference_mode()
    def run(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in prompt.reference_inputs.items()}
        marks = token_type_inputs(model.forward, ids, prompt.image_token_id)
        out = model(input_ids=ids, **inputs, **marks, output_hidden_states=True, use_cache=False)
        return out.logits[0].float(), [h.float() for h in out.hidden_states]

    return run
