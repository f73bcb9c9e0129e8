"""xgrammar against llguidance on this CPU: the figures behind lollm.generate.structured's choice of library.

Run: ``python lollm-core/benchmarks/compare_grammar_libraries.py`` (needs both libraries:
``pip install xgrammar==0.2.9 llguidance==1.9.1``, and the real GGUF tokenizers of
lollm.cli.real_models). Prints, for the real Qwen2.5 tokenizer (151,936 ids) and the
real Gemma 3 tokenizer (262,144 ids), both read by lollm's own tokenizer code:

* the vocabulary preparation (once per tokenizer),
* the compile time of a realistic JSON schema (nested objects, enums, integer ranges,
  bounded arrays, optional fields), best of 3 rounds,
* the time per token to fill the token mask while walking a valid answer, token by token
  (the mask is filled before each token, the token then accepted), median over the answer.

Rounds alternate xgrammar / llguidance. No figure here is asserted: it is a measurement.
"""

from __future__ import annotations

import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string"},
                "tier": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 5,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
        "note": {"type": "string"},
    },
    "required": ["id", "customer", "items"],
    "additionalProperties": False,
}
ANSWER = {
    "id": 4242,
    "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "tier": "pro"},
    "items": [{"sku": "BOOK-17", "quantity": 2, "price": 12.5}, {"sku": "PEN-3", "quantity": 10, "price": 0.99}],
    "gift": False,
}


def _vocab(tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes as lollm decodes it (special tokens marked with a 0xFF prefix, as llguidance wants)."""
    out = []
    for i in range(vocab_size):
        if i >= tokenizer.vocab_size:
            out.append(b"")
        elif i in tokenizer.special_token_ids:
            out.append(b"\xff" + tokenizer.id_to_token(i).encode())
        else:
            out.append(tokenizer.token_bytes(i))
    return out


def _xgrammar(tokenizer, vocab: list[bytes], stop: list[int], answer_ids: list[int]) -> dict[str, float]:
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    raw = [b if not b.startswith(b"\xff") else b"" for b in vocab]  # xgrammar: special tokens by stop/special ids
    info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=stop)
    prep = time.perf_counter() - t0
    compiles = []
    for _ in range(3):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
        compiles.append(time.perf_counter() - t0)
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    fills = []
    for tok in answer_ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        fills.append(time.perf_counter() - t0)
        assert bool((bitmask[0, tok // 32] >> (tok % 32)) & 1), f"xgrammar masked out a token of the answer: {tok}"
        assert matcher.accept_token(tok)
    del torch
    return {"prepare_s": prep, "compile_s": min(compiles), "fill_ms_median": 1e3 * statistics.median(fills),
            "fill_ms_max": 1e3 * max(fills)}


def _llguidance(tokenizer, vocab: list[bytes], stop: list[int], answer_ids: list[int]) -> dict[str, float]:
    import llguidance
    import numpy as np

    class _Wrap:
        eos_token_id = stop[0]
        bos_token_id = tokenizer.bos_token_id
        tokens = vocab
        special_token_ids = sorted(tokenizer.special_token_ids)

        def __call__(self, text):
            return tokenizer.encode(text.decode() if isinstance(text, bytes) else text, add_special_tokens=False)

    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrap()), n_vocab=len(vocab), eos_token=stop)
    prep = time.perf_counter() - t0
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=options)
    compiles = []
    for _ in range(3):
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar)
        compiles.append(time.perf_counter() - t0)
    assert not matcher.is_error(), matcher.get_error()
    bitmask = np.zeros(((len(vocab) + 31) // 32,), dtype=np.int32)
    fills = []
    for tok in answer_ids:
        t0 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        fills.append(time.perf_counter() - t0)
        assert (int(bitmask[tok // 32]) >> (tok % 32)) & 1, f"llguidance masked out a token of the answer: {tok}"
        assert matcher.consume_token(tok), matcher.get_error()
    return {"prepare_s": prep, "compile_s": min(compiles), "fill_ms_median": 1e3 * statistics.median(fills),
            "fill_ms_max": 1e3 * max(fills)}


def main() -> None:
    from lollm.cli.real_models import fetch_gguf
    from lollm.tokenizer import load_gguf_tokenizer

    text = json.dumps(ANSWER)
    for name, vocab_size in (("qwen2.5-coder-0.5b-instruct", 151_936), ("gemma-3-270m", 262_144)):
        tokenizer = load_gguf_tokenizer(fetch_gguf(name))
        vocab = _vocab(tokenizer, vocab_size)
        stop = [tokenizer.eos_token_id]
        answer_ids = tokenizer.encode(text, add_special_tokens=False)
        print(f"\n{name}: vocabulary {vocab_size:,} ids, answer {len(answer_ids)} tokens")
        results: dict[str, list[dict[str, float]]] = {"xgrammar": [], "llguidance": []}
        for _ in range(2):  # alternating rounds
            results["xgrammar"].append(_xgrammar(tokenizer, vocab, stop, answer_ids))
            results["llguidance"].append(_llguidance(tokenizer, vocab, stop, answer_ids))
        for lib, rounds in results.items():
            best = {k: min(r[k] for r in rounds) for k in rounds[0]}
            print(f"  {lib:10s} prepare vocab {best['prepare_s']:6.2f} s · compile schema {1e3 * best['compile_s']:7.1f} ms"
                  f" · fill mask per token: median {best['fill_ms_median']:6.3f} ms, max {best['fill_ms_max']:7.2f} ms")


if __name__ == "__main__":
    main()
