"""``DistAMPEnvironment``: a Lightning ``ClusterEnvironment`` (Fabric and the Trainer share that
class) over :func:`distamp.detect_environment`, so Lightning sees the same rank layout as distamp
for torchrun, SLURM and the MPI launchers.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

from lightning.fabric.plugins.environments import ClusterEnvironment  # noqa: E402

from distamp.cluster import DistEnv, detect_environment  # noqa: E402

__all__ = ["LIGHTNING_VERSION", "DistAMPEnvironment"]


class DistAMPEnvironment(ClusterEnvironment):
    """A Lightning ``ClusterEnvironment`` that reads the job layout with distamp's detection.

    Lightning has one environment class per launcher, each with its own reading of the
    variables; this one delegates to :func:`distamp.detect_environment`, so a job gets the
    same ranks (and the same node-rank rules, e.g. for Open MPI) in distamp and in Lightning.
    Passed in ``plugins=`` (also for one process), it spares the job Lightning's own detection,
    whose MPI environment imports ``mpi4py.MPI``: where mpi4py is installed but no MPI library
    is, that raises ``RuntimeError: cannot load MPI library`` while the Trainer or Fabric is
    being built (Lightning catches only ``ImportError``). distamp's detection loads no MPI.

    Args:
        env: the variables to read (default: ``os.environ`` at construction).
    """

    def __init__(self, env: Any = None) -> None:
        super().__init__()
        self._env: DistEnv = detect_environment(env)
        self._rank = self._env.rank
        self._world = self._env.world_size

    @property
    def dist_env(self) -> DistEnv:
        """What :func:`distamp.detect_environment` found."""
        return self._env

    @property
    @override
    def creates_processes_externally(self) -> bool:
        """True under any launcher (torchrun, srun, mpirun): Lightning must not spawn more."""
        return self._env.is_distributed

    @property
    @override
    def main_address(self) -> str:
        if self._env.main_address is not None:
            return self._env.main_address
        if self._env.num_nodes in (None, 1) and self._env.local_world_size == self._world:
            return "127.0.0.1"  # one node: loopback is right
        raise ValueError(
            f"{self._env.launcher} gave no main address for a multi-node job: export "
            "MASTER_ADDR (and MASTER_PORT), or start with `distamp launch`"
        )

    @property
    @override
    def main_port(self) -> int:
        if self._env.main_port is not None:
            return self._env.main_port
        if not self._env.is_distributed:
            return 29500  # a single process binds no port that others need to agree on
        raise ValueError(
            f"{self._env.launcher} gave no main port: export MASTER_PORT (the same on all ranks)"
        )

    @staticmethod
    @override
    def detect() -> bool:
        """True when a launcher started this process (``detect_environment`` is not single)."""
        return detect_environment().is_distributed

    @override
    def world_size(self) -> int:
        return self._world

    @override
    def set_world_size(self, size: int) -> None:
        if size != self._world:
            raise ValueError(
                f"Lightning asked for world size {size}, but {self._env.launcher} started "
                f"{self._world} processes: make devices x num_nodes match the launch"
            )

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        if rank != self._rank:
            raise ValueError(
                f"Lightning computed global rank {rank}, but {self._env.launcher} says "
                f"{self._rank}: make devices/num_nodes match the launch"
            )

    @override
    def local_rank(self) -> int:
        return self._env.local_rank

    @override
    def node_rank(self) -> int:
        if self._env.node_rank is None:
            raise ValueError(
                f"{self._env.launcher} did not say which node this is and it cannot be derived "
                "(uneven processes per node): set NODE_RANK or GROUP_RANK"
            )
        return self._env.node_rank
