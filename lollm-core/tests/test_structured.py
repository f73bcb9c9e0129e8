"""lollm.generate.structured without a model: the constraint record, its checks, and the token mask on real vocabularies.

The mask is checked against an independent route: a brute-force pass over every id of
the real Qwen2.5 (151,936 ids, byte-level BPE) and Gemma 3 (262,144 ids, SentencePiece)
vocabularies, read from their GGUF files by lollm's tokenizer. An id must be allowed
exactly when its bytes, appended to the text so far, stay a prefix of one of the
schema's complete answers. (Where the next text is *forced*, llguidance allows only its
canonical tokenization, a subset: those states are left out of the brute-force check
and tested on their own.)
"""

from __future__ import annotations

import pytest
import torch

from lollm.errors import LollmError
from lollm.generate.sampling import Sampler, SamplingParams
from lollm.generate.structured import (ConstraintError, OutputConstraint, check_constraint, compile_constraint, json_rule,
                              tagged_json)

BOOLEAN = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
WORDS = ["tea", "team", "tease", "toast", "tx"]
ENUM = {"type": "object", "properties": {"c": {"enum": WORDS}}, "required": ["c"], "additionalProperties": False}
#: every complete answer of each schema, with lollm's separators
ANSWERS = {"boolean": [b'{"ok": true}', b'{"ok": false}'], "enum": [b'{"c": "%s"}' % w.encode() for w in WORDS]}
SCHEMAS = {"boolean": BOOLEAN, "enum": ENUM}


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def vocabulary(request):
    """(tokenizer, vocab_size, stop ids) of a real GGUF."""
    from lollm.gguf import GGUFFile
    from lollm.cli.real_models import fetch_gguf
    from lollm.tokenizer import load_gguf_tokenizer

    path = fetch_gguf(request.param)
    tokenizer = load_gguf_tokenizer(path)
    with GGUFFile(path) as gguf:
        vocab_size = len(gguf.metadata["tokenizer.ggml.tokens"])
    vocab_size = {"qwen2.5-coder-0.5b-instruct": 151936}.get(request.param, vocab_size)  # Qwen's embedding is padded
    return tokenizer, vocab_size, {tokenizer.eos_token_id}


def _brute_force(tokenizer, answers: list[bytes], prefix: bytes) -> set[int]:
    """Every text id whose bytes keep ``prefix`` on the way to one of ``answers`` (no special ids, no empty ones)."""
    allowed = set()
    for i in range(tokenizer.vocab_size):
        if i in tokenizer.special_token_ids:
            continue
        piece = tokenizer.token_bytes(i)
        if piece and any(answer.startswith(prefix + piece) for answer in answers):
            allowed.add(i)
    return allowed


def _walk(matcher, tokenizer, text: str) -> None:
    for token in tokenizer.encode(text, add_special_tokens=False):
        matcher.accept(token)


@pytest.mark.parametrize("schema, prefix", [("boolean", '{"ok":'), ("boolean", '{"ok": '), ("enum", '{"c": "t'),
                                            ("enum", '{"c": "tea')])
def test_the_mask_equals_a_brute_force_pass_over_the_vocabulary(vocabulary, schema, prefix):
    tokenizer, vocab_size, stops = vocabulary
    matcher = compile_constraint(OutputConstraint.json_schema(SCHEMAS[schema]), tokenizer, vocab_size=vocab_size,
                                 stop_ids=stops).matcher()
    _walk(matcher, tokenizer, prefix)
    allowed = set(matcher.allowed().nonzero().flatten().tolist())
    expected = _brute_force(tokenizer, ANSWERS[schema], prefix.encode())
    assert allowed == expected
    assert len(expected) > 1  # a real choice: several tokens, some of them spanning a separator and a value


def test_forced_text_and_the_end(vocabulary):
    """Forced text is one canonical path; once complete only the end ids are allowed, and they end it."""
    tokenizer, vocab_size, stops = vocabulary
    matcher = compile_constraint(OutputConstraint.json_schema(BOOLEAN), tokenizer, vocab_size=vocab_size,
                                 stop_ids=stops).matcher()
    first = matcher.allowed().nonzero().flatten().tolist()
    assert first and all(b'{"ok": true}'.startswith(tokenizer.token_bytes(i)) for i in first)
    _walk(matcher, tokenizer, '{"ok": true}')
    assert matcher.can_end and matcher.is_terminated
    assert set(matcher.allowed().nonzero().flatten().tolist()) == stops
    logits = torch.zeros(vocab_size)
    masked = matcher.mask(logits)
    assert torch.isfinite(masked).sum() == len(stops)
    matcher.reset()
    assert not matcher.can_end and matcher.allowed().nonzero().flatten().tolist() == first


def test_a_forbidden_token_is_an_error(vocabulary):
    tokenizer, vocab_size, stops = vocabulary
    matcher = compile_constraint(OutputConstraint.regex("[0-9]+"), tokenizer, vocab_size=vocab_size, stop_ids=stops).matcher()
    (letter,) = [i for i in tokenizer.encode("x", add_special_tokens=False)]
    with pytest.raises(ConstraintError, match="not allowed"):
        matcher.accept(letter)


@pytest.mark.parametrize("pattern, text", [("a/b", "a/b"), (r"x\/y", "x/y"), (r"[0-9]{2}\.[0-9]", "42.5")])
def test_a_regex_matches_the_whole_output(vocabulary, pattern, text):
    tokenizer, vocab_size, stops = vocabulary
    matcher = compile_constraint(OutputConstraint.regex(pattern), tokenizer, vocab_size=vocab_size, stop_ids=stops).matcher()
    _walk(matcher, tokenizer, text)
    assert matcher.can_end and set(matcher.allowed().nonzero().flatten().tolist()) == stops


def test_special_tokens_and_padding_rows_are_never_text(vocabulary):
    """A JSON string allows almost any text token, but no special id and no id past the tokenizer."""
    tokenizer, vocab_size, stops = vocabulary
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"], "additionalProperties": False}
    matcher = compile_constraint(OutputConstraint.json_schema(schema), tokenizer, vocab_size=vocab_size, stop_ids=stops).matcher()
    _walk(matcher, tokenizer, '{"s": "')
    allowed = matcher.allowed()
    assert int(allowed.sum()) > 0.5 * tokenizer.vocab_size
    assert not any(bool(allowed[i]) for i in tokenizer.special_token_ids if i < vocab_size)
    assert not bool(allowed[tokenizer.vocab_size:].any())


# -- the record and its checks (no vocabulary) ----------------------------------------------------------


@pytest.mark.parametrize("make, message", [
    (lambda: OutputConstraint("xml", "x"), "unknown constraint kind"),
    (lambda: OutputConstraint("json_schema", "not a dict"), "takes a JSON object"),
    (lambda: OutputConstraint("regex", None), "takes a string"),
    (lambda: OutputConstraint("json_object", {"type": "object"}), "takes no value"),
    (lambda: tagged_json("<a>", {}, "</a>", min_count=2, max_count=1), "min_count"),
    (lambda: json_rule(["not", "a", "schema"]), "JSON object"),
])
def test_bad_constraints_are_refused(make, message):
    with pytest.raises(ConstraintError, match=message):
        make()


@pytest.mark.parametrize("constraint, named", [
    (OutputConstraint.json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
    (OutputConstraint.json_schema({"not": {"type": "integer"}}), '"not"'),
    (OutputConstraint.json_schema({"type": "string", "pattern": "(?<=a)b"}), "look-around"),
    (OutputConstraint.regex("(unclosed"), "regex"),
    (OutputConstraint.grammar("start: nowhere"), "nowhere"),
])
def test_what_cannot_be_enforced_is_named(constraint, named):
    with pytest.raises(ConstraintError, match=named) as caught:
        check_constraint(constraint)
    assert isinstance(caught.value, LollmError) and " | " not in str(caught.value)  # no echo of the grammar's source


def test_a_constraint_needs_end_ids_inside_the_vocabulary():
    with pytest.raises(ConstraintError, match="end-of-sequence id"):
        compile_constraint(OutputConstraint.json_object(), object(), vocab_size=10, stop_ids=[])
    with pytest.raises(ConstraintError, match="0 .. 9"):
        compile_constraint(OutputConstraint.json_object(), object(), vocab_size=10, stop_ids=[12])


def test_tagged_json_grammar_text():
    grammar = tagged_json("<tool_call>\n", {"type": "object"}, "\n</tool_call>", max_count=None).lark()
    assert grammar.startswith('start: block ("\\n" block)*\nblock: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {')
    assert '"whitespace_flexible": false' in grammar
    check_constraint(OutputConstraint.grammar(grammar))
    check_constraint(tagged_json("<a>", {"type": "integer"}, "</a>", min_count=0, max_count=3))


# -- the sampler's allowed ids ------------------------------------------------------------------------


def test_the_sampler_picks_only_allowed_ids():
    logits = torch.linspace(0, 10, 100)  # id 99 is by far the likeliest
    allowed = torch.zeros(100, dtype=torch.bool)
    allowed[[3, 40, 41]] = True
    assert Sampler(SamplingParams(temperature=0))(logits, torch.tensor([], dtype=torch.long), allowed) == 41
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=50, seed=0))
    picks = {sampler(logits, torch.tensor([99]), allowed) for _ in range(200)}
    assert picks == {3, 40, 41}  # top-k keeps the best *allowed* ids: all three drawn, nothing else
    assert Sampler(SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=1))(logits, torch.tensor([41]), allowed) in (3, 40, 41)
