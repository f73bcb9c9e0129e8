"""A conversation with one model, reusing its cache from turn to turn: what ``lollm chat`` runs.

::

    a user message
        the chat template renders the whole conversation ─► token ids
        the prompt cache keeps what the last turn computed ─► only the new part is prefilled
        the answer streams out (``should_stop`` ends it early; the conversation keeps what came)
    then: the answer joins the conversation; drop_oldest(N) and reset() forget turns

A full context does not end the conversation. A turn is a user message and
its answer; when the next message would leave too little of the context
(``--ctx-size``) for an answer, the oldest turns leave the conversation (the
system message stays) and a note says how many, as ollama truncates old
messages and llama.cpp shifts its context. With ``--no-context-shift`` the
message is refused instead, with an error that names ``/drop N`` and
``/reset``; a message too long on its own is refused either way.

:class:`ChatSession` holds the conversation (messages, template flags, a
:class:`~lollm.generate.prompt_cache.PromptCache`). The terminal around it (reading
lines, ``/stats``, ``/drop N``, ``/reset``, Ctrl-C) is a command's, in :mod:`lollm.cli.chat`.
"""

from __future__ import annotations

from typing import Callable, Mapping

from lollm.errors import GenerationError, LollmError
from lollm.generate.loop import GenerationResult, generate
from lollm.generate.prompt_cache import CacheReuse, PromptCache
from lollm.sampling_params import SamplingParams
from lollm.load.pipeline import LoadedModel

#: The session context (``--ctx-size``) when none is given, capped by the model's own.
DEFAULT_CONTEXT = 4096


class ChatSession:
    """One conversation with a loaded model (see :func:`lollm.load.pipeline.open_model`).

    sampling:           the :class:`SamplingParams` of every answer.
    stop_ids:           end-of-sequence ids (:func:`lollm.generate.loop.stop_token_ids`).
    system:             a system message, kept across ``/reset`` and ``/drop``.
    template_flags:     extra template variables, e.g. ``{"enable_thinking": False}``.
    max_new_tokens:     most tokens per answer.
    speculative_tokens: draft tokens per step with the model's MTP head (0: off).
    context:            positions of the cache kept across turns (default
                        :data:`DEFAULT_CONTEXT`, at most the model's context; at least 2).
    context_shift:      when a message would not fit: drop the oldest turns (True, the
                        default, as ollama does) or raise an error that says how to go on.
    mmproj:             a GGUF model's vision tower file (llama.cpp's mmproj GGUF, ``lollm chat --mmproj``),
                        opened by :meth:`open_tower`; a safetensors model's tower is in its own files.

    Raises LollmError when the tokenizer has no chat template, GenerationError for a context below 2.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        sampling: SamplingParams,
        stop_ids: set[int],
        system: str | None = None,
        template_flags: Mapping[str, object] | None = None,
        max_new_tokens: int = 512,
        speculative_tokens: int = 0,
        context: int | None = None,
        context_shift: bool = True,
        mmproj: str | None = None,
    ):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        if self.tokenizer.chat_template is None:
            raise LollmError(
                f"{loaded.checkpoint.spec} has no chat template, so it cannot chat; "
                "use `lollm run --no-chat` for plain text completion"
            )
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.system = system
        self.template_flags = dict(template_flags or {})
        self.max_new_tokens = max_new_tokens
        self.speculative_tokens = speculative_tokens
        self.context_shift = context_shift
        if context is None:
            context = min(DEFAULT_CONTEXT, loaded.model.max_context)
        self.cache = PromptCache(loaded.model, context)  # GenerationError below 2 positions
        self.messages: list[dict[str, str]] = []
        self.last: GenerationResult | None = None
        self.dropped = 0  # the oldest turns the last answer made room by dropping
        self.mmproj = mmproj
        self.tower = None  # the model's vision tower, opened by open_tower (the first attach_image at the latest)
        self.pending: list = []  # images (lollm.vision.prompt.EncodedImage) for the next user message
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and the cache; the system message stays."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache.reset()
        self.last = None
        self.pending = []

    # -- turns: a user message and its answer; the oldest go first when the context is full --

    def turns(self) -> int:
        """The complete turns in the conversation (a user message and its answer), the system message aside."""
        return (len(self.messages) - (1 if self.system else 0)) // 2

    def _without_oldest(self, messages: list[dict[str, str]], n: int) -> list[dict[str, str]]:
        head = 1 if self.system else 0
        return messages[:head] + messages[head + 2 * n:]

    def drop_oldest(self, n: int = 1) -> int:
        """Forget the oldest ``n`` turns (all there are, when fewer); the system message stays. Returns how many went.

        The prompt cache keeps what the next prompt still shares with it (the system
        message) and prefills the rest (:mod:`lollm.generate.prompt_cache`).
        """
        n = max(0, min(n, self.turns()))
        self.messages = self._without_oldest(self.messages, n)
        return n

    def answer_room(self) -> int:
        """Positions a context shift leaves free for the answer: ``max_new_tokens``, at most a quarter of the context."""
        return max(1, min(self.max_new_tokens, self.cache.max_tokens // 4))

    def _too_long(self, tokens: int, older: int) -> GenerationError:
        """The error for a prompt of ``tokens`` that does not fit, saying how to go on."""
        where = (f"the context holds {self.cache.max_tokens} positions (--ctx-size; the model's own is "
                 f"{self.loaded.model.max_context})")
        if older == 0:
            system = " with the system message" if self.system else ""
            return GenerationError(f"this message makes a prompt of {tokens} tokens{system}, but {where}: "
                                   f"shorten it, or restart with a larger --ctx-size")
        return GenerationError(
            f"the conversation is full: with this message the prompt is {tokens} tokens, but {where}. To go on: "
            f"/drop N forgets the oldest N of the {older} turn(s), /reset starts over (the system message stays); "
            f"or restart with --context-shift (the oldest turns then go by themselves) or a larger --ctx-size"
        )

    def attach_image(self, image) -> int:
        """Attach a checked RGB ``PIL.Image`` (lollm.vision.image) to the next user message; how many wait now.

        It goes through the model's vision tower at once (opened on the first image). Raises ImageError
        for a model without a tower. A conversation holding images prefills its whole prompt every turn:
        the prompt cache matches prompts by ids, and every image's placeholder ids are the same.
        """
        from lollm.vision.prompt import encode_images

        self.pending.extend(encode_images(self.open_tower(), [image]))
        return len(self.pending)

    def open_tower(self):
        """The model's :class:`lollm.vision.spec.VisionTower` (from ``mmproj`` for a GGUF), opened once.

        Raises ImageError for a model without a tower (a GGUF without ``mmproj`` is told to pass one),
        LollmError for an ``mmproj`` beside a safetensors model or one that does not fit the model.
        """
        from lollm.vision.load import open_vision
        from lollm.vision.prompt import require_tower

        if self.tower is None:
            self.tower = require_tower(open_vision(self.loaded, self.mmproj), self.loaded.checkpoint.spec)
        return self.tower

    def _encode(self, messages: list[dict]) -> list[int]:
        """The chat prompt of ``messages``; with images among them, each placeholder the template wrote expanded
        into its image's tokens (docs/vision.md). ImageError when the template wrote another number."""
        images = [e for m in messages for e in m.get("images", ())]
        if not images:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True, **self.template_flags)
        from lollm.vision.chat import encode_chat_with_images

        return encode_chat_with_images(messages, [e.embeds.shape[0] for e in images], self.tower.spec, self.tokenizer,
                                       model=self.loaded.checkpoint.spec, parse_special=True, **self.template_flags)

    def prompt(self, text: str) -> tuple[list[dict[str, str]], list[int], int]:
        """The next prompt with the user message ``text``: ``(messages, ids, dropped)``.

        ``ids`` must leave at least one position of the context for the answer. With
        ``context_shift``, when they leave less than :meth:`answer_room`, the fewest
        oldest turns are dropped that make the room (found by bisection: a few
        renders of the template, not one per turn); ``dropped`` says how many.
        Raises GenerationError (see :meth:`_too_long`) when the prompt cannot fit:
        without ``context_shift``, or with this message alone too long.
        """
        user: dict = {"role": "user", "content": text}
        if self.pending:  # the template writes the family's placeholder for each image part (docs/vision.md)
            user = {"role": "user", "content": [{"type": "image"}] * len(self.pending) + [{"type": "text", "text": text}],
                    "images": list(self.pending)}
        messages = self.messages + [user]
        context, older = self.cache.max_tokens, self.turns()
        encoded: dict[int, list[int]] = {}

        def ids_without(n: int) -> list[int]:
            if n not in encoded:
                encoded[n] = self._encode(self._without_oldest(messages, n))
            return encoded[n]

        room = self.answer_room() if self.context_shift else 1
        if len(ids_without(0)) + room <= context or (older == 0 and len(ids_without(0)) < context):
            return messages, ids_without(0), 0
        if not self.context_shift or older == 0:
            raise self._too_long(len(ids_without(0)), older)
        if len(ids_without(older)) >= context:
            raise self._too_long(len(ids_without(older)), 0)
        low, high = 1, older  # the fewest turns to drop: ids_without(high) leaves the room (or it is all of them)
        while low < high:
            middle = (low + high) // 2
            if len(ids_without(middle)) + room <= context:
                high = middle
            else:
                low = middle + 1
        return self._without_oldest(messages, high), ids_without(high), high

    def reply(
        self,
        text: str,
        *,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Answer the user message ``text``; the message and the answer join the conversation.

        An answer stopped by ``should_stop`` joins it as far as it got. When the
        oldest turns must go to make room (:meth:`prompt`), ``on_drop(n)`` hears
        it before the answer starts. On an error (a message longer than the
        context, a full context without ``context_shift``, a template that does not render
        image parts ...) the conversation is left as it was before the message, and the images
        attached for it are dropped too (the error says so): the next message starts clean.
        """
        try:
            messages, ids, dropped = self.prompt(text)
            images = self._placed(messages, ids)
        except LollmError as error:
            raise self._failed_turn(error) from None
        if dropped and on_drop is not None:
            on_drop(dropped)
        if images is not None:
            self.cache.reset()  # its ids say nothing of the pixels: the whole prompt runs (docs/vision.md)
        result = generate(
            self.loaded.model, ids, max_new_tokens=self.max_new_tokens, sampling=self.sampling, stop_ids=self.stop_ids,
            tokenizer=self.tokenizer, on_text=on_text, speculative_tokens=self.speculative_tokens,
            prompt_cache=self.cache if images is None else None, should_stop=should_stop, images=images,
        )
        if images is not None:
            self.cache.last = CacheReuse(len(ids), 0, len(ids), "off: the prompt holds images")
        self.pending = []
        self.messages = messages + [{"role": "assistant", "content": result.text}]
        self.last, self.dropped = result, dropped
        return result

    def _failed_turn(self, error: LollmError) -> LollmError:
        """``error``, of the same class, saying the images attached for the failed message were dropped (if any)."""
        if not self.pending:
            return error
        n, self.pending = len(self.pending), []
        return type(error)(f"{error} (the {n} image(s) attached for this message were dropped with it; the "
                           "conversation is as it was: /image attaches again)")

    def _placed(self, messages: list[dict], ids: list[int]):
        """The ImageBatch of the images in ``messages`` (in order) over ``ids``, or None without images."""
        images = [e for m in messages for e in m.get("images", ())]
        if not images:
            return None
        from lollm.vision.prompt import place_images

        return place_images(ids, self.tower.spec, images, max_context=self.cache.max_tokens)

    def stats(self) -> str:
        """The last turn's token counts and speed, and how full the cache is."""
        if self.last is None or self.cache.last is None:
            return "no turn yet"
        r, reuse = self.last, self.cache.last
        cache = self.cache.cache
        return (
            f"last turn: prompt {reuse.prompt_tokens} tokens: {reuse.reused} reused from the cache ({reuse.how}), "
            f"{reuse.prefilled} prefilled; answer {len(r.new_ids)} tokens\n"
            f"speed: prefill {r.prefill_tokens_per_second:.1f} tok/s, decode {r.decode_tokens_per_second:.1f} tok/s; "
            f"stop: {r.stop_reason}\n"
            f"cache: {cache.length if cache is not None else 0} of {self.cache.max_tokens} positions, "
            f"{len(self.cache.snapshots)} snapshot(s)"
        )
