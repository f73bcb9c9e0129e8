"""Mutation tests of the conformance kit: a copy of a family with one deliberate bug must fail it.

A kit that passes a wrong model proves nothing, so each family's tests break a
*copy* of the family on purpose (RoPE scaling ignored, the RoPE base off by a
factor, the norm epsilon ignored, the sliding window off by one, a cached
decode that drops a position) and check that the kit fails it; the unchanged
copy must pass, so each such test can fail::

    from lollm.testing.mutation import copy_family, run_kit

    copy = copy_family("lollm_gemma.gemma3", tmp_path / "src", "mutant_gemma3",
                       {"blocks.py": [("inv_freq = inv_freq / rope.factor", "inv_freq = inv_freq")]})
    run = run_kit("lollm_gemma.gemma3", copy, "gemma3", checkpoint_dir, tmp_path / "kit")
    assert "test_parity_with_the_reference" in run.failed

:func:`copy_family` copies the family's package folder (its modules import
each other relatively, as the design asks) under a new name and replaces
exact pieces of its source, refusing when a piece is not there exactly once
(so a refactor of the family breaks the test loudly instead of making it
test nothing). :func:`run_kit` runs :class:`~lollm.testing.conformance.FamilyConformance`
on the copy, in this process, with ``pytest.main``, and returns each kit
test's outcome and failure message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import re
import shutil
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pytest
import torch

from lollm.attention import visible
from lollm.cli.new_family import find_hub_config
from lollm.hookspecs import hookimpl
from lollm.load.loader import load_checkpoint
from lollm.load.plugins import build_registry
from lollm.load.registry import Registry
from lollm.proof.parity import default_reference
from lollm.testing.reference import NoiseFloor, measure_noise_floor
from lollm.testing.schedules import SEQUENCE_LENGTH
from lollm.cli.hub_configs import hub_config
from lollm.testing.tiny import SENSITIVE_INIT_STD, kit_config, write_tiny_checkpoint
from lollm.testing.vision_checks import VISION_TESTS
from lollm.testing.vision_mutants import FAILS as VISION_FAILS, VISION_EDITS, VISION_PACKAGES

__all__ = ["BLIND_SPOT_BUGS", "BUG_CLASSES", "CONVERTER_TESTS", "FAMILY_ATTRIBUTES", "GGUF_READER_BUGS", "KIT_CHECKS", "KitRun", "MUTANTS", "Mutant",
           "NUMERIC_TESTS", "bf16_softmax_attend", "check_vision_mutant", "copy_family", "mutant_registry", "run_kit",
           "stated_attributes"]

#: The kit tests that can see a wrong number (the others check registration, loading, shapes).
NUMERIC_TESTS = ("test_parity_with_the_reference", "test_cached_decode_matches_the_reference",
                 "test_prefill_all_equals_prefill_then_decode", "test_reference_checkpoint_is_sensitive",
                 "test_bfloat16_parity_with_the_reference", "test_both_config_schemas_give_the_same_logits")
#: The kit's section 12: llama.cpp's converter writes the GGUF the family reads (lollm.testing.converter_checks).
CONVERTER_TESTS = ("test_converter_gguf_parity_with_the_reference", "test_converter_gguf_tokenizer_gives_the_checkpoints_ids")
#: What the mutation suite runs on the unchanged copy: the coverage check, the numeric tests, the converter's GGUF,
#: the vision check (:mod:`lollm.testing.vision_checks`; it skips for a family without vision, saying so).
KIT_CHECKS = ("test_checkpoint_covers_every_feature",) + NUMERIC_TESTS + CONVERTER_TESTS + VISION_TESTS
#: What it runs on each mutant: the two float32 parity tests, the bfloat16 one and the config-schema one
#: (coverage and sensitivity are the checkpoint's, proven once on the unchanged copy). Every mutant of
#: :data:`MUTANTS` but those of :data:`BLIND_SPOT_BUGS` and the vision bugs (:data:`VISION_TESTS` judge
#: those) fails the cached-decode one; ``--all-checks`` adds self-consistency, to see which checks catch what (docs/conformance-kit.md).
JUDGING_TESTS = ("test_parity_with_the_reference", "test_cached_decode_matches_the_reference",
                 "test_bfloat16_parity_with_the_reference", "test_both_config_schemas_give_the_same_logits")
#: The bug classes only the bfloat16 and config-schema tests can see (issue 38): every float32 test passes them.
BLIND_SPOT_BUGS = ("norm_cast_before_scale", "local_rope_from_rope_theta")
#: Bugs of a family's GGUF reader (issue 38): only the converter's GGUF (section 12) reads a file; each such
#: mutant runs those tests besides :data:`JUDGING_TESTS` (:attr:`Mutant.judged_by`), and every other test passes it.
GGUF_READER_BUGS = ("gguf_gate_up_swapped", "gguf_norm_shift_kept")
#: The checks the unchanged copy may skip, with the kit's reason (the suite's report shows it): the converter's
#: GGUF skips for qwen3_5 and qwen3_5_moe (no tokenizer the converter reads that a tiny checkpoint can carry).
#: The vision check skips for a family that declares no vision, or states a ``vision_waiver`` (:data:`FAMILY_ATTRIBUTES`).
MAY_SKIP = ("test_both_config_schemas_give_the_same_logits",) + CONVERTER_TESTS + VISION_TESTS
#: Class attributes the suite gives a family's kit run (what the family's own test class states, and why there);
#: the copies ``lollm new-family`` makes state them too (:func:`stated_attributes`).
#: No bf16_error_fraction today: qwen3_5 and qwen3_5_moe stated 1.0 until their DeltaNet's beta took its
#: sigmoid in the model dtype, as transformers does; since then every family rounds where transformers does.
#: The vision check (lollm.testing.vision_checks) runs for every vision family: none states a ``vision_waiver``.
FAMILY_ATTRIBUTES: dict[str, dict[str, object]] = {}


def stated_attributes(model_types: Iterable[str]) -> dict[str, object]:
    """:data:`FAMILY_ATTRIBUTES` of the installed first-party family serving any of ``model_types`` (transformers
    model types: a copy's ``REFERENCE_MODEL_TYPES`` values), {} for none: a copy rounds where its family rounds."""
    wanted = set(model_types)
    for entry in build_registry().families:
        if entry.family.name in FAMILY_ATTRIBUTES and wanted & set(entry.family.model_types):
            return dict(FAMILY_ATTRIBUTES[entry.family.name])
    return {}
ALL_JUDGING_TESTS = JUDGING_TESTS + ("test_prefill_all_equals_prefill_then_decode",)


def copy_family(package: str, folder: str | Path, name: str,
                edits: Mapping[str, Sequence[tuple[str, str]]] | None = None) -> str:
    """Copy the family package ``package`` (e.g. ``"lollm_gemma.gemma3"``) to ``folder/name``; return ``name``.

    Every mention of ``package`` in the copy's sources (its manifest's ``LOAD``
    target) becomes ``name``. ``edits``: file name inside the package -> pairs
    ``(old, new)``; each ``old`` must occur exactly once in that file (ValueError
    naming the file and the text otherwise), and is replaced by ``new``.
    """
    source = Path(importlib.import_module(package).__file__).parent
    target = Path(folder) / name
    if target.exists():
        raise ValueError(f"{target} exists already; give each copy its own name")
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for path in target.rglob("*.py"):
        path.write_text(path.read_text(encoding="utf-8").replace(package, name), encoding="utf-8")
    for filename, pairs in (edits or {}).items():
        path = target / filename
        if not path.is_file():
            raise ValueError(f"{package} has no file {filename!r} to edit")
        text = path.read_text(encoding="utf-8")
        for old, new in pairs:
            count = text.count(old)
            if count != 1:
                raise ValueError(f"{package}/{filename}: the text to replace occurs {count} times, not once: {old!r}")
            text = text.replace(old, new)
        path.write_text(text, encoding="utf-8")
    return name


def mutant_registry(package: str, family_name: str, copy: str, folder: str | Path) -> Registry:
    """A registry holding only the installed family ``family_name`` with its loader taken from the copy.

    The copy (made by :func:`copy_family` in ``folder``) is put on ``sys.path``;
    the Family record is the installed one with ``package`` replaced by ``copy``
    in its ``load`` target (and ``parity_reference`` and ``vision``, when the family has them
    inside ``package``: gemma4's tower, ``lollm_gemma.gemma4_vision_contract``, stays the installed
    one in a copy of ``lollm_gemma.gemma4``; a copy of ``lollm_gemma`` takes both).
    """
    folder = str(Path(folder))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    importlib.invalidate_caches()
    installed = next((f for f in build_registry().families if f.family.name == family_name), None)
    if installed is None:
        raise LookupError(f"no installed family is named {family_name!r}")
    family = installed.family

    def moved(target: str | None) -> str | None:  # "package.module:function" inside package -> the copy's
        inside = target is not None and target.startswith((f"{package}.", f"{package}:"))
        return copy + target[len(package):] if inside else target

    family = dataclasses.replace(family, load=moved(family.load), parity_reference=moved(family.parity_reference),
                                 vision=moved(family.vision))
    plugin = types.ModuleType(f"{copy}_plugin")

    @hookimpl
    def lollm_register_families(register):
        register(family)

    plugin.lollm_register_families = lollm_register_families
    return build_registry(entry_points=[], extra_plugins=[(f"{copy}_plugin", plugin)])


@dataclass
class KitRun:
    """The outcome of each kit test on one copy: name -> ("passed" | "failed" | "skipped", message)."""

    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def failed(self) -> dict[str, str]:
        """Failed kit tests -> their failure text (the assertion message, with pytest's report around it)."""
        return {k: text for k, (outcome, text) in self.outcomes.items() if outcome == "failed"}

    @property
    def passed(self) -> list[str]:
        return [k for k, (outcome, _) in self.outcomes.items() if outcome == "passed"]


class _Collector:
    def __init__(self) -> None:
        self.run = KitRun()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        name = report.nodeid.split("::")[-1]
        if report.failed:
            self.run.outcomes[name] = ("failed", report.longreprtext)
        elif report.skipped:  # pytest keeps a skip as (file, line, "Skipped: reason")
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longreprtext
            self.run.outcomes[name] = ("skipped", str(reason).removeprefix("Skipped: "))
        elif report.when == "call" and name not in self.run.outcomes:
            self.run.outcomes[name] = ("passed", "")


_TEST_FILE = '''
from pathlib import Path

import pytest

from lollm.testing.conformance import FamilyConformance
from lollm.testing.mutation import mutant_registry


class TestCopy(FamilyConformance):
    reference_available = True
{attributes}
    @pytest.fixture
    def registry(self):
        return mutant_registry({package!r}, {family_name!r}, {copy!r}, {folder!r})

    @pytest.fixture
    def family_name(self):
        return {family_name!r}

    @pytest.fixture
    def checkpoint_dir(self):
        return Path({checkpoint!r})
'''


def run_kit(package: str, copy: str, family_name: str, checkpoint_dir: str | Path, workdir: str | Path, *,
            tests: Sequence[str] = NUMERIC_TESTS, attributes: Mapping[str, object] | None = None) -> KitRun:
    """Run the kit's ``tests`` on the copy ``copy`` of the family package ``package``.

    ``copy`` must have been made by ``copy_family(package, workdir / "src", copy, ...)``. The
    kit runs with ``reference_available = True`` and the class ``attributes`` given
    (e.g. ``{"parity_max_abs_diff": 1e-3}``; each value is written into the test file with
    ``repr``, so plain literals only), on ``checkpoint_dir``, through a nested
    ``pytest.main`` in this process (temporary files under ``workdir``).
    """
    workdir = Path(workdir)
    folder = workdir / "src"
    attrs = "".join(f"    {k} = {v!r}\n" for k, v in (attributes or {}).items())
    test_file = workdir / f"test_kit_on_{copy}.py"
    test_file.write_text(_TEST_FILE.format(attributes=attrs, package=package, family_name=family_name, copy=copy,
                                           folder=str(folder), checkpoint=str(Path(checkpoint_dir))), encoding="utf-8")
    (workdir / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    sys.modules.pop(test_file.stem, None)  # an earlier run of the same copy name, on another checkpoint
    collector = _Collector()
    args = [str(test_file), "-q", "-p", "no:cacheprovider", "--import-mode=importlib", "--rootdir", str(workdir),
            "-c", str(workdir / "pytest.ini"), "--basetemp", str(workdir / "tmp"), "-k", " or ".join(tests),
            # these two plugins run gc.collect() twice per pytest.main: half the time of a mutant's run
            "-p", "no:unraisableexception", "-p", "no:threadexception"]
    code = pytest.main(args, plugins=[collector])
    missing = [t for t in tests if t not in collector.run.outcomes]
    if missing:
        raise RuntimeError(f"the kit run on {copy} (pytest exit code {int(code)}, test file {test_file}) did not "
                           f"report {missing}; outcomes: {collector.run.outcomes}")
    return collector.run


# ---------------------------------------------------------------------------------------------
# The catalogue: one subtle bug per class, for every first-party family where the class applies
# ---------------------------------------------------------------------------------------------

#: Each bug class the suite puts into a copy of a family, and what the bug is.
BUG_CLASSES = {
    "rope_base_x1.5": "the RoPE base times 1.5",
    "norm_eps_ignored": "the RMSNorm epsilon ignored (1e-6 hard-coded)",
    "k_bias_dropped": "the k projection's bias dropped",
    "rotate_half_signs": "rotate_half with its signs swapped: (x2, -x1) for (-x2, x1)",
    "bf16_softmax": "attention's softmax computed in bfloat16",
    "gqa_repeat": "GQA by repeat (tiling the K/V heads) instead of repeat_interleave",
    "final_norm_skipped_in_decode": "the final norm skipped in one-token decode steps only",
    "local_layers_on_global_rope": "sliding layers on the global layers' RoPE",
    "global_layers_on_local_rope": "global layers on the sliding layers' RoPE",
    "embedding_scale_omitted": "the embeddings not multiplied by sqrt(hidden_size)",
    "wrong_attention_scale": "the wrong attention scale (head_dim**-0.5 or none for the configured one)",
    "window_off_by_one_config": "the sliding window read one too small (cache and mask agree)",
    "window_off_by_one_mask": "the sliding window one too small in the mask only",
    "kv_drops_oldest_in_decode": "the KV cache drops its oldest position in decode steps after 32 tokens",
    "exact_gelu": "GeGLU with exact GELU instead of the tanh approximation",
    "norm_cast_before_scale": "Gemma's RMSNorm casting to the input dtype before multiplying by (1 + w)",
    "local_rope_from_rope_theta": "sliding layers reading 'rope_theta' for 'rope_local_base_freq' from a hub config.json",
    "gguf_gate_up_swapped": "the GGUF name map swapping ffn_gate and ffn_up (safetensors untouched)",
    "gguf_norm_shift_kept": "Gemma's GGUF norm shift (+1) undone for the layer norms only, not the QK and final norms",
    "patch_order_transposed": "the vision tower reads its patches column by column (the patch grid transposed)",
    "position_embedding_dropped": "the vision tower's position embedding not added to the patches",
    "merge_one_token_off": "the image embeddings merged one position late (the scatter shifted by one token)",
}


@dataclass(frozen=True)
class Mutant:
    """One bug in one family: ``edits`` maps a file of the family package to its (old, new) pairs
    (each old text must occur exactly once, :func:`copy_family`); ``judged_by``: kit tests the suite runs on
    this mutant besides its judging tests (the converter's GGUF for a bug of the GGUF reader); ``package``:
    the package copied and edited when not the family's own (a vision tower kept beside the family folder:
    the distribution's package, e.g. ``lollm_gemma``, whose files ``edits`` then names from there)."""

    bug: str
    edits: Mapping[str, Sequence[tuple[str, str]]]
    judged_by: tuple[str, ...] = ()
    package: str | None = None


def bf16_softmax_attend(q, k, v, *, start: int, ring: bool = False, window: int | None = None,
                        softcap: float | None = None, scale: float | None = None, layer: int | None = None):
    """A *wrong* attention for the ``bf16_softmax`` mutant: :func:`lollm.attention.eager_probs` with the
    softmax in bfloat16 (q, k, v (1, H|K, T|S, D) -> (1, H, T, D) in q's dtype)."""
    _, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    n_rep = H // K
    scores = torch.matmul(q.reshape(1, K, n_rep * T, D), k.transpose(2, 3)) * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(1, K, n_rep, T, S)
    mask = visible(start, T, S, ring=ring, window=window, device=q.device)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).to(torch.bfloat16), dim=-1)
    out = torch.matmul(probs.to(q.dtype).view(1, K, n_rep * T, S), v)
    return out.view(1, H, T, D)


def _attention_mutants(call: str, scale_edit: tuple[str, str, str]) -> dict[str, Mutant]:
    """bf16 softmax, GQA by repeat and the wrong scale, at the family's ``out = attend(...`` line ``call``."""
    indent = call[: len(call) - len(call.lstrip())]
    scale_file, old, new = scale_edit
    return {
        "bf16_softmax": Mutant("bf16_softmax", {"blocks.py": [(call, f"{indent}from lollm.testing.mutation import "
                                                                   f"bf16_softmax_attend as attend\n{call}")]}),
        "gqa_repeat": Mutant("gqa_repeat", {"blocks.py": [(call, f"{indent}k = k.repeat(1, q.shape[1] // k.shape[1], 1, 1)\n"
                                                                 f"{indent}v = v.repeat(1, q.shape[1] // v.shape[1], 1, 1)\n{call}")]}),
        "wrong_attention_scale": Mutant("wrong_attention_scale", {scale_file: [(old, new)]}),
    }


def _common(rope: list[tuple[str, str]], eps: str, modeling: str, kv_return: str, kv_file: str = "kv.py") -> dict[str, Mutant]:
    """The bug classes every family has: RoPE base, epsilon, rotate_half, final norm, KV cache."""
    kv_indent = kv_return[: len(kv_return) - len(kv_return.lstrip())]
    dropped = kv_return.replace(":end]", "first:end]")
    return {
        "rope_base_x1.5": Mutant("rope_base_x1.5", {"blocks.py": rope}),
        "norm_eps_ignored": Mutant("norm_eps_ignored", {"blocks.py": [(eps, eps.replace("self.eps = eps", "self.eps = 1e-6"))]}),
        "rotate_half_signs": Mutant("rotate_half_signs", {"blocks.py": [("return torch.cat((-x2, x1), dim=-1)",
                                                                          "return torch.cat((x2, -x1), dim=-1)")]}),
        "final_norm_skipped_in_decode": Mutant("final_norm_skipped_in_decode", {modeling: [(
            "x = self.model.norm(x)  # (1, T, C)", "x = x if input_ids.shape[1] == 1 else self.model.norm(x)  # (1, T, C)")]}),
        "kv_drops_oldest_in_decode": Mutant("kv_drops_oldest_in_decode", {kv_file: [(
            kv_return, f"{kv_indent}first = 1 if k.shape[2] == 1 and end > 32 else 0\n{dropped}")]}),
    }


def _qwen(name: str, k_line: str) -> dict[str, Mutant]:
    call = "        out = attend(q, k, v, start=start, layer=self.layer_idx)  # (1, H, T, D)"
    out = _common([("    base = rope.theta\n", "    base = 1.5 * rope.theta\n")], "        self.eps = eps",
                  f"modeling_{name}.py", "        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]")
    out.update(_attention_mutants(call, ("blocks.py", call, call.replace("layer=self.layer_idx)", "scale=1.0, layer=self.layer_idx)"))))
    if k_line:
        out["k_bias_dropped"] = Mutant("k_bias_dropped", {"blocks.py": [(k_line, k_line.replace("self.k_proj(x)", "F.linear(x, self.k_proj.weight)"))]})
    if name == "qwen2":  # a swapped key of the GGUF name map: the safetensors path never reads it
        gate, up = ('    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",',
                    '    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",')
        out["gguf_gate_up_swapped"] = Mutant("gguf_gate_up_swapped", {"weights.py": [(
            f"{gate}\n{up}", f"{gate.replace('ffn_gate', 'ffn_up')}\n{up.replace('ffn_up', 'ffn_gate')}")]}, CONVERTER_TESTS[:1])
    return out


def _qwen3_5(name: str) -> dict[str, Mutant]:
    call = "        out = attend(q, k, v, start=start, layer=self.layer)  # (1, H, T, D)"
    out = _common([("    return 1.0 / (theta**exponents)", "    return 1.0 / ((1.5 * theta)**exponents)")],
                  "        self.weight = nn.Parameter(torch.zeros(dim))\n        self.eps = eps",
                  f"modeling_{name}.py", "        return self.k[slot, :, :, :end], self.v[slot, :, :, :end]")
    out.update(_attention_mutants(call, ("blocks.py", call, call.replace("layer=self.layer)", "scale=1.0, layer=self.layer)"))))
    return out


def _gemma(name: str, call: str, scale: tuple[str, str, str], rope: list[tuple[str, str]], windows: str,
           local_global: bool) -> dict[str, Mutant]:
    out = _common(rope, "        self.eps = eps", f"modeling_{name}.py", "        return self.k[:, :, :end], self.v[:, :, :end]")
    out.update(_attention_mutants(call, scale))
    read = 'sliding_window=read.positive_int("sliding_window", at_most=MAX_CONTEXT),'
    gelu = 'return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))'
    out.update({
        "embedding_scale_omitted": Mutant("embedding_scale_omitted", {f"modeling_{name}.py": [(
            "x = self.model.embed_tokens(input_ids) * self.embed_scale  # (1, T, C)", "x = self.model.embed_tokens(input_ids)  # (1, T, C)")]}),
        "window_off_by_one_config": Mutant("window_off_by_one_config", {"config.py": [(read, read.replace("),", ") - 1,"))]}),
        "window_off_by_one_mask": Mutant("window_off_by_one_mask", {f"modeling_{name}.py": [(
            windows, windows.replace("sliding_window if", "sliding_window - 1 if"))]}),
        "exact_gelu": Mutant("exact_gelu", {"blocks.py": [(gelu, gelu.replace(', approximate="tanh"', ""))]}),
    })
    norm = "        return (x * (1.0 + self.weight.float())).to(dtype)"
    if name != "gemma4":  # Gemma 4's norm scales by w, not 1 + w
        out["norm_cast_before_scale"] = Mutant("norm_cast_before_scale", {"blocks.py": [(
            norm, "        return x.to(dtype) * (1.0 + self.weight)")]})
    if name == "gemma3":  # a missed transform of the GGUF reader: q_norm, k_norm and the final norm keep the +1
        shift = 'return tensor - GGUF_NORM_SHIFT if model_name.endswith("norm.weight") else tensor'
        out["gguf_norm_shift_kept"] = Mutant("gguf_norm_shift_kept", {"weights.py": [(
            shift, shift.replace('"norm.weight"', '"layernorm.weight"'))]}, CONVERTER_TESTS[:1])
    if name == "gemma3":  # the family that reads both spellings of two RoPE bases
        local = 'local_base = read.rope_theta("rope_local_base_freq")'
        out["local_rope_from_rope_theta"] = Mutant("local_rope_from_rope_theta", {"config.py": [(
            local, 'local_base = read.rope_theta("rope_theta")')]})
    if local_global:
        pick = "return self.rope_local if layer_type == SLIDING else self.rope_global"
        out["local_layers_on_global_rope"] = Mutant("local_layers_on_global_rope", {"config.py": [(pick, "return self.rope_global")]})
        out["global_layers_on_local_rope"] = Mutant("global_layers_on_local_rope", {"config.py": [(pick, "return self.rope_local")]})
    return out


_GEMMA_ROPE = [("inv_freq = 1.0 / (rope.theta**exponents)", "inv_freq = 1.0 / ((1.5 * rope.theta)**exponents)")]
_GEMMA_SCALE = ("blocks.py", "self.scale = config.query_pre_attn_scalar**-0.5", "self.scale = config.head_dim**-0.5")

#: family name -> (its package, {mutant name: Mutant}). Every mutant must fail the kit; the
#: unchanged copy must pass it (:func:`run_suite`, ``python -m lollm.testing.mutation``).
MUTANTS: dict[str, tuple[str, dict[str, Mutant]]] = {
    "qwen2": ("lollm_qwen.qwen2", _qwen("qwen2", "        k = self.k_proj(x).view(1, T, K, D).transpose(1, 2)  # (1, K, T, D)")),
    "qwen3": ("lollm_qwen.qwen3", _qwen("qwen3", "")),
    "gemma2": ("lollm_gemma.gemma2", _gemma(
        "gemma2", "        out = attend(q, k, v, start=start, ring=ring, window=window, softcap=self.softcap,",
        _GEMMA_SCALE, _GEMMA_ROPE,
        "windows = {t: self.config.sliding_window if t == SLIDING else None for t in set(self.config.layer_types)}", False)),
    "gemma3": ("lollm_gemma.gemma3", _gemma(
        "gemma3", "        out = attend(q, k, v, start=start, ring=ring, window=window, scale=self.scale,",
        _GEMMA_SCALE, _GEMMA_ROPE,
        "windows = {t: self.config.sliding_window if t == SLIDING else None for t in set(self.config.layer_types)}", True)),
    "gemma4": ("lollm_gemma.gemma4", _gemma(
        "gemma4", "        out = attend(q, k, v, start=start, ring=ring, window=window, scale=1.0, layer=self.layer_idx)",
        ("blocks.py", "window=window, scale=1.0, layer=self.layer_idx)", "window=window, scale=None, layer=self.layer_idx)"),
        [("torch.cat((1.0 / (rope.theta**exponents),", "torch.cat((1.0 / ((1.5 * rope.theta)**exponents),"),
         ("    inv_freq = 1.0 / (rope.theta**exponents)", "    inv_freq = 1.0 / ((1.5 * rope.theta)**exponents)")],
        "windows = {t: c.sliding_window if t == SLIDING else None for t in rope}", True)),
    "qwen3_5": ("lollm_qwen3_5.qwen3_5", _qwen3_5("qwen3_5")),
    "qwen3_5_moe": ("lollm_qwen3_5.qwen3_5_moe", _qwen3_5("qwen3_5_moe")),
}
# the vision check's three, in each vision family's own source (lollm.testing.vision_mutants)
for _family, _bugs in VISION_EDITS.items():
    MUTANTS[_family][1].update({bug: Mutant(bug, edits, VISION_TESTS, VISION_PACKAGES.get(_family))
                                for bug, edits in _bugs.items()})


def check_vision_mutant(family: str, bug: str | None, workdir: str | Path) -> None:
    """The kit's vision check on a copy of ``family`` with the vision mutant ``bug`` (None: the unchanged copy, which
    must pass); AssertionError unless exactly the tests of :data:`~lollm.testing.vision_mutants.FAILS` fail, with their
    messages. The check writes its own checkpoint (``FIRST_PARTY_VISION``) under ``workdir``."""
    package, mutants = MUTANTS[family]
    mutant = mutants[bug] if bug else Mutant("", {})
    copied = mutant.package or package
    run = run_kit(copied, copy_family(copied, Path(workdir) / "src", f"vision_{family}_{bug}", mutant.edits), family,
                  workdir, workdir, tests=VISION_TESTS)
    must_fail = VISION_FAILS.get(bug, {})
    assert sorted(run.failed) == sorted(must_fail), f"{family} {bug}: outcomes {run.outcomes}"
    assert sorted(run.passed) == sorted(set(VISION_TESTS) - set(must_fail)), f"{family} {bug}: outcomes {run.outcomes}"
    for name, needle in must_fail.items():
        assert needle in run.failed[name], f"{family} {bug}: {name} failed without the kit's message: {run.failed[name][-2000:]}"


@dataclass
class SuiteResult:
    """The mutation suite on one family: the checkpoint's noise floor, the unchanged copy's run,
    and for each mutant the kit tests that failed it (none: the mutant survived)."""

    family: str
    hub_config: str
    noise: NoiseFloor
    clean: KitRun
    caught: dict[str, list[str]] = field(default_factory=dict)
    moved: dict[str, float] = field(default_factory=dict)
    bf16_ratio: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def survivors(self) -> list[str]:
        return [name for name, failed in self.caught.items() if not failed]

    @property
    def ok(self) -> bool:
        """The unchanged copy passes every check of :data:`KIT_CHECKS` (the config-schema one may skip, saying
        why: a model type with no older schema), and no mutant survives."""
        ran = set(self.clean.passed) | {t for t in MAY_SKIP if self.clean.outcomes.get(t, ("",))[0] == "skipped"}
        return not self.clean.failed and ran == set(KIT_CHECKS) and not self.survivors


def kit_checkpoint(family_name: str, folder: str | Path) -> tuple[str, Path]:
    """The tiny checkpoint the suite judges ``family_name`` on: the hub config ``lollm new-family``'s
    tests take for it (:func:`lollm.cli.new_family.find_hub_config`), shrunk by
    :func:`lollm.testing.tiny.kit_config`, spread-init weights. Returns (hub config name, folder)."""
    installed = next((f for f in build_registry().families if f.family.name == family_name), None)
    if installed is None:
        raise LookupError(f"no installed family is named {family_name!r}")
    hub = find_hub_config(installed.family.model_types)
    return hub, write_tiny_checkpoint(kit_config(hub_config(hub)), Path(folder), init_std=SENSITIVE_INIT_STD)


def run_suite(family_name: str, workdir: str | Path, only: Sequence[str] = (), *,
              tests: Sequence[str] = JUDGING_TESTS) -> SuiteResult:
    """Every mutant of ``family_name`` (:data:`MUTANTS`, or those named in ``only``) through the kit, in this process.

    The unchanged copy runs :data:`KIT_CHECKS` (coverage, parity, cached decode, self-consistency,
    sensitivity); each mutant runs ``tests`` (:data:`JUDGING_TESTS`) and is caught when one of them fails.
    """
    start = time.perf_counter()
    package, mutants = MUTANTS[family_name]
    workdir = Path(workdir)
    hub, checkpoint = kit_checkpoint(family_name, workdir / "checkpoint")
    loaded = load_checkpoint(checkpoint)
    ids = torch.randint(0, int(loaded.config.get("vocab_size", 512)), (1, SEQUENCE_LENGTH),
                        generator=torch.Generator().manual_seed(1234))
    noise = measure_noise_floor(default_reference, loaded, ids)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        clean = run_kit(package, copy_family(package, workdir / "src", f"copy_{family_name}_clean"), family_name,
                        checkpoint, workdir, tests=KIT_CHECKS, attributes=FAMILY_ATTRIBUTES.get(family_name))
    if clean.failed:
        print(printed.getvalue())  # why the unchanged copy fails: pytest's report
    result = SuiteResult(family_name, hub, noise, clean)
    for name, mutant in mutants.items():
        if only and name not in only:
            continue
        copied = mutant.package or package
        copy = copy_family(copied, workdir / "src", f"mutant_{family_name}_{name.replace('.', '_')}", mutant.edits)
        with contextlib.redirect_stdout(io.StringIO()):  # pytest's report of each expected failure: the table says it
            run = run_kit(copied, copy, family_name, checkpoint, workdir, tests=tuple(tests) + mutant.judged_by,
                          attributes=FAMILY_ATTRIBUTES.get(family_name))
        result.caught[name] = sorted(run.failed)
        found = [float(m) for test, text in run.failed.items() if test not in _OTHER_UNITS for m in _DELTA.findall(text)]
        if found:
            result.moved[name] = max(found)
        ratio = _BF16_RATIO.search(run.failed.get("test_bfloat16_parity_with_the_reference", ""))
        if ratio:
            result.bf16_ratio[name] = float(ratio.group(1))
    result.seconds = time.perf_counter() - start
    return result


#: The tests whose |Δ| is not in units of the float32 bound: bfloat16 logits, and a bit-for-bit comparison.
_OTHER_UNITS = ("test_bfloat16_parity_with_the_reference", "test_both_config_schemas_give_the_same_logits")
#: The bfloat16 test's mean |Δ|, in multiples of the reference's own bfloat16 error ("(1.27 x that here)").
_BF16_RATIO = re.compile(r"\(([0-9.]+) x that here\)")
#: The worst |Δ| a kit failure message reports (parity: "max |Δ| 1.2e-03"; self-consistency: "max |Δ| of the logits ...").
_DELTA = re.compile(r"max \|Δ\|(?: of the logits)? ([0-9.]+e[+-]\d+)")

#: Short names of the kit tests, for the suite's table.
SHORT = {"test_parity_with_the_reference": "parity", "test_cached_decode_matches_the_reference": "cached",
         "test_prefill_all_equals_prefill_then_decode": "self-consistency",
         "test_bfloat16_parity_with_the_reference": "bfloat16", "test_both_config_schemas_give_the_same_logits": "schemas",
         "test_converter_gguf_parity_with_the_reference": "converter GGUF",
         "test_converter_gguf_tokenizer_gives_the_checkpoints_ids": "converter tokenizer"}


def report(result: SuiteResult) -> str:
    """The suite's lines for one family: noise floor and bound, the clean copy, each mutant and what caught it."""
    n = result.noise
    lines = [f"{result.family} ({result.hub_config}, kit_config): noise floor {n.noise:.2e} (float64 {n.float64:.2e}, "
             f"batch {n.batch:.2e}), parity bound {n.bound:.2e}; {len(result.caught)} mutants, {result.seconds:.0f} s",
             f"  unchanged copy: " + ("passes " + ", ".join(sorted(result.clean.passed)) if not result.clean.failed
                                      else "FAILS " + ", ".join(sorted(result.clean.failed)))]
    for test in MAY_SKIP:
        outcome, text = result.clean.outcomes.get(test, ("", ""))
        if outcome == "skipped":
            lines.append(f"  unchanged copy skips {SHORT.get(test, test)}: {text}")
    for name, failed in result.caught.items():
        caught = ", ".join(SHORT.get(t, t) for t in failed) if failed else "SURVIVED (the kit passed it)"
        moved = f"  (max |Δ| {result.moved[name]:.1e}, {result.moved[name] / n.bound:.0f} x the bound)" if name in result.moved else ""
        if name in result.bf16_ratio:
            moved += f"  (bfloat16 mean |Δ| {result.bf16_ratio[name]:.2f} x the reference's bfloat16 error)"
        lines.append(f"  {name:<30} {caught}{moved}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lollm.testing.mutation [FAMILY ...] [--workdir DIR]``: run the suite, print the
    tables, exit 1 when the unchanged copy fails or a mutant survives (every family of
    :data:`MUTANTS` by default)."""
    parser = argparse.ArgumentParser(prog="python -m lollm.testing.mutation", description=main.__doc__)
    parser.add_argument("families", nargs="*", default=sorted(MUTANTS), help=f"of {', '.join(sorted(MUTANTS))}")
    parser.add_argument("--workdir", help="where the copies and checkpoints go (default: a temporary folder)")
    parser.add_argument("--only", nargs="+", default=(), metavar="BUG", help="run only these mutants (bug class names)")
    parser.add_argument("--all-checks", action="store_true",
                        help="also run the self-consistency test on each mutant (slower; shows every check that catches it)")
    args = parser.parse_args(argv)
    unknown = [f for f in args.families if f not in MUTANTS]
    if unknown:
        parser.error(f"no mutants for {unknown}; known: {', '.join(sorted(MUTANTS))}")
    start, ok = time.perf_counter(), True
    with tempfile.TemporaryDirectory(prefix="lollm-mutation-") as tmp:
        for family in args.families:
            result = run_suite(family, Path(args.workdir or tmp) / family, args.only,
                               tests=ALL_JUDGING_TESTS if args.all_checks else JUDGING_TESTS)
            print(report(result), flush=True)
            ok = ok and result.ok
    print(f"mutation suite: {', '.join(args.families)}: {'every mutant fails the kit, the unchanged copies pass' if ok else 'FAILED'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
