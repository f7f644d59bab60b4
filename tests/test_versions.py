"""The verified windows of the optional frameworks (distamp.versions): the rule with fake version
strings (no installs, no network), and pyproject.toml's extras declaring the table's floors."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from distamp.versions import (
    TORCH,
    TORCH_FEATURES,
    WINDOWS,
    KnownBreak,
    UnverifiedVersionWarning,
    Window,
    check_torch,
    check_version,
    compatibility_table,
    install_command,
    require_torch,
)

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _extras() -> dict[str, list[Requirement]]:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is in the standard library from Python 3.11")
    import tomllib

    with PYPROJECT.open("rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in extras.items()}


@pytest.mark.parametrize("package", sorted(WINDOWS))
def test_older_than_the_floor_is_refused_with_the_install_command(package: str) -> None:
    window = WINDOWS[package]
    floor = Version(window.floor)
    older = f"{floor.major}.{floor.minor}.0rc1" if floor.micro == 0 else f"{floor.major}.0.0"
    with pytest.raises(ImportError) as e:
        check_version(package, installed=older)
    message = str(e.value)
    assert f"{package} {older} is older" in message
    assert window.describe() in message
    assert f'pip install -e ".[{window.extra}]"' in message


@pytest.mark.parametrize("package", sorted(WINDOWS))
def test_the_window_itself_is_accepted_silently(package: str) -> None:
    window = WINDOWS[package]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for release in (window.floor, window.newest, f"{window.newest}+cu128"):
            assert check_version(package, installed=release) == release


def test_newer_than_verified_warns_once_naming_the_window() -> None:
    window = WINDOWS["transformers"]
    newer = f"{Version(window.newest).major + 1}.0.0"
    with pytest.warns(UnverifiedVersionWarning, match="newer than") as caught:
        assert check_version("transformers", installed=newer) == newer
    message = str(caught[0].message)
    assert window.describe() in message
    assert f'pip install "transformers=={window.newest}"' in message
    assert issubclass(UnverifiedVersionWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_version("transformers", installed=newer)  # once per process and version


def test_a_known_break_is_refused_naming_it_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    breaks = (
        KnownBreak(specifier="==5.30.0", reason="Trainer no longer builds its accelerator"),
        KnownBreak(specifier=">=5.31,<5.32", reason="scaler attribute renamed", fix="upgrade"),
    )
    window = Window(
        package="transformers", extra="transformers", floor="5.23.0", newest="5.24.0", breaks=breaks
    )
    monkeypatch.setitem(WINDOWS, "transformers", window)
    with pytest.raises(ImportError, match=r"5\.30\.0 is a known break .*==5\.30\.0.*builds") as e:
        check_version("transformers", installed="5.30.0")
    assert 'pip install "transformers==5.24.0"' in str(e.value)
    with pytest.raises(ImportError, match=r"scaler attribute renamed\. Fix: upgrade"):
        check_version("transformers", installed="5.31.2rc1")
    with pytest.warns(UnverifiedVersionWarning):
        check_version("transformers", installed="5.30.1")


def test_a_missing_package_is_refused_with_the_install_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    window = Window(package="distamp-no-such-package", extra="nothing", floor="1.0", newest="1.0")
    monkeypatch.setitem(WINDOWS, window.package, window)
    with pytest.raises(ImportError, match="is not installed") as e:
        check_version(window.package)
    assert install_command(window) in str(e.value)


def test_an_unparseable_version_is_refused() -> None:
    with pytest.raises(ImportError, match="not a PEP 440 version"):
        check_version("torchao", installed="not-a-version")


def test_the_table_is_well_formed() -> None:
    for name, window in WINDOWS.items():
        assert name == window.package
        assert Version(window.floor) <= Version(window.newest)
    with pytest.raises(AssertionError, match="floor"):
        Window(package="x", extra="x", floor="2.0", newest="1.0")
    with pytest.raises(ValueError):
        KnownBreak(specifier="5.30", reason="not a specifier")


def test_every_extra_declares_the_tables_floor_and_no_cap() -> None:
    """The extras and the import-time check read the same floors, so they cannot drift."""
    seen: set[str] = set()
    for extra, requirements in _extras().items():
        for req in requirements:
            if req.name not in WINDOWS:
                continue
            seen.add(req.name)
            specs = list(req.specifier)
            assert [s.operator for s in specs] == [">="], (
                f"pyproject.toml [{extra}] {req}: declare only the floor (>=), no upper bound"
            )
            assert Version(specs[0].version) == Version(WINDOWS[req.name].floor), (
                f"pyproject.toml [{extra}] {req}: the floor in distamp/versions.py is "
                f"{WINDOWS[req.name].floor}"
            )
    assert seen == set(WINDOWS)


def test_every_window_names_an_extra_that_installs_it() -> None:
    extras = _extras()
    for window in WINDOWS.values():
        assert window.package in {r.name for r in extras[window.extra]}, window


def test_dev_installs_every_extra_with_a_window() -> None:
    dev = next(r for r in _extras()["dev"] if r.name == "distamp")
    covered = {req.name for extra in dev.extras for req in _extras()[extra]}
    assert set(WINDOWS) <= covered


def test_the_docs_table_is_generated_from_the_code_table() -> None:
    """docs/compatibility.md is ``distamp versions``' output, so the two cannot drift."""
    docs = (PYPROJECT.parent / "docs" / "compatibility.md").read_text(encoding="utf-8")
    assert docs == compatibility_table(), "regenerate it: distamp versions > docs/compatibility.md"
    for window in (TORCH, *WINDOWS.values()):
        assert f" | {window.floor} | {window.newest} | " in docs, window.package
    readme = (PYPROJECT.parent / "README.md").read_text(encoding="utf-8")
    assert "(docs/compatibility.md)" in readme
    assert f"torch {TORCH.floor} to {TORCH.newest}" in readme


def test_the_cli_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from distamp.cli import main

    assert main(["versions"]) == 0
    assert capsys.readouterr().out == compatibility_table()


def _torch_requirement() -> Requirement:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is in the standard library from Python 3.11")
    import tomllib

    with PYPROJECT.open("rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return next(Requirement(r) for r in deps if Requirement(r).name == "torch")


def test_pyproject_requires_the_torch_floor_and_no_cap() -> None:
    specs = list(_torch_requirement().specifier)
    assert [(s.operator, s.version) for s in specs] == [(">=", TORCH.floor)]


def test_the_running_torch_is_inside_its_window() -> None:
    """The torch this suite runs on (the pin, or a compatibility session's) passes the check
    ``import distamp`` applies, without a warning inside the window."""
    import torch

    found = Version(Version(torch.__version__).public)
    assert Version(TORCH.floor) <= found
    with warnings.catch_warnings():
        warnings.simplefilter("error" if found <= Version(TORCH.newest) else "ignore")
        assert check_torch() == torch.__version__


def test_torch_older_than_the_floor_is_refused_and_newer_warns() -> None:
    with pytest.raises(ImportError, match=r"torch 2\.10\.0 is older .*torch 2\.11\.0 to") as e:
        check_torch(installed="2.10.0")
    assert f'pip install "torch>={TORCH.floor}"' in str(e.value)
    newer = f"{Version(TORCH.newest).major}.{Version(TORCH.newest).minor + 1}.0+cu130"
    with pytest.warns(UnverifiedVersionWarning, match=r"torch .* is newer"):
        check_torch(installed=newer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_torch(installed=f"{TORCH.floor}+cu128") == f"{TORCH.floor}+cu128"


@pytest.mark.parametrize("key", sorted(TORCH_FEATURES))
def test_a_feature_on_a_too_old_torch_is_refused_naming_what_it_needs(key: str) -> None:
    need = TORCH_FEATURES[key]
    assert Version(TORCH.floor) < Version(need.since) <= Version(TORCH.newest)
    with pytest.raises(RuntimeError) as e:
        require_torch(key, installed=TORCH.floor)
    message = str(e.value)
    assert need.feature in message and f"needs torch >= {need.since}" in message
    assert need.reason in message and f'pip install "torch>={need.since}"' in message
    require_torch(key, installed=need.since)  # from that release on: nothing to refuse
    require_torch(key, installed=f"{need.since}+cpu")


def test_fp8_rowwise_on_the_cpu_with_a_too_old_torch_is_refused_before_conversion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``DistAMP(precision=AutocastPolicy("fp8", recipe="rowwise"))`` reports on the CPU with
    torch 2.11: the torch it needs, before any layer is swapped, not torch's internal assert from
    the first float8 GEMM. The tensorwise recipe is not refused."""
    import torch

    from distamp.precision import fp8_torchao

    cpu = torch.device("cpu")
    with monkeypatch.context() as m:
        m.setattr(fp8_torchao, "require_torch", lambda k: require_torch(k, installed="2.11.0"))
        with pytest.raises(RuntimeError, match=r"rowwise recipe on the CPU needs torch >= 2\.12"):
            fp8_torchao.check_device(cpu, "rowwise")
        fp8_torchao.check_device(cpu, "tensorwise")
    if Version(torch.__version__.split("+")[0]) >= Version("2.12.0"):
        fp8_torchao.check_device(cpu, "rowwise")  # this torch: nothing to refuse
