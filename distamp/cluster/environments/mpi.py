"""MPI launchers: Open MPI, MVAPICH, MPICH and Intel MPI (Hydra).

None of them gives a main address: unless ``MASTER_ADDR``/``MASTER_PORT`` are exported,
:func:`~distamp.cluster.init_distributed` asks rank 0 for one over mpi4py. Detection itself
never imports mpi4py, since importing it initializes MPI.
"""

from __future__ import annotations

from collections.abc import Mapping

from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments.base import LauncherEnvironment, block_node_rank, read_world

__all__ = ["MPICH", "MVAPICH", "OpenMPI"]


class OpenMPI(LauncherEnvironment):
    """``mpirun``/``mpiexec`` of Open MPI.

    OMPI_COMM_WORLD_NODE_RANK is this process's rank among the processes of its node, NOT the node's
    index; the node index is derived with :func:`block_node_rank` or left unknown.
    """

    name = "openmpi"
    mpi = True
    _VARS = tuple(f"OMPI_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return cls._VARS[0] in env and cls._VARS[1] in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        r, w, lr, lw = read_world(env, *cls._VARS)
        return DistEnv(cls.name, r, w, lr, lw, block_node_rank(r, w, lr, lw), None, None)


class MVAPICH(OpenMPI):
    name = "mvapich"
    _VARS = tuple(f"MV2_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))


class MPICH(OpenMPI):
    """MPICH and Intel MPI (Hydra's ``mpiexec``)."""

    name = "mpich"
    _VARS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
