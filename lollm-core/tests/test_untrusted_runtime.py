"""Untrusted values met after the config: integer weights, prompt ids past the vocabulary, a cache
larger than the free memory. Each ends in a LollmError naming the tensor, the id or the sizes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import lollm.generate.memory as memory
from lollm.errors import GenerationError, WeightsError
from lollm.generate.loop import generate
from lollm.load.loader import TensorSource
from lollm.generate.sampling import SamplingParams

from test_weights import DictSource, checkpoint, load, on_meta


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_an_integer_tensor_for_a_float_parameter_is_refused_naming_it(dtype):
    bad = checkpoint(embed__weight=torch.ones(10, 4, dtype=dtype))
    with pytest.raises(WeightsError, match=r"tensor 'embed.weight' holds torch\.\w+, an integer type, but 'embed.weight' is a floating-point parameter"):
        load(bad)


def test_an_integer_tensor_in_a_safetensors_file_is_refused_before_it_is_read(tmp_path):
    save_file(checkpoint(norm__weight=torch.ones(4, dtype=torch.int32)), str(tmp_path / "model.safetensors"))
    source = TensorSource([tmp_path / "model.safetensors"])
    with pytest.raises(WeightsError, match=r"tensor 'norm.weight' is stored as I32, an integer type, but 'norm.weight' is a floating-point parameter"):
        from lollm.load.weights import load_weights

        load_weights(on_meta(), source, lambda n: n, device="cpu", dtype=torch.float32)


def test_a_gguf_integer_type_is_refused_though_it_reads_as_float():
    """GGUF's I8..I64 tensors come out of the dequantizer as float32: the stored type decides."""

    class GGUFLike(DictSource):
        def dtype(self, name):
            return "I32" if name == "proj.weight" else "F32"

    from lollm.load.weights import load_weights

    with pytest.raises(WeightsError, match=r"'proj.weight' is stored as I32"):
        load_weights(on_meta(), GGUFLike(checkpoint()), lambda n: n, device="cpu", dtype=torch.float32)


def test_integer_buffers_still_take_integer_tensors():
    model = load(checkpoint())
    assert model.positions.dtype == torch.long


# ------------------------------------------------------------------ prompt ids and the cache


class Cache:
    def __init__(self, max_tokens: int, width: int):
        self.kv = torch.zeros(2, max_tokens, width)  # (K and V, positions, width)
        self.length = 0
        self.max_tokens = max_tokens


class TinyLM(nn.Module):
    """A model meeting lollm.model's protocol; its cache holds 2 * width floats per position."""

    def __init__(self, vocab_size: int = 16, max_context: int = 64, width: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)
        self.vocab_size, self.max_context, self.num_layers, self.eos_token_ids = vocab_size, max_context, 1, ()
        self.width = width
        self.real_caches = 0

    def new_cache(self, max_tokens: int) -> Cache:
        cache = Cache(max_tokens, self.width)
        if not cache.kv.is_meta:
            self.real_caches += 1
        return cache

    def forward(self, ids, cache=None, *, logits_to_keep=0, hidden_states=None):
        x = self.head(self.embed(ids))
        if cache is not None:
            cache.length += ids.shape[1]
        return x[:, -logits_to_keep:] if logits_to_keep else x


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("bad", [16, 10**6, -1])
def test_a_prompt_id_outside_the_vocabulary_is_a_generation_error(bad):
    with pytest.raises(GenerationError, match=rf"the prompt holds the token id {bad}, but the model's vocabulary has ids 0 .. 15"):
        generate(TinyLM(), [1, bad, 2], max_new_tokens=2, sampling=GREEDY)


def test_the_cache_size_is_measured_without_allocating_it():
    model = TinyLM(max_context=2**24, width=4096)
    need = memory.cache_bytes(model, 2**24)  # would be 512 GiB of float32
    assert need == 2 * 2**24 * 4096 * 4
    assert model.real_caches == 0
    assert memory.cache_bytes(model, 3) == memory.tensor_bytes(Cache(3, 4096))


def test_a_cache_larger_than_the_free_memory_is_refused_before_allocation(monkeypatch):
    model = TinyLM(max_context=2**20, width=64)
    monkeypatch.setattr(memory, "free_memory", lambda device: 2**20)  # 1 MiB free
    with pytest.raises(GenerationError, match=r"a cache for 65,538 positions .* needs 32\.0 MiB, but only 1\.0 MiB are free on cpu"):
        generate(model, [1, 2], max_new_tokens=2**16, sampling=GREEDY)
    assert model.real_caches == 0
    result = generate(model, [1, 2], max_new_tokens=2, sampling=GREEDY)  # 4 positions: 2 KiB
    assert len(result.new_ids) == 2 and model.real_caches == 1


def test_free_memory_is_known_on_the_cpu():
    free = memory.free_memory(torch.device("cpu"))
    assert free is not None and free > 0


@pytest.mark.parametrize("value", [[2, None], "abc", [2, "3"], {"id": 2}, True])
def test_bad_eos_ids_in_generation_config_are_named(value):
    from lollm.errors import ConfigError
    from lollm.generate.loop import stop_token_ids

    with pytest.raises(ConfigError, match=r"^generation_config.json 'eos_token_id' is"):
        stop_token_ids({"eos_token_id": value}, {})
    assert stop_token_ids({"eos_token_id": [2, 3]}, {"eos_token_id": 5}) == {2, 3, 5}
