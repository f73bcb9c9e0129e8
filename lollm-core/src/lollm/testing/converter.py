"""llama.cpp's own converter and runtime, as a reference for lollm's GGUF readers.

A GGUF test that writes its own files "the converter's way" proves little: a
misread tensor name or transform sits in the writer and the reader alike. This
module runs the real thing instead:

* :func:`converter_source` finds llama.cpp's sources, vendored in the pinned
  llama-cpp-python source distribution (:data:`LLAMA_CPP_PYTHON`): the folder in
  ``$LOLLM_LLAMA_CPP_SRC``, else ``pip download`` fetches the sdist once into the
  cache (``$LOLLM_CACHE`` or ``~/.cache/lollm``, folder ``llama-cpp-src``) and the
  converter, its ``conversion/`` package and gguf-py are unpacked from it;
* :func:`convert` runs ``convert_hf_to_gguf.py`` on a checkpoint folder as a
  child process (pure Python: torch, numpy, transformers, sentencepiece), with the
  vendored gguf-py first on PYTHONPATH so that the converter and its gguf-py are
  of the same commit;
* :func:`quantize` makes K-quant files (Q4_K_M, Q6_K) with the *compiled*
  llama.cpp: llama-cpp-python's ``llama_model_quantize``, or the ``llama-quantize``
  program; :func:`llama_cpp_logits` runs a file in llama.cpp's runtime through
  llama-cpp-python (``logits_all``). Both need the long compile of the ``bench``
  extra; they raise :class:`ConverterError` naming what is missing.

The comparisons (:func:`agreement`) are position by position, as the parity gate's:
argmax agreement, the smallest cosine (computed in float64), the largest |difference|.
docs/gguf.md, "Proven by llama.cpp's converter and runtime", lists the figures.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

#: The pinned source distribution that vendors llama.cpp (converter, gguf-py, C++ sources).
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
#: ``--outtype`` values of convert_hf_to_gguf.py that the pure-Python converter writes.
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: K-quant file types that only the compiled llama.cpp writes (:func:`quantize`).
KQUANTS = ("Q4_K_M", "Q6_K")
#: What :func:`converter_source` unpacks from the sdist (below ``vendor/llama.cpp/``).
_UNPACKED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ConverterError(RuntimeError):
    """llama.cpp's converter, quantizer or runtime failed or is missing; the message says which and why."""


def converter_source() -> Path:
    """The root of the unpacked pinned sdist (it holds ``vendor/llama.cpp/convert_hf_to_gguf.py``).

    ``$LOLLM_LLAMA_CPP_SRC`` when set (a folder, e.g. a full unpacked sdist), else
    ``<cache>/llama-cpp-src/llama_cpp_python-<version>/``, fetched and unpacked on first use.
    """
    given = os.environ.get("LOLLM_LLAMA_CPP_SRC")
    if given:
        root = Path(given)
        if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").is_file():
            raise ConverterError(f"LOLLM_LLAMA_CPP_SRC={given}: no vendor/llama.cpp/convert_hf_to_gguf.py there")
        return root
    from lollm.cli.real_models import _one_writer, cache_dir

    folder = cache_dir() / "llama-cpp-src"
    name, version = LLAMA_CPP_PYTHON.split("==")
    root = folder / f"{name.replace('-', '_')}-{version}"
    done = root / ".unpacked"
    if not done.exists():
        with _one_writer(folder, "sdist"):  # parallel test workers wait for the first one
            if not done.exists():
                _fetch_and_unpack(folder, root)
                done.write_text(LLAMA_CPP_PYTHON + "\n", encoding="utf-8")
    return root


def _fetch_and_unpack(folder: Path, root: Path) -> None:
    """``pip download`` the sdist into ``folder``; unpack the converter, conversion/ and gguf-py to ``root``."""
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
               "-d", tmp, LLAMA_CPP_PYTHON]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("*.tar.gz"))
        if done.returncode or len(sdists) != 1:
            raise ConverterError(f"could not fetch the {LLAMA_CPP_PYTHON} sdist ({' '.join(cmd)}): {_tail(done.stderr)}")
        prefix = f"{root.name}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as sdist:
            members = [m for m in sdist.getmembers()
                       if m.name.startswith(prefix) and m.name[len(prefix):].startswith(_UNPACKED)]
            if not any(m.name == prefix + "convert_hf_to_gguf.py" for m in members):
                raise ConverterError(f"{sdists[0].name} has no {prefix}convert_hf_to_gguf.py")
            shutil.rmtree(root, ignore_errors=True)
            sdist.extractall(folder, members=members, filter="data")


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def convert(checkpoint_dir: str | Path, out_path: str | Path, outtype: str, extra_args: tuple[str, ...] = ()) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on ``checkpoint_dir`` (config.json, safetensors, tokenizer files).

    outtype: one of :data:`OUTTYPES`; extra_args: more of the converter's options (``--no-mtp``).
    Returns ``out_path``. ConverterError, with the tail of the converter's stderr, when it fails.
    """
    if outtype not in OUTTYPES:
        raise ConverterError(f"outtype {outtype!r}: the converter writes {', '.join(OUTTYPES)} (K-quants: quantize())")
    llama = converter_source() / "vendor" / "llama.cpp"
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    env.pop("NO_LOCAL_GGUF", None)  # the converter then puts its own gguf-py first as well
    cmd = [sys.executable, str(llama / "convert_hf_to_gguf.py"), str(checkpoint_dir), "--outfile", str(out_path),
           "--outtype", outtype, *extra_args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode or not out_path.is_file():
        raise ConverterError(f"convert_hf_to_gguf.py --outtype {outtype} failed on {checkpoint_dir} "
                             f"(exit {done.returncode}):\n{_tail(done.stderr)}")
    return out_path


def _llama_cpp():
    """llama-cpp-python, or ConverterError saying how to get it."""
    try:
        import llama_cpp
    except (ImportError, OSError) as exc:
        raise ConverterError(f"llama-cpp-python is not importable ({type(exc).__name__}: {exc}); install the compiled "
                             f"llama.cpp with pip install 'lollm-core[bench]' ({LLAMA_CPP_PYTHON}, a long compile), or "
                             "point PYTHONPATH and LLAMA_CPP_LIB_PATH at a build") from None
    return llama_cpp


def _quantize_program() -> str | None:
    """The ``llama-quantize`` program: in $LLAMA_CPP_LIB_PATH (a llama.cpp build/bin) or on PATH."""
    lib = os.environ.get("LLAMA_CPP_LIB_PATH")
    if lib and (Path(lib) / "llama-quantize").is_file():
        return str(Path(lib) / "llama-quantize")
    return shutil.which("llama-quantize")


def quantize(src_gguf: str | Path, out: str | Path, kind: str) -> Path:
    """``src_gguf`` (an F32/F16/BF16 file) quantized by the compiled llama.cpp to ``kind`` (:data:`KQUANTS`).

    Through llama-cpp-python's ``llama_model_quantize`` when it imports, else the
    ``llama-quantize`` program; ConverterError naming both when neither is there.
    """
    if kind not in KQUANTS:
        raise ConverterError(f"quantize kind {kind!r}: one of {', '.join(KQUANTS)}")
    out = Path(out)
    try:
        llama_cpp = _llama_cpp()
    except ConverterError as missing:
        program = _quantize_program()
        if program is None:
            raise ConverterError(f"cannot quantize to {kind}: {missing}; and no llama-quantize program "
                                 "(not in $LLAMA_CPP_LIB_PATH, not on PATH)") from None
        done = subprocess.run([program, str(src_gguf), str(out), kind], capture_output=True, text=True)
        if done.returncode:
            raise ConverterError(f"{program} {src_gguf} {kind} failed:\n{_tail(done.stderr)}") from None
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    code = llama_cpp.llama_model_quantize(str(src_gguf).encode(), str(out).encode(), ctypes.byref(params))
    if code != 0 or not out.is_file():
        raise ConverterError(f"llama_model_quantize({src_gguf}, {kind}) returned {code}")
    return out


def llama_cpp_logits(gguf: str | Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits on ``gguf`` for every position of ``ids``: ``(T, vocab)`` float32.

    One ``eval`` of the whole prompt by llama-cpp-python with ``logits_all=True``, on the CPU, with a
    float32 KV cache (llama.cpp's default stores keys and values as f16: a rounding lollm does not do).
    """
    llama_cpp = _llama_cpp()
    f32 = llama_cpp.GGML_TYPE_F32
    model = llama_cpp.Llama(model_path=str(gguf), n_ctx=max(64, len(ids)), n_batch=max(64, len(ids)),
                            logits_all=True, n_gpu_layers=0, n_threads=1, type_k=f32, type_v=f32, verbose=False)
    try:
        model.eval(ids)
        return torch.from_numpy(model.scores[: len(ids)].copy()).float()
    finally:
        model.close()


# --------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Agreement:
    """Two ``(T, vocab)`` logit tensors, position by position."""

    positions: int
    argmax_agree: int
    min_cosine: float
    max_abs_diff: float

    def line(self) -> str:
        return (f"argmax {self.argmax_agree}/{self.positions}, min cosine {self.min_cosine:.6f}, "
                f"max |diff| {self.max_abs_diff:.3g}")


def agreement(ours: torch.Tensor, ref: torch.Tensor) -> Agreement:
    """Argmax agreement, smallest cosine (float64: float32 rounding alone moves a long dot product) and
    largest |difference| of ``ours`` and ``ref``, both ``(T, vocab)``."""
    if ours.shape != ref.shape:
        raise ConverterError(f"logit shapes differ: {tuple(ours.shape)} against {tuple(ref.shape)}")
    a, b = ours.double(), ref.double()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    return Agreement(a.shape[0], agree, float(cosine.min()), float((a - b).abs().max()))


def lollm_logits(gguf: str | Path, ids: list[int], weights: str = "float") -> torch.Tensor:
    """lollm's logits on ``gguf`` (loaded by the family that claims it, float32, CPU): ``(T, vocab)``.

    weights: "float" dequantizes every tensor (the reference path); "auto" keeps the file's
    quantized blocks packed and runs lollm's kernels on them, as ``lollm run`` does.
    """
    from lollm.load.options import LoadOptions
    from lollm.load.pipeline import open_model
    from lollm.testing.quantized import logits_of

    model = open_model(str(gguf), LoadOptions(device="cpu", dtype="float32", weights=weights)).model
    return logits_of(model, ids)


def transformers_logits(checkpoint_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """transformers' logits on the safetensors checkpoint ``checkpoint_dir`` in float32: ``(T, vocab)``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def round_to_bfloat16(checkpoint_dir: str | Path) -> Path:
    """Make the weights of ``checkpoint_dir/model.safetensors`` exactly representable in bfloat16 and float16.

    Released checkpoints are published in bfloat16, so converting them to f16, bf16 or f32
    changes no weight; a tiny random float32 checkpoint would lose bits at f16/bf16 and
    its logits move by rounding, not by a misread tensor. Each weight is rounded to
    bfloat16, and values below 2**-17 (where a float16 subnormal cannot hold all of
    bfloat16's 8 significant bits) become 0. Stored as float32; returns the folder.
    """
    from safetensors.torch import load_file, save_file

    path = Path(checkpoint_dir) / "model.safetensors"
    tensors = load_file(str(path))
    rounded = {}
    for name, value in tensors.items():
        if value.is_floating_point():
            value = value.to(torch.bfloat16).float()
            value = torch.where(value.abs() < 2.0 ** -17, torch.zeros_like(value), value)
        rounded[name] = value.contiguous()
    save_file(rounded, str(path), metadata={"format": "pt"})
    return Path(checkpoint_dir)


#: Q8_0: blocks of 32 consecutive values of a row share one float16 scale; each value is a signed 8-bit integer.
Q8_0_BLOCK = 32


def q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (rows of a multiple of 32 values) as a Q8_0 file stores it, dequantized: float32, same shape.

    Per block of 32: scale ``d = max|w| / 127``, codes ``round(w / d)`` (halves away from zero, as
    gguf-py rounds), values ``float16(d) * code``. The rounding error of a value is at most half a
    step, ``d / 2``, and about ``d / sqrt(12)`` on average: for Gaussian weights (a block's max
    about 2.6 sigma) 0.6% of the weights' RMS.
    """
    blocks = weight.float().reshape(-1, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    codes = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (d.half().float() * codes).reshape(weight.shape)


def q8_0_checkpoint(checkpoint_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of ``checkpoint_dir`` whose weights hold what ``convert_hf_to_gguf.py --outtype q8_0`` keeps of them.

    The converter stores as Q8_0 every tensor of 2+ dimensions named ``*.weight`` whose rows
    split into blocks of 32 (norms, biases and 1-D tensors stay float32); each such tensor
    goes through :func:`q8_0_round_trip` here. transformers on this copy is the reference
    the Q8_0 file is held to: its distance from the source is the quantization error itself.
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(checkpoint_dir), Path(out_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    for name, value in tensors.items():
        if (value.is_floating_point() and value.dim() >= 2 and name.endswith(".weight") and "norm" not in name
                and value.shape[-1] % Q8_0_BLOCK == 0):
            tensors[name] = q8_0_round_trip(value).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Llama Q/K row order: inside each head the converter stores rows (2, D/2) as (D/2, 2)."""
    return weight.reshape(heads, weight.shape[0] // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def file_weights_checkpoint(gguf_path: str | Path, checkpoint_dir: str | Path, out_dir: str | Path,
                            file_weight=None) -> Path:
    """A copy of ``checkpoint_dir`` whose matrices are the ones the quantized file ``gguf_path`` holds.

    Each tensor of 2+ dimensions of the source is found in the file by gguf-py's ``TensorNameMap``
    (the converter's own table, not lollm's), dequantized by gguf-py where the file quantized it,
    and put back (Llama's Q/K rows back in transformers' order); float tensors stay the source's,
    which the file holds exactly. transformers on this copy is the reference a K-quant file is held to.
    ConverterError names a source tensor the file does not have.

    file_weight: for a converter that reorders or stacks what it quantizes (qwen35's value heads, its stacked
    experts), the family's tests give ``file_weight(name, value, names, dequantized)`` -> the weight in the
    source's layout, or None to keep the source's; ``names`` is gguf-py's TensorNameMap, ``dequantized(gguf_name)``
    the file's tensor by gguf-py (None where the file holds it in float: the source's exactly).
    """
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    reader = gguf.GGUFReader(str(gguf_path))
    arch_name = bytes(reader.get_field("general.architecture").parts[-1]).decode()
    arch = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}[arch_name]
    src, out = Path(checkpoint_dir), Path(out_dir)
    shutil.copytree(src, out, dirs_exist_ok=True)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    in_file = {t.name: t for t in reader.tensors}
    float_types = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    tensors = load_file(str(src / "model.safetensors"))

    def dequantized(tensor_name: str) -> torch.Tensor | None:
        if tensor_name not in in_file:
            raise ConverterError(f"{gguf_path}: no tensor {tensor_name}")
        t = in_file[tensor_name]
        return None if t.tensor_type in float_types else torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()

    for name, value in tensors.items():
        if file_weight is not None:
            held = file_weight(name, value, names, dequantized)
            if held is not None:
                tensors[name] = held.contiguous()
            continue
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if value.dim() < 2 or (mapped is None and name == "lm_head.weight"):  # a tied head is not in the file
            continue
        if mapped not in in_file:
            raise ConverterError(f"{gguf_path}: no tensor for {name} (gguf-py's name {mapped})")
        tensor = in_file[mapped]
        if tensor.tensor_type in float_types:
            continue
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float().reshape(value.shape)
        if arch_name == "llama" and mapped.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads"] if "attn_q" in mapped else config["num_key_value_heads"]
            weight = _unpermute(weight, heads)
        tensors[name] = weight.contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --------------------------------------------------------------------- the converter check of one file


@dataclass(frozen=True)
class ConvertedCheck:
    """One checkpoint converted at one outtype and loaded by lollm.

    gguf: the file; vs_reference: lollm on the file against transformers on the weights the
    file holds (the source itself for f32/f16/bf16, :func:`q8_0_checkpoint` for q8_0);
    reference_vs_source: that reference against the source (the quantization error alone;
    exact for f32/f16/bf16); vs_source: lollm on the file against transformers on the source.
    """

    gguf: Path
    vs_reference: Agreement
    reference_vs_source: Agreement
    vs_source: Agreement


def check_converted(checkpoint_dir: str | Path, workdir: str | Path, outtype: str, ids: list[int],
                    source_logits: torch.Tensor | None = None) -> ConvertedCheck:
    """Convert ``checkpoint_dir`` at ``outtype`` into ``workdir`` and compare lollm's logits on ``ids`` with transformers'.

    ``checkpoint_dir`` should hold bfloat16-exact weights (:func:`round_to_bfloat16`), so that
    f16 and bf16 files hold the source's weights exactly. ``source_logits``: transformers' logits
    on the source for ``ids``, when the caller has them already ``(T, vocab)``.
    """
    # 1. llama.cpp's converter writes the file.
    workdir = Path(workdir)
    gguf = convert(checkpoint_dir, workdir / f"{Path(checkpoint_dir).name}-{outtype}.gguf", outtype)
    # 2. The references: transformers on the source, and on the weights the file holds.
    if source_logits is None:
        source_logits = transformers_logits(checkpoint_dir, ids)
    if outtype == "q8_0":
        held = q8_0_checkpoint(checkpoint_dir, workdir / f"{Path(checkpoint_dir).name}-q8_0-weights")
        reference = transformers_logits(held, ids)
    else:
        reference = source_logits
    # 3. lollm reads the file.
    ours = lollm_logits(gguf, ids)
    return ConvertedCheck(gguf, agreement(ours, reference), agreement(reference, source_logits),
                          agreement(ours, source_logits))


def tokenizer_mismatches(gguf: str | Path, tokenizer_json: str | Path, texts: list[str]) -> list[tuple[str, list, list]]:
    """The texts whose ids differ between lollm's tokenizer of ``gguf`` (the metadata the converter wrote) and the
    ``tokenizers`` library on ``tokenizer_json`` (the checkpoint's): ``[(text, ours, expected), ...]``.
    Both add their special tokens (a BOS where the tokenizer asks for one)."""
    import tokenizers

    from lollm.tokenizer import load_gguf_tokenizer

    ours, reference = load_gguf_tokenizer(gguf), tokenizers.Tokenizer.from_file(str(tokenizer_json))
    wrong = []
    for text in texts:
        got, expected = ours.encode(text), reference.encode(text).ids
        if got != expected:
            wrong.append((text, got, expected))
    return wrong


# --------------------------------------------------------------------- a tokenizer the converter accepts

#: How :func:`write_sentencepiece_tokenizer` trains: Gemma's settings (no dummy prefix, <pad> 0, <eos> 1,
#: <bos> 2, <unk> 3, two turn markers) or Llama 2's (dummy prefix, unk 0, bos 1, eos 2, no pad).
SENTENCEPIECE_STYLES = {
    "gemma": dict(add_dummy_prefix=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                  bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"]),
    "llama": dict(add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1),
}


def write_sentencepiece_tokenizer(folder: str | Path, texts: list[str], *, style: str, vocab_size: int = 1024,
                                  max_characters: int | None = None) -> Path:
    """A SentencePiece BPE tokenizer.model of exactly ``vocab_size`` pieces trained on ``texts``, in ``folder``.

    The converter reads a byte-level BPE tokenizer.json only when it knows the hash of its ids
    on a fixed text (``get_vocab_base_pre``), which no tiny trained tokenizer has; a
    tokenizer.model it reads as it is (``_set_vocab_sentencepiece``), the way Gemma and Llama 2
    checkpoints are published. Byte fallback, identity normalization, split digits.

    style "gemma" also writes tokenizer.json and tokenizer_config.json, built by transformers'
    GemmaTokenizer from the pieces (transformers' own ``generate_merges``): Gemma 4's converter
    reads tokenizer.json only (``LlamaHfVocab``). Returns ``folder``.

    max_characters: train on the texts with every character but the ``max_characters`` most frequent
    removed (None: all kept). SentencePiece needs a piece for each character covering 98% of the text,
    which a small vocabulary (the kit's 512) cannot hold beside the 256 byte pieces; the dropped
    characters still encode, as bytes (byte fallback).
    """
    import io
    from collections import Counter

    import sentencepiece as spm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if max_characters is not None:
        counts = Counter(c for t in texts for c in t)
        kept = {c for c, _ in counts.most_common(max_characters)}
        texts = ["".join(c for c in t if c in kept) for t in texts]
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([t for t in texts if t.strip()] * 2), model_writer=buffer, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, normalization_rule_name="identity", character_coverage=0.98,
        hard_vocab_limit=True, split_digits=True, remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        num_threads=1, minloglevel=2, **SENTENCEPIECE_STYLES[style])
    (folder / "tokenizer.model").write_bytes(buffer.getvalue())
    if style == "gemma":
        import transformers
        from transformers.convert_slow_tokenizer import generate_merges

        sp = spm.SentencePieceProcessor(model_proto=buffer.getvalue())
        vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
        tokenizer = transformers.GemmaTokenizer(vocab=vocab, merges=generate_merges(vocab), pad_token="<pad>",
                                                eos_token="<eos>", bos_token="<bos>", unk_token="<unk>", mask_token=None,
                                                add_bos_token=True)  # as Gemma's tokenizer.json: <bos> first
        tokenizer.save_pretrained(folder)
    return folder


def sentencepiece_mismatches(gguf: str | Path, tokenizer_model: str | Path, texts: list[str]) -> list[tuple[str, list, list]]:
    """As :func:`tokenizer_mismatches`, against the ``sentencepiece`` library on ``tokenizer_model`` (BOS first
    when the file's tokenizer adds one, as llama.cpp does)."""
    import sentencepiece as spm

    from lollm.tokenizer import load_gguf_tokenizer

    ours, reference = load_gguf_tokenizer(gguf), spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    wrong = []
    for text in texts:
        expected = ([reference.bos_id()] if ours.add_bos else []) + reference.encode(text)
        got = ours.encode(text)
        if got != expected:
            wrong.append((text, got, expected))
    return wrong


# --------------------------------------------------------------------- llama.cpp's runtime beside lollm

#: Every file type of the cross-runtime check: the converter's, then the compiled quantizer's (from the f32 file).
FILE_TYPES = OUTTYPES + KQUANTS


@dataclass(frozen=True)
class RuntimeCheck:
    """One file read by lollm (dequantized, and packed) and by llama.cpp's runtime, each against transformers on the
    source and on the weights the file holds (:func:`file_weights_checkpoint`; the source itself for float files),
    and each other."""

    gguf: Path
    vs_source: Agreement
    vs_file_weights: Agreement
    llama_cpp_vs_source: Agreement
    llama_cpp_vs_file_weights: Agreement
    vs_llama_cpp: Agreement
    packed_vs_file_weights: Agreement  # lollm with the file's blocks kept packed (``lollm run``'s way)
    packed_vs_llama_cpp: Agreement


def runtime_checks(checkpoint_dir: str | Path, workdir: str | Path, ids: list[int],
                   file_weight=None) -> dict[str, RuntimeCheck]:
    """Every :data:`FILE_TYPES` file of ``checkpoint_dir`` (the converter's, then Q4_K_M and Q6_K quantized by the
    compiled llama.cpp from the f32 file), each run by lollm and by llama.cpp on ``ids``. Needs llama-cpp-python.
    file_weight: as :func:`file_weights_checkpoint`'s."""
    # 1. The files: llama.cpp's converter, then its quantizer.
    workdir, name = Path(workdir), Path(checkpoint_dir).name
    files = {outtype: convert(checkpoint_dir, workdir / f"{name}-{outtype}.gguf", outtype) for outtype in OUTTYPES}
    files.update({kind: quantize(files["f32"], workdir / f"{name}-{kind}.gguf", kind) for kind in KQUANTS})
    # 2. Each file: lollm, llama.cpp, and transformers on the source and on the weights the file holds.
    source = transformers_logits(checkpoint_dir, ids)
    checks = {}
    for kind, gguf in files.items():
        ours, packed, theirs = lollm_logits(gguf, ids), lollm_logits(gguf, ids, "auto"), llama_cpp_logits(gguf, ids)
        held = transformers_logits(file_weights_checkpoint(gguf, checkpoint_dir, workdir / f"{name}-{kind}-weights",
                                                           file_weight), ids)
        checks[kind] = RuntimeCheck(gguf, agreement(ours, source), agreement(ours, held), agreement(theirs, source),
                                    agreement(theirs, held), agreement(ours, theirs), agreement(packed, held),
                                    agreement(packed, theirs))
    return checks


#: lollm against llama.cpp on the same file: float files differ by summation order and by llama.cpp casting
#: activations to f16/bf16 for f16/bf16 weights; on quantized files llama.cpp also rounds each activation row
#: to 8 bits (Q8_0 / Q8_K) before its dot products, where lollm multiplies float32 activations.
RUNTIME_COSINE_MIN = {"f32": 0.99999, "f16": 0.99999, "bf16": 0.9999, "q8_0": 0.999, "Q4_K_M": 0.999, "Q6_K": 0.999}
def assert_beside_llama_cpp(vs_reference: Agreement, llama_cpp_vs_reference: Agreement, vs_llama_cpp: Agreement,
                            cosine_min: float) -> None:
    """lollm and llama.cpp on one file, each against transformers on the weights the file holds (the reference).

    * lollm against the reference: exact argmax, cosine >= 0.9999 (lollm reads the file exactly);
    * lollm against llama.cpp: cosine >= ``cosine_min``, unless llama.cpp is itself further than that from the
      reference (its rounding of activations: a finding, and the issue sides with transformers), in which
      case no further from lollm than from the reference (1e-3); argmax agreement no lower than
      llama.cpp's with the reference, less 2 (random tiny models have near-ties that rounding flips).
    """
    assert vs_reference.argmax_agree == vs_reference.positions and vs_reference.min_cosine >= 0.9999, \
        f"lollm vs transformers on the file's weights: {vs_reference.line()}"
    floor = min(cosine_min, llama_cpp_vs_reference.min_cosine - 1e-3)
    assert vs_llama_cpp.min_cosine >= floor, f"lollm vs llama.cpp {vs_llama_cpp.line()} | llama.cpp vs transformers " \
                                             f"{llama_cpp_vs_reference.line()}"
    assert vs_llama_cpp.argmax_agree >= llama_cpp_vs_reference.argmax_agree - 2, \
        f"lollm vs llama.cpp {vs_llama_cpp.line()} | llama.cpp vs transformers {llama_cpp_vs_reference.line()}"


def assert_runtime_check(check: RuntimeCheck, kind: str) -> None:
    """:func:`assert_beside_llama_cpp` on one :class:`RuntimeCheck` with :data:`RUNTIME_COSINE_MIN` (docs/gguf.md,
    "Proven by llama.cpp's converter and runtime"); then lollm's packed path, which rounds activations for its
    integer kernels as llama.cpp does: its error of the same class as llama.cpp's. Its cosine to transformers on
    the file's weights is at least the smaller of :data:`RUNTIME_COSINE_MIN` and llama.cpp's own cosine to
    transformers, less the larger of 1e-3 and llama.cpp's own distance d = 1 - that cosine; its cosine to
    llama.cpp (two errors of that size, in different directions) at least that smaller value less max(1e-3, 2d)."""
    assert_beside_llama_cpp(check.vs_file_weights, check.llama_cpp_vs_file_weights, check.vs_llama_cpp,
                            RUNTIME_COSINE_MIN[kind])
    cpp, packed = check.llama_cpp_vs_file_weights, check.packed_vs_file_weights
    bound, distance = min(RUNTIME_COSINE_MIN[kind], cpp.min_cosine), 1 - cpp.min_cosine
    assert packed.min_cosine >= bound - max(1e-3, distance), \
        f"lollm packed vs transformers {packed.line()} | llama.cpp {cpp.line()}"
    assert check.packed_vs_llama_cpp.min_cosine >= bound - max(1e-3, 2 * distance), \
        f"lollm packed vs llama.cpp {check.packed_vs_llama_cpp.line()} | llama.cpp vs transformers {cpp.line()}"
