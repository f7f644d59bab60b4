"""The former path of the Lightning resume check, kept importable (re-exports only). The code
lives in :mod:`distamp.integrations.lightning.resume`.
"""

from __future__ import annotations

from distamp.integrations.lightning.resume import (
    LIGHTNING_VERSION,
    DistAMPResumeCheck,
    check_trainer_checkpoint,
)

__all__ = ["LIGHTNING_VERSION", "DistAMPResumeCheck", "check_trainer_checkpoint"]
