"""The kit's vision check (lollm.testing.vision_checks) passes qwen3_5 and qwen3_5_moe and fails each vision mutant.

The ViT lives beside the two family folders (``lollm_qwen3_5/vision*.py``), so each mutant copies
the whole ``lollm_qwen3_5`` package with one exact piece of source replaced
(:mod:`lollm.testing.vision_mutants`): the merge-block patch order transposed, the learned position
table dropped, the decoder's scatter one token late. The unchanged copy must pass, so the test can fail.
"""

from __future__ import annotations

import pytest

from lollm.testing.mutation import check_vision_mutant


@pytest.mark.parametrize("mutation", [None, "patch_order_transposed", "position_embedding_dropped", "merge_one_token_off"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_the_vision_check_passes_the_family_and_fails_each_vision_mutant(family, mutation, tmp_path):
    check_vision_mutant(family, mutation, tmp_path)
