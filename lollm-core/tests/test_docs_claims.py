"""Claims the docs make about the code and the real files, checked against them.

A page that states a fact the code or a file can contradict gets a test here, so
that the page and the thing it describes cannot drift apart silently.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"


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
