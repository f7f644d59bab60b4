"""distamp: distributed automatic mixed precision for PyTorch.

Public API only; see the README for the workflows it supports. The ``distamp`` command lives in
:mod:`distamp.cli` and is not imported here.
"""

from __future__ import annotations

from distamp.audit import audit
from distamp.cluster import (
    DistEnv,
    RendezvousError,
    detect_environment,
    expand_nodelist,
    init_distributed,
)
from distamp.engine import AMPConfig, DistAMP
from distamp.metrics import StepResult
from distamp.policy import AutocastPolicy, Precision, parse_precision
from distamp.scaler import DistributedGradScaler, ScalerStateError, ScaleUnderflowError

__all__ = [
    "AMPConfig",
    "AutocastPolicy",
    "DistAMP",
    "DistEnv",
    "DistributedGradScaler",
    "Precision",
    "RendezvousError",
    "ScaleUnderflowError",
    "ScalerStateError",
    "StepResult",
    "audit",
    "detect_environment",
    "expand_nodelist",
    "init_distributed",
    "parse_precision",
]
__version__ = "0.1.0"
