"""qwen2 and qwen3 from GGUF: the metadata keys, the name map, parity, greedy generation, memory.

Two kinds of files:

* tiny random qwen2/qwen3 GGUFs written here the way llama.cpp's converter
  writes them: transformers makes a random checkpoint from a shrunk hub
  config, gguf-py's own ``TensorNameMap`` (the converter's table, not ours)
  renames the tensors, gguf-py's ``Keys`` name the metadata, and the tensors
  are stored as F32, F16 and Q8_0; we then compare against transformers
  loading the *same* GGUF (so quantization error cancels out);
* the real Qwen2.5-Coder-0.5B-Instruct GGUF (``@pytest.mark.real``; a few
  minutes on 2 cores).

Note on transformers' qwen3 GGUF loading: it ignores ``qwen3.attention.key_length``
and keeps Qwen3Config's default ``head_dim = 128`` (true of every released
Qwen3), so the tiny qwen3 uses head_dim 128 (with hidden 64: heads * head_dim
!= hidden, as in the real models), which also checks that we do read the key.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _qwen_tiny import real_config

from lollm.load.options import LoadOptions
from lollm.errors import ConfigError, WeightsError
from lollm.testing.loading import load_with

PROMPT_RAW = "def quicksort(items):\n    \"\"\"Sort a list with quicksort and return a new list.\"\"\"\n"
PROMPT_CHAT = "Write a Python function that parses a CSV file and returns the rows as dictionaries. Explain each step."
NEW_TOKENS = 64

#: ggml type per GGUF tensor kind in the tiny files: every 1-D tensor F32, the rest mixed.
TINY_TYPES = {
    "token_embd": "Q8_0", "output": "F16", "attn_q": "F16", "attn_k": "F16", "attn_v": "F16",
    "attn_output": "Q8_0", "ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "F32",
}


# ============================================================ tiny GGUF writing


def hf_folder_to_gguf(folder: Path, out: Path, arch: str) -> Path:
    """Write ``folder`` (a transformers qwen2/qwen3 checkpoint) as ``out``, llama.cpp's way."""
    import gguf
    from safetensors.torch import load_file

    from lollm.testing.tiny_gguf import byte_level_vocab, write_gguf

    cfg = json.loads((folder / "config.json").read_text())
    n_layers = cfg["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map({"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3}[arch], n_layers)
    tensors = {}
    for hf_name, value in load_file(str(folder / "model.safetensors")).items():
        name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf-py has no llama.cpp name for {hf_name}"
        kind = re.sub(r"^blk\.\d+\.", "", name).rsplit(".", 1)[0]
        ggml_type = "F32" if value.ndim == 1 else TINY_TYPES[kind]
        tensors[name] = (value.float().numpy(), ggml_type)

    K = gguf.Keys
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    meta = {
        K.LLM.BLOCK_COUNT.format(arch=arch): n_layers,
        K.LLM.CONTEXT_LENGTH.format(arch=arch): cfg["max_position_embeddings"],
        K.LLM.EMBEDDING_LENGTH.format(arch=arch): cfg["hidden_size"],
        K.LLM.FEED_FORWARD_LENGTH.format(arch=arch): cfg["intermediate_size"],
        K.Attention.HEAD_COUNT.format(arch=arch): cfg["num_attention_heads"],
        K.Attention.HEAD_COUNT_KV.format(arch=arch): cfg["num_key_value_heads"],
        K.Rope.FREQ_BASE.format(arch=arch): float(theta),
        K.Attention.LAYERNORM_RMS_EPS.format(arch=arch): float(cfg["rms_norm_eps"]),
    }
    if "head_dim" in cfg:  # the converter: key_length and value_length when config.json has head_dim
        meta[K.Attention.KEY_LENGTH.format(arch=arch)] = cfg["head_dim"]
        meta[K.Attention.VALUE_LENGTH.format(arch=arch)] = cfg["head_dim"]
    tokens, merges, types = byte_level_vocab(cfg["vocab_size"])
    meta.update({
        K.Tokenizer.MODEL: "gpt2", K.Tokenizer.PRE: "qwen2", K.Tokenizer.LIST: tokens,
        K.Tokenizer.TOKEN_TYPE: types, K.Tokenizer.MERGES: merges,
        K.Tokenizer.EOS_ID: tokens.index("<|im_end|>"), K.Tokenizer.BOS_ID: tokens.index("<|endoftext|>"),
        K.Tokenizer.PAD_ID: tokens.index("<|endoftext|>"), K.Tokenizer.ADD_BOS: False,
        K.Tokenizer.CHAT_TEMPLATE: "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                                   "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    })
    return write_gguf(out, arch, meta, tensors)


_MADE: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory ``(family, tied) -> path of a tiny .gguf`` (written once per session)."""
    from lollm.testing.tiny import shrink_config, write_tiny_checkpoint

    def make(family: str, tied: bool) -> Path:
        key = f"{family}-{'tied' if tied else 'untied'}"
        if key not in _MADE:
            overrides = {"tie_word_embeddings": tied}
            if family == "qwen3":
                overrides["head_dim"] = 128  # see the module docstring
            raw = shrink_config(real_config(family), **overrides)
            folder = write_tiny_checkpoint(raw, tmp_path_factory.mktemp(key), schema="hub")
            _MADE[key] = hf_folder_to_gguf(folder, tmp_path_factory.mktemp(key + "-gguf") / f"{key}.gguf", family)
        return _MADE[key]

    return make


def _types(path: Path) -> dict[str, str]:
    from lollm.gguf import GGUFFile

    return {n: t.ggml_type for n, t in GGUFFile(path).tensors.items()}


# ============================================================ tiny: parity against transformers


@pytest.mark.parametrize(("family", "tied"), [("qwen3", True), ("qwen3", False), ("qwen2", True), ("qwen2", False)])
def test_tiny_gguf_parity_against_transformers(tiny_gguf, family, tied):
    from lollm.proof.parity import run_parity

    path = tiny_gguf(family, tied)
    types = _types(path)
    assert {"F32", "F16", "Q8_0"} <= set(types.values())
    assert ("output.weight" in types) is not tied
    report = run_parity(str(path))  # the embedded tiny tokenizer encodes the default prompt
    assert report.family == family
    assert report.num_tokens >= 30
    assert report.argmax_matches == report.num_tokens, report.to_json()
    assert report.min_cosine >= 0.99999, report.min_cosine


def test_tiny_gguf_model_shapes(tiny_gguf):
    from lollm.load.pipeline import open_model

    loaded = open_model(str(tiny_gguf("qwen3", True)), LoadOptions(device="cpu", dtype="float32"))
    cfg = loaded.model.config
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size, cfg.vocab_size) == (128, 4, 64, 512)
    assert cfg.tie_word_embeddings and loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    assert not cfg.attention_bias


def test_tiny_gguf_loads_in_bfloat16(tiny_gguf):
    from lollm.load.pipeline import open_model

    loaded = open_model(str(tiny_gguf("qwen2", False)), LoadOptions(device="cpu", dtype="bfloat16"))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}


# ============================================================ hard-fail on keys and tensors


def _meta(path: Path) -> tuple[dict, dict]:
    from lollm.gguf import GGUFTensorSource

    src = GGUFTensorSource(path)
    return dict(src.metadata), {n: src.shape(n) for n in src.names()}


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("missing", ["block_count", "embedding_length", "feed_forward_length", "attention.head_count",
                                     "rope.freq_base", "attention.layer_norm_rms_epsilon", "context_length"])
def test_missing_required_key_is_named(tiny_gguf, family, missing):
    from importlib import import_module

    meta, shapes = _meta(tiny_gguf(family, True))
    del meta[f"{family}.{missing}"]
    config_cls = getattr(import_module(f"lollm_qwen.{family}.config"), f"{family.capitalize()}Config")
    with pytest.raises(ConfigError, match=re.escape(f"{family}.{missing}")):
        config_cls.from_gguf(meta, shapes)


def test_qwen3_needs_key_length(tiny_gguf):
    from lollm_qwen.qwen3.config import Qwen3Config

    meta, shapes = _meta(tiny_gguf("qwen3", True))
    assert Qwen3Config.from_gguf(meta, shapes).head_dim == 128
    del meta["qwen3.attention.key_length"]
    with pytest.raises(ConfigError, match=r"qwen3\.attention\.key_length"):
        Qwen3Config.from_gguf(meta, shapes)


@pytest.mark.parametrize(("key", "value"), [
    ("qwen2.attention.sliding_window", 4096),
    ("qwen2.rope.scaling.attn_factor", 1.0),
    ("qwen2.rope.scaling.yarn_beta_fast", 32.0),
    ("qwen2.pooling_type", 1),
    ("qwen2.expert_count", 8),
])
def test_unread_arch_key_is_refused(tiny_gguf, key, value):
    from lollm_qwen.qwen2.config import Qwen2Config

    meta, shapes = _meta(tiny_gguf("qwen2", True))
    meta[key] = value
    with pytest.raises(ConfigError, match=re.escape(key)):
        Qwen2Config.from_gguf(meta, shapes)


def test_rope_scaling_keys(tiny_gguf):
    from lollm_qwen.qwen2.config import Qwen2Config

    meta, shapes = _meta(tiny_gguf("qwen2", True))
    yarn = {**meta, "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
            "qwen2.rope.scaling.original_context_length": 32768}
    rope = Qwen2Config.from_gguf(yarn, shapes).rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    linear = {**meta, "qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0}
    assert Qwen2Config.from_gguf(linear, shapes).rope.rope_type == "linear"
    assert Qwen2Config.from_gguf({**meta, "qwen2.rope.scaling.type": "none"}, shapes).rope.rope_type == "default"
    with pytest.raises(ConfigError, match="longrope"):
        Qwen2Config.from_gguf({**meta, "qwen2.rope.scaling.type": "longrope", "qwen2.rope.scaling.factor": 2.0}, shapes)
    with pytest.raises(ConfigError, match=r"qwen2\.rope\.scaling\.factor"):
        Qwen2Config.from_gguf({**meta, "qwen2.rope.scaling.type": "yarn"}, shapes)
    with pytest.raises(ConfigError, match="rope.dimension_count"):
        Qwen2Config.from_gguf({**meta, "qwen2.rope.dimension_count": 8}, shapes)


def test_vocab_size_sources(tiny_gguf):
    from lollm_qwen.qwen2.config import Qwen2Config

    meta, shapes = _meta(tiny_gguf("qwen2", True))
    assert Qwen2Config.from_gguf(meta, shapes).vocab_size == 512
    assert Qwen2Config.from_gguf(meta).vocab_size == 512  # from tokenizer.ggml.tokens
    assert Qwen2Config.from_gguf(meta).eos_token_ids == (meta["tokenizer.ggml.eos_token_id"],)
    with pytest.raises(ConfigError, match=r"qwen2\.vocab_size"):
        Qwen2Config.from_gguf({**meta, "qwen2.vocab_size": 500}, shapes)


def test_unknown_tensor_is_named(tiny_gguf, tmp_path):
    """A tensor the map does not know (here rope_freqs, which would rescale RoPE) is an error naming it."""
    from lollm.gguf import GGUFTensorSource
    from lollm_qwen.qwen2.weights import load

    src = GGUFTensorSource(tiny_gguf("qwen2", True))

    class WithExtra:
        metadata = src.metadata

        def names(self):
            return src.names() + ["rope_freqs.weight"]

        def shape(self, name):
            return (16,) if name == "rope_freqs.weight" else src.shape(name)

        def read(self, name):
            return torch.ones(16) if name == "rope_freqs.weight" else src.read(name)

    with pytest.raises(WeightsError, match=r"rope_freqs\.weight"):
        load_with(load, src.metadata, WithExtra(), "gguf")


def test_wrong_architecture_is_refused(tiny_gguf):
    from lollm_qwen.qwen3.config import Qwen3Config

    meta, shapes = _meta(tiny_gguf("qwen2", True))
    with pytest.raises(ConfigError, match="general.architecture"):
        Qwen3Config.from_gguf(meta, shapes)


# ============================================================ the real Qwen2.5-Coder GGUF


def test_bench_of_a_gguf_says_when_llama_cpp_is_not_measured(tiny_gguf, monkeypatch):
    import lollm.proof.bench as bench

    monkeypatch.setattr(bench, "llama_cpp_available", lambda: False)
    path = str(tiny_gguf("qwen2", True))
    result = bench.run_bench(path, ids=list(range(3, 11)), new_tokens=2, rounds=1, threads=1, reference=False)
    assert [e.name for e in result.engines] == ["lollm"] and result.note == bench.NO_LLAMA_CPP
    quiet = bench.run_bench(path, ids=list(range(3, 11)), new_tokens=2, rounds=1, threads=1, reference=False, llama_cpp=False)
    assert quiet.note == ""


_LOAD_AND_GENERATE = """
import sys
import torch
from lollm.generate.loop import generate
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model
from lollm.generate.sampling import SamplingParams
loaded = open_model(sys.argv[1], LoadOptions(weights="auto"))
with torch.inference_mode():
    result = generate(loaded.model, [3, 4, 5], max_new_tokens=3, sampling=SamplingParams(temperature=0.0), attn=loaded.attn)
assert len(result.new_ids) == 3
print(sorted(m for m in ("torch._dynamo", "triton") if m in sys.modules))
"""


def test_load_and_generate_import_neither_dynamo_nor_triton(tiny_gguf):
    """Building the modules (lollm.load.build.on_meta) and sizing the cache (lollm.generate.memory) stay off
    torch._dynamo: importing it (and Triton with it) costs about 150 MB of resident memory."""
    done = subprocess.run([sys.executable, "-c", _LOAD_AND_GENERATE, str(tiny_gguf("qwen2", True))],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    from lollm.cli.real_models import fetch_gguf

    return fetch_gguf("qwen2.5-coder-0.5b-instruct")


def _lollm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lollm.cli", *args], capture_output=True, text=True)


@pytest.mark.real
def test_real_gguf_parity_cli_fp32(real_gguf):
    done = _lollm("parity", str(real_gguf), "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    print(json.dumps({k: report[k] for k in ("num_tokens", "argmax_matches", "min_cosine", "max_abs_diff", "min_top5_overlap")}))
    assert report["family"] == "qwen2"
    assert report["num_tokens"] >= 30
    assert report["argmax_matches"] == report["num_tokens"]
    assert report["min_cosine"] >= 0.9999
    assert report["passed"] is True


def _reference_greedy(path: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    out = {}
    with torch.inference_mode():
        for name, ids in prompts.items():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 temperature=None, top_p=None, top_k=None, repetition_penalty=None)
            out[name] = gen[0, len(ids):].tolist()
    del model
    gc.collect()
    return out


@pytest.fixture(scope="module")
def real_greedy_pairs(real_gguf):
    """Our greedy ids and transformers' on the GGUF, raw and chat prompt (one model in memory at a time)."""
    from lollm.generate.loop import generate, stop_token_ids
    from lollm.load.pipeline import open_model
    from lollm.generate.sampling import SamplingParams

    loaded = open_model(str(real_gguf), LoadOptions(device="cpu", dtype="float32"))
    tok = loaded.tokenizer
    prompts = {
        "raw": tok.encode(PROMPT_RAW),
        "chat": tok.encode_chat([{"role": "user", "content": PROMPT_CHAT}], add_generation_prompt=True),
    }
    stops = stop_token_ids(loaded.checkpoint.generation_config, loaded.checkpoint.config, tok)
    ours = {
        name: generate(loaded.model, ids, max_new_tokens=NEW_TOKENS, sampling=SamplingParams(temperature=0.0),
                       stop_ids=stops, tokenizer=tok).new_ids
        for name, ids in prompts.items()
    }
    del loaded
    gc.collect()
    return ours, _reference_greedy(real_gguf, prompts)


@pytest.mark.real
@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_real_gguf_greedy_64_tokens_match_transformers(real_greedy_pairs, kind):
    ours, theirs = real_greedy_pairs
    assert len(theirs[kind]) == NEW_TOKENS, "the reference stopped early: choose a prompt with a longer answer"
    assert ours[kind] == theirs[kind]


MEMORY_SCRIPT = textwrap.dedent("""
    import json, re, sys
    def hwm():
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
    import torch
    import lollm.load.pipeline, lollm.gguf, lollm.load.weights, lollm.load.options
    import lollm_qwen.qwen2.weights, lollm_qwen.qwen2.modeling_qwen2
    before = hwm()
    loaded = lollm.load.pipeline.open_model(sys.argv[1], lollm.load.options.LoadOptions(device="cpu", dtype="float32"))
    after = hwm()
    params = {id(p): p.numel() * p.element_size() for p in loaded.model.parameters()}
    print(json.dumps({"before": before, "after": after, "model_bytes": sum(params.values())}))
""")


@pytest.mark.real
def test_real_gguf_load_peak_memory(real_gguf):
    """Loading the real GGUF into float32 grows the peak RSS by less than 1.5x the dequantized model."""
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(real_gguf)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout.strip().splitlines()[-1])
    growth = data["after"] - data["before"]
    ratio = growth / data["model_bytes"]
    print(json.dumps({**data, "growth": growth, "ratio": round(ratio, 3)}))
    assert data["model_bytes"] > 2e9  # 630M parameters (untied output) in float32
    assert ratio < 1.5, data


# -- the README's Python snippet runs as written, on a tiny GGUF ----------------------------------


def _run_readme_python_snippet(gguf: Path) -> dict:
    """README "From Python", its model path replaced by ``gguf``; the names it defines."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- tested: python snippet -->\s*```python\n(.*?)```", readme, re.S)
    assert match, "README.md has no python block after '<!-- tested: python snippet -->'"
    code = match.group(1)
    spec = re.search(r'open_model\("([^"]+)"', code).group(1)
    namespace: dict = {}
    exec(compile(code.replace(spec, str(gguf)), "README.md", "exec"), namespace)
    return namespace


def test_the_readme_python_snippet_runs(tiny_gguf, capsys):
    """README "From Python": open_model with LoadOptions, keep the GGUF packed, generate greedily."""
    namespace = _run_readme_python_snippet(tiny_gguf("qwen2", True))
    loaded, result = namespace["loaded"], namespace["result"]
    assert loaded.model.weights_summary.packed > 0  # weights="auto": the file's blocks stayed packed
    assert len(result.new_ids) >= 1 and capsys.readouterr().out.strip() == result.text.strip()


def test_the_readme_python_snippet_stops_at_the_end_of_the_answer(real_gguf):
    """On the real Qwen2.5 GGUF the snippet's greedy answer ends at <|im_end|>, as `lollm run` does."""
    namespace = _run_readme_python_snippet(real_gguf)
    result, tokenizer = namespace["result"], namespace["tokenizer"]
    assert result.stop_reason == "eos" and tokenizer.decode([result.new_ids[-1]]) == "<|im_end|>"
    assert result.text.strip() and len(result.new_ids) < 32
