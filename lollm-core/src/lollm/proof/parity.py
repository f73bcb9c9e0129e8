"""The parity gate: our logits against the transformers reference, position by position.

Same checkpoint, same token ids, same dtype and device. Only one model is in
memory at a time: ours runs first and its logits are kept, then it is freed
and the reference is built. For every position of the prompt we compare:

* argmax: does the most likely next token agree?
* top-5 overlap: how many of the five most likely tokens are shared (0..5)?
* cosine similarity of the two logit vectors;
* max |Δ|: the largest absolute difference of a logit.

The gate passes when every argmax agrees and every cosine reaches
``min_cosine``. With quantized weights (``--weights quantized``; float32 stays
the gate's standard) the model is expected to differ a little from the float
reference, and the gate asks for :data:`QUANTIZED_MIN_TOP1` of the argmaxes and a
cosine of :data:`QUANTIZED_MIN_COSINE` instead (docs/quantized-execution.md).

transformers reads exactly the weight file(s) lollm read
(:func:`reference_weights`): the same GGUF file, or the same safetensors files
with ``use_safetensors=True``; a folder where it would read something else is
refused rather than compared. When it fails, the hidden states of the two models are compared
layer by layer to name the first layer that diverges: that is where to look
for a wrong RoPE, norm or weight map.

Under tensor parallelism (``torchrun --nproc-per-node N -m lollm parity --tp N``)
our model is split over the N ranks and every rank runs its forward (the
collectives need them all); the reference then runs on rank 0 alone, in one
process holding the whole model (transformers' own load, on the CPU), while
the other ranks wait for rank 0's report, which :func:`run_parity` hands to
every rank so that each exits with the verdict. Our logits and hidden states
are whole on every rank (the head's logits are all-gathered, the residual
stream is all-reduced), so the comparison is the one-process one.

transformers is needed only here (``pip install 'lollm-core[parity]'``).
"""

from __future__ import annotations

import functools
import gc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from lollm.attention import resolve_backend, use_backend
from lollm.errors import LollmError
from lollm.generate.sequence import check_prompt_ids
from lollm.load.loader import Checkpoint, load_checkpoint
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model, pick_device, route
from lollm.load.registry import InstalledFamily
from lollm.load.quantized import WeightsSummary
from lollm.load.ranks import leader_decides
from lollm.proof.parity_images import ImagePrompt, image_prompt, image_reference

# Lazy imports below: transformers, in load_reference_model, the optional ``lollm-core[parity]`` extra.

#: A reference model as the gate runs it: (1, T) int64 ids on the CPU -> ((T, V) float logits,
#: the hidden states, each (1, T, hidden), in transformers' ``output_hidden_states`` order).
Reference = Callable[[torch.Tensor], tuple[torch.Tensor, list[torch.Tensor]]]

DEFAULT_PROMPT = (
    "The history of the Roman Empire begins with the founding of the city of Rome, which legend dates to "
    "753 BC. Over the following centuries the small settlement on the Tiber grew into a republic, and "
    "then into an empire that stretched from Britain to Egypt. Write a short summary:"
)


#: The quantized gate: share of positions whose argmax must agree, and the lowest cosine.
QUANTIZED_MIN_TOP1 = 0.9
QUANTIZED_MIN_COSINE = 0.98


@dataclass
class PositionStats:
    """How ours and the reference agree on the next token after one position of the prompt."""

    position: int
    token_id: int
    ours_argmax: int
    ref_argmax: int
    top5_overlap: int
    cosine: float
    max_abs_diff: float


@dataclass
class ParityReport:
    """The verdict of one parity run: what was compared, the statistics per position and per layer."""

    model: str
    family: str
    dtype: str
    device: str
    num_tokens: int
    min_cosine_required: float
    weights: str = "float"
    min_top1_required: float = 1.0
    positions: list[PositionStats] = field(default_factory=list)
    layer_cosines: list[float] = field(default_factory=list)  # min over positions, per hidden state
    first_diverging_layer: int | None = None
    attn: str = "sdpa"  # the attention backend ours ran with
    tp: int = 1  # the ranks ours was split over (--tp)

    @property
    def argmax_matches(self) -> int:
        """How many positions' argmax agree (0 .. num_tokens)."""
        return sum(p.ours_argmax == p.ref_argmax for p in self.positions)

    @property
    def min_cosine(self) -> float:
        """The lowest cosine of the two logit vectors over the positions."""
        return min(p.cosine for p in self.positions)

    @property
    def max_abs_diff(self) -> float:
        """The largest |ours - reference| of one logit, over every position and id."""
        return max(p.max_abs_diff for p in self.positions)

    @property
    def min_top5_overlap(self) -> int:
        """The fewest shared ids of the two top-5 lists over the positions (0 .. 5)."""
        return min(p.top5_overlap for p in self.positions)

    @property
    def passed(self) -> bool:
        """The verdict: enough argmaxes agree (``min_top1_required``) and every cosine reaches ``min_cosine_required``."""
        top1_ok = self.argmax_matches >= self.min_top1_required * self.num_tokens
        return top1_ok and self.min_cosine >= self.min_cosine_required

    def to_json(self) -> dict[str, object]:
        """The report as a JSON object (``lollm parity --json``): its fields and the summary figures."""
        data = asdict(self)
        data.update(
            passed=self.passed,
            argmax_matches=self.argmax_matches,
            min_cosine=self.min_cosine,
            max_abs_diff=self.max_abs_diff,
            min_top5_overlap=self.min_top5_overlap,
        )
        return data


def compare_logits(ours: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> list[PositionStats]:
    """Per-position statistics of two (T, V) logit tensors (any float dtype, compared in float64).

    ``ids``: the T prompt ids, for the report. LollmError when the two shapes differ.
    """
    ours, ref = ours.double(), ref.double()
    if ours.shape != ref.shape:
        raise LollmError(f"logit shapes differ: ours {tuple(ours.shape)}, reference {tuple(ref.shape)}")
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    diff = (ours - ref).abs().amax(dim=-1)
    top_ours = ours.topk(5, dim=-1).indices
    top_ref = ref.topk(5, dim=-1).indices
    stats = []
    for t in range(ours.shape[0]):
        overlap = len(set(top_ours[t].tolist()) & set(top_ref[t].tolist()))
        stats.append(
            PositionStats(t, ids[t], int(ours[t].argmax()), int(ref[t].argmax()), overlap, float(cos[t]), float(diff[t]))
        )
    return stats


def layer_cosines(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> list[float]:
    """Minimum cosine over positions of each pair of hidden states ((1, T, H) each, any float dtype; in float64)."""
    out = []
    for a, b in zip(ours, ref):
        out.append(float(torch.nn.functional.cosine_similarity(a[0].double(), b[0].double(), dim=-1).min()))
    return out


def reference_weights(checkpoint: Checkpoint) -> tuple[str, dict[str, str | bool]]:
    """The folder and ``from_pretrained`` arguments that make transformers read exactly the weights lollm read.

    GGUF: the same file (``gguf_file=``; transformers dequantizes it itself).
    safetensors: ``use_safetensors=True`` (transformers never falls back to a
    pickle ``.bin``), and only when the files lollm read are the ones
    transformers reads: ``model.safetensors``, or the shards of
    ``model.safetensors.index.json``. Raises LollmError otherwise (lollm read
    another ``*.safetensors`` name), naming the files.
    """
    if checkpoint.fmt == "gguf":
        path = checkpoint.weights.gguf.path
        return str(path.parent), {"gguf_file": path.name}
    folder = Path(checkpoint.path)
    read = sorted({Path(checkpoint.weights.file_of(name)).name for name in checkpoint.weights.names()})
    if (folder / "model.safetensors.index.json").is_file():
        return str(folder), {"use_safetensors": True}  # both read the shards the index lists
    if read == ["model.safetensors"]:
        return str(folder), {"use_safetensors": True}
    raise LollmError(
        f"{folder}: lollm read its weights from {', '.join(read)}, but transformers reads only model.safetensors "
        f"or the shards of model.safetensors.index.json, so the reference would not read the same weights; "
        f"rename the file to model.safetensors to compare"
    )


def relabel_model_types(raw: object, model_types: dict[str, str]) -> object:
    """A copy of a config dict with every ``model_type`` found in ``model_types`` (nested ones too) replaced by its value."""
    if isinstance(raw, dict):
        out = {key: relabel_model_types(value, model_types) for key, value in raw.items()}
        if out.get("model_type") in model_types:
            out["model_type"] = model_types[out["model_type"]]
        return out
    if isinstance(raw, list):
        return [relabel_model_types(value, model_types) for value in raw]
    return raw


def load_reference_model(checkpoint: Checkpoint, dtype: torch.dtype,
                         model_types: dict[str, str] | None = None) -> torch.nn.Module:
    """transformers' ``AutoModelForCausalLM`` on exactly the weights lollm read (:func:`reference_weights`), in eval mode.

    ``model_types`` maps model types transformers does not know to the ones whose
    classes stand for them (a family copied by ``lollm new-family`` keeps the map as
    ``REFERENCE_MODEL_TYPES``): the config is built as that architecture's, from the
    same config.json. LollmError when transformers is missing or refuses the
    checkpoint (its message is kept), never a traceback from inside transformers.
    """
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise LollmError("the reference needs transformers: pip install 'lollm-core[parity]'") from None
    folder, kwargs = reference_weights(checkpoint)
    if model_types and checkpoint.fmt == "safetensors" and checkpoint.model_type in model_types:
        raw = relabel_model_types(dict(checkpoint.config), model_types)
        try:
            kwargs = {**kwargs, "config": transformers.CONFIG_MAPPING[raw["model_type"]].from_dict(raw)}
        except (KeyError, ValueError, TypeError) as exc:
            raise LollmError(f"transformers has no config class for {raw['model_type']!r} (the reference of "
                             f"{checkpoint.model_type!r}): {type(exc).__name__}: {exc}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError ... for checkpoints it refuses
        raise LollmError(f"transformers could not load the reference from {folder}: {type(exc).__name__}: {exc}") from None
    return model.eval()


def default_reference(checkpoint: Checkpoint, dtype: torch.dtype) -> Reference:
    """transformers' ``AutoModelForCausalLM`` on the same weights (:func:`load_reference_model`), returning (logits, hidden_states)."""
    model = load_reference_model(checkpoint, dtype)

    @torch.inference_mode()
    def run(ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model(ids.to(model.device), output_hidden_states=True, use_cache=False)
        return out.logits[0].float(), [h.float() for h in out.hidden_states]

    return run


#: The gate's standard load: float32, float weights, on the CPU.
PARITY_OPTIONS = LoadOptions(device="cpu", dtype="float32", weights="float")


def run_parity(
    spec: str,
    *,
    prompt: str = DEFAULT_PROMPT,
    ids: list[int] | None = None,
    chat: bool = False,
    options: LoadOptions = PARITY_OPTIONS,
    min_cosine: float | None = None,
    images: Sequence[str] = (),
) -> ParityReport:
    """Run ours, then the reference, on the same ids; return the report (it does not raise on failure).

    ``ids``: the prompt's token ids (None: ``prompt`` encoded, chat-templated with ``chat``).
    ``min_cosine``: the lowest cosine that passes (None: 0.99999 in float32, 0.99 in 16-bit
    dtypes, :data:`QUANTIZED_MIN_COSINE` with packed weights). Raises LollmError when the
    gate cannot run: a checkpoint that does not load, an attention backend that cannot run,
    weights transformers would not read as ours (:func:`reference_weights`), ids outside the
    vocabulary, a reference that does not build.

    ``options``: how ours loads (:class:`lollm.load.options.LoadOptions`; default :data:`PARITY_OPTIONS`,
    float32 float weights on the CPU, the gate's standard): the attention backend ours runs with,
    packed weights, ``--family``. The reference is always transformers' own load of the same file,
    at the same dtype and device.

    ``options.tp``: tensor-parallel degree; above 1 this process is one of ``tp`` ranks
    started by torchrun (:func:`lollm.load.process_group.init`). Every rank runs
    our sharded forward; rank 0 alone builds the reference and compares, then
    broadcasts the report (or its error) so that every rank returns the same
    report (or raises the same LollmError).

    ``images``: image files (``lollm parity --image``): the prompt gets one placeholder per image, ours
    reads them through the family's tower and the reference is the whole ``*ForConditionalGeneration``
    on the same pixels (:mod:`lollm.proof.parity_images`). Not with ``ids`` or ``tp`` > 1.
    """
    if images and (ids is not None or options.tp > 1):
        raise LollmError("lollm parity --image builds its own prompt ids and runs on one process (no --tp)")
    # 0. Refuse at once a backend that cannot run, or weights transformers would not read as we do.
    resolve_backend(options.attn, pick_device(options.device))
    checkpoint = load_checkpoint(spec)
    if not route(checkpoint, options.family).family.parity_reference:
        reference_weights(checkpoint)

    # 1. Ours: load, run every position, keep logits and hidden states, free the model.
    loaded = open_model(checkpoint, options)
    del checkpoint
    summary = getattr(loaded.model, "weights_summary", None)
    packed = summary is not None and summary.packed > 0
    pictured = image_prompt(loaded, list(images), prompt, chat=chat, model=spec) if images else None
    if pictured is not None:
        ids = pictured.ids
    elif ids is None:  # the tokenizer is read only when the ids are not given
        tokenizer = loaded.tokenizer
        ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    check_prompt_ids(ids, loaded.model.vocab_size)  # a clear error, not an IndexError inside the embedding
    input_ids = torch.tensor([ids], dtype=torch.long, device=loaded.device)
    hidden: list[torch.Tensor] = []
    extra = {} if pictured is None else {"images": pictured.images}
    with torch.inference_mode(), use_backend(loaded.attn):
        ours_logits = loaded.model(input_ids, None, hidden_states=hidden, **extra)[0].float().cpu()
    hidden = [h.float().cpu() for h in hidden]
    checkpoint, installed, dt, dev = loaded.checkpoint, loaded.family, loaded.dtype, loaded.device
    attn_name, group = loaded.attn, loaded.tp
    del loaded
    gc.collect()
    reference_and_compare = functools.partial(
        _reference_and_compare, spec, checkpoint, installed, dt, dev, attn_name, ids, input_ids, ours_logits, hidden,
        min_cosine, packed, summary, options.tp, pictured)
    return leader_decides(group, reference_and_compare)  # --tp: rank 0 builds the reference; every rank gets the report


def _reference_and_compare(spec: str, checkpoint: Checkpoint, installed: InstalledFamily, dt: torch.dtype,
                           dev: torch.device, attn_name: str, ids: list[int], input_ids: torch.Tensor,
                           ours_logits: torch.Tensor, hidden: list[torch.Tensor], min_cosine: float | None,
                           packed: bool, summary: WeightsSummary | None, tp: int,
                           pictured: ImagePrompt | None = None) -> ParityReport:
    """Steps 2 and 3 of :func:`run_parity`: build the reference, run it on ``input_ids``, compare with ours.

    ``input_ids``: (1, T) int64; ``ours_logits``: (T, V) float32 on the CPU; ``hidden``: ours, each
    (1, T, hidden) float32 on the CPU. LollmError when the reference cannot be built or its logits'
    shape differs from ours.
    """
    # 2. The reference, built the way the family says (default: transformers AutoModelForCausalLM).
    build: Callable[[Checkpoint, torch.dtype], Reference]
    if pictured is not None:  # --image: the whole *ForConditionalGeneration on the same pixels
        build = functools.partial(image_reference, prompt=pictured)
    elif installed.family.parity_reference:
        build = installed.family.resolve("parity_reference")
    else:
        build = default_reference
    reference = build(checkpoint, dt)
    # the reference builds its model where it likes (transformers' default: the CPU); ids go in on the CPU
    ref_logits, ref_hidden = reference(input_ids.cpu())
    ref_logits = ref_logits.float().cpu()
    del reference
    gc.collect()

    # 3. Compare.
    if min_cosine is not None:
        required = min_cosine
    elif packed:
        required = QUANTIZED_MIN_COSINE
    else:
        required = 0.99999 if dt == torch.float32 else 0.99
    report = ParityReport(
        model=spec, family=installed.family.name, dtype=str(dt).removeprefix("torch."), device=str(dev),
        num_tokens=len(ids), min_cosine_required=required, attn=attn_name,
        weights=summary.requested if packed else "float", min_top1_required=QUANTIZED_MIN_TOP1 if packed else 1.0, tp=tp,
    )
    report.positions = compare_logits(ours_logits, ref_logits, ids)
    if ref_hidden and len(ref_hidden) == len(hidden):
        report.layer_cosines = layer_cosines(hidden, [h.cpu() for h in ref_hidden])
        if not report.passed:
            for i, c in enumerate(report.layer_cosines):
                if c < required:
                    report.first_diverging_layer = i
                    break
    return report
