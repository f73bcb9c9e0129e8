"""How much a quantized model departs from the float32 one: top-1 agreement and perplexity on one text.

Used by the real-weights tests of the families and by
``lollm-core/benchmarks/bench_quant.py``; docs/measurements.md reports
its figures. Both models read the same token ids in one forward each (every
position of the text), so the comparison is position by position:

* top-1 agreement: at how many positions the most likely next token is the same;
* perplexity of the text itself under each model, ``exp(mean(-log p(next token)))``:
  a quantized model that is as good a language model as the float one has
  about the same perplexity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from lollm.load.options import LoadOptions
from lollm.load.pipeline import open_model

#: A text of about 600 tokens (Qwen2.5's and Gemma 3's tokenizers), written for these
#: measurements: plain English prose with names, numbers and a little code.
EVAL_TEXT = """\
The printing press did not arrive in Europe as a single invention. Johannes Gutenberg, working in Mainz around
1450, combined several older ideas: a screw press borrowed from wine makers, an ink thick enough to cling to
metal, and above all a hand mould that could cast thousands of identical letters. Each letter was a small block
of an alloy of lead, tin and antimony, cheap to melt and hard enough to survive many impressions. A compositor
picked the letters from a case, set them line by line in a composing stick, and locked the finished page into a
frame. After printing, the type was cleaned and sorted back into the case, ready for the next page.

The consequences took decades to unfold. Before the press, a copy of a long book could take a scribe a year;
by 1500, presses in more than two hundred towns had produced perhaps twenty million volumes. Prices fell,
spelling slowly settled, and scholars in different cities could finally be sure that they were reading the
same words on the same page. Errors still happened, but an error could now be corrected in the next edition
for every reader at once, instead of being copied faithfully into every new manuscript.

Computers repeated the story five centuries later. Early machines were programmed by rewiring panels or by
punching holes into cards, one instruction per card. Assemblers replaced numbers with short names, and
compilers replaced whole sequences of instructions with a single line. A modern programmer can write

    def mean(values):
        return sum(values) / len(values)

and never think about registers, memory addresses or the carry flag. Every layer hides the one below it, and
every layer can be studied on its own: that is why a student can learn how a compiler works without first
building a processor, and why a processor designer does not need to read every program that will ever run.

Language models are the newest layer. A model reads text as a sequence of tokens, small pieces of words, and
predicts the next token from all the previous ones. Its knowledge is stored in matrices of numbers called
weights. A model with half a billion weights stored as 32-bit floats needs two gigabytes of memory, and every
generated token reads all of them once, so the speed of generation is set mostly by how fast memory can deliver
those bytes. Storing each weight in four or eight bits instead shrinks the model four to eight times, and the
same memory bandwidth then produces tokens several times faster. The price is precision: a weight that was
0.01371 might become 0.0137 or 0.0140, and the question is whether the model still says the same things.

Careful engineers answer that question with measurements rather than hopes. They run the original model and
the compressed one on the same text, compare their predictions position by position, and count how often the
most likely next token agrees. They also compute perplexity, a number that says how surprised a model is by
the real text: lower is better, and two models with nearly the same perplexity understand the text about
equally well. If both figures stay close, the smaller model is a good replacement for the larger one.
"""


@dataclass
class Agreement:
    """The comparison of a quantized model with the float32 one on the same ids."""

    positions: int
    top1_agree: int
    perplexity_float: float
    perplexity_quantized: float

    @property
    def top1_rate(self) -> float:
        return self.top1_agree / self.positions

    @property
    def perplexity_ratio(self) -> float:
        """Quantized perplexity over float perplexity (1.02 = 2% worse)."""
        return self.perplexity_quantized / self.perplexity_float


@torch.inference_mode()
def logits_of(model, ids: list[int]) -> torch.Tensor:
    """One forward over all of ``ids`` (no cache): logits ``(T, vocab)`` in float32."""
    return model(torch.tensor([ids]), None)[0].float()


@torch.inference_mode()
def decode_logits_of(model, ids: list[int]) -> torch.Tensor:
    """The same logits as :func:`logits_of`, computed as decode steps do: one position at a time
    through the model's cache, so that every packed layer sees one row (lollm's native kernel where
    it runs; docs/native-kernel.md). ``(T, vocab)`` float32."""
    cache = model.new_cache(len(ids))
    rows = [model(torch.tensor([[token]]), cache)[0, -1].float() for token in ids]
    return torch.stack(rows)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    """``exp`` of the mean negative log-likelihood of ``ids[1:]`` given ``logits[:-1]`` ``(T, vocab)``."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    target = torch.tensor(ids[1:])
    nll = -logp[torch.arange(len(target)), target].mean()
    return math.exp(float(nll))


def compare(float_logits: torch.Tensor, quantized_logits: torch.Tensor, ids: list[int]) -> Agreement:
    """Top-1 agreement at every position and the perplexity of ``ids`` under both logit tensors ``(T, vocab)``."""
    agree = int((float_logits.argmax(-1) == quantized_logits.argmax(-1)).sum())
    return Agreement(len(ids), agree, perplexity(float_logits, ids), perplexity(quantized_logits, ids))


def check_quantize_at_load(folder, mode: str, group_size: int = 32, min_cosine: float = 0.9) -> int:
    """Load a float checkpoint twice, as float32 and quantized at load (``mode`` int8 or int4); compare logits.

    Asserts that some tensors were packed and that every position's logits have a
    cosine of at least ``min_cosine`` with the float ones. Returns the number of
    packed tensors. Random tiny weights have flat, near-uniform logits, on which
    int4/int8 noise weighs more than on trained ones (cosines 0.95 to 0.99 are
    normal); a wrong layout or scale gives cosines near 0. The check is on the
    wiring: the real files measure accuracy.
    """
    float_model = open_model(str(folder), LoadOptions(device="cpu", dtype="float32")).model
    packed = open_model(str(folder), LoadOptions(device="cpu", dtype="float32", quantize=mode, group_size=group_size)).model
    summary = packed.weights_summary
    assert summary.requested == mode and summary.packed > 0, summary.line()
    ids = torch.randint(0, float_model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0)).tolist()[0]
    a, b = logits_of(float_model, ids), logits_of(packed, ids)
    cosine = torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)
    assert float(cosine.min()) >= min_cosine, f"{mode}: min cosine {float(cosine.min()):.5f} ({summary.line()})"
    return summary.packed
