"""torchrun (torchelastic) and hand-made ``env://`` setups."""

from __future__ import annotations

from collections.abc import Mapping

from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments.base import (
    LauncherEnvironment,
    block_node_rank,
    read_int,
    read_world,
)

__all__ = ["TorchElastic"]


class TorchElastic(LauncherEnvironment):
    """torchrun (torchelastic) and the ``env://`` contract: RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    MASTER_ADDR/MASTER_PORT alone do not select it: they are also the override for SLURM and MPI.
    """

    name = "torchrun"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE"} <= env.keys()

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        rank, world = read_int(env, "RANK"), read_int(env, "WORLD_SIZE")
        # Hand-made env:// setups often give only RANK/WORLD_SIZE: that means one node.
        local = {**{"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}, **env}
        r, w, lr, lw = read_world(local, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        node = read_int(env, "GROUP_RANK") if "GROUP_RANK" in env else block_node_rank(r, w, lr, lw)
        return DistEnv(cls.name, r, w, lr, lw, node, None, None)
