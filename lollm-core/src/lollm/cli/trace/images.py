"""``lollm trace --image``: the image's tokens on the picture, and where each prediction after it looked.

An image becomes n decoder positions (Gemma 3: 256, each the average of a 4 x 4 block of
14-pixel patches, the tiny test tower: 16; Gemma 4: one per 3 x 3 block of 16-pixel patches, a
grid of the image's own aspect; Qwen3.5: one per 2 x 2 block, its ``grid``). The trace page shows, written into its HTML
(no script needed):

* the picture as the tower saw it (the preprocessed pixels, mean and std undone), with the
  grid of its n tokens drawn on it;
* for the last positions after the image (the last one's prediction is the token the model
  generates first), the attention each of the n tokens received from it: the weights of
  every layer and head averaged, so a cell's shade is "how much this prediction read this
  part of the picture"; the caption gives the share of all its attention that went to the image.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass

import torch

#: How many positions after an image the page shows (the last ones of the prompt).
SHOWN_POSITIONS = 8
#: Side of the drawn picture, in CSS pixels.
THUMBNAIL_PX = 160


@dataclass
class ImageView:
    """One image of a traced prompt, as the page draws it.

    start, end: its positions (end exclusive); rows x cols: its tokens' grid (n = rows * cols);
    thumbnail:  a ``data:image/png`` URL of the pixels the tower read;
    attention:  ``[(position, piece, weights (n,) floats, share), ...]`` for the shown positions;
    width_px, height_px: the drawn picture's size in CSS pixels (its aspect ratio, the longer side
                :data:`THUMBNAIL_PX`).
    """

    number: int
    start: int
    end: int
    rows: int
    cols: int
    thumbnail: str
    attention: list[tuple[int, str, list[float], float]]
    width_px: int = THUMBNAIL_PX
    height_px: int = THUMBNAIL_PX


def _thumbnail(pixels: torch.Tensor, mean, std) -> str:
    """(3, H, W) normalized pixels -> a PNG data URL of the image the tower read."""
    from PIL import Image

    rgb = pixels.float() * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    array = (rgb.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def token_grid(image, pixels: torch.Tensor, spec) -> tuple[int, int]:
    """(rows, cols) of an image's tokens over its picture: rows * cols = its number of tokens.

    image: its :class:`lollm.vision.spec.PlacedImage`; pixels: its preprocessed (3, H, W) tensor.
    In order: the grid its tower gave (``PlacedImage.grid``, (t, h, w): Qwen3.5); else the pixels' sides
    over ``patch_size * merge`` (Gemma 3: 896 / (14 * 4) = 16 a side; Gemma 4: a grid of its own aspect);
    else a square; else one row.
    """
    n = image.end - image.start
    side = spec.patch_size * spec.merge
    candidates = [(pixels.shape[-2] // side, pixels.shape[-1] // side), (math.isqrt(n), math.isqrt(n)), (1, n)]
    if image.grid is not None:
        t, h, w = image.grid
        candidates.insert(0, (t * h, w))
    return next((rows, cols) for rows, cols in candidates if rows * cols == n)


def image_views(trace, images, pixels: list[torch.Tensor], spec) -> list[ImageView]:
    """The :class:`ImageView` of each placed image (``images``: the prompt's ImageBatch) from the trace's attention.

    pixels: each image's preprocessed (3, H, W) tensor; spec: the tower's VisionSpec (mean, std, patch, merge).
    The token grid is the image's own (:func:`token_grid`); the picture keeps its aspect ratio.
    """
    T = len(trace.ids)
    mean = torch.stack([layer.probs.mean(0) for layer in trace.attention]).mean(0) if trace.attention else torch.zeros(T, T)
    views = []
    for number, (im, px) in enumerate(zip(images.images, pixels), 1):
        rows, cols = token_grid(im, px, spec)
        shown = range(max(im.end, T - SHOWN_POSITIONS), T)
        attention = [(q, trace.pieces[q], mean[q, im.start:im.end].tolist(), float(mean[q, im.start:im.end].sum()))
                     for q in shown]
        height, width = px.shape[-2:]
        scale = THUMBNAIL_PX / max(height, width)
        views.append(ImageView(number, im.start, im.end, rows, cols, _thumbnail(px, spec.image_mean, spec.image_std),
                               attention, max(1, round(width * scale)), max(1, round(height * scale))))
    return views


def _grid(view: ImageView, weights: list[float] | None) -> str:
    """The picture with its token grid; each cell shaded by its weight (relative to the largest) when given."""
    top = max(weights) if weights else 0.0
    cells = []
    for w in weights or [0.0] * (view.rows * view.cols):
        alpha = 0.85 * (w / top) if top > 0 else 0.0
        cells.append(f'<div style="border:1px solid rgba(255,255,255,.5);background:rgba(220,30,30,{alpha:.3f})"></div>')
    style = (f"display:grid;grid-template-rows:repeat({view.rows},1fr);grid-template-columns:repeat({view.cols},1fr);"
             f"width:{view.width_px}px;height:{view.height_px}px;background:url({view.thumbnail}) center/100% 100%")
    return f'<div style="{style}">{"".join(cells)}</div>'


def images_html(views: list[ImageView]) -> str:
    """The page's image section (empty without images); every text escaped."""
    if not views:
        return ""
    parts = ['<section id="images-panel"><h2>Images</h2><p>Each image became a grid of decoder positions, drawn on '
             "the picture as the tower read it. For the last positions after it, the attention each of its tokens "
             "received (every layer and head averaged; darker: more). The last position's prediction is the first "
             "token the model generates.</p>"]
    for view in views:
        parts.append(f"<h3>image {view.number}: positions {view.start}..{view.end - 1}, {view.rows} x {view.cols} "
                     f"tokens</h3><div style=\"display:flex;flex-wrap:wrap;gap:12px\">")
        parts.append(f"<figure>{_grid(view, None)}<figcaption>its tokens</figcaption></figure>")
        for position, piece, weights, share in view.attention:
            caption = html.escape(f"position {position} {piece!r}: {100 * share:.1f}% on the image")
            parts.append(f"<figure>{_grid(view, weights)}<figcaption>{caption}</figcaption></figure>")
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)
