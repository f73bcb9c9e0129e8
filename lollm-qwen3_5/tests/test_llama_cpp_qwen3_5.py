"""qwen3_5 and qwen3_5_moe beside llama.cpp's runtime, on every file type (issue 38; ``nox -s llama_cpp``).

test_gguf_qwen3_5.py proves lollm's reading of the converter's f32/f16/bf16/q8_0 files against
transformers. Here, as for the other families (lollm.testing.converter.runtime_checks), each file
is also run by llama.cpp itself (llama-cpp-python, ``logits_all``) and K-quant files are made by
the compiled llama.cpp's quantizer:

* the checkpoints: tiny random Qwen3.5 and Qwen3.5-MoE in the text layout (Qwen3_5ForCausalLM /
  Qwen3_5MoeForCausalLM, from the real hub configs), with an MTP head (the converter keeps it as
  the nextn block), weights rounded to bfloat16 (so f16/bf16 files hold them exactly), the real
  Qwen2.5 tokenizer (the converter's pre-tokenizer hash "qwen2"; 151,936 embedding rows);
* the widths: llama.cpp's qwen35/qwen35moe loaders take the value heads as wide as the key heads
  (``ssm.state_size``) and refuse ``attn_qkv`` otherwise, so Dk = Dv = 64 here (test_gguf_qwen3_5.py's
  tiny keeps Dk != Dv to catch a swapped axis). Every matrix's row length (its ggml ne0, what K-quants
  cut in super-blocks of 256) is 256 or 512; Hv = 4 over Hk = 2, so the converter's value-head reorder
  is undone by lollm on quantized blocks, and by :func:`file_weight` for the reference;
* the bounds: lollm.testing.converter.assert_runtime_check, as for every family.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import qwen3_5_tiny as tiny

FAMILIES = ("qwen3_5", "qwen3_5_moe")
FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "Q4_K_M", "Q6_K")
PROMPT_LENGTH = 64
VOCAB = 151936
#: 256 wide, 4 layers (layer 3 full attention), equal key/value head widths; transformers' own init (std 0.02)
WIDE = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "initializer_range": 0.02, "vocab_size": VOCAB,
}
WIDE_DENSE = {"intermediate_size": 512}
#: Every expert routed (k = E): with k < E a random router has near ties (the 2nd and 3rd expert's scores a hair
#: apart) that any rounding of the activations flips, each flip a step in the logits. Measured with k = 2 of 8:
#: lollm's float load equals transformers on the file's weights on every file (cosine 1.000000), llama.cpp is at
#: 0.985 (q8_0), 0.919 (Q4_K_M), 0.881 (Q6_K) from it, lollm packed at 0.966, 0.918, 0.965: noise of the routing,
#: not of the reading. With k = E the routing weights are continuous and the comparison measures reading and
#: arithmetic; top-k selection is proven against transformers by test_gguf_qwen3_5.py (k = 4 of 16).
WIDE_MOE = {"num_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256}


def _tiled_to_grouped(weight: torch.Tensor, dim: int, key_heads: int, head_dim: int) -> torch.Tensor:
    """Undo the converter's value-head reorder along ``dim``: it stores the Hv value heads tiled over the key
    heads (``k0v0 k1v0 k0v1 k1v1``, for ggml's broadcast), transformers grouped (``k0v0 k0v1 k1v0 k1v1``);
    along ``dim``, (r, Hk, head_dim) back to (Hk, r, head_dim) with r = Hv / Hk."""
    dim = dim % weight.dim()
    shape = list(weight.shape)
    tiled = weight.reshape(*shape[:dim], shape[dim] // key_heads // head_dim, key_heads, head_dim, *shape[dim + 1:])
    return tiled.transpose(dim, dim + 1).reshape(shape)


def file_weight(text: dict):
    """For runtime_checks: ``(name, value, names, dequantized)`` -> the weight a qwen35/qwen35moe file holds for the
    source tensor ``name``, in transformers' layout, or None where the source's stands (1-D and float tensors,
    the ``mtp.*`` head transformers does not load). Read from llama.cpp's converter (conversion/qwen.py), not
    from lollm's reader:

    * expert e's ``mlp.experts.{e}.{gate,up,down}_proj`` (transformers saves them one by one) is slice e of the
      file's ``ffn_{gate,up,down}_exps`` (E, rows, columns), which the converter stacked;
    * when Hv != Hk the converter tiled the value rows of ``in_proj_qkv`` (after its 2 Hk Dk query/key rows),
      the rows of ``in_proj_z`` (Dv each) and of ``in_proj_a``/``in_proj_b`` (one each), and the columns of
      ``out_proj``: put back grouped.
    """
    key_heads, dk, dv = text["linear_num_key_heads"], text["linear_key_head_dim"], text["linear_value_head_dim"]
    reorder = text["linear_num_value_heads"] != key_heads
    stacked: dict[str, object] = {}  # each expert tensor of the file being read, dequantized once

    def get(name: str, value: torch.Tensor, names, dequantized):
        if value.dim() < 2 or name.startswith("mtp."):
            return None
        if stacked.get("file") is not dequantized:  # another file (runtime_checks reads one per file type)
            stacked.clear()
            stacked["file"] = dequantized
        # 1. The file's tensor, dequantized by gguf-py (None: float in the file, the source's weights exactly).
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if expert:
            block, e, kind = expert.groups()
            file_name = f"blk.{block}.ffn_{kind}_exps.weight"
            if file_name not in stacked:
                stacked[file_name] = dequantized(file_name)
            weight = None if stacked[file_name] is None else stacked[file_name][int(e)]
        else:
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                if name == "lm_head.weight":
                    return None  # a tied head is not in the file
                raise AssertionError(f"{name}: gguf-py's TensorNameMap has no name for it")
            weight = dequantized(mapped)
        if weight is None:
            return None
        weight = weight.reshape(value.shape)
        # 2. The value heads back in transformers' order.
        if reorder and ".linear_attn." in name:
            if name.endswith("in_proj_qkv.weight"):
                qk = 2 * key_heads * dk
                weight = torch.cat([weight[:qk], _tiled_to_grouped(weight[qk:], 0, key_heads, dv)])
            elif name.endswith("in_proj_z.weight"):
                weight = _tiled_to_grouped(weight, 0, key_heads, dv)
            elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
                weight = _tiled_to_grouped(weight, 0, key_heads, 1)
            elif name.endswith("out_proj.weight"):
                weight = _tiled_to_grouped(weight, 1, key_heads, dv)
        return weight

    return get


def _prompt() -> list[int]:
    return torch.randint(0, 151643, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1)).tolist()


def _write(family: str, folder: Path, tokenizer_files: list[Path]) -> tuple[Path, dict]:
    """The wide tiny checkpoint of ``family`` (text layout, MTP head, bfloat16-exact, Qwen2.5 tokenizer)."""
    from lollm.testing.converter import round_to_bfloat16

    sizes = {**WIDE, **(WIDE_MOE if family == "qwen3_5_moe" else WIDE_DENSE)}
    tiny.write_tiny(family, "text", folder, mtp=True, **sizes)
    round_to_bfloat16(folder)
    for path in tokenizer_files[:2]:  # tokenizer.json, tokenizer_config.json
        shutil.copy(path, folder / path.name)
    return folder, tiny.tiny_config(family, "text", **sizes)


_RUNTIME: dict[str, dict] = {}


@pytest.fixture(scope="module")
def runtime(tmp_path_factory, qwen_tokenizer_files):
    """family -> {file type: RuntimeCheck}: every file type read by lollm and by llama.cpp, made once."""
    from lollm.testing.converter import runtime_checks

    def get(family: str) -> dict:
        if family not in _RUNTIME:
            folder, text = _write(family, tmp_path_factory.mktemp(f"wide-{family}"), qwen_tokenizer_files)
            _RUNTIME[family] = runtime_checks(folder, tmp_path_factory.mktemp("wide-gguf"), _prompt(), file_weight(text))
        return _RUNTIME[family]
    return get


@pytest.mark.llama_cpp
@pytest.mark.parametrize("file_type", FILE_TYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_runtime_agrees(runtime, family, file_type):
    """lollm against llama.cpp on the same file, and both against transformers on the source and on the file's
    weights (lollm.testing.converter.assert_runtime_check states the bounds)."""
    from lollm.testing.converter import assert_runtime_check

    check = runtime(family)[file_type]
    print(f"FIGURES {family} {file_type} | lollm~source {check.vs_source.line()} | lollm~file weights {check.vs_file_weights.line()} | "
          f"llama.cpp~source {check.llama_cpp_vs_source.line()} | llama.cpp~file weights {check.llama_cpp_vs_file_weights.line()} | "
          f"lollm~llama.cpp {check.vs_llama_cpp.line()} | packed~file weights {check.packed_vs_file_weights.line()} | "
          f"packed~llama.cpp {check.packed_vs_llama_cpp.line()}")
    assert_runtime_check(check, file_type)


def test_the_reference_undoes_the_converters_value_head_order():
    """:func:`_tiled_to_grouped` inverts the converter's reorder (conversion/qwen.py's ``_reorder_v_heads``, restated:
    grouped (Hk, r, d) -> tiled (r, Hk, d)) on rows and on columns; without it the reference would be wrong."""
    grouped = torch.arange(2 * 3 * 5 * 7, dtype=torch.float32).reshape(2 * 3 * 5, 7)  # Hk 2, r 3, d 5; 7 columns
    tiled = grouped.reshape(2, 3, 5, 7).transpose(0, 1).reshape(30, 7)
    assert not torch.equal(tiled, grouped)
    assert torch.equal(_tiled_to_grouped(tiled, 0, 2, 5), grouped)
    assert torch.equal(_tiled_to_grouped(tiled.T.contiguous(), 1, 2, 5), grouped.T)
