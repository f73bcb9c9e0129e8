"""The conformance kit: the tests every lollm family must pass, for plugin authors to inherit.

A plugin author subclasses :class:`FamilyConformance` in their own test suite
and gives two fixtures; every test below then runs against their family::

    import pytest
    from lollm.testing.conformance import FamilyConformance

    class TestMyFamily(FamilyConformance):
        reference_available = True  # transformers knows this architecture: run the parity test

        @pytest.fixture
        def family_name(self):
            return "mine"

        @pytest.fixture
        def checkpoint_dir(self, tmp_path):
            return write_my_tiny_checkpoint(tmp_path)  # config.json + model.safetensors

What the inherited tests prove (each one is a method below, read them):

0. the tiny checkpoint and the prompts can see every feature the family has (each layer kind,
   every window crossed twice, decode past position 64 and past a delta-rule chunk, soft-caps
   and scalars away from neutral: :mod:`lollm.testing.coverage`), or the kit fails the
   checkpoint, naming the blind spot and its fix;
1. the family is registered under its name and serves the checkpoint's ``model_type``;
2. the plugin module it came from imports no torch (``lollm families`` stays light);
3. ``load`` builds a model meeting :mod:`lollm.model`'s protocol: attributes, ``new_cache``,
   forward shapes, ``logits_to_keep``, ``num_layers + 1`` hidden states;
4. prefill-all equals prefill-then-decode (one token or a chunk at a time, and with a sliding
   window W, prefills and chunks that end before, on and after its edge), cosine and max |Δ|
   bounded at every position;
5. the cache is preallocated: decoding never replaces its tensors;
6. a missing and an unexpected tensor raise :class:`~lollm.errors.WeightsError` naming it;
7. the shared generate loop drives the model, and greedy generation follows the logits;
   with a prompt cache (:mod:`lollm.generate.prompt_cache`), every turn of a conversation equals a
   cold run of the same prompt (:func:`check_prompt_cache_turns`, also usable alone);
8. with ``reference_available = True``: the same argmax at every position as
   transformers' ``AutoModelForCausalLM`` (or the family's own ``parity_reference``),
   cosine >= :attr:`FamilyConformance.parity_min_cosine` and max |Δ| <= a bound set from the
   reference's own float32 noise on the checkpoint (:func:`measure_noise_floor`), at fp32,
   after a prefill and through the cache (prefill then decode); and the checkpoint is
   *sensitive*: perturbing the reference's RoPE base, RoPE scaling, norm epsilon, attention
   scale or sliding window moves its logits far past that bound (:func:`reference_sensitivity`), or the kit fails the checkpoint;
9. with ``gguf_types`` set: the checkpoint written as a GGUF the converter's way
   (:mod:`lollm.testing.gguf_writer`, F32/F16/Q8_0/Q4_0) loads through the family and
   matches the reference run on the weights the file holds;
10. with ``reference_available = True``: ours at bfloat16 against transformers at bfloat16, within
   bounds from the reference's own bfloat16 noise (:func:`measure_bf16_noise`);
11. with ``reference_available = True``: config.json respelled in the hub's older schema
   (``rope_theta``, ``rope_local_base_freq``, ``sliding_window_pattern``: :mod:`lollm.testing.schemas`)
   gives the same logits, bit for bit, once transformers proves the two spellings one model (else
   the test skips, saying why: nothing to respell, a model type that never had the older schema);
12. with ``reference_available = True`` and a GGUF architecture declared: llama.cpp's own
   ``convert_hf_to_gguf.py`` converts the checkpoint (bfloat16-rounded, with a SentencePiece
   tokenizer the kit trains to its vocabulary, or the real byte-level BPE the fixture
   ``converter_tokenizer_dir`` gives) at each of ``converter_outtypes``; each file
   loads through the family and matches the reference on the weights it holds, prefill and
   cached decode, within the float32 parity bounds; the tokenizer the converter wrote gives the
   kit tokenizer's ids on lollm's held-in corpus (:mod:`lollm.testing.converter_checks`; a
   copied family's file is converted under the reference's model type and relabelled to
   ``converter_architecture``).
13. for a family that declares vision (``Capabilities.vision``): on a tiny random
   ``*ForConditionalGeneration`` checkpoint with spread weights, for 1 and 2 drawn images of
   different sizes, the tower's features equal transformers' ``get_image_features`` and the logits
   at every position equal transformers' (same argmax, cosine >= ``vision_min_cosine``)
   (:mod:`lollm.testing.vision_checks`; the family gives a ``vision_setup`` or a ``vision_waiver``).

Where each check lives: this module holds :class:`FamilyConformance`, its fixtures and
sections 0 to 2; it inherits sections 3 to 6 from :mod:`lollm.testing.model_checks`, section 7
and the engine tests from :mod:`lollm.testing.generation_checks` (with the checks a family's own
tests call alone: :func:`check_speculation_is_exact`, :func:`check_chunked_prefill_is_exact`,
:func:`check_prompt_cache_turns`), sections 8 to 11 from :mod:`lollm.testing.parity_checks`, section 12 from
:mod:`lollm.testing.converter_checks`, section 13 from :mod:`lollm.testing.vision_checks`; the
parity bound and the sensitivity come from :mod:`lollm.testing.reference`, the prompt's length and
chunk schedules from :mod:`lollm.testing.schedules`.

Why these checks and bounds, and the mutants that prove the kit fails a wrong family:
docs/conformance-kit.md (:mod:`lollm.testing.mutation` makes those mutants).

The family must be installed (its entry point visible) for the tests to find
it; while developing, override the ``registry`` fixture with
``build_registry(entry_points=[], extra_plugins=[("mine", my_plugin_module)])``.

Everything runs on the CPU at float32, but section 10 (bfloat16). pytest is needed (``lollm-core[test]``),
transformers only for the parity test (``lollm-core[parity]``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch

from lollm.hookspecs import ENTRY_POINT_GROUP
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.plugins import build_registry
from lollm.load.registry import InstalledFamily, Registry
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.model import CausalLM
from lollm.testing.converter_checks import ConverterChecks
from lollm.testing.coverage import check_coverage
from lollm.testing.generation_checks import (GenerationChecks, check_chunked_prefill_is_exact, check_prompt_cache_turns,
                                             check_speculation_is_exact, prefill_chunk_sizes, refused_imports,
                                             repeating_prompt)
from lollm.testing.model_checks import TIE_CANDIDATES, UNEXPECTED_TENSOR, ModelChecks
from lollm.testing.parity_checks import REFERENCE_TESTS, ParityChecks
from lollm.testing.reference import (BF16_ERROR_FRACTION, BOUND_FLOOR, NOISE_FACTOR, SENSITIVITY_CHECKS,
                                     SENSITIVITY_CHECKS_HELP, NoiseFloor, cached_reference, measure_noise_floor,
                                     reference_sensitivity, with_layer_types)
from lollm.testing.schedules import MAX_WINDOWED_PROMPT, SEQUENCE_LENGTH, chunk_schedules, sliding_window_of
from lollm.testing.vision_checks import VisionChecks

# The checks live in the modules above, by what they check; every name families and their tests
# import stays importable from here (``from lollm.testing.conformance import check_speculation_is_exact``).
__all__ = ["BF16_ERROR_FRACTION", "BOUND_FLOOR", "FamilyConformance", "NOISE_FACTOR", "NoiseFloor", "REFERENCE_TESTS",
           "SENSITIVITY_CHECKS", "SENSITIVITY_CHECKS_HELP", "SEQUENCE_LENGTH", "TIE_CANDIDATES", "UNEXPECTED_TENSOR", "cached_reference",
           "check_chunked_prefill_is_exact", "check_prompt_cache_turns", "check_speculation_is_exact",
           "measure_noise_floor", "prefill_chunk_sizes", "reference_sensitivity", "refused_imports", "repeating_prompt"]


class FamilyConformance(ModelChecks, GenerationChecks, ParityChecks, ConverterChecks, VisionChecks):
    """Inherit from this in a ``Test…`` class and provide the fixtures ``family_name`` and ``checkpoint_dir``.

    Class attributes to adjust:

    reference_available:     run the parity tests against transformers (it must know the architecture).
    sequence_length:         positions in the test prompt at least (kept below the model's context);
                             with a sliding window W, at least 3 W + 2 (see ``prompt_ids``).
    self_consistency_min_cosine: prefill-all versus prefill-then-decode, per position.
    self_consistency_max_abs_diff: the same, the largest |Δ| of a logit allowed at any position.
    parity_min_cosine:       ours versus the reference at fp32, per position.
    parity_max_abs_diff:     ours versus the reference at fp32: the largest |Δ| of a logit allowed at
                             any position, after a prefill and after a cached decode. None (the
                             default): set per checkpoint from the reference's own float32 noise,
                             ``max(parity_noise_factor * noise, parity_bound_floor)``
                             (:func:`measure_noise_floor`); a number: that fixed bound.
    parity_noise_factor, parity_bound_floor: see ``parity_max_abs_diff`` (5 and 1e-5).
    sensitivity_margin:      each perturbation of :data:`SENSITIVITY_CHECKS` must move the reference's
                             logits by more than ``sensitivity_margin`` times the parity bound.
    coverage_waivers:        feature name -> why this checkpoint cannot show it (the coverage test,
                             :mod:`lollm.testing.coverage`, then lets it pass; the reason is the
                             record of what the kit does not see).
    sensitivity_checks:      which perturbations the sensitivity test applies (those that apply to
                             the checkpoint: a config without RoPE scaling has no "rope_scaling").
    bf16_error_fraction:     the bfloat16 test's bound on the mean |Δ| of a logit, as a fraction of the
                             reference's own bfloat16 error (:data:`BF16_ERROR_FRACTION`, 0.25; unless
                             5 x its bfloat16 noise is larger); None turns the test off. A family that
                             rounds elsewhere than transformers on purpose states its own, saying why.
    gguf_types:              the GGUF mode: ggml types (of ``lollm.testing.gguf_writer.GGUF_TYPES``) in which
                             the checkpoint is written as a GGUF the converter's way, loaded through
                             the family and compared with the reference on the same (dequantized)
                             weights, with the parity bounds; () (the default): no GGUF mode.
    converter_outtypes:      llama.cpp's converter (section 12): the ``--outtype`` values (of
                             ``lollm.testing.converter.OUTTYPES``: f32, f16, bf16, q8_0) at which
                             ``convert_hf_to_gguf.py`` converts the checkpoint for the family to read.
                             None (the default): all four when the family declares a GGUF architecture
                             (``Family.gguf_architectures``), else none (the tests skip, saying so); a
                             tuple: those; () turns the check off (say why beside it).
    converter_architecture:  the GGUF architecture the converter's file is relabelled to before the
                             family reads it (``general.architecture`` and every ``<arch>.`` key), for a
                             family whose architecture llama.cpp does not know (one made by ``lollm
                             new-family`` states its own name); the checkpoint is then converted with
                             its model types respelled by ``reference_model_types``. None (the default):
                             the file as the converter wrote it.
    reference_model_types:   for model types transformers does not know (a family copied by
                             ``lollm new-family``), the transformers model type whose class stands
                             for each; the sensitivity test perturbs that class.
    tensor_to_drop:          the tensor the "missing tensor" test removes (default: the first
                             one, in sorted order, that is not an embedding or an lm_head).
    batch_invariance_weights, batch_invariance_bound: batch invariance (docs/batching.md): with
                             ``"int8"`` weights (every matmul the family packs runs in lollm's native
                             kernel) and a bound of 0.0, every logit of a request must be equal, bit for
                             bit, alone and batched. A family whose forward keeps float matmuls over the
                             step's rows (torch's float32 GEMM rounds a row differently beside other rows)
                             runs the check on ``"float"`` weights, where int8 activations cannot magnify
                             that rounding, within the largest |Δ logit| it allows. None (the defaults):
                             int8 and 0.0 where an int8 load leaves no ``nn.Linear`` and no 3-D weight
                             (:func:`lollm.testing.generation_checks.float_matmuls`), else float weights
                             within ``self_consistency_max_abs_diff``. Set them to state your own.
    """

    reference_available: bool = False
    sequence_length: int = SEQUENCE_LENGTH
    self_consistency_min_cosine: float = 0.9999
    self_consistency_max_abs_diff: float = 1e-3
    parity_min_cosine: float = 0.99999
    parity_max_abs_diff: float | None = None
    parity_noise_factor: float = NOISE_FACTOR
    parity_bound_floor: float = BOUND_FLOOR
    coverage_waivers: dict[str, str] = {}
    sensitivity_margin: float = 10.0
    sensitivity_checks: tuple[str, ...] = SENSITIVITY_CHECKS
    bf16_error_fraction: float | None = BF16_ERROR_FRACTION
    gguf_types: tuple[str, ...] = ()
    converter_outtypes: tuple[str, ...] | None = None
    converter_architecture: str | None = None
    reference_model_types: dict[str, str] = {}
    tensor_to_drop: str | None = None
    batch_invariance_weights: str | None = None
    batch_invariance_bound: float | None = None

    # -- fixtures the plugin author provides ---------------------------------------

    @pytest.fixture
    def family_name(self) -> str:
        pytest.fail("FamilyConformance: define the fixture `family_name` (the Family.name to test) in your subclass",
                    pytrace=False)

    @pytest.fixture
    def checkpoint_dir(self) -> Path:
        pytest.fail("FamilyConformance: define the fixture `checkpoint_dir` (a tiny checkpoint folder with "
                    "config.json and model.safetensors) in your subclass", pytrace=False)

    # -- fixtures the kit builds from them (override if you must) -------------------

    @pytest.fixture
    def registry(self) -> Registry:
        """The installed plugins, read afresh (not the process-wide cache)."""
        return build_registry()

    @pytest.fixture
    def checkpoint(self, checkpoint_dir) -> Checkpoint:
        return load_checkpoint(Path(checkpoint_dir))

    @pytest.fixture
    def installed(self, registry: Registry, family_name: str) -> InstalledFamily:
        for entry in registry.families:
            if entry.family.name == family_name:
                return entry
        broken = "; ".join(f"{b.plugin} ({b.distribution}): {b.error}" for b in registry.broken) or "none"
        names = ", ".join(f.family.name for f in registry.families) or "none"
        pytest.fail(f"no installed family is named {family_name!r} (installed: {names}; broken plugins: {broken}). "
                    f"Is your distribution installed, with an entry point in the group {ENTRY_POINT_GROUP!r}?",
                    pytrace=False)

    @pytest.fixture
    def load(self, installed: InstalledFamily) -> Callable[[Checkpoint], CausalLM]:
        """``load(checkpoint)`` with the family's loader, on the CPU at float32 (plugin contract 2)."""
        loader = installed.family.resolve("load")
        options = LoadOptions(device="cpu", dtype="float32", attn="sdpa", weights="float", quantization=Quantization("float"))

        def load(checkpoint: Checkpoint) -> CausalLM:
            return loader(checkpoint, options)

        return load

    @pytest.fixture
    def model(self, load: Callable[[Checkpoint], CausalLM], checkpoint: Checkpoint) -> CausalLM:
        return load(checkpoint)

    @pytest.fixture
    def sliding_window(self, checkpoint: Checkpoint) -> int | None:
        """The checkpoint's sliding window W (positions a sliding-window query sees), or None.

        Read from config.json (``sliding_window``, or ``text_config.sliding_window``), unless
        ``use_sliding_window`` is false. Override it when your family spells it otherwise.
        """
        return sliding_window_of(checkpoint.config)

    @pytest.fixture
    def prompt_ids(self, model, sliding_window) -> torch.Tensor:
        """(1, T) deterministic random ids inside the vocabulary.

        T = ``sequence_length`` (72: decode steps past position 64, a prefill past a delta-rule
        chunk), or 3 W + 2 with a sliding window W when that is longer (so that prompts and chunks
        cross the window more than once), at most ``model.max_context - 4`` (room for the cache tests'
        decode steps after it).
        """
        wanted = self.sequence_length
        if sliding_window is not None and 3 * sliding_window + 2 <= MAX_WINDOWED_PROMPT:
            wanted = max(wanted, 3 * sliding_window + 2)
        T = max(2, min(wanted, int(model.max_context) - 4))
        g = torch.Generator().manual_seed(1234)
        return torch.randint(0, int(model.vocab_size), (1, T), generator=g)

    @pytest.fixture
    def parity_bound(self, installed, checkpoint, prompt_ids) -> float:
        """The largest |Δ| of a logit the parity tests allow: ``parity_max_abs_diff`` when set,
        else measured on this checkpoint and prompt (:func:`measure_noise_floor`)."""
        if not self.reference_available:  # the tests that ask for it skip, saying the same
            pytest.skip("reference_available = False: no transformers reference for this family")
        if self.parity_max_abs_diff is not None:
            return float(self.parity_max_abs_diff)
        floor = measure_noise_floor(self._reference_builder(installed), checkpoint, prompt_ids,
                                    model_types=self.reference_model_types, factor=self.parity_noise_factor,
                                    floor=self.parity_bound_floor)
        return floor.bound

    # -- 0. coverage: the checkpoint and the prompts can see every feature --------------

    def test_checkpoint_covers_every_feature(self, checkpoint, prompt_ids, sliding_window):
        """From config.json and the prompt schedule: every layer kind present, every window crossed
        twice, decode past position 64 and past a delta-rule chunk, soft-caps and scalars away from
        their neutral values (:func:`lollm.testing.coverage.check_coverage`). A blind spot fails,
        naming the feature and the config change that fixes it (or ``coverage_waivers`` records why not).
        The report is printed too: ``pytest -rP`` shows it when the test passes."""
        T = prompt_ids.shape[1]
        schedules = chunk_schedules(T, sliding_window)
        longest = max(s[0] for s in schedules if len(s) > 1 and s[1] == 1)
        report = check_coverage(with_layer_types(checkpoint.config, self.reference_model_types),
                                prompt_length=T, longest_prefill=longest)
        print(f"coverage report ({T}-position prompt, longest prefill before decode {longest}):\n{report.table()}")
        blind = report.blind(self.coverage_waivers)
        assert not blind, (
            "the tiny checkpoint or the prompts cannot see: "
            + "; ".join(f"{f.name} ({f.detail}) -- fix: {f.fix}" for f in blind)
            + ". A family with a bug there would pass the kit. Coverage report:\n" + report.table()
        )

    # -- 1. registration ------------------------------------------------------------

    def test_family_is_registered_and_serves_the_checkpoint(self, registry, installed, checkpoint, family_name):
        assert family_name == installed.family.name
        assert checkpoint.model_type in installed.family.model_types, (
            f"the checkpoint's model_type {checkpoint.model_type!r} is not among the family's "
            f"model_types {installed.family.model_types}"
        )
        routed = registry.route(checkpoint.model_type)  # raises on an unknown or doubly claimed type
        assert routed.family.name == family_name, f"{checkpoint.model_type!r} routes to {routed.family.name!r}"
        assert not [b for b in registry.broken if b.plugin == installed.plugin], registry.broken

    # -- 2. the plugin module is light ----------------------------------------------------

    def test_plugin_module_imports_no_torch(self, installed, family_name):
        eps = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == installed.plugin]
        if not eps:
            pytest.skip(f"plugin {installed.plugin!r} is not installed through an entry point "
                        f"(registered directly), so there is no plugin module to import alone")
        ep = eps[0]
        code = textwrap.dedent(
            f"""
            import json, sys
            import importlib.metadata as md
            from lollm.load.plugins import build_registry
            ep = md.EntryPoint({ep.name!r}, {ep.value!r}, {ENTRY_POINT_GROUP!r})
            reg = build_registry(entry_points=[ep])
            print(json.dumps({{
                "families": [f.family.name for f in reg.families],
                "broken": [b.error for b in reg.broken],
                "heavy": sorted(m for m in ("torch", "transformers", "safetensors", "numpy") if m in sys.modules),
            }}))
            """
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert not result["broken"], result["broken"]
        assert family_name in result["families"]
        assert "torch" not in result["heavy"], (
            f"importing the plugin module {ep.value!r} and registering its families imported {result['heavy']}; "
            f"name the loader as a 'module:function' string and import torch only there"
        )
