"""Core's shape, checked: layers that import only downward, no cycles, small files and functions.

docs/architecture.md draws the layers; this file holds the code to them. Every import counts,
the ones inside functions too (a lazy import is still a dependency). The checks read the
source with :mod:`ast` and import nothing.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "lollm"

#: The layers from the bottom up. A module may import modules of its own layer and of the
#: layers below it, never above. Keys are module names relative to ``lollm``; a name ending
#: in ``.`` stands for every module of that subpackage.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("contract", ("__init__", "_moved", "errors", "hookspecs", "family", "model", "sampling_params")),
    ("files", ("files", "gguf.", "tokenizer.")),
    ("model seams", ("batch", "attention", "kernels.", "native.", "trace.", "vision.")),
    ("load", ("load.",)),
    ("generate", ("generate.",)),
    ("engine", ("engine.",)),
    ("serve and proof", ("serve.", "proof.")),
    ("commands", ("cli.", "__main__")),
    ("kit", ("testing.",)),
]

MAX_TOP_LEVEL_MODULES = 15
MAX_FILE_LINES = 600
MAX_FUNCTION_CODE_LINES = 70


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(name: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if name == member or (member.endswith(".") and (name + ".").startswith(member)):
                return index
    raise AssertionError(f"lollm.{name} belongs to no layer of tests/test_layout.py's LAYERS: add it")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The lollm modules that ``name`` imports anywhere in its file (top level or inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()

    def add(dotted: str) -> None:
        # the longest prefix that names one of our modules
        parts = dotted.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in modules:
                found.add(candidate)
                return
            parts.pop()

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lollm."):
                    add(alias.name.removeprefix("lollm."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            elif node.module == "lollm":
                origin = ""
            elif node.module and node.module.startswith("lollm."):
                origin = node.module.removeprefix("lollm.")
            else:
                continue
            for alias in node.names:
                target = f"{origin}.{alias.name}" if origin else alias.name
                if target in modules:
                    found.add(target)
                elif origin:
                    add(origin)
                else:
                    found.add("__init__")
    found.discard(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    for name in graph:
        _layer(name)


def test_each_layer_imports_only_its_own_and_those_below(graph):
    climbs = [f"lollm.{name} ({LAYERS[_layer(name)][0]}) imports lollm.{target} ({LAYERS[_layer(target)][0]})"
              for name, targets in graph.items() for target in sorted(targets) if _layer(target) > _layer(name)]
    assert not climbs, "imports that climb a layer:\n" + "\n".join(climbs)


def test_no_import_cycle(graph):
    """Tarjan's strongly connected components over every import, lazy ones included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(cycle) for cycle in cycles)


def test_production_code_never_imports_the_kit(graph):
    users = sorted(f"lollm.{name} imports lollm.{target}" for name, targets in graph.items()
                   if not name.startswith("testing") for target in targets if target.startswith("testing"))
    assert not users, "\n".join(users)


def test_few_top_level_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, f"{len(top)} modules at the top of lollm/: {top}"


def test_no_file_over_the_limit():
    long = {str(path.relative_to(PACKAGE)): lines for path in PACKAGE.rglob("*.py")
            if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def _code_lines(node: ast.AST, source: list[str]) -> int:
    """Lines of a function that hold code: not blank, not only a comment, not its docstring."""
    body = node.body
    skip: set[int] = set()
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    count = 0
    for number in range(node.lineno, node.end_lineno + 1):
        text = source[number - 1].strip()
        if text and not text.startswith("#") and number not in skip:
            count += 1
    return count


def test_no_function_over_the_limit():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        source = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = _code_lines(node, source)
                if lines > MAX_FUNCTION_CODE_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_CODE_LINES} code lines:\n" + "\n".join(long)


def test_the_reading_order_names_files_that_exist():
    """docs/architecture.md's walk from ``lollm run`` to one token names real files."""
    import re

    page = (PACKAGE.parents[2] / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = page.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"\| `lollm/([\w/]+\.py)` \| (\d+) \|", section)
    assert len(named) >= 15, "the reading order lists too few files"
    missing = [name for name, _ in named if not (PACKAGE / name).is_file()]
    assert not missing, f"docs/architecture.md's reading order names files that do not exist: {missing}"
