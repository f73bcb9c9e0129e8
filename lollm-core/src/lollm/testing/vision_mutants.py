"""The vision check's three mutants, written into each vision family's own source (:mod:`lollm.testing.mutation`).

Only the kit's vision check (:mod:`lollm.testing.vision_checks`) gives the tower and the merge
an image, so only it can fail these bugs; every text test passes them:

* ``patch_order_transposed``: the image's patches read column by column (the patch grid
  transposed), while their positions stay those of row-by-row order;
* ``position_embedding_dropped``: the tower's learned position table never added;
* ``merge_one_token_off``: the image embeddings merged one position late (the scatter of the
  decoder's forward given ``start - 1``; an int start only, as in the kit's forward).

Each family writes these steps in its own files, so each has its own edits (file -> exact
``(old, new)`` pairs, as :func:`lollm.testing.mutation.copy_family` takes them). gemma3 keeps its
tower inside its family folder; gemma4 and qwen3_5 keep theirs beside it, in the distribution's
package (``lollm_gemma/gemma4_vision*.py``, ``lollm_qwen3_5/vision*.py``), so their mutants copy that
whole package (:data:`VISION_PACKAGES`) and name each file from there.
"""

from __future__ import annotations

#: family -> the package its vision mutants copy, when it is not the family's own (the tower lives beside it).
VISION_PACKAGES = {"gemma4": "lollm_gemma", "qwen3_5": "lollm_qwen3_5", "qwen3_5_moe": "lollm_qwen3_5"}

Edits = dict[str, list[tuple[str, str]]]


def _merge(path: str, line: str) -> Edits:
    """The scatter call ``line`` in ``path`` given ``start - 1``: an image placed at p lands at p + 1."""
    return {path: [(line, line.replace("start)", "start - 1 if isinstance(start, int) else start)"))]}


def _gemma3() -> dict[str, Edits]:
    """SigLIP: its patches flattened from the conv's (D, h, w) grid, one position vector per patch."""
    flatten = "x = x.flatten(2).transpose(1, 2)  # (1, P, D): patches in reading order, row by row"
    positions = "return x + self.position_embedding.weight[None]  # patch i gets position vector i"
    return {
        "patch_order_transposed": {"vision.py": [(flatten, flatten.replace("x.flatten(2)", "x.transpose(2, 3).flatten(2)"))]},
        "position_embedding_dropped": {"vision.py": [(positions, "return x  # the position table never added")]},
        "merge_one_token_off": _merge("modeling_gemma3.py", "x = scatter_step_images(x, images, start)"),
    }


def _gemma4() -> dict[str, Edits]:
    """Gemma 4: patches cut from the (H, W, 3) pixels with an (x, y) position each, two per-axis tables."""
    cut = "patches = pixels.reshape(gh, p, gw, p, 3).permute(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)"
    table = "return x + table[0][positions[:, 0]] + table[1][positions[:, 1]]"
    return {
        "patch_order_transposed": {"gemma4_vision_preprocess.py": [(cut, cut.replace("permute(0, 2,", "permute(2, 0,"))]},
        "position_embedding_dropped": {"gemma4_vision.py": [(table, "return x  # the position tables never added")]},
        "merge_one_token_off": _merge("gemma4/modeling_gemma4.py", "x = scatter_step_images(x, images, start)"),
    }


def _qwen3_5(name: str) -> dict[str, Edits]:
    """Qwen3.5's ViT: patches in 2 x 2 merge-block order, a learned table resized to each grid, then 2D RoPE."""
    order = "x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (block row, block col, in-row, in-col, C, P, P)"
    learned = "x = x + learned_positions(self.pos_embed, grid, c.spatial_merge_size)"
    return {
        "patch_order_transposed": {"vision_preprocess.py": [(order, order.replace("permute(1, 4, 2, 5,", "permute(4, 1, 5, 2,"))]},
        "position_embedding_dropped": {"vision.py": [(learned, "x = x  # the position table never added")]},
        "merge_one_token_off": _merge(f"{name}/modeling_{name}.py", "x = scatter_step_images(x, images, start)"),
    }


#: family -> {bug class: its edits}; the files are those of the family's package, or of
#: :data:`VISION_PACKAGES`' package for a family named there.
VISION_EDITS: dict[str, dict[str, Edits]] = {
    "gemma3": _gemma3(), "gemma4": _gemma4(), "qwen3_5": _qwen3_5("qwen3_5"), "qwen3_5_moe": _qwen3_5("qwen3_5_moe"),
}

#: What each vision mutant fails -> a text the kit's message holds. A right tower with a wrong merge passes
#: the features test: only the logits see where the image landed.
FAILS = {
    "patch_order_transposed": {"test_vision_tower_features_equal_the_reference": "vision features",
                               "test_vision_logits_equal_the_reference": "vision parity failed"},
    "position_embedding_dropped": {"test_vision_tower_features_equal_the_reference": "vision features",
                                   "test_vision_logits_equal_the_reference": "vision parity failed"},
    "merge_one_token_off": {"test_vision_logits_equal_the_reference": "vision parity failed"},
}

