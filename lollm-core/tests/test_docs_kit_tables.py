"""docs/conformance-kit.md's mutation tables against lollm.testing.mutation's catalogue.

The page states how many mutants each family has, their total, and one row per bug class; the
catalogue (``MUTANTS``, ``BUG_CLASSES``) is what the mutation suite runs. A mutant added to the
catalogue without its row on the page, or a count left behind, fails here, naming both sides.
"""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "conformance-kit.md"
FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3", "gemma4", "qwen3_5", "qwen3_5_moe")


def _row(text: str, first_cell: str, width: int) -> list[str]:
    """The ``width`` cells after ``first_cell`` of the one table row that starts with it and has that many."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")][1:]
            for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    rows = [cells for cells in rows if len(cells) == width]
    assert len(rows) == 1, f"{PAGE.name}: expected one table row '| {first_cell} |' of {width} more cells, found {len(rows)}"
    return rows[0]


def test_the_pages_mutant_counts_are_the_catalogues():
    from lollm.testing.mutation import MUTANTS

    text = PAGE.read_text(encoding="utf-8")
    assert set(MUTANTS) == set(FAMILIES), f"the catalogue's families {sorted(MUTANTS)}; the page's columns {FAMILIES}"
    counts = {family: len(MUTANTS[family][1]) for family in FAMILIES}
    total = sum(counts.values())
    stated = dict(zip(FAMILIES, (int(c) for c in _row(text, "mutants", len(FAMILIES)))))
    assert stated == counts, f"{PAGE.name}, row 'mutants': {stated}; lollm.testing.mutation.MUTANTS: {counts}"
    kit = _row(text, "the kit", len(FAMILIES) + 1)
    assert [int(c) for c in kit] == [*counts.values(), total], f"{PAGE.name}, row 'the kit': {kit}; the catalogue: {counts}, {total}"
    for claim in re.findall(r"(\d+) mutants", text):
        assert int(claim) == total, f"{PAGE.name} says '{claim} mutants'; the catalogue holds {total}"


def test_every_bug_class_has_its_rows_on_the_page():
    from lollm.testing.mutation import BUG_CLASSES, MUTANTS

    text = PAGE.read_text(encoding="utf-8")
    for bug in BUG_CLASSES:
        cells = _row(text, f"`{bug}`", len(FAMILIES))  # the "which checks fail it" table
        applies = [family for family in FAMILIES if bug in MUTANTS[family][1]]
        marked = [family for family, cell in zip(FAMILIES, cells) if cell not in ("–", "")]
        assert marked == applies, f"{PAGE.name}, row `{bug}`: checks given for {marked}; the catalogue has it for {applies}"
        described = [line for line in text.splitlines()
                     if line.startswith("| `") and f"`{bug}`" in line.split(" | ")[0] and line.count("|") == 3]
        assert described, f"{PAGE.name}: bug class {bug} has no row in the table of what each bug is"
