"""Short functions, short signatures and short docstrings in megatrain/, actors/ and pipelines/ (read with ast, like
test_imports.py): no function longer than 60 lines and no signature with more than 12 parameters (self and cls not
counted; *args and **kwargs count one each); no module docstring over 12 lines and no function or class docstring over
15 (the rationale lives in docs/design.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatrain", "actors", "pipelines")
MAX_LINES, MAX_PARAMS = 60, 12
MAX_MODULE_DOC, MAX_DOC = 12, 15  # lines of ast.get_docstring

def parameters(args: ast.arguments) -> int:
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    return len(named) + (args.vararg is not None) + (args.kwarg is not None)


def functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((prefix + node.name, node))
            found += functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            found += functions(node, f"{prefix}{node.name}.")
    return found


def offenders() -> dict[str, str]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name, node in functions(ast.parse(path.read_text(), str(path))):
                lines, params = node.end_lineno - node.lineno + 1, parameters(node.args)
                if lines > MAX_LINES or params > MAX_PARAMS:
                    out[f"{path.relative_to(ROOT)}:{name}"] = f"{lines} lines, {params} parameters"
    return out


def doc_lines(node: ast.AST) -> int:
    doc = ast.get_docstring(node)  # type: ignore[arg-type]
    return len(doc.splitlines()) if doc else 0


def long_docstrings(tree: ast.Module, where: str) -> dict[str, int]:
    out = {where: doc_lines(tree)} if doc_lines(tree) > MAX_MODULE_DOC else {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and doc_lines(node) > MAX_DOC:
            out[f"{where}:{node.name}"] = doc_lines(node)
    return out


def test_no_long_docstring() -> None:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found |= long_docstrings(ast.parse(path.read_text(), str(path)), str(path.relative_to(ROOT)))
    assert found == {}, (f"docstrings over {MAX_MODULE_DOC} lines (a module's) or {MAX_DOC} (a function's or class's): "
                         f"{found}; say what and why in a few lines, the rationale in docs/design.md")


def test_the_docstring_rule_counts_lines() -> None:
    long = "\n".join(f"line {i}" for i in range(MAX_DOC + 1))
    source = f'"""{long}"""\nclass A:\n    """{long}"""\n    def f(self):\n        """short"""\n'
    assert long_docstrings(ast.parse(source), "m.py") == {"m.py": MAX_DOC + 1, "m.py:A": MAX_DOC + 1}


def test_no_long_function_or_signature() -> None:
    found = offenders()
    assert found == {}, f"over {MAX_LINES} lines or {MAX_PARAMS} parameters: {found}"


def test_the_counter_counts_as_the_rule_says(tmp_path: Path) -> None:
    source = "class A:\n    def f(self, a, b, *args, c, **kw):\n        pass\n"
    (name, node), = functions(ast.parse(source))
    assert (name, parameters(node.args)) == ("A.f", 5)
