"""The prompt cache on full KV caches: each turn of a conversation equals a cold run, reusing by rollback."""

from __future__ import annotations

from lollm.testing.conformance import check_prompt_cache_turns

from _qwen_tiny import family, load_ours, tiny_checkpoint, torch  # noqa: F401  (fixtures)


def test_turns_equal_cold_runs_and_roll_back_to_the_common_prefix(tiny_checkpoint, family):
    torch.set_num_threads(1)
    model = load_ours(tiny_checkpoint(family, num_hidden_layers=3), family)
    records = check_prompt_cache_turns(model, vocab=500)
    how = [(r.how, r.reused) for r in records]
    # turn lengths: 40, 60 (40+8+12), 98 (60+8+30), 74 (60+2+12), 74, 17; each answer 8 tokens
    assert how == [
        ("cold", 0),
        ("extend", 47),  # 40 + 8 - 1: the last answer token was never run
        ("extend", 67),
        ("rollback", 62),  # turn 4 parts from turn 3 after 2 tokens of answer 2: a KV cache goes right there
        ("rollback", 73),  # the same prompt again: all but its last token
        ("rollback", 5),
    ], how
