"""What ``distamp env`` reports: versions, the detected launcher, CUDA/NCCL/MPI, autocast and
fp8 support, and the launcher variables of the environment.

Versions come from package metadata, so mpi4py, triton and torchao are reported without being
imported (importing mpi4py would initialize MPI). It sits above every package because it asks
several of them (the launcher detection, fp8 support); the parser (:mod:`distamp.cli`) prints it.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from distamp.cluster import detect_environment

__all__ = ["environment_report", "package_version", "print_report"]


def package_version(dist: str) -> str | None:
    """The installed release of distribution ``dist``, ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _autocast_supported(device: str, dtype: Any) -> bool:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.autocast(device, dtype=dtype)
        except (RuntimeError, ValueError):
            return False
    return not caught  # torch warns, then disables autocast, for a dtype the device cannot run


# What `distamp env` shows of the environment: launcher variables and the backends' knobs.
_SHOWN = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|CUDA_VISIBLE_DEVICES)$|MPI_LOCAL"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI_COMM_WORLD|PMI|MV2_COMM_WORLD|DISTAMP|NCCL|TORCH_NCCL|GLOO"
    r"|TORCH_DISTRIBUTED)_"
)


def environment_report(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Versions, detected launcher, CUDA/NCCL/MPI, autocast and fp8 support, launcher variables.

    fp8: see :func:`distamp.precision.fp8_torchao.fp8_support` (CUDA compute capability 8.9+,
    or the CPU through ``torch._scaled_mm``; torchao in range).
    """
    import torch
    import torch.distributed as dist

    from distamp.precision.fp8_torchao import fp8_support

    env = os.environ if env is None else env
    try:
        detected: dict[str, Any] = asdict(detect_environment(env))
    except ValueError as exc:
        detected = {"error": str(exc)}
    cuda = torch.cuda.is_available()
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    )
    nccl = dist.is_available() and dist.is_nccl_available()
    return {
        "versions": {
            "distamp": package_version("distamp"),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "triton": package_version("triton"),
            "mpi4py": package_version("mpi4py"),
        },
        "environment": detected,
        "cuda": {
            "available": cuda,
            "version": torch.version.cuda,
            "devices": devices,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and nccl else None,
        },
        "mpi": {
            "mpirun": shutil.which("mpirun"),
            "srun": shutil.which("srun"),
            "torch_mpi_backend": dist.is_mpi_available(),
        },
        "autocast": {
            f"{device}.{name}": _autocast_supported(device, dtype)
            for device in ("cpu", "cuda")
            for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16))
        },
        "fp8": fp8_support(),
        "variables": {k: v for k, v in sorted(env.items()) if _SHOWN.match(k)},
    }


def print_report(report: Mapping[str, Any]) -> None:
    """:func:`environment_report` as text: one section per heading, one value per line."""
    for section, values in report.items():
        print(f"{section}:")
        for key, value in values.items():
            print(f"  {key:<20} {'-' if value is None else value}")
