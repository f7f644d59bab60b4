"""distamp: distributed automatic mixed precision for PyTorch.

Public API only; see the README for the workflows it supports.
"""

from __future__ import annotations

from distamp.scaler import DistributedGradScaler, ScalerStateError, ScaleUnderflowError

__all__ = ["DistributedGradScaler", "ScaleUnderflowError", "ScalerStateError"]
__version__ = "0.1.0"
