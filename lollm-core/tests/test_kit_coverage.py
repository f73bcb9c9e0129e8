"""The conformance kit's coverage check (lollm.testing.coverage) and the tiny configs that pass it.

The blind checkpoint is the one the issue found: ``lollm new-family --like gemma3`` used to write
gemma-3-1b-it shrunk to two layers, both sliding, with its 512-token window, and the kit fed it
32-token prompts. The check must name each blind spot and its fix; the configs of
:func:`lollm.testing.tiny.kit_config` must pass it for every hub config a copy starts from.
"""

from __future__ import annotations

import pytest

from lollm.testing.schedules import SEQUENCE_LENGTH, chunk_schedules
from lollm.testing.coverage import CoverageError, check_coverage, layer_kinds
from lollm.cli.hub_configs import available, hub_config, hub_configs_dir
from lollm.testing.tiny import SENSITIVE_NORM_EPS, kit_config, shrink_config


def test_the_old_gemma3_copy_checkpoint_is_blind_and_told_how_to_fix_it():
    old = {**shrink_config(hub_config("google__gemma-3-1b-it")), "rms_norm_eps": SENSITIVE_NORM_EPS}
    assert layer_kinds(old) == ["sliding_attention", "sliding_attention"]
    report = check_coverage(old, prompt_length=32, longest_prefill=16)
    blind = {f.name: f for f in report.blind()}
    assert set(blind) == {"sliding and global layers", "window crossed twice", "long decode"}
    assert "sliding_window_pattern 2" in blind["sliding and global layers"].fix
    assert "set sliding_window <= 15" in blind["window crossed twice"].fix
    assert "raise sequence_length above 65" in blind["long decode"].fix
    with pytest.raises(CoverageError, match="sliding and global layers .*2 sliding_attention"):
        report.raise_for_blind()
    # a waiver lets one feature pass, and only that one
    waived = report.blind({"long decode": "a test of the waiver"})
    assert {f.name for f in waived} == {"sliding and global layers", "window crossed twice"}
    # a scalar left at its neutral value is blind too
    neutral = check_coverage({**old, "query_pre_attn_scalar": old["head_dim"]}, prompt_length=72, longest_prefill=65)
    assert "query_pre_attn_scalar" in {f.name for f in neutral.blind()}


def test_a_hybrid_without_a_full_attention_layer_or_a_long_prefill_is_blind():
    raw = shrink_config(hub_config("Qwen__Qwen3.5-0.8B")["text_config"], num_hidden_layers=3)
    report = check_coverage({**raw, "rms_norm_eps": 0.1}, prompt_length=72, longest_prefill=36)
    blind = {f.name for f in report.blind()}
    assert blind == {"linear and full attention layers", "delta-rule chunk"}


#: Every shipped hub config with a whole config.json, but the MoE Gemma 4 (lollm's gemma4 refuses
#: its experts) and gemma-3-4b-it (its text_config lists only the keys that differ from transformers'
#: defaults: the kit reads its layer kinds through transformers, see test_conformance_kit.py).
KIT_HUBS = [h for h in available() if (hub_configs_dir() / h / "config.json").is_file()
            and h not in ("google__gemma-4-26B-A4B", "google__gemma-3-4b-it")]


@pytest.mark.parametrize("hub", KIT_HUBS)
def test_kit_config_passes_the_coverage_check(hub):
    """kit_config of each hub config is seen whole by the kit's own schedule (72 positions, window 6)."""
    cfg = kit_config(hub_config(hub))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) is not False else None
    T = max(SEQUENCE_LENGTH, 3 * window + 2) if window else SEQUENCE_LENGTH
    longest = max(s[0] for s in chunk_schedules(T, window) if len(s) > 1 and s[1] == 1)
    report = check_coverage(cfg, prompt_length=T, longest_prefill=longest)
    if "layer_types" not in cfg and cfg["model_type"] == "gemma2":
        cfg = {**cfg, "layer_types": ["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2)}
        report = check_coverage(cfg, prompt_length=T, longest_prefill=longest)  # as transformers derives them
    assert not report.blind(), report.table()
    assert "text_config" not in cfg and cfg["vocab_size"] == 512


def test_the_kit_prints_its_coverage_report_when_it_passes(capsys):
    # the table the docs show, for a user whose checkpoint passes (pytest -rP shows a passed test's output)
    from types import SimpleNamespace

    import torch

    from lollm.testing.conformance import FamilyConformance

    config = {**kit_config(hub_config("google__gemma-3-1b-it")), "layer_types": ["sliding_attention", "full_attention"]}
    kit = FamilyConformance()
    kit.test_checkpoint_covers_every_feature(SimpleNamespace(config=config), torch.zeros(1, SEQUENCE_LENGTH), 6)
    printed = capsys.readouterr().out
    assert "coverage report" in printed and "seen   window crossed twice" in printed and "BLIND" not in printed


def test_the_gguf_mode_skip_says_how_to_turn_it_on():
    from lollm.testing.conformance import FamilyConformance

    kit = FamilyConformance()
    kit.reference_available = True
    with pytest.raises(pytest.skip.Exception, match=r"set gguf_types = \("):
        kit.test_gguf_parity_with_the_reference(None, None, None, None, None, None, None)
