"""What a tiny checkpoint and the kit's prompts can see: the conformance kit's coverage check.

A parity test can only fail a wrong family on a feature the checkpoint exercises. A tiny
copy of Gemma 3 with two sliding layers and a 512-token window, fed 32-token prompts, has
no global layer and never crosses its window: a window off by one, or global layers on the
local RoPE base, pass every check. So the kit proves its coverage *before* it judges, from
the checkpoint's config.json and the prompt schedule alone::

    report = check_coverage(config, prompt_length=80, longest_prefill=72)
    print(report.table())          # one line per feature: seen, or why not and how to fix it
    report.raise_for_blind()       # CoverageError naming each feature it cannot see

The features (each a :class:`Feature`, named as in docs/conformance-kit.md):

* ``layer kinds``: every kind of layer the config declares has a layer in the checkpoint:
  sliding *and* global attention when a sliding window is in use (``layer_types``, or
  Gemma 3's ``sliding_window_pattern``), linear attention *and* full attention in a
  hybrid (Qwen 3.5), and MoE layers next to the dense ones a config names
  (``mlp_only_layers``); a mixture routes to fewer experts than it has.
* ``window``: the prompt crosses every sliding window at least twice (T > 2 W).
* ``long decode``: the cached schedules decode one token at a time past position
  :data:`LONG_DECODE` (a cache that misbehaves once it holds 32 or 64 tokens shows).
* ``delta-rule chunk``: with linear-attention layers, a prefill longer than one chunk of
  the chunked delta rule (:data:`DELTA_RULE_CHUNK`, transformers' ``chunk_size``), then
  decode steps after it.
* ``soft-caps``: a soft-cap the config sets is a real number (``None`` or 0 is off:
  the family has no soft-cap to get wrong).
* ``scalars``: ``query_pre_attn_scalar`` differs from ``head_dim`` (else a family that
  scales by ``head_dim ** -0.5`` is right by accident), and the norm epsilon is at least
  :data:`VISIBLE_NORM_EPS` (a hub epsilon of 1e-6 hides an ignored one).

Pure Python on config dicts: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lollm.errors import LollmError

__all__ = ["CoverageError", "CoverageReport", "Feature", "check_coverage", "layer_kinds",
           "LONG_DECODE", "DELTA_RULE_CHUNK", "VISIBLE_NORM_EPS"]

#: The cached schedules must decode one token at a time past this position.
LONG_DECODE = 64
#: The chunk length of the chunked delta rule (transformers' ``torch_chunk_gated_delta_rule``,
#: ``chunk_size=64``): a prefill longer than this crosses a chunk boundary.
DELTA_RULE_CHUNK = 64
#: A norm epsilon below this is invisible in a tiny model's logits (an ignored epsilon passes).
VISIBLE_NORM_EPS = 1e-2
#: The config keys of a norm epsilon.
EPS_KEYS = ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon")
#: The config keys of soft-caps.
SOFTCAP_KEYS = ("final_logit_softcapping", "attn_logit_softcapping")


class CoverageError(LollmError):
    """The tiny checkpoint (or the prompt schedule) cannot see a feature of the family; the message names each."""


@dataclass(frozen=True)
class Feature:
    """One line of the coverage report.

    name: the feature ("layer kinds", "window", ...); seen: True when the checkpoint and the
    prompts exercise it; detail: what was found (counts, sizes); fix: how to change the config
    or the kit's attributes when it is not seen ("" when it is).
    """

    name: str
    seen: bool
    detail: str
    fix: str = ""


@dataclass
class CoverageReport:
    """Every :class:`Feature` checked, in order; :meth:`blind` the ones not seen."""

    features: list[Feature] = field(default_factory=list)

    def blind(self, waived: dict[str, str] | None = None) -> list[Feature]:
        """The features not seen, less those ``waived`` (feature name -> the reason it cannot be seen)."""
        return [f for f in self.features if not f.seen and f.name not in (waived or {})]

    def table(self) -> str:
        """The report as aligned text lines: ``seen``/``BLIND``, the feature, what was found, the fix."""
        width = max((len(f.name) for f in self.features), default=0)
        return "\n".join(f"{'seen ' if f.seen else 'BLIND'}  {f.name:<{width}}  {f.detail}"
                         + ("" if f.seen else f"  -> {f.fix}") for f in self.features)

    def raise_for_blind(self, waived: dict[str, str] | None = None) -> None:
        """CoverageError listing every feature not seen (and not waived), each with its fix."""
        blind = self.blind(waived)
        if blind:
            raise CoverageError("the tiny checkpoint or the prompts cannot see "
                                + "; ".join(f"{f.name} ({f.detail}; fix: {f.fix})" for f in blind)
                                + ". A family with a bug there would pass the kit. Coverage report:\n" + self.table())


def _text_config(config: dict[str, object]) -> dict[str, object]:
    """The decoder's config: ``text_config`` when there is one, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def layer_kinds(config: dict[str, object]) -> list[str]:
    """The attention kind of each layer, as ``layer_types`` spells them, read from a config.json dict.

    An explicit ``layer_types`` list wins; else Gemma 3's ``sliding_window_pattern`` N (every Nth
    layer global, the others sliding); else every layer "sliding_attention" when a window is in
    use (``sliding_window`` set and ``use_sliding_window`` not false, the Mistral way), or
    "full_attention". (Qwen 2's ``max_window_layers`` is left aside: its tiny tests turn the window off.)
    """
    text = _text_config(config)
    n = _int(text.get("num_hidden_layers")) or 0
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        return [str(t) for t in types]
    pattern = _int(text.get("sliding_window_pattern", text.get("_sliding_window_pattern")))
    window = _int(text.get("sliding_window"))
    uses_window = window is not None and window > 0 and text.get("use_sliding_window", True) is not False
    if pattern and uses_window:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return ["sliding_attention" if uses_window else "full_attention"] * n


def _layer_features(text: dict[str, object], kinds: list[str]) -> list[Feature]:
    out: list[Feature] = []
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    detail = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no layers"
    window = _int(text.get("sliding_window"))
    uses_window = bool(window) and text.get("use_sliding_window", True) is not False
    if "sliding_attention" in counts or (uses_window and "linear_attention" not in counts):
        both = "sliding_attention" in counts and "full_attention" in counts
        out.append(Feature("sliding and global layers", both, detail,
                           "" if both else "give the checkpoint at least one layer of each kind (layer_types, or "
                           "sliding_window_pattern 2 with num_hidden_layers >= 2): a window or RoPE base used on the "
                           "wrong kind of layer shows only when both are there"))
    if "linear_attention" in counts:
        both = "full_attention" in counts
        out.append(Feature("linear and full attention layers", both, detail,
                           "" if both else "raise num_hidden_layers (or edit layer_types) until one full_attention "
                           "layer follows the linear_attention ones (Qwen 3.5: every full_attention_interval-th layer)"))
    experts = _int(text.get("num_experts"))
    if experts:
        per_token = _int(text.get("num_experts_per_tok")) or _int(text.get("top_k_experts")) or 1
        dense = text.get("mlp_only_layers") or []
        moe_layers = len(kinds) - len([i for i in dense if isinstance(i, int) and 0 <= i < len(kinds)])
        ok = experts > per_token and moe_layers > 0
        out.append(Feature("MoE and dense layers", ok,
                           f"{experts} experts, {per_token} per token, {moe_layers} MoE and {len(kinds) - moe_layers} dense layers",
                           "" if ok else "keep more experts than num_experts_per_tok (so routing matters) and at "
                           "least one MoE layer (mlp_only_layers must not name every layer)"))
    return out


def check_coverage(config: dict[str, object], *, prompt_length: int, longest_prefill: int,
                   decode_reaches: int | None = None) -> CoverageReport:
    """The coverage report of a checkpoint's config.json dict under the kit's prompt schedule.

    prompt_length: T, the positions of the kit's test prompt; longest_prefill: the longest
    chunk some cached schedule feeds before decoding one token at a time; decode_reaches:
    the last position a one-token decode step of the schedules reaches (default T - 1).
    Returns the report; nothing is raised (:meth:`CoverageReport.raise_for_blind` does).
    """
    text = _text_config(config)
    kinds = layer_kinds(config)
    report = CoverageReport(_layer_features(text, kinds))
    T = prompt_length
    window = _int(text.get("sliding_window"))
    if window and "sliding_attention" in kinds:
        ok = T > 2 * window
        report.features.append(Feature("window crossed twice", ok, f"window {window}, prompt {T} positions",
                                       "" if ok else f"set sliding_window <= {(T - 1) // 2} in the tiny config (the "
                                       f"kit's prompt has {T} positions), or raise sequence_length above {2 * window}"))
    reach = T - 1 if decode_reaches is None else decode_reaches
    ok = reach > LONG_DECODE
    report.features.append(Feature("long decode", ok, f"one-token decode steps reach position {reach}",
                                   "" if ok else f"raise sequence_length above {LONG_DECODE + 1} and "
                                   f"max_position_embeddings above it"))
    if "linear_attention" in kinds:
        ok = longest_prefill > DELTA_RULE_CHUNK and reach >= longest_prefill
        report.features.append(Feature("delta-rule chunk", ok, f"longest prefill {longest_prefill} positions "
                                        f"(chunk {DELTA_RULE_CHUNK}), then decode",
                                        "" if ok else f"raise sequence_length above {DELTA_RULE_CHUNK + 2}"))
    for key in SOFTCAP_KEYS:
        if key in text:
            cap = text[key]
            on = isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0
            report.features.append(Feature(f"soft-cap {key}", True, f"{cap}" if on else f"{cap} (off: nothing to get wrong)"))
    head_dim, scalar = _int(text.get("head_dim")), text.get("query_pre_attn_scalar")
    if head_dim and isinstance(scalar, (int, float)):
        ok = scalar != head_dim
        report.features.append(Feature("query_pre_attn_scalar", ok, f"{scalar} (head_dim {head_dim})",
                                       "" if ok else f"set query_pre_attn_scalar to another value than head_dim "
                                       f"(e.g. {2 * head_dim}): equal, a family that scales by head_dim**-0.5 passes"))
    for key in EPS_KEYS:
        eps = text.get(key)
        if isinstance(eps, float):
            ok = eps >= VISIBLE_NORM_EPS
            report.features.append(Feature(f"norm epsilon {key}", ok, f"{eps:g}",
                                           "" if ok else f"set {key} to lollm.testing.tiny.SENSITIVE_NORM_EPS (0.1): "
                                           f"{eps:g} is far below any mean square, an ignored epsilon passes"))
    return report
