"""A budget for the thinking: the Messages API's ``thinking: {"type": "enabled", "budget_tokens": N}``, enforced.

A thinking model (lollm.serve.reasoning) ends its thinking when it likes. With a budget of
``N`` tokens the server runs the answer in two phases, one after the other, as two jobs of
the same engine::

    phase 1: the prompt ........................ at most N tokens, stopped at "</think>"
             <think>\\nThe user wants ... the fox is in</think>
    between: the thinking did not close in N tokens -> the server writes "</think>" itself;
             then the gap the template writes before the answer ("\\n\\n")
    phase 2: prompt + phase 1 + between ........ the rest of max_tokens: the answer
             \\n\\nThe fox is in the garden.

Phase 2's prompt begins with phase 1's whole sequence, so the engine's prefix cache holds
most of it already: only the few tokens written between the phases are prefilled again.
An output constraint (``output_config``, a forced tool call) binds phase 2 alone: it
begins right after the thinking, where the answer starts. A stream sends phase 1's text,
then the text written between, then phase 2's text, through the same callbacks, so the
reasoning splitter sees one text: the thinking deltas, then the answer's, and a stream
equals the whole answer.

What the client sees: ``usage.output_tokens`` counts every token of the answer, the
server's own ``</think>`` and gap included (they are part of the sequence the model
continued). A model that does not open a thinking (Qwen3's template lets it answer at
once) and writes more than ``N`` tokens is simply continued in phase 2: its answer is not
cut. With an output constraint, that case cannot be continued (the constraint's place in
phase 1 is lost), so such a request is refused up front: see :func:`check_budget`.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

from lollm.generate.loop import GenerationResult
from lollm.generate.structured import CompiledConstraint
from lollm.serve.model_server import ModelServer
from lollm.serve.reasoning import CLOSE, GAP, ReasoningSplitter
from lollm.serve.requests import ApiError, Job, PreparedRequest
from lollm.tokenizer import Tokenizer

#: Phase 1 ends with these stop reasons only when the budget or "</think>" ended it; any other is the answer's end.
_GO_ON = ("max_new_tokens", "stop_string")


@dataclasses.dataclass
class ThinkingBudget:
    """At most ``tokens`` tokens of thinking, for a job whose answer begins in reasoning ``state`` ("start" / "inside").

    answer_constraint: what phase 2 must follow (the request's constraint without the
    thinking in front of it, :func:`lollm.serve.reasoning.after_thinking`'s ``constraint``), or None.
    """

    tokens: int
    state: str
    answer_constraint: CompiledConstraint | None = None


def check_budget(budget: ThinkingBudget, job: Job) -> None:
    """ApiError 400 (param ``thinking.budget_tokens``) for a budget that cannot be kept exactly (see the module's text)."""
    if budget.state == "start" and job.constraint is not None:
        raise ApiError(400, "thinking.budget_tokens: this model's template lets the model choose whether it thinks, and "
                            "a budget cannot be combined with an output constraint (output_config, tool_choice any or "
                            "tool) there; leave out budget_tokens (use {\"type\": \"adaptive\"})",
                       param="thinking.budget_tokens")


def between(tokenizer: Tokenizer, budget: ThinkingBudget, result: GenerationResult) -> tuple[str, list[int]] | None:
    """What comes between the phases, as (text, ids the server adds); None when phase 1 ended the answer itself.

    Phase 1 stopped at ``</think>`` (the model closed its thinking): the text ``</think>``
    (a stop string: held back from phase 1's text, its token is in ``new_ids``) and the gap. Phase 1 ran out
    of its ``tokens`` inside the thinking: ``</think>`` and the gap. Out of tokens before any
    thinking opened, or after an answer began (Qwen3 answering at once): nothing, it continues.
    """
    if result.stop_reason not in _GO_ON:
        return None
    if result.stop_reason == "stop_string":
        tail = tokenizer.decode(result.new_ids)[len(result.text):]
        if not tail.startswith(CLOSE):
            return None  # one of the client's stop sequences: the answer ends here
        return CLOSE + GAP, tokenizer.encode(GAP, add_special_tokens=False, parse_special=False)  # "</think>": in new_ids
    splitter = ReasoningSplitter(budget.state)
    splitter.feed(result.text)
    if splitter.state != "inside":
        return "", []
    return CLOSE + GAP, tokenizer.encode(CLOSE + GAP, add_special_tokens=False, parse_special=True)


def joined(first: GenerationResult, text: str, ids: list[int], second: GenerationResult) -> GenerationResult:
    """The two phases as one GenerationResult: the first's prompt, every token after it, the second's stop reason."""
    return GenerationResult(prompt_ids=first.prompt_ids, new_ids=first.new_ids + ids + second.new_ids,
                            text=first.text + text + second.text, stop_reason=second.stop_reason,
                            prefill_seconds=first.prefill_seconds + second.prefill_seconds,
                            decode_seconds=first.decode_seconds + second.decode_seconds,
                            reused_tokens=first.reused_tokens, logprobs=first.logprobs + second.logprobs)


def submit(server: ModelServer, budget: ThinkingBudget, job: Job) -> Future[GenerationResult | None]:
    """Run ``job`` on ``server`` in the budget's two phases; a Future of the joined result (as ``server.submit``'s).

    Both phases share ``job``'s cancel flag and callbacks (``on_text`` gets phase 1's text,
    the text written between, then phase 2's). ApiError 503 at once when the queue is full
    for phase 1; phase 2's refusal (the server closing) becomes the Future's error.
    """
    if budget.tokens >= job.max_tokens:  # the token limit comes first: no budget to keep
        return server.submit(job)
    first = dataclasses.replace(job, max_tokens=budget.tokens, stop=[*job.stop, CLOSE])
    outer: Future[GenerationResult | None] = Future()

    def second_done(future: Future, head: GenerationResult, text: str, ids: list[int], second: Job) -> None:
        job.shutdown = job.shutdown or second.shutdown
        if not future.cancelled() and future.exception() is not None:
            outer.set_exception(future.exception())
        elif future.cancelled() or future.result() is None:
            outer.set_result(head)  # cancelled between the phases: the answer so far
        else:
            outer.set_result(joined(head, text, ids, future.result()))

    def first_done(future: Future) -> None:
        job.shutdown = first.shutdown
        try:
            head = None if future.cancelled() else future.result()
            gap = between(server.tokenizer, budget, head) if head is not None and not job.cancel.is_set() else None
            rest = job.max_tokens - len(head.new_ids) - len(gap[1]) if gap is not None else 0
            if gap is None or rest <= 0:
                outer.set_result(head)
                return
            text, ids = gap
            if text and job.on_text is not None:
                job.on_text(text)
            second = dataclasses.replace(job, ids=[*job.ids, *head.new_ids, *ids], max_tokens=rest,
                                         constraint=budget.answer_constraint)
            server.submit(second).add_done_callback(lambda f: second_done(f, head, text, ids, second))
        except BaseException as error:  # noqa: BLE001  (handed to whoever waits on the Future)
            outer.set_exception(error)

    server.submit(first).add_done_callback(first_done)
    return outer


class BudgetedServer:
    """A ModelServer whose :meth:`submit` runs a thinking budget's two phases; every other attribute is the server's."""

    def __init__(self, server: ModelServer, budget: ThinkingBudget):
        self.server, self.budget = server, budget

    def __getattr__(self, name: str) -> object:  # any other attribute: the server's own
        return getattr(self.server, name)

    def submit(self, job: Job) -> Future[GenerationResult | None]:
        return submit(self.server, self.budget, job)


def budgeted(server: ModelServer, plan: PreparedRequest) -> ModelServer | BudgetedServer:
    """``server``, or the :class:`BudgetedServer` that keeps the plan's thinking budget (``plan.extra["thinking_budget"]``)."""
    budget = plan.extra.get("thinking_budget")
    return server if budget is None else BudgetedServer(server, budget)
