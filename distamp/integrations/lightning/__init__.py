"""Lightning (Fabric and Trainer) with distamp's scaler, policy and metrics, and distamp's launcher
detection: one module per plug-in, as Lightning keeps its own precision plug-ins.

- :class:`DistAMPPrecision` (:mod:`~distamp.integrations.lightning.fabric`): the Fabric precision
  plug-in (``Fabric(plugins=[DistAMPPrecision()])``).
- :class:`DistAMPTrainerPrecision` (:mod:`~distamp.integrations.lightning.trainer`) and
  :class:`DistAMPFSDPPrecision` (:mod:`~distamp.integrations.lightning.fsdp`): the Trainer's
  precision plug-ins (single device, DDP, ``ModelParallelStrategy``; ``FSDPStrategy``), both on
  :class:`~distamp.integrations.lightning.base.TrainerPrecisionBase`, their arguments checked by
  :mod:`~distamp.integrations.lightning.arguments`.
- :class:`DistAMPEnvironment` (:mod:`~distamp.integrations.lightning.environment`): a
  ``ClusterEnvironment`` (Fabric and Trainer share that class) over
  :func:`distamp.detect_environment`, so Lightning sees the same rank layout as distamp for
  torchrun, SLURM and the MPI launchers.
- :mod:`~distamp.integrations.lightning.weights`: what ``DistAMPTrainerPrecision("bf16-true")``
  does with 16-bit weights and their exact masters (the cast, the optimizers, the checkpoints).
- :class:`SkipAwareScheduler` (:mod:`~distamp.integrations.lightning.scheduler`): the gate that
  keeps per-step learning-rate schedulers from stepping at skipped steps.
- :class:`DistAMPResumeCheck` (:mod:`~distamp.integrations.lightning.resume`): a callback that
  refuses a resumed checkpoint the plug-in refuses before Lightning restores the model.

Verified with the releases in :data:`SUPPORTED` (:mod:`~distamp.integrations.lightning.version`);
older ones are refused at import, newer ones warn. Importing this package imports Lightning
Fabric; the Trainer's names are imported on first use, so that it does not import the Trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from distamp.integrations.lightning import version as lightning_version

SUPPORTED = lightning_version.SUPPORTED
"""The Lightning releases this adapter was verified with (see :mod:`distamp.versions`)."""

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

from distamp.integrations.lightning.environment import DistAMPEnvironment  # noqa: E402
from distamp.integrations.lightning.fabric import DistAMPPrecision  # noqa: E402

if TYPE_CHECKING:
    from distamp.integrations.lightning.fsdp import DistAMPFSDPPrecision
    from distamp.integrations.lightning.resume import DistAMPResumeCheck
    from distamp.integrations.lightning.scheduler import SkipAwareScheduler
    from distamp.integrations.lightning.trainer import DistAMPTrainerPrecision

__all__ = [
    "LIGHTNING_VERSION",
    "SUPPORTED",
    "DistAMPEnvironment",
    "DistAMPFSDPPrecision",
    "DistAMPPrecision",
    "DistAMPResumeCheck",
    "DistAMPTrainerPrecision",
    "SkipAwareScheduler",
]

# The Trainer plugins live in their own modules (they need lightning.pytorch, Fabric does not);
# they are re-exported here lazily so that importing this package does not import the Trainer.
_TRAINER_NAMES = {
    "DistAMPTrainerPrecision": "distamp.integrations.lightning.trainer",
    "DistAMPFSDPPrecision": "distamp.integrations.lightning.fsdp",
    "SkipAwareScheduler": "distamp.integrations.lightning.scheduler",
    "DistAMPResumeCheck": "distamp.integrations.lightning.resume",
}


def __getattr__(name: str) -> Any:
    if name in _TRAINER_NAMES:
        import importlib

        return getattr(importlib.import_module(_TRAINER_NAMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
