"""Claims the docs make about the code, read from the pages and held to the code's own constants.

A page that states a number the code also holds can drift from it silently: the code changes and
the prose does not, or the other way round. Each test here reads the number from the page and
from the code and fails when the two part, naming both. The same holds for what a page says of the real
files (the Qwen2.5 head) and for the links between pages.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
NATIVE = REPO / "lollm-core" / "src" / "lollm" / "native"


def _cpp_constant(source: Path, name: str) -> int:
    """The value of ``constexpr int64_t NAME = N;`` in a C++ source. Raises AssertionError when the
    line is missing (the constant was renamed or moved: update this test and the docs with it)."""
    found = re.findall(rf"constexpr\s+int64_t\s+{name}\s*=\s*(\d+)\s*;", source.read_text(encoding="utf-8"))
    assert len(found) == 1, f"{source.name}: expected one 'constexpr int64_t {name} = N;', found {len(found)}"
    return int(found[0])


def test_the_many_rows_rule_the_docs_state_is_the_codes():
    """The rule for many rows, stated once in docs/quantized-execution.md ("Many rows"), and every
    "AMX tiles from N rows" on any page, against lollm/native/block_int8.cpp and lollm.load.

    The rule: no packed layer switches its path by row count (``native_gemm_rows()`` is a kept
    name that returns None); inside the kernel the AMX tiles take a call from ``kTileMinRows``
    rows. Fails if the page's number, any page's "tiles from N rows", the C++ constant, or
    ``native_gemm_rows()`` changes without the others.
    """
    from lollm.load.packed_linear import native_gemm_rows

    tile_rows = _cpp_constant(NATIVE / "block_int8.cpp", "kTileMinRows")
    page = DOCS / "quantized-execution.md"
    text = page.read_text(encoding="utf-8")
    rule = re.search(r"<!-- tested: the many-rows rule -->\n(.*?)\n\n", text, re.S)
    assert rule, f"{page.name} has no paragraph after '<!-- tested: the many-rows rule -->'"
    rule = " ".join(rule.group(1).split())
    stated = re.search(r"AMX tiles take the call from (\d+) rows", rule)
    assert stated, f"{page.name}'s many-rows rule no longer says 'AMX tiles take the call from N rows': {rule!r}"
    assert int(stated.group(1)) == tile_rows, (
        f"{page.name} says the AMX tiles take over from {stated.group(1)} rows; "
        f"block_int8.cpp's kTileMinRows is {tile_rows}")
    assert "`native_gemm_rows()` returns None" in rule and "no packed layer switches" in rule.lower(), (
        f"{page.name}'s many-rows rule must say that no packed layer switches by row count and that "
        f"native_gemm_rows() returns None: {rule!r}")
    assert native_gemm_rows() is None, "native_gemm_rows() returns a row count again: docs/quantized-execution.md says None"

    wrong = []
    for doc in sorted(DOCS.glob("*.md")) + [REPO / "README.md"]:
        flat = " ".join(doc.read_text(encoding="utf-8").split())
        wrong += [f"{doc.name}: {m.group(0)!r}" for m in re.finditer(r"tiles from (\d+) rows", flat)
                  if int(m.group(1)) != tile_rows]
    assert not wrong, f"pages that give the AMX tiles another row count than kTileMinRows = {tile_rows}: {wrong}"


def test_qwen25_head_is_untied_in_both_files_as_the_docs_say(qwen25_dir):
    """docs/qwen2-reference.md, "Tied or untied": the Qwen2.5-Coder GGUF has its own Q8_0 ``output.weight``
    beside a Q5_0 ``token_embd.weight``; the safetensors folder derived from it has ``lm_head.weight`` and
    ``tie_word_embeddings: false``; Qwen's own Qwen2.5-0.5B configs (kept in lollm.cli's hub_configs) tie it.
    No page may call the Coder files' head tied.

    Reads the GGUF's header and the safetensors header only (no tensor data).
    """
    from lollm.gguf import GGUFFile

    gguf = GGUFFile(qwen25_dir.parent / "qwen2.5-coder-0.5b-instruct.gguf")
    try:
        types = {name: gguf.tensors[name].ggml_type for name in ("output.weight", "token_embd.weight")}
    finally:
        gguf.close()
    assert types == {"output.weight": "Q8_0", "token_embd.weight": "Q5_0"}

    config = json.loads((qwen25_dir / "config.json").read_text(encoding="utf-8"))
    assert config["tie_word_embeddings"] is False
    with open(qwen25_dir / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(header)

    hub = REPO / "lollm-core" / "src" / "lollm" / "cli" / "data" / "hub_configs"
    for file in ("Qwen__Qwen2.5-0.5B/config.json", "Qwen__Qwen2.5-0.5B-Instruct/config.partial.json"):  # Qwen's own: tied
        assert json.loads((hub / file).read_text(encoding="utf-8"))["tie_word_embeddings"] is True

    page = (DOCS / "qwen2-reference.md").read_text(encoding="utf-8")
    assert "`output.weight`, Q8_0 (its own tensor)" in page and '`"tie_word_embeddings": false`' in page
    tied_claim = re.compile(r"tied[^.\n]{0,40}(in the 0\.5B|Qwen2\.5-0\.5B)|0\.5B[^.\n]{0,40}\btied\b|both models here", re.IGNORECASE)
    for name in ("qwen2.md", "qwen2-reference.md", "trace.md", "kv-cache.md"):
        text = (DOCS / name).read_text(encoding="utf-8")
        assert not tied_claim.search(text), f"docs/{name} calls the Qwen2.5 0.5B's head tied: {tied_claim.search(text)[0]!r}"


def _anchors(page: Path) -> set[str]:
    """The GitHub anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    out = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            out.add(re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-"))
    return out


def test_relative_links_in_the_docs_resolve():
    """Every relative link in README.md and docs/**/*.md names a file that exists and, for a
    ``page.md#section`` link, a heading that page has (code blocks are not read)."""
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (page.parent / path) if path else page
            where = f"{page.relative_to(REPO)} -> {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)
