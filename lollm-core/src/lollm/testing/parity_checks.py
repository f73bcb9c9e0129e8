"""The conformance kit's parity checks: ours against the reference, after a prefill, through the
cache, from a GGUF and at bfloat16; the tiny checkpoint's sensitivity; and the same logits from
config.json spelled in either schema (transformers 5's, the hub's older one).

Sections 8 to 11 of :class:`lollm.testing.conformance.FamilyConformance` (which inherits
:class:`ParityChecks`); the bounds come from :mod:`lollm.testing.reference`. Section 12 (llama.cpp's
converter writes the GGUF) is :mod:`lollm.testing.converter_checks`, which uses the comparisons here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lollm.errors import LollmError
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.quantized import Quantization
from lollm.load.registry import InstalledFamily
from lollm.proof.parity import compare_logits, default_reference, layer_cosines
from lollm.testing.coverage import DELTA_RULE_CHUNK
from lollm.testing.gguf_writer import write_tiny_gguf
from lollm.testing.reference import (SENSITIVITY_CHECKS_HELP, ReferenceBuilder, ReferenceRun, cached_reference,
                                     measure_bf16_noise, reference_sensitivity)
from lollm.testing.schemas import (NoOlderSchema, hub_schema_copy, other_schema, reference_logits_agree,
                                   transformers_reads_it_the_same)
from lollm.testing.schedules import fill_chunks, short_schedule

#: The kit's tests that need the transformers reference (skipped with ``reference_available = False``).
REFERENCE_TESTS = ("test_parity_with_the_reference", "test_cached_decode_matches_the_reference",
                   "test_reference_checkpoint_is_sensitive", "test_gguf_parity_with_the_reference",
                   "test_bfloat16_parity_with_the_reference", "test_both_config_schemas_give_the_same_logits",
                   "test_converter_gguf_parity_with_the_reference", "test_converter_gguf_tokenizer_gives_the_checkpoints_ids")


class ParityChecks:
    """Sections 8 to 11 of the kit; the fixtures and class attributes they use are :class:`FamilyConformance`'s."""

    # -- 8. parity against the reference ------------------------------------------------------

    @staticmethod
    def _reference_builder(installed: InstalledFamily) -> ReferenceBuilder:
        return installed.family.resolve("parity_reference") if installed.family.parity_reference else default_reference

    def _reference(self, installed: InstalledFamily, checkpoint: Checkpoint) -> ReferenceRun:
        return cached_reference(self._reference_builder(installed), checkpoint, torch.float32)

    def _check_parity(self, ours: torch.Tensor, ref: torch.Tensor, ids: list[int], what: str, bound: float,
                      hidden: list[torch.Tensor] | None = None, ref_hidden: list[torch.Tensor] | None = None) -> None:
        """Fail unless every position has the reference's argmax, cosine >= parity_min_cosine and
        max |Δ| <= ``bound`` (the parity_bound fixture); the message names the worst position (and
        the first diverging hidden state when both sides gave them)."""
        stats = compare_logits(ours.float(), ref.float(), ids)
        bad = [s for s in stats if s.ours_argmax != s.ref_argmax or s.cosine < self.parity_min_cosine
               or s.max_abs_diff > bound]
        if not bad:
            return
        layers = ""
        if hidden and ref_hidden and len(ref_hidden) == len(hidden):
            cos = layer_cosines(hidden, ref_hidden)
            first = next((i for i, c in enumerate(cos) if c < self.parity_min_cosine), None)
            layers = f"; per hidden state min cosine {[round(c, 6) for c in cos]}, first diverging: {first}"
        worst = max(bad, key=lambda s: s.max_abs_diff)
        pytest.fail(
            f"{what}: parity failed at {len(bad)} of {len(stats)} positions {[s.position for s in bad][:16]} "
            f"(argmax, cosine < {self.parity_min_cosine} or max |Δ| > {bound:.2e}, the bound from the reference's "
            f"own float32 noise); "
            f"worst position {worst.position}: max |Δ| {worst.max_abs_diff:.3e}, cosine {worst.cosine:.7f}, "
            f"argmax ours {worst.ours_argmax} vs reference {worst.ref_argmax}{layers}",
            pytrace=False,
        )

    def test_parity_with_the_reference(self, model, installed, checkpoint, prompt_ids, parity_bound):
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        with torch.inference_mode():
            hidden: list[torch.Tensor] = []
            ours = model(prompt_ids, None, hidden_states=hidden)[0].float()
        ref_logits, ref_hidden = self._reference(installed, checkpoint)(prompt_ids)
        self._check_parity(ours, ref_logits, prompt_ids[0].tolist(), "prefill", parity_bound, hidden, ref_hidden)

    def test_cached_decode_matches_the_reference(self, model, installed, checkpoint, prompt_ids, sliding_window,
                                                 parity_bound):
        """Ours through the cache (a prefill, then one token at a time; a prefill past a delta-rule
        chunk, then one at a time; chunks across the window) equals the reference's prefill of the
        whole prompt, position by position."""
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        T = prompt_ids.shape[1]
        ref_logits, _ = self._reference(installed, checkpoint)(prompt_ids)
        first = max(1, min(T - 1, sliding_window - 1)) if sliding_window else max(1, T // 2)
        schedules = [[first] + [1] * (T - first)]
        if T > DELTA_RULE_CHUNK + 2:
            schedules.append([DELTA_RULE_CHUNK + 1] + [1] * (T - DELTA_RULE_CHUNK - 1))
        if sliding_window:
            schedules.append(fill_chunks(T, [sliding_window + 1]))
        with torch.inference_mode():
            for schedule in schedules:
                cache = model.new_cache(T)
                rows, at = [], 0
                for size in schedule:
                    rows.append(model(prompt_ids[:, at : at + size], cache)[0].float())
                    at += size
                self._check_parity(torch.cat(rows), ref_logits, prompt_ids[0].tolist(),
                                   f"cached forward in chunks {short_schedule(schedule)} vs the reference's prefill", parity_bound)

    def test_reference_checkpoint_is_sensitive(self, checkpoint, prompt_ids, parity_bound):
        """The tiny checkpoint can tell a right model from a wrong one.

        Each perturbation of :data:`SENSITIVITY_CHECKS` that applies to the checkpoint is made
        to the *reference* (transformers, same weights, one config value or attention scale
        changed) and must move its logits by more than ``sensitivity_margin`` times the parity
        bound at some position; otherwise a family with that bug would pass
        the parity tests above, and this test fails the checkpoint, naming what it cannot see.

        The reference here is always transformers' model of the checkpoint (a family's own
        ``parity_reference`` cannot be perturbed; ``reference_model_types`` names the class for a
        model type transformers does not know); ``sensitivity_checks = ()`` turns the test off.
        """
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        moved = reference_sensitivity(checkpoint, prompt_ids, self.sensitivity_checks, self.reference_model_types)
        if not moved:
            pytest.skip(f"none of the perturbations {self.sensitivity_checks} applies to this checkpoint's config")
        need = self.sensitivity_margin * parity_bound
        weak = {name: d for name, d in moved.items() if not d > need}
        assert not weak, (
            "the tiny checkpoint is insensitive to "
            + "; ".join(f"{name} ({SENSITIVITY_CHECKS_HELP[name.split(' ')[0]]}: the reference's logits moved by "
                        f"{d:.3e} at most)" for name, d in weak.items())
            + f"; each must move them by more than {need:.3e} ({self.sensitivity_margin:g} x the parity bound), "
            f"or a family with that bug passes the parity tests. Make the checkpoint more sensitive: "
            f"write_tiny_checkpoint(..., init_std=lollm.testing.tiny.SENSITIVE_INIT_STD), "
            f"rms_norm_eps=SENSITIVE_NORM_EPS in its config, a sliding window under a third of the prompt "
            f"(prompt: {prompt_ids.shape[1]} positions); moved by: "
            + ", ".join(f"{k} {v:.3e}" for k, v in moved.items())
        )

    # -- 9. the GGUF mode ------------------------------------------------------------------------

    def _check_file_parity(self, model, ref_logits: torch.Tensor, ref_hidden: list[torch.Tensor], prompt_ids: torch.Tensor,
                           sliding_window: int | None, what: str, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A model loaded from a file against the reference's prefill: its prefill, then a prefill up to the
        window's edge (half the prompt without a window) followed by one-token decode steps. Returns the
        logits of both, ``(T, V)`` each."""
        T = prompt_ids.shape[1]
        first = max(1, min(T - 1, sliding_window - 1)) if sliding_window else max(1, T // 2)
        ids = prompt_ids[0].tolist()
        with torch.inference_mode():
            hidden: list[torch.Tensor] = []
            ours = model(prompt_ids, None, hidden_states=hidden)[0].float()
            self._check_parity(ours, ref_logits, ids, f"{what}: prefill", bound, hidden, ref_hidden)
            cache = model.new_cache(T)
            rows = [model(prompt_ids[:, :first], cache)[0].float()]
            rows += [model(prompt_ids[:, t : t + 1], cache)[0].float() for t in range(first, T)]
        self._check_parity(torch.cat(rows), ref_logits, ids, f"{what}: prefill of {first}, then decode", bound)
        return ours, torch.cat(rows)

    def test_gguf_parity_with_the_reference(self, load, installed, checkpoint_dir, prompt_ids, sliding_window, tmp_path,
                                            parity_bound):
        """The checkpoint as a GGUF of each of ``gguf_types`` (:func:`lollm.testing.gguf_writer.write_tiny_gguf`,
        the converter's names, metadata and quirks) loads through the family and matches the
        reference run on the weights as the file holds them, after a prefill and through the cache."""
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        if not self.gguf_types:
            declares = installed is not None and bool(installed.family.gguf_architectures)
            converter = "" if self.converter_outtypes == () or not declares else (
                "; llama.cpp's own converter writes this family's GGUF files in "
                "test_converter_gguf_parity_with_the_reference (section 12)")
            pytest.skip("gguf_types = (): the GGUF mode of lollm's writer is off for this family; set gguf_types = "
                        "(\"F32\", \"F16\", \"Q8_0\", \"Q4_0\") (any subset) on the test class to turn it on" + converter)
        for ggml_type in self.gguf_types:
            path = write_tiny_gguf(checkpoint_dir, tmp_path / f"tiny-{ggml_type}.gguf", ggml_type,
                                   reference_dir=tmp_path / f"reference-{ggml_type}")
            gguf_checkpoint = load_checkpoint(path)
            assert gguf_checkpoint.fmt == "gguf", f"{path} was read as {gguf_checkpoint.fmt!r}"
            ref_logits, ref_hidden = self._reference(installed, load_checkpoint(tmp_path / f"reference-{ggml_type}"))(prompt_ids)
            self._check_file_parity(load(gguf_checkpoint), ref_logits, ref_hidden, prompt_ids, sliding_window,
                                    f"GGUF {ggml_type}", parity_bound)

    # -- 10. bfloat16 ------------------------------------------------------------------------------

    def test_bfloat16_parity_with_the_reference(self, installed, checkpoint, prompt_ids):
        """Ours loaded at bfloat16 against transformers at bfloat16, prefill, every position.

        The bounds come from the reference's own bfloat16 noise (:func:`measure_bf16_noise`): the
        mean |Δ| of a logit at most ``max(5 x noise, bf16_error_fraction x the reference's bfloat16
        error)``, the max |Δ| at most twice that error's max, and the reference's argmax wherever its
        two best logits lie further apart than that max bound. The float32 tests cannot see a value
        rounded to bfloat16 once too often (Gemma's norm cast before its (1 + w)); this one can.
        """
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference for this family")
        if self.bf16_error_fraction is None:
            pytest.skip("bf16_error_fraction = None: the bfloat16 check is off for this family")
        build = self._reference_builder(installed)
        noise = measure_bf16_noise(build, checkpoint, prompt_ids, factor=self.parity_noise_factor,
                                   fraction=self.bf16_error_fraction)
        options = LoadOptions(device="cpu", dtype="bfloat16", attn="sdpa", weights="float",
                              quantization=Quantization("float"))
        model = installed.family.resolve("load")(checkpoint, options)
        with torch.inference_mode():
            ours = model(prompt_ids, None)[0].double()
        ref = cached_reference(build, checkpoint, torch.bfloat16)(prompt_ids)[0].double()
        diff = (ours - ref).abs()
        best = ref.topk(2, dim=-1).values  # (T, 2)
        flips = [p for p in range(ref.shape[0]) if int(ours[p].argmax()) != int(ref[p].argmax())
                 and float(best[p, 0] - best[p, 1]) > noise.max_bound]
        mean, worst = float(diff.mean()), float(diff.max())
        assert mean <= noise.mean_bound and worst <= noise.max_bound and not flips, (
            f"bfloat16: ours vs the reference at bfloat16: mean |Δ| {mean:.3e} (bound {noise.mean_bound:.3e}), "
            f"max |Δ| {worst:.3e} at position {int(diff.max(dim=-1).values.argmax())} (bound {noise.max_bound:.3e}), "
            f"argmax differs away from a near tie at positions {flips[:16]}. The reference's own bfloat16 error: "
            f"mean {noise.error_mean:.3e} ({mean / noise.error_mean if noise.error_mean else float('inf'):.2f} x "
            f"that here), max {noise.error_max:.3e}; its noise in another blocking: mean {noise.noise_mean:.3e}, max "
            f"{noise.noise_max:.3e}. A value rounded to bfloat16 where transformers keeps float32 (a norm's scale, "
            f"a softmax) shows as a mean |Δ| near the reference's own bfloat16 error"
        )

    # -- 11. both config schemas ---------------------------------------------------------------------

    def test_both_config_schemas_give_the_same_logits(self, load, model, checkpoint_dir, prompt_ids, tmp_path):
        """The checkpoint's config.json respelled in the other schema (:func:`lollm.testing.schemas.other_schema`:
        a transformers-5 one the hub's older way, ``rope_theta``, ``rope_scaling``, ``rope_local_base_freq``,
        ``sliding_window_pattern``; a hub-schema one as transformers 5 writes it, ``rope_parameters``,
        ``layer_types``) gives the same logits, bit for bit.

        transformers proves the two spellings mean one model first: its configs agree, it reads
        every older key written, and its logits are equal on both folders; otherwise (or when the
        config has nothing to respell) the test skips with that reason.
        """
        if not self.reference_available:
            pytest.skip("reference_available = False: no transformers reference to prove the respelling")
        config_path = Path(checkpoint_dir) / "config.json"
        if not config_path.is_file():
            pytest.skip(f"{checkpoint_dir} has no config.json: nothing to respell")
        original = json.loads(config_path.read_text(encoding="utf-8"))
        try:
            schema, respelled = other_schema(original, self.reference_model_types)
        except NoOlderSchema as exc:
            pytest.skip(str(exc))
        why = transformers_reads_it_the_same(original, respelled, self.reference_model_types)
        if why is not None:
            pytest.skip(why)
        folder = hub_schema_copy(checkpoint_dir, tmp_path / "other-schema", respelled)
        why = reference_logits_agree(Path(checkpoint_dir), folder, prompt_ids, self.reference_model_types)
        if why is not None:
            pytest.skip(f"transformers does not read the respelled config the same way: {why}")
        try:
            hub_model = load(load_checkpoint(folder))
        except LollmError as exc:
            pytest.fail(f"the family refuses config.json in {schema}, which transformers reads as the same model "
                        f"({folder / 'config.json'}): {exc}", pytrace=False)
        with torch.inference_mode():
            ours = model(prompt_ids, None)[0]
            hub = hub_model(prompt_ids, None)[0]
        spelled = {k: v for k, v in respelled.get("text_config", respelled).items() if k in (
            "rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern", "layer_types", "rope_parameters")}
        assert torch.equal(ours, hub), (
            f"the same checkpoint gives other logits when config.json is spelled in {schema} ({spelled}): "
            f"max |Δ| {float((ours - hub).abs().max()):.3e}; transformers gives equal logits from both. The family "
            f"reads a key of one schema wrongly (a RoPE base, the scaling, the layer kinds)"
        )
