"""torchao for ``precision="fp8"``: the tested version range, a lazy import that explains what
to install, and whether this machine runs float8 GEMMs at all.

torchao is imported lazily (:func:`require_torchao`), so ``import distamp`` works without it; the
verified releases are :data:`TORCHAO_RANGE` (the ``torchao`` row of :mod:`distamp.versions`):
older ones are refused with the install command, newer ones warn.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from packaging.version import Version

from distamp.torch_compat import scaled_mm
from distamp.versions import WINDOWS, check_version, require_torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "TORCHAO_RANGE",
    "check_device",
    "fp8_support",
    "require_torchao",
    "torchao_version_tested",
]

TORCHAO_RANGE = WINDOWS["torchao"]
"""The torchao releases distamp was verified with (see :mod:`distamp.versions`)."""


def torchao_version_tested(version: str) -> bool:
    """Whether torchao ``version`` (e.g. ``"0.18.0"``, ``"0.18.0+cu128"``) lies in
    :data:`TORCHAO_RANGE`: what ``distamp env`` reports. A newer release is still accepted by
    :func:`require_torchao` (with a warning); this says only whether it was verified."""
    found = Version(Version(version).public)
    return Version(TORCHAO_RANGE.floor) <= found <= Version(TORCHAO_RANGE.newest)


@contextmanager
def _quiet_torchao_import() -> Iterator[None]:
    # torchao logs a WARNING for each CUDA kernel library it cannot load; without CUDA every one
    # fails by design, so on such machines the lines are noise (torchao 0.18, torch 2.13 CPU).
    logger = logging.getLogger("torchao")
    previous = logger.level
    if not torch.cuda.is_available():
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


def require_torchao() -> ModuleType:
    """Import ``torchao.float8`` or explain what to install.

    Raises:
        ImportError: torchao is not installed, outside its window or a known break (float8
            APIs change between releases).
    """
    try:
        check_version("torchao")
    except ImportError as e:
        raise ImportError(f"precision='fp8': {e}") from e.__cause__
    with _quiet_torchao_import():
        return importlib.import_module("torchao.float8")


def fp8_support() -> dict[str, Any]:
    """What ``distamp env`` reports: torchao, and whether this machine runs float8 GEMMs.

    CUDA needs compute capability 8.9+ (Ada, Hopper and later have float8 tensor cores); the
    CPU runs ``torch._scaled_mm`` through its reference kernel (torch 2.13 has one), which is
    correct but not fast. Probes one 16x16 float8 GEMM on the CPU.
    """
    try:
        version: str | None = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        version = None
    in_range = version is not None and torchao_version_tested(version)
    try:
        a = torch.ones(16, 16).to(torch.float8_e4m3fn)
        one = torch.ones((), dtype=torch.float32)
        scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        cpu = True
    except (RuntimeError, AttributeError, NotImplementedError):
        cpu = False
    cuda = [torch.cuda.get_device_capability(i) >= (8, 9) for i in range(torch.cuda.device_count())]
    return {
        "torchao": version,
        "torchao_tested": in_range,
        "cpu": cpu,
        "cuda_sm89": cuda or None,
        "supported": in_range and (cpu or any(cuda)),
    }


def check_device(device: torch.device, recipe: str = "tensorwise") -> None:
    """Refuse a device that cannot run the recipe's float8 GEMMs, before any layer is swapped."""
    if device.type == "cpu" and recipe == "rowwise":
        require_torch("fp8-rowwise-cpu")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            raise RuntimeError(
                f"precision='fp8' on {torch.cuda.get_device_name(index)} (compute capability "
                f"{major}.{minor}): float8 GEMMs need 8.9+ (Ada, Hopper or later); use "
                "precision='bf16' on this GPU"
            )
