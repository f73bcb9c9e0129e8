"""M-RoPE: the decoder's positions for a prompt that holds image tokens, and their rotary angles.

A text token has one position. Qwen3.5's decoder gives every token *three*
(time, height, width) and turns different rotary frequencies by different ones
(multimodal RoPE, "M-RoPE"):

* text: all three are the token's ordinary index (then M-RoPE equals 1-D RoPE,
  which is why the text-only decoder ignores it);
* an image of merged grid (t, h', w') = (t, h/m, w/m), placed where the running
  position is p: its t*h'*w' placeholder tokens, in raster order, get
  (p + frame, p + row, p + column);
* after the image the running position resumes at p + max(h', w') — *not* at
  p + t*h'*w': a 512 x 384 image takes 192 tokens but only 16 positions.

So a prompt of T tokens ends at a position below T: :func:`mrope_positions`
returns that offset (``delta``, <= 0) too; a token generated at index i gets
position i + delta on all three axes.

Which frequency follows which axis (:func:`mrope_cos_sin`): Qwen3.5 interleaves
them. Of the R/2 frequencies (32 in Qwen3.5-0.8B: rotary dim 64), frequency j
follows height when j % 3 == 1 and j < 3 * section[1], width when j % 3 == 2 and
j < 3 * section[2], time otherwise (``mrope_section`` = [11, 11, 10]:
T H W T H W ... T H). The angles are then laid out as the decoder's text RoPE
lays them out (R/2 angles repeated twice, for rotate_half), so the decoder's
``apply_partial_rope`` takes them unchanged.

Reference: transformers' ``Qwen3_5Model.get_rope_index`` / ``get_vision_position_ids`` and
``Qwen3_5TextRotaryEmbedding`` (models/qwen3_5/modeling_qwen3_5.py).
"""

from __future__ import annotations

from typing import Sequence

import torch

from lollm.batch import Batch, token_positions


def mrope_positions(
    input_ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], merge_size: int
) -> tuple[torch.Tensor, int]:
    """(3, T) positions (time, height, width) of a prompt, and ``delta`` = next position - T.

    input_ids: the prompt with each image already expanded to t*h*w/m² ``image_token_id`` tokens;
    grids: each image's patch grid (t, h, w) in prompt order; merge_size: m.
    ValueError naming the image when the placeholders and the grids disagree (a run of image
    tokens shorter than its grid, a grid left over, image tokens left over).
    """
    ids = list(input_ids)
    columns: list[torch.Tensor] = []  # each (3, n) for a stretch of the prompt
    pos, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:  # a stretch of text: positions pos, pos + 1, ... on all three axes
            j = i
            while j < len(ids) and ids[j] != image_token_id:
                j += 1
            columns.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos, i = pos + j - i, j
            continue
        if image >= len(grids):
            raise ValueError(f"input_ids has image tokens at index {i} beyond the {len(grids)} image grid(s) given")
        t, h, w = (int(n) for n in grids[image])
        hm, wm = h // merge_size, w // merge_size  # the merged grid
        n = t * hm * wm
        if ids[i:i + n] != [image_token_id] * n:
            raise ValueError(f"image {image} (grid {(t, h, w)}) needs {n} image tokens from index {i}; "
                             "the prompt has fewer")
        frame, row, col = torch.meshgrid(torch.arange(t), torch.arange(hm), torch.arange(wm), indexing="ij")
        columns.append(torch.stack([frame, row, col]).reshape(3, n) + pos)  # (3, n), raster order
        pos, i, image = pos + max(hm, wm), i + n, image + 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grids given but the prompt holds {image} image(s)")
    positions = torch.cat(columns, dim=1) if columns else torch.zeros(3, 0, dtype=torch.long)
    return positions, pos - len(ids)


def mrope_axis_of_frequency(n_freq: int, section: Sequence[int]) -> torch.Tensor:
    """Which position axis (0 time, 1 height, 2 width) turns each of the ``n_freq`` frequencies: (n_freq,) long.

    Interleaved: frequency j follows height when j % 3 == 1 and j < 3 * section[1], width when
    j % 3 == 2 and j < 3 * section[2], time otherwise.
    """
    j = torch.arange(n_freq)
    axis = torch.zeros(n_freq, dtype=torch.long)
    axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axis


def mrope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, section: Sequence[int], dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, R) of M-RoPE for positions (3, T); inv_freq: (R/2,) float32, the decoder's.

    Each frequency j turns by positions[axis[j]] * inv_freq[j] (:func:`mrope_axis_of_frequency`); the
    R/2 angles are repeated twice like the text RoPE's. For text-only positions (three equal rows)
    this equals the decoder's 1-D RoPE exactly.
    """
    axis = mrope_axis_of_frequency(inv_freq.shape[0], section).to(positions.device)
    chosen = positions.float()[axis]  # (R/2, T): each frequency's own position row
    angles = chosen.T * inv_freq[None, :]  # (T, R/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, R)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def mrope_positions_window(
    images: Sequence[tuple[int, Sequence[int]]], start: int, T: int
) -> tuple[torch.Tensor, int]:
    """The (3, T) M-RoPE positions of sequence indices ``start .. start+T-1``, from the images' spans alone.

    What a decoder needs for one forward of a chunked prefill or a decode step, without the
    earlier ids: images is ``[(first index, merged grid (t, h', w')), ...]`` of the whole
    sequence (core's ``PlacedImage.start`` and ``.grid``), an image taking t*h'*w' indices from
    its first. Returns the positions and ``delta``, the shift after every image
    (sum of max(h', w') - t*h'*w'): a text index i past all images sits at i + delta.

    Rule (the same as :func:`mrope_positions`): a text index i sits at i plus the shifts of the
    images that end before it; an image starting at index s sits at p = s + (those shifts), its
    k-th token (raster order) at (p + frame, p + row, p + column).
    """
    index = torch.arange(start, start + T)
    positions = index.expand(3, -1).clone()
    spans = []
    shift = 0
    for first, (t, h, w) in sorted((int(s), tuple(int(n) for n in g)) for s, g in images):
        n = t * h * w
        spans.append((first, n, (t, h, w), first + shift))  # p: where the image's positions start
        positions[:, index >= first + n] += max(h, w) - n
        shift += max(h, w) - n
    for first, n, (t, h, w), p in spans:
        inside = (index >= first) & (index < first + n)
        k = index[inside] - first  # the token's rank inside the image, raster order
        positions[0, inside] = p + k // (h * w)
        positions[1, inside] = p + (k // w) % h
        positions[2, inside] = p + k % w
    return positions, shift


def sequence_cos_sin(
    rotary_emb, section: Sequence[int], spans: Sequence[tuple[int, Sequence[int]]], start: int, T: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, R) of the decoder's RoPE for sequence indices ``start .. start+T-1``.

    rotary_emb: the decoder's ``RotaryEmbedding`` (1-D RoPE; its ``inv_freq`` (R/2,) float32);
    section:    the config's ``mrope_section``;
    spans:      the sequence's images, ``[(first index, merged grid (t, h', w')), ...]`` ([] for text),
                as the decoder keeps them in its cache (a decode step gets no images, only the cache).

    A text-only sequence takes the text path unchanged: 1-D RoPE at ``start .. start+T-1``. A
    sequence with images takes M-RoPE (:func:`mrope_positions_window`) for every forward, the
    decode steps after the images included: their three axes are equal (index + delta), so
    M-RoPE gives the 1-D angles of the shifted position, bit for bit.
    """
    device = rotary_emb.inv_freq.device
    if not spans:
        return rotary_emb(torch.arange(start, start + T, device=device), dtype)
    positions, _ = mrope_positions_window(spans, start, T)  # (3, T)
    return mrope_cos_sin(positions.to(device), rotary_emb.inv_freq, section, dtype)


def image_spans(images) -> list[tuple[int, tuple[int, int, int]]]:
    """``[(first index, merged grid (t, h', w')), ...]`` of an :class:`lollm.vision.spec.ImageBatch` (None: []).

    ValueError for an image without a grid or whose grid does not count its tokens.
    """
    spans = []
    for k, im in enumerate([] if images is None else images.images):
        t, h, w = (int(n) for n in im.grid) if im.grid is not None else (0, 0, 0)
        if t * h * w != im.end - im.start:
            raise ValueError(f"image {k + 1} has {im.end - im.start} tokens but its grid is {im.grid}: "
                             "M-RoPE needs each image's merged (t, h, w) grid from the tower")
        spans.append((im.start, (t, h, w)))
    return spans


def sequence_image_spans(images, start: int, T: int, cache) -> list[tuple[int, tuple[int, int, int]]]:
    """The images of the sequence a single-sequence forward belongs to, ``[(first index, merged grid), ...]``; [] for text.

    images: the forward's :class:`lollm.vision.spec.ImageBatch` or None; start: its first index;
    cache: the sequence's cache or None. With images (the forwards of a prefill): read from them
    (:func:`image_spans`), checked, and kept in ``cache.image_spans`` for the forwards that follow;
    without (decode steps): what the cache kept. ValueError for an image this forward cuts.
    """
    if images is None or not images.images:
        return [] if cache is None else cache.image_spans
    images.within(start, T)  # raises for an image cut by this forward's edges
    spans = image_spans(images)
    if cache is not None:
        cache.image_spans = spans
    return spans


def forward_cos_sin(rotary_emb, section: Sequence[int], images, start: int | Batch, T: int, cache,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, R) of one forward's T tokens, M-RoPE for each sequence that has images.

    Single sequence (``start`` an int): :func:`sequence_image_spans` then :func:`sequence_cos_sin`.
    An engine step (``start`` a Batch): ``images`` None, or one ImageBatch-or-None per sequence,
    which the engine gives in every step of a sequence with images (its decode steps too, so
    their positions are shifted; docs/vision.md section 6). Every row first takes 1-D RoPE at its
    own position; the rows of a sequence with images are then replaced by its M-RoPE angles.
    A step without images is the text path, unchanged.
    """
    if not isinstance(start, Batch):
        spans = sequence_image_spans(images, start, T, cache)
        return sequence_cos_sin(rotary_emb, section, spans, start, T, dtype)
    cos, sin = rotary_emb(token_positions(start, T, rotary_emb.inv_freq.device), dtype)  # (T, R) each
    if images is None:
        return cos, sin
    if not isinstance(images, (list, tuple)) or len(images) != len(start.counts):
        raise ValueError(f"an engine step of {len(start.counts)} sequences wants images as a list of as many "
                         f"ImageBatch-or-None, got {type(images).__name__}")
    for (lo, hi), first, im in zip(start.segments(), start.starts, images):
        spans = image_spans(im)
        if spans:
            cos[lo:hi], sin[lo:hi] = sequence_cos_sin(rotary_emb, section, spans, first, hi - lo, dtype)
    return cos, sin
