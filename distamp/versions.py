"""The releases of torch and of each optional framework that distamp was verified with.

torch's window (:data:`TORCH`) is checked at ``import distamp``; the features that need a newer
torch than its floor are listed in :data:`TORCH_FEATURES` and refused up front on an older one
(:func:`require_torch`).

The integrations reach into a framework's objects (which attribute holds the scaler, which class
wraps optimizers, which float8 API converts a model); those names are not a stable API. A fixed
upper pin would refuse every new release although most of them work, so each package has a
*window*: the oldest release verified (the floor) and the newest release verified. The rule
:func:`check_version` applies (at import for torch, at an integration's import for the others):

- older than the floor, or not installed: :class:`ImportError` with the install command (the
  extras in ``pyproject.toml`` declare the same floors; ``tests/test_versions.py`` keeps them
  equal);
- a release listed in the window's known breaks: :class:`ImportError` naming the break and the fix;
- newer than the newest verified: used as is, with one :class:`UnverifiedVersionWarning` per
  package naming the window, so that a failure later is traced to the untested release.

To move a window, run the tests against the new release (``nox -s floors`` and ``nox -s torch``
run the floors and the newest torch) and edit the tables below; ``docs/compatibility.md`` is
generated from them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "TORCH",
    "TORCH_FEATURES",
    "WINDOWS",
    "KnownBreak",
    "TorchFeature",
    "UnverifiedVersionWarning",
    "Window",
    "check_torch",
    "check_version",
    "compatibility_table",
    "install_command",
    "require_torch",
]


class UnverifiedVersionWarning(UserWarning):
    """A framework release newer than the newest one distamp was verified with is in use."""


@dataclass(frozen=True, kw_only=True)
class KnownBreak:
    """Releases known not to work, refused up front instead of failing mid-training."""

    specifier: str
    """The broken releases as a PEP 440 specifier, e.g. ``"==5.30.0"`` or ``">=5.30,<5.31"``."""
    reason: str
    """What breaks, in one phrase (shown in the error)."""
    fix: str = ""
    """What to install instead; empty: the newest verified release of the window."""

    def __post_init__(self) -> None:
        SpecifierSet(self.specifier)  # an invalid specifier fails when the table is built


@dataclass(frozen=True, kw_only=True)
class Window:
    """The releases of one package that distamp was verified with."""

    package: str
    """The distribution name, as ``pip`` and :func:`importlib.metadata.version` spell it."""
    extra: str = ""
    """The ``pyproject.toml`` extra that installs it (``pip install -e ".[extra]"``); empty for
    a requirement of distamp itself (torch)."""
    floor: str
    """The oldest release verified; older ones are refused. The extra's lower bound."""
    newest: str
    """The newest release verified; newer ones are used with a warning."""
    breaks: tuple[KnownBreak, ...] = field(default=())
    """Releases inside or above the window that are refused, each with its reason."""

    def __post_init__(self) -> None:
        if not Version(self.floor) <= Version(self.newest):
            raise AssertionError(f"{self.package}: floor {self.floor} > newest {self.newest}")

    def describe(self) -> str:
        """The window as the messages show it, e.g. ``"transformers 5.23.0 to 5.24.0"``."""
        return f"{self.package} {self.floor} to {self.newest}"


# Each row was verified by running the integration's tests (tests/test_<integration>.py) with
# torch 2.13 on the CPU, with the floor and with the newest release installed. Why some floors
# are not older: lightning < 2.6.4's FSDP precision plugin builds the module under
# ``mixed_precision_config.param_dtype``, which is ``None`` when autocast owns mixed precision
# (failed in tests/test_lightning_trainer.py with 2.6.0); torchft 0.1.1 imports
# ``torch.distributed.ProcessGroupNCCL``, which torch 2.13's CPU build lacks.
WINDOWS: dict[str, Window] = {
    w.package: w
    for w in (
        Window(package="transformers", extra="transformers", floor="5.22.2", newest="5.24.0"),
        Window(package="accelerate", extra="accelerate", floor="1.14.0", newest="1.15.0"),
        Window(package="lightning", extra="lightning", floor="2.6.4", newest="2.6.6"),
        Window(package="torchao", extra="fp8", floor="0.17.0", newest="0.18.0"),
        Window(package="ray", extra="ray", floor="2.59.0", newest="2.60.0"),
        # TRL's trainers are Trainer subclasses (with_distamp); checked when one is wrapped.
        Window(package="trl", extra="trl", floor="1.7.0", newest="1.16.0"),
        Window(package="torchft", extra="torchft", floor="0.2.0", newest="0.2.0"),
        # The export targets (distamp.deploy): "onnx" exports through torch.onnx's dynamo
        # exporter (onnxscript) and checks the file under ONNX Runtime; "pte" lowers to
        # ExecuTorch with XNNPACK. executorch declares no torch requirement, but its native
        # libraries link libtorch: 1.5.1 was verified with torch 2.13 (tests/test_deploy.py).
        Window(package="onnx", extra="onnx", floor="1.23.2", newest="1.23.2"),
        Window(package="onnxscript", extra="onnx", floor="0.7.2", newest="0.7.2"),
        Window(package="onnxruntime", extra="onnx", floor="1.32.0", newest="1.32.0"),
        Window(package="executorch", extra="edge", floor="1.5.1", newest="1.5.1"),
    )
}
"""Package name -> its verified window. The one place the supported releases are written."""

TORCH = Window(package="torch", floor="2.11.0", newest="2.15.0")
"""torch's verified window: the whole suite passes on the CPU with the floor and the pinned
release (2.13.0), and the core suite and the main job with the newest (``nox -s torch`` runs the
core suite and the main job at both ends). ``pyproject.toml`` declares the floor
(``tests/test_versions.py`` keeps them equal). Older releases fail the suite: 2.10's first step
of a pipeline schedule under FSDP2 over gloo computes a zero gradient norm; 2.9's pipeline
schedules abort gloo (an int64 tensor sent into a float32 buffer) and its torchrun cannot relay
SIGUSR1 (``signals_to_handle`` comes with 2.10); 2.8's FSDP2 over gloo sums gradients instead of
averaging them (clip norms twice too large)."""


@dataclass(frozen=True, kw_only=True)
class TorchFeature:
    """A feature that needs a newer torch than the window's floor, and why."""

    key: str
    """The name :func:`require_torch` is called with."""
    feature: str
    """What the user does, as the docs and the error name it."""
    since: str
    """The oldest torch release on which it works."""
    reason: str
    """What breaks on older releases."""


TORCH_FEATURES: dict[str, TorchFeature] = {
    f.key: f
    for f in (
        TorchFeature(
            key="fp8-rowwise-cpu",
            feature="precision='fp8' with the rowwise recipe on the CPU",
            since="2.12.0",
            reason="torch 2.11's CPU _scaled_mm takes per-tensor scales only (an internal assert "
            "fails on row-wise ones); the tensorwise recipe works",
        ),
    )
}
"""Feature key -> the torch release it needs. Everything not listed works on the whole window."""

_warned: set[tuple[str, str]] = set()  # (package, version) already warned about in this process


def install_command(window: Window) -> str:
    """How to install the package at a verified release: distamp is installed from a checkout
    (it is not on a package registry), so the extra is named on the checkout."""
    if not window.extra:
        return f'pip install "{window.package}>={window.floor}"'
    return f'pip install -e ".[{window.extra}]" (from a distamp checkout)'


def check_version(package: str, *, installed: str | None = None) -> str:
    """Return the installed version of ``package`` after applying its window's rule.

    Args:
        package: a key of :data:`WINDOWS`, or ``"torch"``.
        installed: the version to judge; ``None`` reads the installed distribution's metadata
            (tests pass fake versions here).

    Raises:
        ImportError: the package is missing, older than its window's floor, or a known break;
            the message names the window, or the break, and the install command.
    """
    window = TORCH if package == "torch" else WINDOWS[package]
    if installed is None:
        try:
            installed = version(package)
        except PackageNotFoundError as e:
            raise ImportError(
                f"{package} is not installed (distamp is verified with {window.describe()}): "
                f"{install_command(window)}"
            ) from e
    try:
        # A local build (``0.18.0+cu128``) is the release it was built from.
        found = Version(Version(installed).public)
    except InvalidVersion as e:
        raise ImportError(
            f"{package} reports the version {installed!r}, which is not a PEP 440 version; "
            f"distamp is verified with {window.describe()}: {install_command(window)}"
        ) from e
    if found < Version(window.floor):
        raise ImportError(
            f"{package} {installed} is older than the releases distamp is verified with "
            f"({window.describe()}): {install_command(window)}"
        )
    for known in window.breaks:
        if SpecifierSet(known.specifier).contains(found, prereleases=True):
            fix = known.fix or f'pip install "{package}=={window.newest}"'
            raise ImportError(
                f"{package} {installed} is a known break ({package}{known.specifier}): "
                f"{known.reason}. Fix: {fix}"
            )
    if found > Version(window.newest) and (package, installed) not in _warned:
        _warned.add((package, installed))
        warnings.warn(
            f"{package} {installed} is newer than the releases distamp was verified with "
            f"({window.describe()}); it is used as is. If the integration misbehaves, "
            f'pip install "{package}=={window.newest}" and report the break',
            UnverifiedVersionWarning,
            stacklevel=2,
        )
    return installed


def _release(installed: str | None) -> Version:
    if installed is None:
        import torch

        installed = torch.__version__
    return Version(Version(str(installed)).public)


def check_torch(*, installed: str | None = None) -> str:
    """:func:`check_version` for torch, reading ``torch.__version__`` (what ``import torch``
    loaded, which may differ from the installed metadata in a source build)."""
    if installed is None:
        import torch

        installed = str(torch.__version__)
    return check_version("torch", installed=installed)


def require_torch(key: str, *, installed: str | None = None) -> None:
    """Refuse a feature of :data:`TORCH_FEATURES` on a torch older than it needs.

    Raises:
        RuntimeError: naming the feature, the torch in use, what breaks and the fix.
    """
    need = TORCH_FEATURES[key]
    found = _release(installed)
    if found < Version(need.since):
        raise RuntimeError(
            f"{need.feature} needs torch >= {need.since}; this is torch {found}: {need.reason}. "
            f'Fix: pip install "torch>={need.since}"'
        )


def compatibility_table() -> str:
    """The windows and the torch features as Markdown: ``docs/compatibility.md`` is this text
    (``distamp versions > docs/compatibility.md``; a test keeps them equal)."""
    lines = [
        "# Compatibility",
        "",
        "Generated from `distamp/versions.py` (`distamp versions`); do not edit by hand.",
        "",
        "## Verified releases",
        "",
        "Older than the floor: refused at import with the install command. Newer than the newest",
        "verified: used, with one `UnverifiedVersionWarning` naming the window.",
        "",
        "| package | extra | floor | newest verified | known breaks |",
        "|---|---|---|---|---|",
    ]
    for w in (TORCH, *WINDOWS.values()):
        extra = f"`{w.extra}`" if w.extra else "(required)"
        breaks = "; ".join(f"`{b.specifier}`: {b.reason}" for b in w.breaks) or "none"
        lines.append(f"| {w.package} | {extra} | {w.floor} | {w.newest} | {breaks} |")
    lines += [
        "",
        "## Features that need a newer torch than the floor",
        "",
        "Refused up front on an older torch, with the reason and the fix. Every other feature",
        f"works on the whole torch window ({TORCH.describe()}).",
        "",
        "| feature | torch | why |",
        "|---|---|---|",
    ]
    lines += [f"| {f.feature} | >= {f.since} | {f.reason} |" for f in TORCH_FEATURES.values()]
    return "\n".join(lines) + "\n"
