"""The rules of the house, checked on the package's source (read, never imported):

- no module imports another module's private name, and none reads another object's private
  member defined by distamp (the owner exposes what collaborators need);
- no import cycle between distamp's modules, type-only and function-level imports included;
- no module over 500 lines.

Each failure names the file, the line and the rule.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "distamp"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in MODULES.items()}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names() -> set[str]:
    """Private attribute and function names that distamp itself defines (``self._x = ...``,
    ``def _x``, class attributes): reading one of them on another object is a reach-in.
    torch's and torchao's private members are outside this rule (they have their own
    wrappers and comments)."""
    names: set[str] = set()
    for tree in TREES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if _is_private(node.name):
                    names.add(node.name)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and _is_private(node.attr)
            ):
                names.add(node.attr)
    return names


def _imports(module: str, tree: ast.Module) -> Iterator[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) for every distamp import, anywhere."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("distamp"):
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = module.split(".")
                if MODULES[module].name != "__init__.py":
                    pkg = pkg[:-1]
                base = ".".join([*pkg[: len(pkg) - node.level + 1], node.module])
            if not base.startswith("distamp"):
                continue
            for alias in node.names:
                yield node.lineno, base, alias.name


def _target(base: str, name: str | None) -> str:
    """The module an import loads: ``from pkg import sub`` loads ``pkg.sub`` when it is one."""
    if name is not None and f"{base}.{name}" in MODULES:
        return f"{base}.{name}"
    return base


def test_no_private_names_imported_across_modules() -> None:
    bad = [
        f"{MODULES[module]}:{line}: imports {base}.{name}"
        for module, tree in TREES.items()
        for line, base, name in _imports(module, tree)
        if name is not None and _is_private(name) and _target(base, name) != base + "." + name
    ]
    assert not bad, "\n".join(bad)


def test_no_private_members_read_on_other_objects() -> None:
    private = _defined_private_names()
    bad = []
    for module, tree in TREES.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr in private):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
                continue
            bad.append(f"{MODULES[module]}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for module, tree in TREES.items():
        for _, base, name in _imports(module, tree):
            target = _target(base, name)
            if target != module and target in MODULES:
                graph.setdefault(module, set()).add(target)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module: str) -> None:
    lines = MODULES[module].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module]}: {lines} lines (at most {MAX_LINES})"
