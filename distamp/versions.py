"""The releases of each optional framework that distamp was verified with, in one table.

The integrations reach into a framework's objects (which attribute holds the scaler, which class
wraps optimizers, which float8 API converts a model); those names are not a stable API. A fixed
upper pin would refuse every new release although most of them work, so each package has a
*window*: the oldest release verified (the floor) and the newest release verified. The rule
:func:`check_version` applies at import:

- older than the floor, or not installed: :class:`ImportError` with the install command (the
  extras in ``pyproject.toml`` declare the same floors; ``tests/test_versions.py`` keeps them
  equal);
- a release listed in the window's known breaks: :class:`ImportError` naming the break and the fix;
- newer than the newest verified: used as is, with one :class:`UnverifiedVersionWarning` per
  package naming the window, so that a failure later is traced to the untested release.

To move a window, run the integration's tests against the new release and edit the table below.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "WINDOWS",
    "KnownBreak",
    "UnverifiedVersionWarning",
    "Window",
    "check_version",
    "install_command",
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
    extra: str
    """The ``pyproject.toml`` extra that installs it (``pip install -e ".[extra]"``)."""
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
        Window(package="torchft", extra="torchft", floor="0.2.0", newest="0.2.0"),
    )
}
"""Package name -> its verified window. The one place the supported releases are written."""

_warned: set[tuple[str, str]] = set()  # (package, version) already warned about in this process


def install_command(window: Window) -> str:
    """How to install the package at a verified release: distamp is installed from a checkout
    (it is not on a package registry), so the extra is named on the checkout."""
    return f'pip install -e ".[{window.extra}]" (from a distamp checkout)'


def check_version(package: str, *, installed: str | None = None) -> str:
    """Return the installed version of ``package`` after applying its window's rule.

    Args:
        package: a key of :data:`WINDOWS`.
        installed: the version to judge; ``None`` reads the installed distribution's metadata
            (tests pass fake versions here).

    Raises:
        ImportError: the package is missing, older than its window's floor, or a known break;
            the message names the window, or the break, and the install command.
    """
    window = WINDOWS[package]
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
