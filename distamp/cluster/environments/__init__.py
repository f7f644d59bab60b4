"""One module per launcher family; the order they are tried in is
:data:`distamp.cluster.detection.ENVIRONMENTS`.
"""

from __future__ import annotations

from distamp.cluster.environments.base import LauncherEnvironment
from distamp.cluster.environments.mpi import MPICH, MVAPICH, OpenMPI
from distamp.cluster.environments.ray_train import RayTrain
from distamp.cluster.environments.single import Single
from distamp.cluster.environments.slurm import Slurm
from distamp.cluster.environments.torchelastic import TorchElastic

__all__ = [
    "MPICH",
    "MVAPICH",
    "LauncherEnvironment",
    "OpenMPI",
    "RayTrain",
    "Single",
    "Slurm",
    "TorchElastic",
]
