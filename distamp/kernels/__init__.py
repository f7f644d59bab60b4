"""Fused unscale kernels: unscale + non-finite check (+ sum of squares) in one read pass.

``unscale_check_sumsq_`` is the entry point the scaler and clipping use; ``unscale_and_check_``
is its shorthand without the sum of squares. Both dispatch over the "triton" and "torch"
backends (see :mod:`distamp.kernels.dispatch`). ``check_sumsq_cpu_`` is the torch backend's
check and sum of squares for CPU gradients, called directly by a clip on the CPU, where the
dispatcher's validation and routing would cost more than the small ops of the norm itself.
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
from distamp.kernels.reference import check_sumsq_cpu_

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "check_sumsq_cpu_",
    "get_default_backend",
    "set_default_backend",
    "triton_available",
    "unscale_and_check_",
    "unscale_check_sumsq_",
]
