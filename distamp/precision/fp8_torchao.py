"""torchao for ``precision="fp8"``: the tested version range, a lazy import that explains what
to install, and whether this machine runs float8 GEMMs at all.

torchao is imported lazily (:func:`require_torchao`), so ``import distamp`` works without it; the
tested range is :data:`TORCHAO_RANGE` and other versions are refused with the install command.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "TORCHAO_RANGE",
    "check_device",
    "fp8_support",
    "require_torchao",
    "torchao_version_tested",
]

TORCHAO_RANGE = ((0, 18), (0, 19))
"""torchao versions distamp was tested with: ``>=0.18,<0.19`` (as the ``fp8`` extra pins)."""


def torchao_version_tested(version: str) -> bool:
    """Whether torchao ``version`` (e.g. ``"0.18.0"``, ``"0.18.1+cu128"``) is in
    :data:`TORCHAO_RANGE`."""
    lo, hi = TORCHAO_RANGE
    return lo <= tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3]) < hi


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
        ImportError: torchao is not installed, or its version is outside :data:`TORCHAO_RANGE`.
    """
    lo, hi = TORCHAO_RANGE
    wanted = f">={'.'.join(map(str, lo))},<{'.'.join(map(str, hi))}"
    install = f'pip install "distamp[fp8]" (torchao{wanted})'
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"precision='fp8' needs torchao: {install}") from None
    if not torchao_version_tested(version):
        raise ImportError(
            f"precision='fp8': torchao {version} is installed, distamp is tested with "
            f"torchao{wanted} (float8 APIs change between releases): {install}"
        )
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
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
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


def check_device(device: torch.device) -> None:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 9):
            raise RuntimeError(
                f"precision='fp8' on {torch.cuda.get_device_name(index)} (compute capability "
                f"{major}.{minor}): float8 GEMMs need 8.9+ (Ada, Hopper or later); use "
                "precision='bf16' on this GPU"
            )
