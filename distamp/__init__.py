"""distamp: distributed automatic mixed precision for PyTorch.

Public API only: what the README and the ``launch/`` examples use, and the error types they can
raise. Integrations live in :mod:`distamp.integrations` (they import Accelerate or Lightning);
the ``distamp`` command lives in :mod:`distamp.cli`. Neither is imported here.
"""

# ruff: noqa: E402  (torch's version is checked before the imports below touch it)

from __future__ import annotations

from distamp.versions import check_torch

check_torch()  # before anything touches torch's internals: an older torch fails here, named

from distamp.cluster import (
    CollectiveTimeoutError,
    DistEnv,
    RendezvousError,
    check_shared_directory,
    detect_environment,
    init_distributed,
    shutdown_distributed,
)
from distamp.deploy import export
from distamp.engine import DistAMP
from distamp.engine.checkpoint import CheckpointError
from distamp.engine.config import check_settings
from distamp.engine.guards import ConsecutiveSkipsError, SpikeGuard
from distamp.observe.metrics import StepResult, WindowStats
from distamp.observe.recorder import MetricsRecorder
from distamp.observe.telemetry import Telemetry
from distamp.observe.writers import ProgressPrinter, make_writer
from distamp.optim import MasterWeightOptimizer, WeightPrecision, master_weights
from distamp.parallel.recompute import AC_MODES, apply_activation_checkpointing, compile_blocks
from distamp.parallel.strategies import COMM_HOOKS, STRATEGIES
from distamp.precision.adaptive import AdaptiveRules, PrecisionChange
from distamp.precision.audit import audit
from distamp.precision.backward_scales import BackwardScaleChange, BackwardScaleRules
from distamp.precision.fp8_select import FP8_RECIPES
from distamp.precision.policy import AutocastPolicy, parse_precision
from distamp.scaler import DistributedGradScaler, ScalerStateError, ScaleUnderflowError

__all__ = [
    # training
    "AutocastPolicy",
    "DistAMP",
    "DistributedGradScaler",
    "SpikeGuard",
    "StepResult",
    "audit",
    "check_settings",
    "parse_precision",
    # the values DistAMP's and the helpers' string arguments take (for argument parsers)
    "AC_MODES",
    "COMM_HOOKS",
    "FP8_RECIPES",
    "STRATEGIES",
    # the memory half: 16-bit weights with an exact master, 16-bit or sharded optimizer state
    "MasterWeightOptimizer",
    "WeightPrecision",
    "master_weights",
    # the memory recipe: activation checkpointing and torch.compile per block
    "apply_activation_checkpointing",
    "compile_blocks",
    # deployment: the trained precision in a torch.export program (distamp.deploy)
    "export",
    # adaptive precision: the rules of AutocastPolicy(adaptive=..., backward_scales=...) and
    # the records of what they changed
    "AdaptiveRules",
    "BackwardScaleChange",
    "BackwardScaleRules",
    "PrecisionChange",
    # launching
    "DistEnv",
    "check_shared_directory",
    "detect_environment",
    "init_distributed",
    "shutdown_distributed",
    # metrics, and per-module telemetry (what `distamp report` draws)
    "MetricsRecorder",
    "ProgressPrinter",
    "Telemetry",
    "WindowStats",
    "make_writer",
    # errors
    "CheckpointError",
    "CollectiveTimeoutError",
    "ConsecutiveSkipsError",
    "RendezvousError",
    "ScaleUnderflowError",
    "ScalerStateError",
]
__version__ = "0.1.0"
