"""qwen3_5 and qwen3_5_moe read GGUF files written by llama.cpp's own converter, proven against transformers.

The chain: a tiny random checkpoint in the published (multimodal) layout, written by
transformers with an MTP head -> llama.cpp's ``convert_hf_to_gguf.py`` (the pinned sdist,
conftest.py: the convert_to_gguf fixture, lollm.testing.converter.convert) at ``--outtype`` f32, f16, bf16 and q8_0 -> lollm loads the file ->
its logits are compared with transformers' on the source checkpoint. The converter, not a
writer of ours, decides every name and transform (norms +1, -exp(A_log), the squeezed conv,
the value heads reordered for ggml), so a misreading of ours cannot hide in a writer too.

Tokenizer: the converter refuses a tokenizer whose pre-tokenizer it cannot identify (it
hashes how a fixed text tokenizes), so the tiny checkpoint carries the real Qwen2.5
tokenizer.json (same byte-level BPE lineage as Qwen3.5; the converter names it "qwen2"),
and its vocabulary is widened to 151,936 rows so every token id has an embedding row (the
converter asserts this). Only the embedding and head grow; every other size stays tiny.

Bounds (figures in the report of each run; ``-s`` prints them):

* f32: transformers' own numbers: exact argmax at every position, cosine >= 0.9999.
* f16 / bf16: the file holds the weights rounded to 16 bits. Against transformers on the
  source checkpoint the cosine is >= 0.9999 at every position; the argmax is compared
  exactly with transformers on the same checkpoint with its weights rounded as the file
  stores them (each tensor's type read from the file by gguf-py), because a tiny random
  model has near-ties that 8 bits of mantissa can flip (measured: 1 position of 24).
* q8_0: each weight is rounded to a step of 1/127 of its block's largest magnitude (about
  sigma/53 for a block of 32 Gaussian weights): a relative error of about 0.5% per weight
  (RMS). Over the ~20 matrix products of the tiny model that leaves the logits within a few
  percent (cosine 1 - e^2/2: e = 4% gives 0.9992), and in the MoE a router whose top-k is a
  near tie may pick another expert for a token, a step of its own: cosine >= 0.998 at every
  position (measured 0.99990 dense, 0.99929 MoE). The argmax must agree wherever transformers'
  top-two margin exceeds 5% of that position's logit spread (std), above that error; a nearer
  tie may flip.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import qwen3_5_tiny as tiny
from lollm.errors import WeightsError
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model

FAMILIES = ("qwen3_5", "qwen3_5_moe")
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}
#: the Qwen2.5 tokenizer's ids (151,665) fit in these rows; its padded vocabulary size
VOCAB = 151936
PROMPT = tiny.random_ids(24, 151643, seed=5)
#: the torch dtype each 16-bit outtype rounds to
ROUNDED = {"f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this run shares (the parent of the workers' temp folders),
    so each checkpoint is written and each file converted once per run, not once per worker."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "qwen3_5-gguf"
    root.mkdir(exist_ok=True)
    return root


def _once(path: Path, make) -> Path:
    """``make(tmp)`` then rename to ``path``, under a file lock, unless a worker already made it."""
    from filelock import FileLock

    with FileLock(str(path) + ".lock"):
        if not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            make(tmp)
            tmp.rename(path)
    return path


@pytest.fixture(scope="module")
def sources(shared, qwen_tokenizer_files):
    """family -> folder: the tiny multimodal checkpoint (transformers' init, the reference checkpoint's
    tie: 0.8B tied, 35B-A3B not) with an MTP head and the Qwen2.5 tokenizer."""

    def write(family: str, folder: Path) -> None:
        tiny.write_tiny(family, "multimodal", folder, mtp=True, vocab_size=VOCAB)
        for path in qwen_tokenizer_files[:2]:  # tokenizer.json, tokenizer_config.json
            shutil.copy(path, folder / path.name)

    return {family: _once(shared / f"{family}-src", lambda tmp, family=family: write(family, tmp)) for family in FAMILIES}


@pytest.fixture(scope="module")
def gguf_file(sources, shared, convert_to_gguf):
    """``gguf_file(family, outtype)`` -> the converter's file (converted once per run)."""

    def get(family: str, outtype: str) -> Path:
        return _once(shared / f"{family}-{outtype}.gguf", lambda tmp: convert_to_gguf(sources[family], tmp, outtype))

    return get


@pytest.fixture(scope="module")
def references(sources):
    """``references(family)`` -> transformers' model of the source checkpoint (float32)."""
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = tiny.reference_class(family, "multimodal").from_pretrained(sources[family], dtype=torch.float32).eval()
        return made[family]

    return get


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        out = model(torch.tensor([ids]))
    return (out.logits if hasattr(out, "logits") else out)[0].float()  # (T, V)


def _ours(path):
    return open_model(str(path), LoadOptions(device="cpu", dtype="float32")).model


def _rounded_as_stored(reference, path, dtype):
    """transformers' model with each weight rounded as the GGUF stores it (the types from the file's header).

    The converter keeps 1-D tensors, ``ssm_conv1d`` and the routers (``ffn_gate_inp``,
    ``ffn_gate_inp_shexp``) in F32 and every other tensor in the outtype: asserted here from
    the file, then the same tensors of the transformers model (conv1d, mlp.gate,
    shared_expert_gate stay) are rounded.
    """
    from lollm.gguf.reader import GGUFFile

    wanted = {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    with GGUFFile(path) as file:
        for name, info in file.tensors.items():
            kept = len(info.shape) == 1 or "ssm_conv1d" in name or "ffn_gate_inp" in name
            assert info.ggml_type == ("F32" if kept else wanted), (name, info.ggml_type)
    model = copy.deepcopy(reference)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not name.endswith(("conv1d.weight", "mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(p.to(dtype).float())
    return model


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    """(share of equal argmax, min cosine over positions, want's top-two margin / std per position)."""
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    top2 = want.topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]) / want.std(dim=-1)
    return (got.argmax(-1) == want.argmax(-1)).float().mean().item(), cos.min().item(), margin


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_converter_gguf_matches_transformers(family, outtype, gguf_file, references):
    path = gguf_file(family, outtype)
    model = _ours(path)
    assert model.has_draft_head  # the converter keeps the MTP layer (blk.L, nextn.*)
    got, want = _logits(model, PROMPT), _logits(references(family), PROMPT)
    agree, cos, margin = _compare(got, want)
    print(f"\n{family} {outtype}: vs transformers argmax {agree:.3f}, min cosine {cos:.6f}", end="")
    if outtype == "f32":
        assert agree == 1.0 and cos >= 0.9999
    elif outtype in ROUNDED:
        assert cos >= 0.9999
        agree_stored, cos_stored, _ = _compare(got, _logits(_rounded_as_stored(references(family), path, ROUNDED[outtype]), PROMPT))
        print(f"; vs transformers on the weights as stored argmax {agree_stored:.3f}, min cosine {cos_stored:.6f}", end="")
        assert agree_stored == 1.0 and cos_stored >= 0.9999
    else:  # q8_0: the bound of the module docstring
        assert cos >= 0.998
        clear = margin > 0.05
        assert bool((got.argmax(-1) == want.argmax(-1))[clear].all()), (margin, got.argmax(-1), want.argmax(-1))
        assert clear.float().mean() >= 0.5  # the check is not empty


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_equals_config_json(family, sources, gguf_file):
    """Every number config_from_gguf reads equals config.json's (eps: the float32 the file stores)."""
    import importlib

    from lollm.gguf.reader import GGUFTensorSource

    config_module = importlib.import_module(f"lollm_qwen3_5.{family}.config")
    source = GGUFTensorSource(gguf_file(family, "f32"))
    from_gguf = config_module.config_from_gguf(source.metadata, {n: source.shape(n) for n in source.names()})
    from_json = getattr(config_module, "Qwen3_5Config" if family == "qwen3_5" else "Qwen3_5MoeConfig").from_hf(
        json.loads((sources[family] / "config.json").read_text()))
    assert from_gguf.rms_norm_eps == pytest.approx(from_json.rms_norm_eps, rel=1e-7)
    skip = {"rms_norm_eps", "eos_token_ids"}  # eos: the file's is the tokenizer's (tokenizer_config.json)
    for field in from_json.__dataclass_fields__:
        if field not in skip:
            assert getattr(from_gguf, field) == getattr(from_json, field), field


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_drafts_from_gguf_equal_those_from_safetensors(family, sources, gguf_file):
    """The MTP head read from the converter's f32 file drafts the same tokens as from safetensors."""
    from lollm.generate.loop import generate
    from lollm.generate.sampling import SamplingParams

    drafts = {}
    for name, path in (("safetensors", sources[family]), ("gguf", gguf_file(family, "f32"))):
        model = _ours(path)
        seen, real_draft = [], model.draft

        def draft(cache, pending, num_tokens, real_draft=real_draft, seen=seen):
            tokens = real_draft(cache, pending, num_tokens)
            seen.append(list(tokens))
            return tokens

        model.draft = draft
        result = generate(model, PROMPT, max_new_tokens=24, sampling=SamplingParams(temperature=0), speculative_tokens=3)
        drafts[name] = (seen, result.new_ids)
    assert len(drafts["gguf"][0]) >= 6
    assert drafts["gguf"] == drafts["safetensors"]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_loads_the_safetensors_parameters(family, sources, gguf_file):
    """Every parameter read from the converter's f32 file (MTP head included) equals the safetensors one:
    each transform undone exactly once (a norm shifted twice, or not at all, is off by 1)."""
    from_safetensors = dict(_ours(sources[family]).named_parameters())
    from_gguf = dict(_ours(gguf_file(family, "f32")).named_parameters())
    assert from_gguf.keys() == from_safetensors.keys()
    assert any(name.startswith("mtp.") for name in from_gguf)
    for name, value in from_gguf.items():
        torch.testing.assert_close(value, from_safetensors[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def broken_moe_gguf(gguf_file, tmp_path_factory):
    """``broken_moe_gguf(drop=..., cut=..., flat=...)``: the converter's qwen3_5_moe f32 file, read by gguf-py
    and written again without tensor ``drop``, with the last expert of tensor ``cut`` removed, or with
    tensor ``flat`` flattened to 1-D.

    The tokenizer's keys are left out (gguf-py writes their 151,936 strings slowly, and the family's
    ``load`` does not read them); everything else is copied as it is.
    """
    import gguf

    reader = gguf.GGUFReader(str(gguf_file("qwen3_5_moe", "f32")))
    folder = tmp_path_factory.mktemp("broken")

    def write(*, drop: str | None = None, cut: str | None = None, flat: str | None = None):
        path = folder / f"{drop or cut or flat}.gguf"
        writer = gguf.GGUFWriter(str(path), reader.fields["general.architecture"].contents())
        for field in reader.fields.values():
            if field.name.startswith(("GGUF.", "tokenizer.")) or field.name == "general.architecture":
                continue
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
        for t in reader.tensors:
            if t.name != drop:
                data = t.data[:-1] if t.name == cut else t.data.reshape(-1) if t.name == flat else t.data  # numpy order
                writer.add_tensor(t.name, data.copy())
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    return write


@pytest.mark.parametrize("change,tensor", [("missing", "blk.5.ffn_up_exps.weight"), ("wrong shape", "blk.2.ffn_down_exps.weight"),
                                           ("wrong shape", "blk.8.ffn_gate_exps.weight")])
def test_a_broken_expert_tensor_is_named(change, tensor, broken_moe_gguf):
    """One expert tensor left out, or one expert short, is refused naming that tensor (blk.8: the MTP layer's)."""
    from lollm.gguf.reader import GGUFTensorSource
    from lollm.testing.loading import load_with
    from lollm_qwen3_5.qwen3_5_moe.weights import load

    if change == "missing":
        source = GGUFTensorSource(broken_moe_gguf(drop=tensor))
        message = rf"the GGUF file has no tensor '{re.escape(tensor)}'"
    else:
        source = GGUFTensorSource(broken_moe_gguf(cut=tensor))
        message = rf"GGUF tensor '{re.escape(tensor)}' has shape \(15, "
    with pytest.raises(WeightsError, match=message):
        load_with(load, source.metadata, source, "gguf")


def test_packed_experts_keep_their_blocks_and_only_the_routed_ones_run(gguf_file):
    """A packed load (``weights="auto"``) of the q8_0 file: every expert's three matrices stay in the file's
    blocks (no float expert tensor is left), a one-token step runs exactly k experts per MoE layer, and the
    logits match the float load of the same file.

    Bound: the same weights either way (a panel layer dequantizes to the file's numbers bit for bit,
    checked where the native kernel made one); only the kernels' summation order and the packed
    attention/DeltaNet projections differ: cosine >= 0.999 (measured 0.99946), argmax equal wherever
    the float load's top-two margin exceeds 5% of the logits' spread.
    """
    from lollm_qwen3_5.qwen3_5_moe.packed_experts import PackedExperts

    path = gguf_file("qwen3_5_moe", "q8_0")
    floats = _ours(path)
    packed = open_model(str(path), LoadOptions(device="cpu", dtype="float32", weights="auto")).model
    experts = {name: m for name, m in packed.named_modules() if isinstance(m, PackedExperts)}
    assert len(experts) == floats.config.num_hidden_layers + 1  # and the MTP layer's
    assert not any(".experts." in name for name, _ in packed.named_parameters())  # no float expert tensor left
    k, E, I = floats.config.num_experts_per_tok, floats.config.num_experts, floats.config.moe_intermediate_size
    for name, module in experts.items():
        assert len(module.gate) == len(module.up) == len(module.down) == E
        assert not any(isinstance(layer, torch.nn.Linear) for layer in (*module.gate, *module.up, *module.down))
        fused = floats.get_submodule(name).gate_up_proj  # (E, 2I, C), the float load's
        for e in (0, E - 1):
            if hasattr(module.gate[e], "dequantize"):
                assert torch.equal(module.gate[e].dequantize(), fused[e, :I]) and torch.equal(module.up[e].dequantize(), fused[e, I:])

    calls: dict[tuple[str, int], int] = {}
    for name, module in experts.items():
        for e, layer in enumerate(module.gate):
            layer.register_forward_hook(lambda *_, key=(name, e): calls.__setitem__(key, calls.get(key, 0) + 1))
    _logits(packed, PROMPT[:1])  # one token through the decoder (the MTP head does not run)
    per_layer = {name: sum(1 for (n, _) in calls if n == name) for name in experts if name.startswith("model.")}
    assert set(per_layer.values()) == {k} and set(calls.values()) == {1}

    got, want = _logits(packed, PROMPT), _logits(floats, PROMPT)
    agree, cos, margin = _compare(got, want)
    print(f"\nqwen3_5_moe q8_0 packed experts vs float load: argmax {agree:.3f}, min cosine {cos:.6f}", end="")
    assert cos >= 0.999
    assert bool((got.argmax(-1) == want.argmax(-1))[margin > 0.05].all())


def test_a_flat_shared_expert_gate_loads(broken_moe_gguf, gguf_file):
    """llama-quantize writes ``ffn_gate_inp_shexp`` (ggml ne (C, 1)) as (C,): the same numbers, accepted."""
    from lollm.gguf.reader import GGUFTensorSource
    from lollm.testing.loading import load_with
    from lollm_qwen3_5.qwen3_5_moe.weights import load

    name = "blk.0.ffn_gate_inp_shexp.weight"
    flat = GGUFTensorSource(broken_moe_gguf(flat=name))
    assert flat.shape(name) == (64,)
    model = load_with(load, flat.metadata, flat, "gguf")
    whole = GGUFTensorSource(gguf_file("qwen3_5_moe", "f32"))
    assert torch.equal(model.model.layers[0].mlp.shared_expert_gate.weight, whole.read(name))


@pytest.mark.parametrize("change,key", [
    ({"{arch}.rope.scaling.type": "yarn"}, "{arch}.rope.scaling.type"),  # a key the family does not implement
    ({"{arch}.ssm.inner_size": 98}, "{arch}.ssm.inner_size"),  # not a multiple of Hv
    ({"{arch}.full_attention_interval": 3}, "{arch}.full_attention_interval"),  # contradicts recurrent_layers
    ({"{arch}.attention.recurrent_layers": [True] * 9}, "{arch}.attention.recurrent_layers"),  # an MTP block recurrent
    ({"{arch}.block_count": None}, "{arch}.block_count"),  # missing
    ({"{arch}.rope.dimension_sections": [11, 11]}, "{arch}.rope.dimension_sections"),  # M-RoPE needs (t, h, w)
])
@pytest.mark.parametrize("family", FAMILIES)
def test_bad_gguf_metadata_is_named(family, change, key, gguf_file):
    """The converter's metadata with one key changed: ConfigError naming that key."""
    import importlib

    from lollm.errors import ConfigError
    from lollm.gguf.reader import GGUFTensorSource

    arch = ARCH[family]
    source = GGUFTensorSource(gguf_file(family, "f32"))
    metadata = dict(source.metadata)
    for name, value in change.items():
        name = name.format(arch=arch)
        if value is None:
            del metadata[name]
        else:
            metadata[name] = value
    config_from_gguf = importlib.import_module(f"lollm_qwen3_5.{family}.config").config_from_gguf
    with pytest.raises(ConfigError, match=re.escape(key.format(arch=arch))):
        config_from_gguf(metadata, {n: source.shape(n) for n in source.names()})


def test_two_mtp_layers_are_refused(gguf_file):
    from lollm.errors import ConfigError
    from lollm.gguf.reader import GGUFTensorSource
    from lollm.testing.loading import load_with
    from lollm_qwen3_5.qwen3_5.weights import load

    source = GGUFTensorSource(gguf_file("qwen3_5", "f32"))
    metadata = {**source.metadata, "qwen35.nextn_predict_layers": 2, "qwen35.block_count": 10,
                "qwen35.attention.recurrent_layers": source.metadata["qwen35.attention.recurrent_layers"] + [False]}
    with pytest.raises(ConfigError, match="nextn_predict_layers is 2"):
        load_with(load, metadata, source, "gguf")


def test_packed_load_of_the_dense_q8_0_file(gguf_file):
    """qwen3_5 with ``weights="auto"``: the projections keep the file's blocks, in_proj_qkv's and in_proj_z's rows
    put back in transformers' order on the blocks (ConvertedGGUF.read_raw), out_proj float (its columns
    were reordered). Bound as for the packed experts: cosine >= 0.999 against the float load of the file."""
    path = gguf_file("qwen3_5", "q8_0")
    floats = _ours(path)
    packed = open_model(str(path), LoadOptions(device="cpu", dtype="float32", weights="auto")).model
    mixer = packed.model.layers[0].linear_attn
    assert not isinstance(mixer.in_proj_qkv, torch.nn.Linear) and not isinstance(mixer.in_proj_z, torch.nn.Linear)
    assert isinstance(mixer.out_proj, torch.nn.Linear)
    got, want = _logits(packed, PROMPT), _logits(floats, PROMPT)
    agree, cos, margin = _compare(got, want)
    print(f"\nqwen3_5 q8_0 packed vs float load: argmax {agree:.3f}, min cosine {cos:.6f}", end="")
    assert cos >= 0.999
    assert bool((got.argmax(-1) == want.argmax(-1))[margin > 0.05].all())


def test_the_files_tokenizer_gives_the_checkpoints_ids(sources, gguf_file):
    """The tokenizer the converter wrote into the file (``tokenizer.ggml.*``, pre-tokenizer "qwen2") gives
    the ids of the checkpoint's tokenizer.json (the tokenizers library) on lollm-core's held-in strings."""
    import tokenizers

    from lollm.tokenizer import load_gguf_tokenizer

    strings = json.loads((tiny.REPO / "lollm-core" / "tests" / "data" / "hard_strings.json").read_text(encoding="utf-8"))
    ours = load_gguf_tokenizer(str(gguf_file("qwen3_5", "f32")))
    theirs = tokenizers.Tokenizer.from_file(str(sources["qwen3_5"] / "tokenizer.json"))
    assert len(strings) >= 20
    for text in strings:
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False).ids, text
