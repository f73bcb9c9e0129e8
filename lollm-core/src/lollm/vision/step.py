"""Images in an engine step: each sequence's :class:`ImageBatch` laid over the step's :class:`lollm.batch.Batch`.

In an engine step (docs/batching.md) the forward's T tokens are those of B sequences end to
end, and ``start`` is a Batch. A decoder that reads images then receives ``images`` as a list
of B entries, one per sequence of the Batch: that sequence's ImageBatch (its positions count
from its own first token, as always), or None for a sequence without images. The engine gives it
in every step of a sequence that has images, its decode steps too (Qwen3.5's M-RoPE positions
depend on the images before them); the helpers here skip the images outside the step's rows::

    Batch    counts [1, 21, 1]     starts [40, 0, 7]      N = 23 tokens
    images   [None, ImageBatch([PlacedImage(start=3, 16 rows)]), None]
    x rows   [ a | b b b I I I ... I c c | d ]   rows 4..19: sequence 1's image, its positions 3..18

The two helpers here are the single-sequence ones (:func:`lollm.vision.prompt.scatter_images`,
``images.within``) run once per sequence, on its rows ``lo:hi`` of the N:

* :func:`scatter_step_images`: the merge, each sequence's image rows into its own segment;
* :func:`image_numbers`: for each of the T tokens, which image it belongs to (-1 for text),
  numbered across the whole step, so that "same image" never joins two sequences.

Both accept the single-sequence form too (``start`` an int, ``images`` an ImageBatch or None),
so a family's forward calls them the same way in both.
"""

from __future__ import annotations

import torch

from lollm.batch import Batch
from lollm.vision.prompt import scatter_images
from lollm.vision.spec import ImageBatch


def _per_sequence(images, start: int | Batch, T: int) -> list[tuple[int, int, int, ImageBatch | None]]:
    """``[(lo, hi, first position, ImageBatch or None), ...]``: each sequence's rows of the T and its images.

    ``start`` an int: one sequence, rows 0..T. A Batch: ``images`` must be a list of one entry per
    sequence (ValueError otherwise: the engine and the family disagree).
    """
    if not isinstance(start, Batch):
        return [(0, T, start, images)]
    if not isinstance(images, (list, tuple)) or len(images) != len(start.counts):
        raise ValueError(f"an engine step of {len(start.counts)} sequences wants images as a list of as many "
                         f"ImageBatch-or-None, got {type(images).__name__}")
    return [(lo, hi, first, im) for (lo, hi), first, im in zip(start.segments(), start.starts, images)]


def scatter_step_images(x: torch.Tensor, images, start: int | Batch) -> torch.Tensor:
    """The merge for one forward: ``x`` (1, T, C) with every image row replaced by its embedding.

    images: an ImageBatch (or None) when ``start`` is an int; a list of B ImageBatch-or-None when
    ``start`` is a Batch. Raises ValueError for an image cut by its sequence's rows of this forward.
    Returns a new tensor when some image falls inside, else ``x`` itself.
    """
    if images is None:
        return x
    pieces = _per_sequence(images, start, x.shape[1])
    if not any(im is not None and im.within(first, hi - lo) for lo, hi, first, im in pieces):
        return x
    x = x.clone()
    for lo, hi, first, im in pieces:
        if im is not None:
            x[:, lo:hi] = scatter_images(x[:, lo:hi], im, first)
    return x


def image_numbers(images, start: int | Batch, T: int, device: torch.device | str | None = None) -> torch.Tensor | None:
    """(T,) int64: the number of the image each new token belongs to, -1 for text; None when no image falls inside.

    Images are numbered in the order they come across the whole forward (sequence by sequence),
    so two tokens carry the same number only when they are of the same image of the same
    sequence. images and start as :func:`scatter_step_images`; ValueError for a cut image.
    """
    if images is None:
        return None
    numbers, count = None, 0
    for lo, hi, first, im in _per_sequence(images, start, T):
        for placed in ([] if im is None else im.within(first, hi - lo)):
            if numbers is None:
                numbers = torch.full((T,), -1, dtype=torch.int64, device=device)
            numbers[lo + placed.start - first:lo + placed.end - first] = count
            count += 1
    return numbers
