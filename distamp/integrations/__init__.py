"""Adapters that put distamp's scaler, policy and metrics inside other trainers.

Each submodule imports its framework when it is itself imported, never from here, so that
``import distamp`` (and ``import distamp.integrations``) works without Accelerate or Lightning:

- :mod:`distamp.integrations.accelerate`: ``DistAMPAccelerator``, an ``accelerate.Accelerator``.
- :mod:`distamp.integrations.lightning`: ``DistAMPPrecision`` (Fabric precision plugin) and
  ``DistAMPEnvironment`` (a ``ClusterEnvironment`` over :func:`distamp.detect_environment`);
  re-exports the Trainer plugins (``DistAMPTrainerPrecision`` of
  :mod:`distamp.integrations.lightning_trainer`, ``DistAMPFSDPPrecision`` of
  :mod:`distamp.integrations.lightning_fsdp`) and the scheduler gate of
  :mod:`distamp.integrations.lightning_scheduler` (``SkipAwareScheduler``). The Fabric module
  and the Trainer plugins' modules take the Lightning version check from
  :mod:`distamp.integrations.lightning_version`, so the re-exporting module is imported by none.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["check_version"]


def _release(text: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
        if not piece.isdigit():  # "0rc1": stop after the leading number
            break
    return tuple(parts)


def check_version(
    package: str, minimum: str, below: str, *, extra: str, installed: str | None = None
) -> str:
    """Return the installed version of ``package`` if ``minimum <= version < below``.

    The integrations reach into a framework's objects (which attribute holds the scaler, which
    class wraps optimizers); those names are not a stable API, so a version outside the tested
    range is refused up front instead of failing, or silently training wrong, later.

    Raises:
        ImportError: the package is missing or its version is outside the range; the message
            names the range and the pip command.
    """
    if installed is None:
        try:
            installed = version(package)
        except PackageNotFoundError as e:
            raise ImportError(
                f"{package} is not installed: pip install 'distamp[{extra}]' "
                f"(supported: {package}>={minimum},<{below})"
            ) from e
    if not _release(minimum) <= _release(installed) < _release(below):
        raise ImportError(
            f"{package} {installed} is not supported by distamp.integrations.{extra} "
            f"(tested range: >={minimum},<{below}): pip install 'distamp[{extra}]'"
        )
    return installed
