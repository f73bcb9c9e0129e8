"""load_weights: a model built on the meta device, filled one tensor at a time, strictly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lollm.errors import LollmError, WeightsError
from lollm.load.loader import TensorSource
from lollm.load.weights import load_weights


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.register_buffer("scale", torch.zeros(4))
        self.register_buffer("positions", torch.zeros(6, dtype=torch.long))


def on_meta() -> Tiny:
    with torch.device("meta"):
        return Tiny()


def checkpoint(**drop_or_replace) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {
        "embed.weight": torch.randn(10, 4, generator=g),
        "proj.weight": torch.randn(4, 4, generator=g),
        "proj.bias": torch.randn(4, generator=g),
        "norm.weight": torch.randn(4, generator=g),
        "norm.bias": torch.randn(4, generator=g),
        "lm_head.weight": torch.randn(10, 4, generator=g),
        "scale": torch.randn(4, generator=g),
        "positions": torch.arange(6, dtype=torch.long),
    }
    for name, value in drop_or_replace.items():
        name = name.replace("__", ".")
        if value is None:
            t.pop(name)
        else:
            t[name] = value
    return t


class DictSource:
    """The part of TensorSource that load_weights uses, over a dict; counts the reads."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.reads: list[str] = []

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name):
        self.reads.append(name)
        return self.tensors[name].clone()


def identity(name: str) -> str:
    return name


def load(tensors, **kwargs):
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("dtype", torch.float32)
    return load_weights(on_meta(), DictSource(tensors), kwargs.pop("name_map", identity), **kwargs)


def test_fills_every_parameter_and_buffer():
    ref = checkpoint()
    model = load(ref)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    assert set(state) == set(ref)
    for name, value in ref.items():
        got = state[name]
        assert not got.is_meta and got.device.type == "cpu"
        assert torch.equal(got, value), name
    assert all(isinstance(p, nn.Parameter) and not p.requires_grad for p in model.parameters())
    out = model.lm_head(model.norm(model.proj(model.embed(torch.tensor([1, 2])))))
    assert out.shape == (2, 10)


def test_converts_floating_tensors_only():
    ref = checkpoint(scale=torch.randn(4, dtype=torch.float16))
    model = load(ref, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.scale.dtype == torch.bfloat16
    assert model.positions.dtype == torch.long and model.positions.tolist() == list(range(6))
    assert torch.equal(model.proj.weight, ref["proj.weight"].to(torch.bfloat16))


def test_reads_from_a_real_safetensors_file(tmp_path):
    ref = checkpoint(norm__weight=torch.randn(4).to(torch.bfloat16))
    save_file(ref, str(tmp_path / "model.safetensors"))
    model = load_weights(on_meta(), TensorSource([tmp_path / "model.safetensors"]), identity,
                         device="cpu", dtype=torch.float32)
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(model.norm.weight, ref["norm.weight"].float())
    assert torch.equal(model.embed.weight, ref["embed.weight"])


def test_ties_a_slot_the_checkpoint_lacks():
    model = load(checkpoint(lm_head__weight=None), tied={"lm_head.weight": "embed.weight"})
    assert model.lm_head.weight is model.embed.weight
    assert not model.lm_head.weight.is_meta


def test_does_not_tie_when_the_checkpoint_has_the_tensor():
    ref = checkpoint()
    model = load(ref, tied={"lm_head.weight": "embed.weight"})
    assert model.lm_head.weight is not model.embed.weight
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


def test_name_map_renames_and_skips():
    ref = {f"file.{k}": v for k, v in checkpoint().items()}
    ref["vision_tower.weight"] = torch.zeros(3)
    source = DictSource(ref)

    def name_map(name):
        return None if name.startswith("vision_tower.") else name.removeprefix("file.")

    model = load_weights(on_meta(), source, name_map, device="cpu", dtype=torch.float32)
    assert torch.equal(model.proj.bias, ref["file.proj.bias"])
    assert "vision_tower.weight" not in source.reads  # skipped tensors are never read


def test_transform_runs_before_the_shape_check():
    ref = checkpoint(norm__weight=torch.zeros(2, 2))  # wrong shape in the file, fixed by the transform

    def transform(name, tensor):
        return tensor.reshape(4) + 1 if name == "norm.weight" else tensor

    model = load(ref, transform=transform)
    assert model.norm.weight.tolist() == [1.0] * 4


def test_unexpected_tensor_raises_naming_it():
    with pytest.raises(WeightsError, match=r"'model\.extra\.weight'") as info:
        load(checkpoint(model__extra__weight=torch.zeros(3)))
    assert isinstance(info.value, LollmError)


def test_unexpected_model_name_after_the_map_names_both():
    with pytest.raises(WeightsError) as info:
        load(checkpoint(), name_map=lambda n: "nowhere.weight" if n == "proj.bias" else n)
    assert "'proj.bias'" in str(info.value) and "'nowhere.weight'" in str(info.value)


@pytest.mark.parametrize("name", ["proj.bias", "embed.weight", "scale", "positions"])
def test_missing_tensor_raises_naming_it(name):
    with pytest.raises(WeightsError, match=repr(name).replace(".", r"\.")):
        load(checkpoint(**{name.replace(".", "__"): None}))


def test_missing_tied_source_raises_naming_both_slots():
    with pytest.raises(WeightsError) as info:
        load(checkpoint(lm_head__weight=None, embed__weight=None), tied={"lm_head.weight": "embed.weight"})
    assert "'lm_head.weight'" in str(info.value) and "'embed.weight'" in str(info.value)


def test_wrong_shape_raises_naming_the_tensor_and_shapes():
    with pytest.raises(WeightsError) as info:
        load(checkpoint(proj__weight=torch.zeros(4, 5)))
    msg = str(info.value)
    assert "'proj.weight'" in msg and "(4, 5)" in msg and "(4, 4)" in msg


def test_two_tensors_for_one_slot_raise_naming_them():
    ref = checkpoint()
    ref["copy.of.proj.weight"] = ref["proj.weight"].clone()
    with pytest.raises(WeightsError) as info:
        load(ref, name_map=lambda n: "proj.weight" if n == "copy.of.proj.weight" else n)
    assert "'copy.of.proj.weight'" in str(info.value) and "'proj.weight'" in str(info.value)


def test_progress_bar_does_not_change_the_result():
    ref = checkpoint()
    model = load(ref, progress=True)
    assert torch.equal(model.embed.weight, ref["embed.weight"])


# -- peak memory ---------------------------------------------------------------

LAYERS, WIDTH = 48, 1024  # 48 x 1024 x 1024 fp32 = ~201 MB


def write_big_checkpoint(folder: Path, dtype: torch.dtype) -> int:
    """A checkpoint of a ~200 MB fp32 model in 8 shards, written a shard at a time (the test process stays small).

    Returns the size of the model in fp32, in bytes.
    """
    folder.mkdir()
    weight_map, total, per_shard = {}, 0, LAYERS // 8
    for s in range(8):
        shard = f"model-{s + 1:05d}-of-00008.safetensors"
        part = {
            f"layers.{i}.weight": torch.full((WIDTH, WIDTH), float(i), dtype=dtype)
            for i in range(s * per_shard, (s + 1) * per_shard)
        }
        save_file(part, str(folder / shard))
        weight_map.update({k: shard for k in part})
        total += sum(t.numel() * 4 for t in part.values())
        del part
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return total


MEASURE = """
import json, sys
from pathlib import Path
import torch
from torch import nn
from lollm.load.loader import TensorSource, _weight_files
from lollm.load.weights import load_weights

LAYERS, WIDTH = {layers}, {width}

class Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

folder = Path(sys.argv[1])
source = TensorSource(_weight_files(folder))
with torch.device("meta"):
    model = Big()
before = status_kib("VmRSS")
load_weights(model, source, lambda n: n, device="cpu", dtype=torch.float32)
# touch every weight, as inference would: a tensor may be a lazily paged map of the file
for i, layer in enumerate(model.layers):
    assert layer.weight.dtype == torch.float32 and float(layer.weight.sum()) == i * WIDTH * WIDTH
# VmHWM: the peak RSS of this process image. resource.getrusage's ru_maxrss is the same
# figure only in a process not forked from a big one: Linux carries the parent's peak
# over fork + exec into ru_maxrss, and the pytest process may be gigabytes by now.
peak = status_kib("VmHWM")
print(json.dumps({{"before_kib": before, "peak_kib": peak}}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc (Linux)")
@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_streaming_load_peak_memory_stays_near_one_model_copy(tmp_path, file_dtype):
    folder = tmp_path / "big"
    size = write_big_checkpoint(folder, file_dtype)
    assert 190e6 < size < 220e6
    code = textwrap.dedent(MEASURE.format(layers=LAYERS, width=WIDTH))
    done = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    growth = (figures["peak_kib"] - figures["before_kib"]) * 1024
    assert growth < 1.5 * size, f"peak RSS grew by {growth / 1e6:.0f} MB for a {size / 1e6:.0f} MB model"
    assert growth > 0.9 * size  # the model itself is resident: the measurement measures something


@pytest.mark.parametrize("tied", [{"lm_head.wieght": "embed.weight"}, {"lm_head.weight": "embed.wieght"}, {"lm_head.weight": "scale"}])
def test_a_tie_naming_no_parameter_raises_naming_it(tied):
    with pytest.raises(WeightsError) as info:
        load(checkpoint(lm_head__weight=None), tied=tied)
    bad = next(n for pair in tied.items() for n in pair if n not in {"lm_head.weight", "embed.weight"})
    assert repr(bad) in str(info.value)
