"""Ray Train workers (``ray.train.torch.TorchTrainer``)."""

from __future__ import annotations

from collections.abc import Mapping

from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments.base import LauncherEnvironment, read_int, read_world

__all__ = ["RayTrain"]


class RayTrain(LauncherEnvironment):
    """A Ray Train worker: Ray's torch backend sets the ``env://`` variables (RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR/PORT) in a Ray worker process, which
    carries ``RAY_RAYLET_PID``, and initializes the process group itself (checked on Ray 2.60);
    :func:`distamp.init_distributed` then keeps that group.

    The Ray variable alone does not select it: every Ray task and actor has it, while only
    Train's workers have a rank. A torchrun started inside a Ray worker is torchrun's.
    """

    name = "ray"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return (
            "RAY_RAYLET_PID" in env
            and {"RANK", "WORLD_SIZE"} <= env.keys()
            and "TORCHELASTIC_RUN_ID" not in env
        )

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        r, w, lr, lw = read_world(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        node = read_int(env, "NODE_RANK") if "NODE_RANK" in env else None
        return DistEnv(cls.name, r, w, lr, lw, node, None, None)
