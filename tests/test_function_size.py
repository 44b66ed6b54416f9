"""Short functions and short signatures in megatrain/, actors/ and pipelines/ (read with ast, like test_imports.py):
no function longer than 60 lines and no signature with more than 12 parameters (self and cls not counted; *args and
**kwargs count one each)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("megatrain", "actors", "pipelines")
MAX_LINES, MAX_PARAMS = 60, 12

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


def test_no_long_function_or_signature() -> None:
    found = offenders()
    assert found == {}, f"over {MAX_LINES} lines or {MAX_PARAMS} parameters: {found}"


def test_the_counter_counts_as_the_rule_says(tmp_path: Path) -> None:
    source = "class A:\n    def f(self, a, b, *args, c, **kw):\n        pass\n"
    (name, node), = functions(ast.parse(source))
    assert (name, parameters(node.args)) == ("A.f", 5)
