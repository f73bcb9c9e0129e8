"""lollm.load.checks: typed, range-checked reads of config values, and sizes against the tensor table."""

from __future__ import annotations

import math

import pytest

from lollm.load.checks import MAX_LAYERS, MAX_VOCAB, ConfigReader, WeightTable, show
from lollm.errors import ConfigError, WeightsError

WHERE = "fam: config.json"


def read(**raw) -> ConfigReader:
    return ConfigReader(raw, WHERE)


@pytest.mark.parametrize(
    "value",
    [0, -1, "2", True, 2.0, None, [2], {"n": 2}, MAX_LAYERS + 1, 10**9],
)
def test_positive_int_refuses_and_names_file_key_and_value(value):
    with pytest.raises(ConfigError) as err:
        read(num_hidden_layers=value).positive_int("num_hidden_layers", at_most=MAX_LAYERS)
    message = str(err.value)
    assert message.startswith(WHERE) and "'num_hidden_layers'" in message
    if value is not None:
        assert show(value) in message


def test_positive_int_reads_a_good_value_and_a_default():
    assert read(n=24).positive_int("n", at_most=MAX_LAYERS) == 24
    assert read().positive_int("n", default=7, at_most=MAX_LAYERS) == 7
    assert read(n=None).positive_int("n", default=7, at_most=MAX_LAYERS) == 7  # null counts as absent
    assert read().positive_int("n", default=None, at_most=MAX_LAYERS) is None


@pytest.mark.parametrize("value", ["abc", 0, -10.0, math.nan, math.inf, -math.inf, True, False, [1.0], "1e6"])
def test_rope_theta_must_be_a_finite_number_above_one(value):
    with pytest.raises(ConfigError, match=r"'rope_theta' is .*expected a finite number > 1.0"):
        read(rope_theta=value).number("rope_theta", above=1.0)


def test_number_accepts_ints_and_floats_in_range():
    assert read(eps=1e-6).number("eps", above=0.0, at_most=1.0) == 1e-6
    assert read(theta=10000).number("theta", above=1.0) == 10000.0
    with pytest.raises(ConfigError, match="'eps' is -1"):
        read(eps=-1).number("eps", above=0.0)
    with pytest.raises(ConfigError, match="'eps' is 0"):
        read(eps=0).number("eps", above=0.0)


@pytest.mark.parametrize("value", ["true", "false", 1, 0, "yes", [True]])
def test_booleans_must_be_real_booleans(value):
    with pytest.raises(ConfigError, match=r"'tie_word_embeddings' is .*expected true or false"):
        read(tie_word_embeddings=value).boolean("tie_word_embeddings", default=False)


@pytest.mark.parametrize("value", [[2, None], [2, "3"], -1, "2", [True], MAX_VOCAB, [[2]], 2.0])
def test_token_ids_refuse_nulls_and_non_ids(value):
    with pytest.raises(ConfigError, match="'eos_token_id'"):
        read(eos_token_id=value).token_ids("eos_token_id")


def test_token_ids_one_or_many():
    assert read(eos_token_id=2).token_ids("eos_token_id") == (2,)
    assert read(eos_token_id=[2, 5]).token_ids("eos_token_id") == (2, 5)
    assert read().token_ids("eos_token_id") == ()


@pytest.mark.parametrize("value", [[1, 2], "linear", 3, True])
def test_objects_must_be_objects(value):
    with pytest.raises(ConfigError, match=r"'rope_scaling' is .*expected an object"):
        read(rope_scaling=value).mapping("rope_scaling")


def test_a_section_names_its_parent_in_errors():
    section = read(rope_parameters={"factor": 0}).section("rope_parameters")
    with pytest.raises(ConfigError, match=r"^fam: config.json 'rope_parameters' 'factor' is 0"):
        section.number("factor", above=0.0)


def test_strings_and_layer_lists():
    assert read(act="silu").string("act", choices=("silu",)) == "silu"
    with pytest.raises(ConfigError, match="'act' is 'gelu'; implemented: 'silu'"):
        read(act="gelu").string("act", choices=("silu",))
    with pytest.raises(ConfigError, match="'act' is 3: expected a string"):
        read(act=3).string("act")
    types = ("full_attention", "sliding_attention")
    assert read(layer_types=["full_attention"] * 2).strings("layer_types", length=2, choices=types) == ("full_attention",) * 2
    with pytest.raises(ConfigError, match="expected a list of 2 entries"):
        read(layer_types=["full_attention"] * 3).strings("layer_types", length=2, choices=types)
    with pytest.raises(ConfigError, match="'layer_types' holds None"):
        read(layer_types=["full_attention", None]).strings("layer_types", length=2, choices=types)


def test_a_config_that_is_not_an_object_is_refused():
    with pytest.raises(ConfigError, match="fam: config.json is \\[1, 2\\]: expected an object"):
        ConfigReader([1, 2], WHERE)


def test_defaults_fill_the_keys_left_out_and_are_checked_like_the_rest():
    r = ConfigReader({"a": 2}, WHERE, defaults={"a": 1, "b": 3})
    assert (r.positive_int("a", at_most=9), r.positive_int("b", at_most=9)) == (2, 3)


def test_show_cuts_a_huge_value():
    assert len(show("x" * 10**6)) <= 80


SHAPES = {
    "model.embed_tokens.weight": (512, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.1.mlp.up_proj.weight": (128, 64),
}


def test_layers_against_the_weights_name_the_key_and_what_the_weights_hold():
    table = WeightTable(SHAPES, WHERE)
    table.layers("num_hidden_layers", 2)
    with pytest.raises(ConfigError, match=r"'num_hidden_layers' is 1000000000, but the weights hold 2 layers \(model.layers.0 .. model.layers.1\)"):
        table.layers("num_hidden_layers", 10**9)
    gguf = WeightTable(SHAPES, "fam: GGUF metadata", {"num_hidden_layers": "fam.block_count"})
    with pytest.raises(ConfigError, match=r"GGUF metadata 'fam.block_count' is 3, but the weights hold 2 layers"):
        gguf.layers("num_hidden_layers", 3)


def test_sizes_against_the_weights():
    table = WeightTable(SHAPES, WHERE)
    table.size("vocab_size", 512, "model.embed_tokens.weight", 0)
    with pytest.raises(ConfigError, match=r"'vocab_size' is 513, but the weights hold 'model.embed_tokens.weight' of shape \(512, 64\)"):
        table.size("vocab_size", 513, "model.embed_tokens.weight", 0)
    with pytest.raises(ConfigError, match=r"'num_attention_heads' x 'head_dim' is 96"):
        table.size(("num_attention_heads", "head_dim"), 96, "model.layers.0.mlp.up_proj.weight", 0)
    with pytest.raises(WeightsError, match="no tensor for 'lm_head.weight'"):
        table.size("vocab_size", 512, "lm_head.weight", 0)
