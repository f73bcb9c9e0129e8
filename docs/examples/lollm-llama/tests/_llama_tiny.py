"""Tiny Llama checkpoints for the tests: safetensors written by transformers, GGUF written the way llama.cpp does.

(Named ``_llama_tiny`` so it cannot clash with other distributions' test helpers.)

The two configs stand for the config.json files of two real models,
``meta-llama/Llama-2-7b-hf`` and ``meta-llama/Llama-3.2-1B``. lollm.testing ships
no Llama config and the hub cannot be reached from the machines these tests run
on, so they were typed in from the published files as the authors knew them, not
fetched and compared byte for byte; what the tests rely on (Llama 2: no GQA, no
``rope_theta`` key in the first release, so base 10000; Llama 3.2: GQA 4:1, llama3
scaling with factor 32 and band edges 1 and 4, base 500000, tied head) is what both
model cards and transformers' ``LlamaConfig`` describe. The tests shrink their sizes
(``lollm.testing.tiny.shrink_config``) and keep everything else: Llama 2's plain
RoPE at base 10000 with no ``rope_theta`` key and no GQA, Llama 3.2's llama3
scaling, base 500000, explicit ``head_dim``, GQA and tied output head.

:func:`hf_to_gguf` writes a tiny checkpoint as llama.cpp's ``convert_hf_to_gguf.py``
(class ``LlamaModel``) would: gguf-py's ``TensorNameMap`` renames the tensors,
q/k rows (weights and biases) are permuted for ggml's interleaved RoPE, llama3
scaling becomes the tensor ``rope_freqs.weight``, linear scaling the metadata
``rope.scaling.*``, and the metadata keys are gguf-py's ``Keys``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

#: What every tiny version changes besides the sizes, so that a mistake shows in the logits
#: (the kit's test_reference_checkpoint_is_sensitive checks it): weights 10x larger than
#: transformers' default initialisation (at 0.02 the attention of a random model is nearly
#: uniform, and a wrong RoPE barely moves the logits), and an RMSNorm epsilon large enough
#: against the activations' mean square that ignoring it changes the output
#: (lollm.testing.tiny.SENSITIVE_NORM_EPS).
SENSITIVE = {"initializer_range": 0.2, "rms_norm_eps": 0.1}

#: llama3 scaling at the tiny size: the published band edges (factor 32, low 1, high 4) over an
#: original context of 64 positions instead of 8192, so that with head_dim 16 the channel pairs
#: fall in all three regimes (kept, blended, divided by 32) and differ within a 96-token prompt.
TINY_LLAMA3_ROPE = dict(LLAMA32_1B["rope_scaling"], original_max_position_embeddings=64)

#: name -> (hub config, overrides of the tiny version)
CONFIGS = {
    # Llama 2 7B has no GQA: keep K = H at the tiny size
    "llama2": (LLAMA2_7B, {"num_key_value_heads": 4}),
    # Llama 3.2 1B: GQA (4 query heads per KV head at the tiny size), llama3 scaling, tied head
    "llama3": (LLAMA32_1B, {"rope_scaling": TINY_LLAMA3_ROPE}),
    # the switches no released Llama uses, on the Llama 3.2 shape: biases everywhere, untied head
    "llama3-bias": (LLAMA32_1B, {"rope_scaling": TINY_LLAMA3_ROPE, "attention_bias": True, "mlp_bias": True,
                                 "tie_word_embeddings": False}),
    # Llama 2 with both biases and plain RoPE (one difference from plain Llama 2 at a time)
    "llama2-bias": (LLAMA2_7B, {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    # linear RoPE scaling (what some Llama 2 long-context fine-tunes use)
    "llama2-linear": (LLAMA2_7B, {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
}


def tiny_config(kind: str, **overrides) -> dict:
    """The shrunk hub config of ``kind`` (a key of :data:`CONFIGS`)."""
    from lollm.testing.tiny import shrink_config

    raw, base = CONFIGS[kind]
    return shrink_config(raw, **{**SENSITIVE, **base, **overrides})


def write_tiny(kind: str, folder: Path, schema: str = "hub", seed: int = 0, tokenizer: bool = False, **overrides) -> Path:
    """A tiny random checkpoint of ``kind`` in ``folder`` (config.json, model.safetensors; tokenizer files when asked)."""
    from lollm.testing.tiny import write_tiny_checkpoint, write_tiny_tokenizer

    write_tiny_checkpoint(tiny_config(kind, **overrides), folder, schema=schema, seed=seed)
    if tokenizer:
        write_tiny_tokenizer(folder, vocab_size=512)
    return folder


def converter_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: inside each head, rows (2, D/2) stored as (D/2, 2)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> list[float]:
    """The divisors llama.cpp's converter stores as ``rope_freqs.weight`` for llama3 scaling (one per channel pair)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def hf_to_gguf(folder: Path, out: Path, matrix_type: str = "F32") -> Path:
    """Write the transformers llama checkpoint ``folder`` as the GGUF ``out`` (2-D tensors in ``matrix_type``)."""
    import gguf
    from safetensors.torch import load_file

    from lollm.testing.tiny_gguf import byte_level_vocab, write_gguf

    cfg = json.loads((folder / "config.json").read_text())
    arch = "llama"
    n_layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    tensors = {}
    for hf_name, value in load_file(str(folder / "model.safetensors")).items():
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            value = converter_permute(value, heads)
        elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            value = converter_permute(value, kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf-py has no llama.cpp name for {hf_name}"
        tensors[name] = (value.float().numpy(), matrix_type if value.ndim == 2 else "F32")
    if rope_type == "llama3":
        import numpy as np

        tensors["rope_freqs.weight"] = (np.array(llama3_rope_factors(rope, theta, head_dim), dtype=np.float32), "F32")

    K = gguf.Keys
    meta = {
        K.LLM.VOCAB_SIZE.format(arch=arch): cfg["vocab_size"],
        K.LLM.CONTEXT_LENGTH.format(arch=arch): cfg["max_position_embeddings"],
        K.LLM.EMBEDDING_LENGTH.format(arch=arch): cfg["hidden_size"],
        K.LLM.BLOCK_COUNT.format(arch=arch): n_layers,
        K.LLM.FEED_FORWARD_LENGTH.format(arch=arch): cfg["intermediate_size"],
        K.Rope.DIMENSION_COUNT.format(arch=arch): head_dim,
        K.Attention.HEAD_COUNT.format(arch=arch): heads,
        K.Attention.HEAD_COUNT_KV.format(arch=arch): kv_heads,
        K.Rope.FREQ_BASE.format(arch=arch): theta,
        K.Attention.LAYERNORM_RMS_EPS.format(arch=arch): float(cfg["rms_norm_eps"]),
    }
    if "head_dim" in cfg:
        meta[K.Attention.KEY_LENGTH.format(arch=arch)] = head_dim
        meta[K.Attention.VALUE_LENGTH.format(arch=arch)] = head_dim
    if rope_type == "linear":
        meta[K.Rope.SCALING_TYPE.format(arch=arch)] = "linear"
        meta[K.Rope.SCALING_FACTOR.format(arch=arch)] = float(rope["factor"])
    tokens, merges, types = byte_level_vocab(cfg["vocab_size"], specials=("<|begin_of_text|>", "<|end_of_text|>"))
    meta.update({
        K.Tokenizer.MODEL: "gpt2", K.Tokenizer.PRE: "llama-bpe", K.Tokenizer.LIST: tokens,
        K.Tokenizer.TOKEN_TYPE: types, K.Tokenizer.MERGES: merges,
        K.Tokenizer.BOS_ID: tokens.index("<|begin_of_text|>"), K.Tokenizer.EOS_ID: tokens.index("<|end_of_text|>"),
        K.Tokenizer.ADD_BOS: False,
    })
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(out, arch, meta, tensors)


def main(argv: list[str] | None = None) -> None:
    """``python tests/_llama_tiny.py FOLDER``: a tiny Llama 3.2-shaped checkpoint to try the family on.

    Writes FOLDER/llama3/ (config.json, model.safetensors, tokenizer files), then the same
    weights as llama.cpp would convert them: FOLDER/llama3-F32.gguf and FOLDER/llama3-Q8_0.gguf.
    """
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    folder = parser.parse_args(argv).folder
    source = write_tiny("llama3", folder / "llama3", tokenizer=True)
    for matrix_type in ("F32", "Q8_0"):
        print(hf_to_gguf(source, folder / f"llama3-{matrix_type}.gguf", matrix_type))
    print(source)


if __name__ == "__main__":
    main()
