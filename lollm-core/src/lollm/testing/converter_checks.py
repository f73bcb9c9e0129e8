"""The conformance kit's converter GGUF check: llama.cpp's own ``convert_hf_to_gguf.py`` writes the file.

Section 12 of :class:`lollm.testing.conformance.FamilyConformance` (which inherits
:class:`ConverterChecks`). The GGUF mode of section 9 writes the checkpoint with lollm's
own writer "the converter's way" (:mod:`lollm.testing.gguf_writer`): a misreading of how
the converter names or transforms a tensor would sit in that writer and in the family's
reader alike. Here the converter itself writes each file (:mod:`lollm.testing.converter`:
the pinned llama-cpp-python sdist, pure Python, a child process of about 3 s):

1. the kit's tiny checkpoint is copied, its weights rounded to bfloat16
   (:func:`~lollm.testing.converter.round_to_bfloat16`: released checkpoints are bfloat16,
   so f16 and bf16 files hold them exactly), what no GGUF carries set to what llama.cpp
   derives (:data:`GGUF_DERIVED_KEYS`, :data:`GGUF_FIXED_SLIDING_PATTERN`: the reference runs
   on the same copy), and given a tokenizer the converter accepts
   (:func:`write_kit_tokenizer`: a SentencePiece ``tokenizer.model`` of exactly the
   checkpoint's vocabulary, trained on lollm's held-in corpus);
2. for a model type the converter does not know (a family made by ``lollm new-family``), the
   copy's config.json is respelled to the reference's type (``reference_model_types``: the
   class transformers already proves equivalent), converted, and the file is relabelled to the
   family's own GGUF architecture (``converter_architecture``: :func:`relabel_gguf`, with the
   converter's own gguf-py), so the family's GGUF reader is what reads it;
3. the family loads each file of ``converter_outtypes`` and is compared with the reference
   (transformers) on the weights the file holds (the rounded copy for f32/f16/bf16; for q8_0 that
   copy Q8_0-rounded, :func:`~lollm.testing.converter.q8_0_checkpoint`), after a prefill and
   through the cache, with the kit's float32 parity bounds: exact argmax, cosine >=
   ``parity_min_cosine``, max |Δ| <= the bound from the reference's own float32 noise. Those
   bounds hold because lollm and transformers then multiply the same numbers: a dequantized
   Q8_0 weight is exactly the Q8_0-rounded one (the converter tests' looser cosine >= 0.9999
   would let a small misread pass);
4. the tokenizer the converter wrote into the file gives the kit tokenizer's ids on the corpus.

Conversions are cached per process (pytest-xdist workers convert once each) by the content of
the checkpoint, so the two tests and the classes sharing a checkpoint convert it once.
docs/conformance-kit.md, "The converter's GGUF", says what is and is not run, and why.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lollm.load.loader import load_checkpoint
from lollm.load.registry import InstalledFamily

#: lollm's held-in corpus of hard strings (lollm-core/tests/data/hard_strings.json, shipped with the kit).
CORPUS_PATH = Path(__file__).resolve().parents[1] / "cli" / "data" / "corpus" / "hard_strings.json"
#: The pieces of the kit's byte-fallback SentencePiece tokenizer that are not characters: 256 bytes, the special
#: pieces of the largest style (Gemma's 4 + 2 turn markers), and room for 64 merges.
RESERVED_PIECES = 256 + 6 + 64
#: The smallest vocabulary the kit writes a tokenizer for: the reserved pieces and 32 characters.
MIN_VOCAB = RESERVED_PIECES + 32
#: The converter's byte-level BPE path only (``TextModel._set_vocab_gpt2``, no tokenizer.model tried first):
#: these reference model types have no tokenizer the kit can write; the family's test class gives a real one
#: (the fixture ``converter_tokenizer_dir``, docs/conformance-kit.md).
BPE_ONLY_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
#: config.json keys a GGUF file cannot carry -> the key llama.cpp derives them from: the converter drops them
#: and llama.cpp takes the scale from head_dim (Gemma 2/3's ``query_pre_attn_scalar``). Where a checkpoint sets
#: them otherwise, the kit's copy takes the derived value (the reference runs on that copy too): the file
#: cannot hold the checkpoint's own model, and the wrong-scale bug is the float32 tests' to find.
GGUF_DERIVED_KEYS = {"query_pre_attn_scalar": "head_dim"}
#: Reference model types whose GGUF cannot carry the layer kinds: llama.cpp makes every N-th layer global
#: (Gemma 3: 6, its ``set_swa_pattern``; the converter writes no pattern). The kit's copy takes that pattern.
GGUF_FIXED_SLIDING_PATTERN = {"gemma3": 6, "gemma3_text": 6}
#: The special ids of each SentencePiece style (:data:`lollm.testing.converter.SENTENCEPIECE_STYLES`),
#: written into the copy's config.json (the converter takes them from there): they describe the tokenizer.
STYLE_TOKEN_IDS = {"gemma": {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2},
                   "llama": {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}}


def corpus() -> list[str]:
    return json.loads(CORPUS_PATH.read_text(encoding="utf-8"))


def tokenizer_style(model_type: str) -> str:
    """The SentencePiece style for a reference model type: Gemma's ids and turn markers for ``gemma*``
    (Gemma 4's converter reads only the tokenizer.json the style also writes), Llama 2's for the rest."""
    return "gemma" if model_type.startswith("gemma") else "llama"


def write_kit_tokenizer(folder: Path, vocab_size: int, style: str) -> Path:
    """A SentencePiece tokenizer of exactly ``vocab_size`` pieces, trained on :func:`corpus`, in ``folder``.

    The converter reads a ``tokenizer.model`` as it is (``_set_vocab_sentencepiece``: Llama, Gemma 2/3,
    and Qwen2/Qwen3, which try it before their byte-level BPE); a tiny byte-level BPE would be refused
    (its pre-tokenizer hash is unknown to ``get_vocab_base_pre``). The characters beyond what the
    vocabulary holds are left out of training (they still encode, as bytes).
    """
    from lollm.testing.converter import write_sentencepiece_tokenizer

    if vocab_size < MIN_VOCAB:
        pytest.fail(f"the checkpoint's vocabulary ({vocab_size}) is too small for the tokenizer the converter needs "
                    f"(a byte-fallback SentencePiece model of at least {MIN_VOCAB} pieces); write the kit's checkpoint "
                    f"with vocab_size >= {MIN_VOCAB}, or set converter_outtypes = () saying why", pytrace=False)
    return write_sentencepiece_tokenizer(folder, corpus(), style=style, vocab_size=vocab_size,
                                         max_characters=vocab_size - RESERVED_PIECES)


def tokenizer_json_size(folder: Path) -> int:
    """1 + the largest id of ``folder/tokenizer.json`` (its model's vocabulary and its added tokens)."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def grow_vocabulary(folder: Path, rows: int) -> None:
    """The checkpoint in ``folder`` with ``rows`` vocabulary rows: the embedding and an untied head grow by rows
    drawn like their own (normal, their standard deviation, seeded), config.json's ``vocab_size`` with them.
    The converter requires every id of a real byte-level BPE tokenizer to have a row. The prompt's ids stay
    below the old vocabulary; the new rows add logit columns, compared with the reference's like the others.
    Nothing changes when the checkpoint has ``rows`` already."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    old = int(text["vocab_size"])
    if rows <= old:
        return
    g = torch.Generator().manual_seed(38)
    for name, value in tensors.items():
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and value.shape[0] == old:
            extra = torch.randn((rows - old,) + tuple(value.shape[1:]), generator=g) * value.float().std()
            tensors[name] = torch.cat([value, extra.to(value.dtype)]).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    text["vocab_size"] = rows
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _stamp(folder: Path) -> str:
    """A digest of config.json and the safetensors files: the same checkpoint written twice has one stamp."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def respell(raw: object, model_types: dict[str, str]) -> object:
    """config.json with each ``model_type`` of ``model_types`` (nested ones too) set to the reference's, and
    ``architectures`` to transformers' causal-LM class of that type (what the converter picks its class by)."""
    if isinstance(raw, list):
        return [respell(v, model_types) for v in raw]
    if not isinstance(raw, dict):
        return raw
    out = {k: respell(v, model_types) for k, v in raw.items()}
    if out.get("model_type") in model_types:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        out["model_type"] = model_types[out["model_type"]]
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(out["model_type"])
        if "architectures" in out and causal_lm is not None:
            out["architectures"] = [causal_lm]
    return out


_RELABEL = r'''
import sys
import gguf

src, dst, new = sys.argv[1:]
reader = gguf.GGUFReader(src)
old = bytes(reader.get_field("general.architecture").parts[-1]).decode()
writer = gguf.GGUFWriter(dst, arch=new)
for field in reader.fields.values():
    if field.name == "general.architecture" or field.name.startswith("GGUF."):
        continue  # the writer writes these itself
    name = new + field.name[len(old):] if field.name.startswith(old + ".") else field.name
    kind = field.types[0]
    sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
    writer.add_key_value(name, field.contents(), kind, sub_type=sub)
for t in reader.tensors:
    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_ti_data_to_file()
for t in reader.tensors:
    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
writer.close()
'''


def relabel_gguf(src: Path, dst: Path, architecture: str) -> Path:
    """``src`` rewritten as ``dst`` with ``general.architecture`` = ``architecture`` and every ``<old arch>.`` key
    renamed ``<architecture>.``; tensors and every other key as they are. Runs the converter's own gguf-py."""
    from lollm.testing.converter import ConverterError, converter_source

    gguf_py = converter_source() / "vendor" / "llama.cpp" / "gguf-py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(gguf_py), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _RELABEL, str(src), str(dst), architecture],
                          capture_output=True, text=True, env=env)
    if done.returncode or not dst.is_file():
        raise ConverterError(f"relabelling {src} as {architecture!r} failed:\n{done.stderr[-3000:]}")
    return dst


@dataclass(frozen=True)
class ConvertedFile:
    """One conversion: the file the family reads, the folder holding the weights the file holds (in the family's
    own model type: the reference runs there), the tokenizer the kit wrote, and its style."""

    gguf: Path
    held: Path
    tokenizer: Path
    style: str


_CONVERTED: dict[tuple, ConvertedFile] = {}
_WORKDIR: list[Path] = []


def _workdir() -> Path:
    """One temporary folder per process for the conversions, removed when the process ends."""
    if not _WORKDIR:
        _WORKDIR.append(Path(tempfile.mkdtemp(prefix="lollm-kit-converter-")))
        atexit.register(shutil.rmtree, _WORKDIR[0], True)
    return _WORKDIR[0]


def _carried_by_gguf(text: dict, reference_type: str) -> None:
    """Set, in the decoder's config dict ``text``, what a GGUF cannot carry to what llama.cpp derives
    (:data:`GGUF_DERIVED_KEYS`, :data:`GGUF_FIXED_SLIDING_PATTERN`)."""
    for key, source in GGUF_DERIVED_KEYS.items():
        if key in text and isinstance(text.get(source), int):
            text[key] = text[source]
    pattern = GGUF_FIXED_SLIDING_PATTERN.get(reference_type)
    if pattern is not None:
        for key in ("sliding_window_pattern", "_sliding_window_pattern"):
            if key in text:
                text[key] = pattern
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                   for i in range(len(text["layer_types"]))]


def converter_flags(folder: Path) -> tuple[str, ...]:
    """``("--no-mtp",)`` when config.json declares an MTP block (``mtp_num_hidden_layers``) that the weights
    lack, else ().

    transformers writes no MTP head (its models do not run one), so a tiny checkpoint of a hub config that
    declares one has none; the converter counts the block from config.json and refuses a checkpoint without
    its tensors unless told ``--no-mtp`` (its own option for a file without the head). The reference never
    runs MTP either."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if not config.get("text_config", config).get("mtp_num_hidden_layers"):
        return ()
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        return () if any(name.startswith("mtp.") for name in weights.keys()) else ("--no-mtp",)


def _prepare(checkpoint_dir: Path, folder: Path, model_types: dict[str, str],
             tokenizer_dir: Path | None) -> tuple[Path, Path | None, str]:
    """The rounded copy with its tokenizer (the family's own model type), and when the model type is one of
    ``model_types`` a respelled copy for the converter; returns (copy, respelled or None, style).

    tokenizer_dir: a real byte-level BPE tokenizer (tokenizer.json ...) to copy in, the vocabulary grown to
    its size (style "bpe"); None: the kit's SentencePiece tokenizer (style "gemma" or "llama")."""
    from lollm.testing.converter import round_to_bfloat16

    if not (checkpoint_dir / "model.safetensors").is_file():
        pytest.fail(f"the converter check needs the checkpoint in one model.safetensors; {checkpoint_dir} has "
                    f"{sorted(p.name for p in checkpoint_dir.iterdir())}", pytrace=False)
    rounded = folder / "checkpoint"
    shutil.copytree(checkpoint_dir, rounded, ignore=shutil.ignore_patterns("tokenizer*", "*.gguf"))
    if tokenizer_dir is not None:
        for path in Path(tokenizer_dir).glob("tokenizer*.json"):
            shutil.copy(path, rounded / path.name)
        grow_vocabulary(rounded, tokenizer_json_size(rounded))
    round_to_bfloat16(rounded)
    config = json.loads((rounded / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    reference_type = model_types.get(text.get("model_type"), text.get("model_type"))
    style = "bpe" if tokenizer_dir is not None else tokenizer_style(str(reference_type))
    for key, value in STYLE_TOKEN_IDS.get(style, {}).items():  # the tokenizer's ids, where config.json names them
        for part in (config, text):
            if key in part:
                part[key] = value
    _carried_by_gguf(text, str(reference_type))
    (rounded / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if tokenizer_dir is None:
        write_kit_tokenizer(rounded, int(text["vocab_size"]), style)
    if text.get("model_type") not in model_types and config.get("model_type") not in model_types:
        return rounded, None, style
    respelled = folder / "respelled"
    shutil.copytree(rounded, respelled)
    (respelled / "config.json").write_text(json.dumps(respell(config, model_types), indent=2), encoding="utf-8")
    return rounded, respelled, style


def convert_checkpoint(checkpoint_dir: str | Path, outtype: str, model_types: dict[str, str],
                       architecture: str | None, tokenizer_dir: Path | None = None) -> ConvertedFile:
    """The kit checkpoint ``checkpoint_dir`` converted at ``outtype`` (cached per process; module docstring, 1-2)."""
    from lollm.testing.converter import convert, q8_0_checkpoint

    checkpoint_dir = Path(checkpoint_dir)
    key = (_stamp(checkpoint_dir), outtype, tuple(sorted(model_types.items())), architecture, str(tokenizer_dir))
    if key in _CONVERTED:
        return _CONVERTED[key]
    folder = _workdir() / f"{key[0]}-{len(_CONVERTED)}-{outtype}"
    rounded, respelled, style = _prepare(checkpoint_dir, folder, model_types, tokenizer_dir)
    path = convert(respelled or rounded, folder / f"converter-{outtype}.gguf", outtype, converter_flags(rounded))
    if architecture is not None:
        path = relabel_gguf(path, folder / f"{architecture}-{outtype}.gguf", architecture)
    held = q8_0_checkpoint(rounded, folder / "q8_0-weights") if outtype == "q8_0" else rounded
    tokenizer = rounded / ("tokenizer.model" if style == "llama" else "tokenizer.json")
    _CONVERTED[key] = ConvertedFile(path, held, tokenizer, style)
    return _CONVERTED[key]


class ConverterChecks:
    """Section 12 of the kit; the fixtures and class attributes it uses are :class:`FamilyConformance`'s."""

    @pytest.fixture
    def converter_tokenizer_dir(self) -> Path | None:
        """A folder holding the real tokenizer.json (and tokenizer_config.json) the converter reads for this
        architecture, or None (the default): the kit writes a SentencePiece tokenizer.model of the checkpoint's
        vocabulary. Override it where the converter reads only a byte-level BPE it knows by hash
        (:data:`BPE_ONLY_MODEL_TYPES`); the kit then grows the checkpoint's vocabulary to the tokenizer's."""
        return None

    def _converter_plan(self, installed: InstalledFamily, checkpoint_dir, tokenizer_dir) -> tuple[str, ...]:
        """The outtypes to convert, or a skip saying why there are none."""
        from lollm.testing.converter import OUTTYPES

        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        outtypes = self.converter_outtypes
        if outtypes is None:
            if not installed.family.gguf_architectures:
                pytest.skip(f"the family {installed.family.name!r} declares no GGUF architecture "
                            f"(Family.gguf_architectures): it reads no GGUF, so the converter check does not apply")
            outtypes = OUTTYPES
        if not outtypes:
            pytest.skip("converter_outtypes = (): the converter check is off for this family")
        unknown = [o for o in outtypes if o not in OUTTYPES]
        assert not unknown, f"converter_outtypes {unknown}: the converter writes {OUTTYPES}"
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text(encoding="utf-8"))
        model_type = config.get("text_config", config).get("model_type")
        reference_type = self.reference_model_types.get(model_type, model_type)
        if reference_type in BPE_ONLY_MODEL_TYPES and tokenizer_dir is None:
            pytest.skip(f"llama.cpp's converter reads a {reference_type!r} tokenizer only as a byte-level BPE "
                        f"tokenizer.json whose pre-tokenizer it knows by hash (TextModel._set_vocab_gpt2), which no "
                        f"tiny tokenizer has; the fixture converter_tokenizer_dir gives none (a real one, e.g. "
                        f"Qwen2.5's, 151,936 ids: lollm-qwen3_5/tests/test_conformance.py does)")
        return tuple(outtypes)

    def _converted(self, checkpoint_dir, outtype: str, tokenizer_dir) -> ConvertedFile:
        return convert_checkpoint(checkpoint_dir, outtype, dict(self.reference_model_types), self.converter_architecture,
                                  tokenizer_dir)

    def test_converter_gguf_parity_with_the_reference(self, load, installed, checkpoint_dir, prompt_ids,
                                                      sliding_window, parity_bound, converter_tokenizer_dir):
        """Each file of ``converter_outtypes``, written by llama.cpp's converter from the checkpoint, loads through
        the family and matches the reference on the weights the file holds, after a prefill and through the
        cache, within the kit's float32 parity bounds (module docstring). ``pytest -rP`` shows the figures."""
        from lollm.testing.converter import agreement

        for outtype in self._converter_plan(installed, checkpoint_dir, converter_tokenizer_dir):
            converted = self._converted(checkpoint_dir, outtype, converter_tokenizer_dir)
            gguf_checkpoint = load_checkpoint(converted.gguf)
            architecture = gguf_checkpoint.config["general.architecture"]
            assert architecture in installed.family.gguf_architectures, (
                f"the converter's file {converted.gguf} says general.architecture {architecture!r}, which the family "
                f"does not serve (gguf_architectures {installed.family.gguf_architectures}); a family copied from "
                f"another states converter_architecture (the GGUF architecture the file is relabelled to)")
            reference = self._reference(installed, load_checkpoint(converted.held))
            ref_logits, ref_hidden = reference(prompt_ids)
            prefill, decode = self._check_file_parity(load(gguf_checkpoint), ref_logits, ref_hidden, prompt_ids,
                                                      sliding_window, f"converter's GGUF {outtype}", parity_bound)
            print(f"converter's GGUF {outtype} ({architecture}): prefill {agreement(prefill, ref_logits).line()}; "
                  f"cached decode {agreement(decode, ref_logits).line()}; bound {parity_bound:.2e}")

    def test_converter_gguf_tokenizer_gives_the_checkpoints_ids(self, installed, checkpoint_dir, converter_tokenizer_dir):
        """The tokenizer the converter wrote into the file (lollm's GGUF tokenizer on its ``tokenizer.ggml.*``
        keys) gives the ids of the tokenizer the kit wrote beside the checkpoint, on every text of the corpus."""
        from lollm.testing.converter import sentencepiece_mismatches, tokenizer_mismatches

        outtype = self._converter_plan(installed, checkpoint_dir, converter_tokenizer_dir)[0]
        converted = self._converted(checkpoint_dir, outtype, converter_tokenizer_dir)
        texts = corpus()
        check = sentencepiece_mismatches if converted.style == "llama" else tokenizer_mismatches
        wrong = check(converted.gguf, converted.tokenizer, texts)
        assert not wrong, (f"{len(wrong)} of {len(texts)} texts of {CORPUS_PATH.name} tokenize otherwise from the "
                           f"converter's file {converted.gguf} than with {converted.tokenizer}; first: {wrong[0]}")
