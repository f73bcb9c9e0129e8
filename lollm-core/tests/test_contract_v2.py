"""Plugin contract 2: LoadOptions is the only way load settings reach a family.

A spy family records what its ``load(checkpoint, options)`` receives from
:func:`lollm.load.pipeline.open_model`: the quantization and the tensor-parallel group
come from the options (resolved by core), and nothing is set on the tensor source.
A family written for contract 1 is refused with what to change.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lollm.errors import LollmError
from lollm.family import CONTRACT_VERSION, Family
from lollm.hookspecs import hookimpl
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.load.plugins import build_registry
from lollm.load.quantized import Quantization
from lollm.load.tensor_parallel import Group

SEEN: list = []


class Spy(torch.nn.Module):
    vocab_size = 4


def spy_load(checkpoint, options):
    SEEN.append((checkpoint, options, dict(vars(checkpoint.weights))))
    model = Spy()
    model.tensor_parallel = options.tensor_parallel  # as Sharding.build marks a model built for --tp
    return model


class SpyPlugin:
    @hookimpl
    def lollm_register_families(self, register):
        register(Family(name="spy", contract=CONTRACT_VERSION, model_types=("spy",), load=f"{__name__}:spy_load"))


@pytest.fixture
def spy(tmp_path, monkeypatch):
    """A registry with the spy family only, and a safetensors folder of model_type "spy"."""
    registry = build_registry(entry_points=[], extra_plugins=[("spy", SpyPlugin())])
    monkeypatch.setattr("lollm.load.pipeline.get_registry", lambda: registry)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "spy"}))
    save_file({"w": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    SEEN.clear()
    return tmp_path


def test_the_family_gets_resolved_options_and_nothing_on_the_weights(spy):
    loaded = open_model(str(spy), LoadOptions(device="cpu", quantize="int8", group_size=64))
    (checkpoint, options, source_attributes), = SEEN
    assert options.quantization == Quantization("int8", 64)  # decided by core from quantize + format
    assert options.device == "cpu" and options.dtype == "float32" and options.attn == "sdpa"
    assert options.tensor_parallel is None and options.resolved
    assert checkpoint.fmt == "safetensors" and checkpoint.config["model_type"] == "spy"
    assert "quantization" not in source_attributes and "tensor_parallel" not in source_attributes
    assert loaded.options is options


def test_the_tensor_parallel_group_reaches_the_family_through_the_options(spy, monkeypatch):
    group = Group(rank=1, world=2, backend="gloo", device=torch.device("cpu"))
    monkeypatch.setattr("lollm.load.process_group.init", lambda tp, device, timeout=None: group)  # torchrun's group, without torchrun
    loaded = open_model(str(spy), LoadOptions(device="cpu", tp=2))
    (_, options, source_attributes), = SEEN
    assert options.tensor_parallel is group and options.tp == 2
    assert options.quantization == Quantization("float")
    assert "tensor_parallel" not in source_attributes
    assert loaded.tp is group


def test_unresolved_options_are_refused_by_build_model():
    from lollm.load.build import WeightLayout, build_model

    with pytest.raises(LollmError, match="resolved LoadOptions"):
        build_model(Spy, None, None, "safetensors", LoadOptions(), WeightLayout(name_maps={}))


@pytest.mark.parametrize("changes, message", [
    (dict(dtype="float64"), "unknown dtype 'float64'"),
    (dict(weights="packed"), "--weights 'packed'"),
    (dict(quantize="int3"), "--quantize 'int3'"),
    (dict(weights="float", quantize="int8"), "give one of them"),
    (dict(tp=0), "--tp 0"),
    (dict(device="gpu"), "--device 'gpu'"),
    (dict(group_size=48), "group size 48"),
    (dict(group_size=True), "group size True"),
    (dict(progress="yes"), "progress must be True or False"),
    (dict(family=3), "--family 3"),
    (dict(attn=1), "--attn 1"),
])
def test_load_options_refuse_what_no_load_could_honour(changes, message):
    with pytest.raises(LollmError, match=message):
        LoadOptions(**changes)


def test_a_contract_1_family_is_refused_with_what_to_change():
    class Old:
        @hookimpl
        def lollm_register_families(self, register):
            register(Family(name="old", contract=1, model_types=("old",), load="old.weights:load"))

    registry = build_registry(entry_points=[], extra_plugins=[("old", Old())])
    (broken,) = registry.broken
    assert "contract 1" in broken.error and f"speaks contract {CONTRACT_VERSION}" in broken.error
    assert "load(checkpoint, options)" in broken.error and "Moving a family to contract 2" in broken.error


def old_style_load(raw_config, weights, fmt, device, dtype, progress):  # contract 1's signature
    raise AssertionError("never called: the signature is refused first")


class OldSignature:
    @hookimpl
    def lollm_register_families(self, register):
        register(Family(name="spy", contract=CONTRACT_VERSION, model_types=("spy",), load=f"{__name__}:old_style_load"))


def test_a_contract_1_load_under_a_contract_2_record_is_named_before_the_call(spy, monkeypatch):
    from lollm.errors import PluginError

    registry = build_registry(entry_points=[], extra_plugins=[("old", OldSignature())])
    monkeypatch.setattr("lollm.load.pipeline.get_registry", lambda: registry)
    with pytest.raises(PluginError, match=r"takes \(raw_config, weights, fmt, device, dtype, progress\).*"
                                          r"calls load\(checkpoint, options\).*Moving a family to contract 2"):
        open_model(str(spy), LoadOptions(device="cpu"))
