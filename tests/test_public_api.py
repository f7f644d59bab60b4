"""The documented import paths resolve: every name of ``distamp.__all__``, every
``from distamp... import ...`` and every ``distamp.x.y`` the README and the docs write.

A module moved or a name renamed without the docs following fails here, naming the path.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import pytest

import distamp

ROOT = Path(__file__).resolve().parents[1]
# The README and every page of the docs site (the API reference's ``::: name`` lines included).
README = "\n".join(
    p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted(ROOT.glob("docs/**/*.md"))]
)
DEVELOPMENT = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")

# ``from distamp.x import a, b`` (also parenthesised over several lines) inside the README.
_FROM_IMPORT = re.compile(r"from (distamp(?:\.\w+)*) import \(?([\w\s,]+?)\)?(?:\n|$|#)", re.M)
# ``distamp.x.y`` written in backticks or code: a dotted path starting at the package.
_DOTTED = re.compile(r"\b(distamp(?:\.[A-Za-z_]\w*)+)")


def _resolve(path: str) -> Any:
    """Import the longest module prefix of ``path``, then walk the rest as attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is None or not ".".join(parts).startswith(exc.name):
                raise  # a dependency of a real module is missing: not a path problem
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


def _readme_imports() -> list[tuple[str, str]]:
    found = []
    for module, names in _FROM_IMPORT.findall(README):
        for name in re.split(r"[\s,]+", names.strip()):
            if name:
                found.append((module, name))
    return sorted(set(found))


def _readme_paths() -> list[str]:
    return sorted(set(_DOTTED.findall(README)))


def test_every_name_in_all_resolves() -> None:
    missing = [name for name in distamp.__all__ if not hasattr(distamp, name)]
    assert not missing, f"distamp.__all__ names what distamp does not define: {missing}"
    assert len(set(distamp.__all__)) == len(distamp.__all__)


def test_readme_has_imports_to_check() -> None:
    # The patterns below must keep finding the README's imports: a reformatted README that
    # hid them from these tests would make them pass vacuously.
    assert len(_readme_imports()) >= 5
    assert len(_readme_paths()) >= 10


@pytest.mark.parametrize(("module", "name"), _readme_imports())
def test_readme_import_resolves(module: str, name: str) -> None:
    if module.startswith("distamp.integrations."):
        framework = {"accelerate": "accelerate", "lightning": "lightning"}.get(module.split(".")[2])
        if framework is not None:
            pytest.importorskip(framework, reason=f"{module} needs {framework}")
    mod = importlib.import_module(module)
    assert hasattr(mod, name), f"docs: `from {module} import {name}`: no such name"


# The integrations' modules that import a framework, and which (lightning*: Lightning); the
# others (the scaler slot, the step guards) import none and must resolve everywhere.
_FRAMEWORK_OF = {
    "accelerate": "accelerate",
    "accelerate_optimizer": "accelerate",
    "transformers": "transformers",
    "ray": "ray",
    "torchft": "torchft",
}


@pytest.mark.parametrize("path", _readme_paths())
def test_readme_dotted_path_resolves(path: str) -> None:
    if path.startswith("distamp.integrations."):
        module = path.split(".")[2]
        framework = "lightning" if module.startswith("lightning") else _FRAMEWORK_OF.get(module)
        if framework is not None:
            pytest.importorskip(framework, reason=f"{path} needs {framework}")
    if path.startswith(("distamp.fp8", "distamp.precision.fp8")):
        pytest.importorskip("torchao", reason=f"{path} documents the fp8 extra")
    try:
        _resolve(path)
    except (ModuleNotFoundError, AttributeError) as exc:
        pytest.fail(f"the README or the docs name `{path}`, which does not resolve: {exc}")


def test_readme_folder_map_names_every_package_folder() -> None:
    """The development page's folder map lists each folder of the package, and only those."""
    root = Path(distamp.__file__).parent
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    section = DEVELOPMENT.split("\n## Where a change belongs\n", 1)[1]
    mapped = set(re.findall(r"^distamp/(\w+)/", section, re.M))
    assert mapped == folders, f"folder map {sorted(mapped)} vs package folders {sorted(folders)}"


def test_at_most_twelve_modules_directly_in_the_package() -> None:
    root = Path(distamp.__file__).parent
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= 12, modules


def test_step_guards_are_exported() -> None:
    """The spike guard and the error of the consecutive-skip limit are public, as DistAMP's
    ``spike_guard=`` and ``max_consecutive_skips=`` are."""
    for name in ("SpikeGuard", "ConsecutiveSkipsError"):
        assert name in distamp.__all__, name
    assert issubclass(distamp.ConsecutiveSkipsError, RuntimeError)
    assert distamp.StepResult(None, None, None, spike=True).skip_reason == "spike"


def test_shared_directory_check_is_public_and_documented() -> None:
    """``distamp.check_shared_directory``: what fit and the main job call before training, for
    loops of users' own that save with ``save_state``."""
    assert "check_shared_directory" in distamp.__all__
    assert distamp.check_shared_directory is distamp.cluster.check_shared_directory
    reference = (ROOT / "docs" / "reference" / "cluster.md").read_text(encoding="utf-8")
    assert "::: distamp.check_shared_directory" in reference
