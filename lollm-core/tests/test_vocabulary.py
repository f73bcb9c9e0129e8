"""The tokenizer's compact tables: the vocabulary in flat arrays (lollm.tokenizer.vocabulary), which must
answer exactly as a dict would, and the added tokens' prefix-tree regex, which must match exactly as the
plain longest-first alternation does."""

from __future__ import annotations

import random
import re

import pytest

from lollm.errors import TokenizerError
from lollm.tokenizer.added_tokens import MAX_TRIE_DEPTH, literal_pattern
from lollm.tokenizer.vocabulary import Vocabulary


class Colliding(Vocabulary):
    """Every text hashes to one of three values: the table's probing and byte comparison do all the work."""

    hash_text = staticmethod(lambda text: len(text.encode("utf-8", "surrogatepass")) % 3)


def _pieces(seed: int, n: int) -> list[str]:
    """Distinct texts: ASCII, accents, CJK, 4-byte emoji, the empty text, and prefixes of one another."""
    rng = random.Random(seed)
    alphabet = "ab▁é中🙂<>0x"
    pieces = {"", "a", "ab", "abc", "▁", "▁▁", "🙂", "<0x0A>"}
    while len(pieces) < n:
        pieces.add("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))))
    ordered = sorted(pieces)
    rng.shuffle(ordered)
    return ordered


def _queries(pieces: list[str]) -> list[str]:
    """Every piece, and texts near them that are not pieces (a character more or less, another last one)."""
    near = [p + "z" for p in pieces] + [p[:-1] for p in pieces] + [p[:-1] + "q" for p in pieces if p]
    return pieces + near + ["\ud800", "a\udcff", "z" * 40]


@pytest.mark.parametrize("kind", [Vocabulary, Colliding], ids=["python hash", "colliding hash"])
def test_answers_as_a_dict(kind):
    pieces = _pieces(0, 400)
    reference = {piece: i for i, piece in enumerate(pieces)}
    vocab = kind(pieces, source="test")
    for query in _queries(pieces):
        assert vocab.get(query) == reference.get(query), query
        assert (query in vocab) == (query in reference)
    assert vocab.get("nope", -7) == -7 and 3 not in vocab and vocab["ab"] == reference["ab"]
    with pytest.raises(KeyError):
        vocab["nope"]
    assert [vocab.piece(i) for i in range(len(pieces))] == pieces
    assert vocab.piece(-1) is None and vocab.piece(len(pieces)) is None
    assert list(vocab) == pieces and list(vocab.items()) == list(reference.items())
    assert len(vocab) == vocab.size == len(pieces) and dict(vocab) == reference


@pytest.mark.parametrize("kind", [Vocabulary, Colliding], ids=["python hash", "colliding hash"])
def test_far_and_missing_ids(kind):
    """A mapping whose ids have holes and one far id: the ids array answers id -> piece."""
    mapping = {"a": 0, "b": 2, "c": 3, "zz": 10**6}
    vocab = kind.from_mapping(mapping, source="test")
    assert vocab._ids is not None and vocab.size == 10**6 + 1 and len(vocab) == 4
    assert [vocab.get(p) for p in mapping] == list(mapping.values())
    assert [vocab.piece(i) for i in (0, 1, 2, 3, 4, 10**6, 10**6 + 1)] == ["a", None, "b", "c", None, "zz", None]
    dense = kind.from_mapping({"b": 1, "a": 0}, source="test")
    assert dense._ids is None and list(dense) == ["a", "b"] and Vocabulary.from_mapping(dense) is dense


@pytest.mark.parametrize("kind", [Vocabulary, Colliding], ids=["python hash", "colliding hash"])
def test_refuses_repeats_and_bad_entries(kind):
    with pytest.raises(TokenizerError, match=r"test: token 'ab' appears twice \(ids 1 and 3\)"):
        kind(["a", "ab", "b", "ab"], source="test")
    with pytest.raises(TokenizerError, match=r"test: tokens 'a' and 'b' share the id 4"):
        kind.from_mapping({"a": 4, "b": 4}, source="test")
    with pytest.raises(TokenizerError, match=r"test: token 'a' has the negative id -1"):
        kind.from_mapping({"a": -1, "b": 4}, source="test")
    with pytest.raises(TokenizerError, match=r"test: token #1 is a int, not a string"):
        kind(["a", 5], source="test")
    with pytest.raises(TokenizerError, match=r"test: token #1 '\\ud800' has no UTF-8 spelling"):
        kind(["a", "\ud800"], source="test")
    with pytest.raises(TokenizerError, match=r"not in increasing order \(5 before 2\)"):
        kind(["a", "b"], [5, 2], source="test")


def test_a_real_sized_vocabulary_is_flat():
    """262,144 pieces (Gemma 3's count): a handful of arrays, every piece found, the table at most half full."""
    pieces = [f"▁piece{i}" for i in range(262_144)]
    vocab = Vocabulary(pieces)
    assert [vocab.get(pieces[i]) for i in range(0, 262_144, 997)] == list(range(0, 262_144, 997))
    assert len(vocab._slots) >= 2 * len(pieces)
    assert sum(1 for entry in vocab._slots if entry >= 0) == len(pieces)


def _alternation(contents: set[str]) -> re.Pattern:
    """The plain matcher: every text, longest first (a regex tries its branches in order)."""
    return re.compile("|".join(re.escape(c) for c in sorted(contents, key=lambda c: (-len(c), c))))


@pytest.mark.parametrize("seed", range(6))
def test_the_prefix_tree_matches_as_the_longest_first_alternation(seed):
    """Texts sharing prefixes, texts inside others, regex metacharacters: the same matches, span for span."""
    rng = random.Random(seed)
    alphabet = "ab<>|.*?()[]\\ \t▁中🙂"
    contents = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 60))}
    contents |= {"<unused1>", "<unused10>", "<unused101>", "\t", "\t\t", "\t\t\t"}
    tree, plain = re.compile(literal_pattern(contents)), _alternation(contents)
    pieces = sorted(contents) + list(alphabet) + ["<unused", "<unused1", "<unused10", "<unused1011"]
    for _ in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert [m.span() for m in tree.finditer(text)] == [m.span() for m in plain.finditer(text)], text


def test_a_deep_prefix_tree_is_written_flat():
    """Tokens "a", "aa", ... nest one group per length; past MAX_TRIE_DEPTH the plain alternation is used
    (Python's re parses groups recursively: a thousand nested groups exceed its recursion limit), and it
    matches the same."""
    deep = {"a" * n for n in range(1, 1200)}
    pattern = literal_pattern(deep)
    assert pattern == _alternation(deep).pattern
    text = "a" * 2500 + "b" + "a" * 7
    assert [m.span() for m in re.finditer(pattern, text)] == [(0, 1199), (1199, 2398), (2398, 2500), (2501, 2508)]
    assert literal_pattern({"a" * n for n in range(1, 6)}) == "a(?:a(?:a(?:a(?:a|)|)|)|)"
    assert literal_pattern({"a" * n for n in range(1, MAX_TRIE_DEPTH + 2)}).startswith("a(?:")
