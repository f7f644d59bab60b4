"""The former path of the Lightning Trainer's FSDP precision plug-in, kept importable (re-exports
only). The code lives in :mod:`distamp.integrations.lightning.fsdp`.
"""

from __future__ import annotations

from distamp.integrations.lightning.fsdp import LIGHTNING_VERSION, DistAMPFSDPPrecision

__all__ = ["LIGHTNING_VERSION", "DistAMPFSDPPrecision"]
