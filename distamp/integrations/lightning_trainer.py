"""The former path of the Lightning Trainer precision plug-in, kept importable (re-exports only).

The code lives in the package :mod:`distamp.integrations.lightning`: the plug-in in
:mod:`~distamp.integrations.lightning.trainer`, its base class in
:mod:`~distamp.integrations.lightning.base`, the argument checks in
:mod:`~distamp.integrations.lightning.arguments`.
"""

from __future__ import annotations

from distamp.integrations.lightning.arguments import (
    UnscaleWhen,
    check_plugin_args,
    lightning_precision_name,
)
from distamp.integrations.lightning.base import TrainerPrecisionBase
from distamp.integrations.lightning.trainer import LIGHTNING_VERSION, DistAMPTrainerPrecision

__all__ = [
    "LIGHTNING_VERSION",
    "DistAMPTrainerPrecision",
    "TrainerPrecisionBase",
    "UnscaleWhen",
    "check_plugin_args",
    "lightning_precision_name",
]
