"""The rules of the house, checked on the package's source (read, never imported):

- no module imports another module's private name, and none reads another object's private
  member defined by distamp (the owner exposes what collaborators need);
- no import cycle between distamp's modules, type-only and function-level imports included;
- the packages import in layers (:data:`LAYERS`): each only from the layers below it, with
  function-level imports and ``importlib.import_module("distamp...")`` counted and only imports
  for type checking (``if TYPE_CHECKING:``) aside; hence no cycle between packages either;
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


_DYNAMIC_IMPORTS = ("importlib.import_module", "import_module", "__import__")


def _dynamic_import(node: ast.AST) -> str | None:
    """The distamp module a call such as ``importlib.import_module("distamp.x")`` or
    ``__import__("distamp.x")`` loads: such a call is an import like any other."""
    if not (isinstance(node, ast.Call) and ast.unparse(node.func) in _DYNAMIC_IMPORTS):
        return None
    first = node.args[0] if node.args else None
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
        return None  # a name computed at run time: not a fixed dependency
    return first.value if first.value.startswith("distamp") else None


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
        elif (loaded := _dynamic_import(node)) is not None:
            yield node.lineno, loaded, None


_TYPE_CHECKING = ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _type_checking_lines(tree: ast.Module) -> set[int]:
    """The lines inside ``if TYPE_CHECKING:`` blocks: imports there exist for the type checker
    only and are never executed."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in _TYPE_CHECKING:
            for stmt in node.body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


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


# The layers, from the ground up (the design's "packages in layers"): a package imports only
# from packages of a lower layer. "ground" is the plain modules every layer may use. The
# package's __init__ (the public API: re-exports) and the legacy public paths distamp.fp8 and
# distamp.fp8_parallel sit on top, so nothing inside the package imports them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("arguments", "versions", "torch_compat", "model_names"),  # ground
    ("cluster",),
    ("kernels",),
    ("agreement",),
    ("observe",),
    ("scaler",),
    ("precision",),
    ("optim",),
    ("parallel",),
    ("engine",),
    ("integrations", "deploy", "env_report"),  # env_report: what `distamp env` asks them all
    ("cli",),
    ("__init__", "fp8", "fp8_parallel"),  # the public paths: re-exports only
)
_GROUND = LAYERS[0]


def _package(module: str) -> str:
    """The first-level part of distamp a module belongs to: its subpackage (``scaler``), the
    plain module itself (``cli``, ``fp8``), "ground" for the ground modules, ``__init__`` for
    the package's own ``__init__``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return "ground" if parts[1] in _GROUND else parts[1]


def _layer_of(package: str) -> int | None:
    """The index of ``package``'s layer in :data:`LAYERS`; ``None`` for one it lacks."""
    if package == "ground":
        return 0
    for level, names in enumerate(LAYERS):
        if package in names:
            return level
    return None


def _package_edges() -> Iterator[tuple[str, int, str, str]]:
    """(file, line, importing package, imported package) for every import that crosses from
    one first-level package to another, imports for type checking aside."""
    for module, tree in TREES.items():
        type_only = _type_checking_lines(tree)
        for line, base, name in _imports(module, tree):
            target = _target(base, name)
            if line in type_only or target not in MODULES:
                continue
            source_pkg, target_pkg = _package(module), _package(target)
            if source_pkg != target_pkg:
                yield str(MODULES[module].relative_to(PACKAGE.parent)), line, source_pkg, target_pkg


def test_every_package_has_a_layer() -> None:
    unknown = sorted({_package(m) for m in MODULES if _layer_of(_package(m)) is None})
    assert not unknown, f"packages missing from LAYERS in tests/test_house.py: {unknown}"


def test_no_import_cycles_between_packages() -> None:
    graph: dict[str, set[str]] = {}
    for _, _, source, target in _package_edges():
        graph.setdefault(source, set()).add(target)
    cycles = _cycles(graph)
    assert not cycles, "package import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_packages_import_only_from_lower_layers() -> None:
    order = " < ".join(", ".join(names) for names in LAYERS)
    bad = []
    for path, line, source, target in _package_edges():
        low, high = _layer_of(source), _layer_of(target)
        if low is None or high is None or low <= high:
            bad.append(f"{path}:{line}: {source} imports {target}")
    assert not bad, f"imports against the layer order ({order}):\n" + "\n".join(bad)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module: str) -> None:
    lines = MODULES[module].read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module]}: {lines} lines (at most {MAX_LINES})"
