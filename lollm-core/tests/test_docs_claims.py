"""Claims the docs make about the code, read from the pages and held to the code's own constants.

A page that states a number the code also holds can drift from it silently: the code changes and
the prose does not, or the other way round. Each test here reads the number from the page and
from the code and fails when the two part, naming both.
"""

from __future__ import annotations

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
