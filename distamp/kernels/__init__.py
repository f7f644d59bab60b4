"""Fused unscale kernels: unscale + non-finite check (+ sum of squares) in one read pass.

``unscale_check_sumsq_`` is the entry point the scaler and clipping use; ``unscale_and_check_``
is its shorthand without the sum of squares. Both dispatch over the "triton" and "torch"
backends (see :mod:`distamp.kernels.dispatch`).
Triton is imported only when a CUDA call first needs it.
"""

from __future__ import annotations

from distamp.kernels.dispatch import (
    BACKENDS,
    ENV_VAR,
    get_default_backend,
    set_default_backend,
    triton_available,
    unscale_and_check_,
    unscale_check_sumsq_,
)

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "get_default_backend",
    "set_default_backend",
    "triton_available",
    "unscale_and_check_",
    "unscale_check_sumsq_",
]
