"""The import graph of megatrain/, actors/ and pipelines/ flows one way and has no cycles, lazy imports included.

Read from the source (ast), so an import inside a function counts as much as one at the top of a file: a cycle
broken only by importing late is still a cycle to a reader. Imports under `if TYPE_CHECKING:` are left out: they
name types for annotations and never run (the family registry's protocol and ModelConfig name each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatrain", "actors", "pipelines")

# The one upward import: `megatrain.Engine` is the public name of the Ray driver, which lives in pipelines/ with the
# rest of the Ray-aware code; the package's __init__ imports it only when that name is asked for.
FACADE = {("megatrain", "pipelines.engine")}

# What the bottom rooms may import of megatrain: model math and data know nothing of the engine, memory or Ray.
BOTTOM = {"megatrain.model": ("megatrain.config", "megatrain.model"),
          "megatrain.data": ("megatrain.config", "megatrain.data")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports anywhere in its file (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if is_type_checking_block(block)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def room(module: str) -> str:
    return module.split(".")[0]


def test_no_import_cycles() -> None:
    assert cycles(graph()) == []


def test_the_library_imports_neither_actors_nor_pipelines() -> None:
    upward = sorted((a, b) for a, targets in graph().items() for b in targets
                    if room(a) == "megatrain" and room(b) != "megatrain" and (a, b) not in FACADE)
    assert upward == []


def test_actors_import_no_pipelines() -> None:
    upward = sorted((a, b) for a, targets in graph().items() for b in targets
                    if room(a) == "actors" and room(b) == "pipelines")
    assert upward == []


def test_model_and_data_import_only_the_bottom() -> None:
    def allowed(module: str, target: str) -> bool:
        for prefix, bottom in BOTTOM.items():
            if module == prefix or module.startswith(prefix + "."):
                return any(target == b or target.startswith(b + ".") for b in bottom)
        return True

    assert sorted((a, b) for a, targets in graph().items() for b in targets if not allowed(a, b)) == []


def test_every_module_opens_with_a_docstring_and_stays_short() -> None:
    for name, path in modules().items():
        text = path.read_text()
        assert ast.get_docstring(ast.parse(text)), f"{name} has no docstring saying its job"
        assert len(text.splitlines()) <= 500, f"{name} is over 500 lines"


def test_the_checker_sees_lazy_imports_and_cycles(tmp_path: Path) -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import actors.executor\n"
                      "def f():\n    from megatrain.config import ModelConfig\n    import pipelines.engine\n")
    known = {"megatrain.config": source, "pipelines.engine": source, "actors.executor": source, "x.mod": source}
    assert imported("x.mod", source, known) == {"megatrain.config", "pipelines.engine"}
