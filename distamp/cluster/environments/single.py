"""A process no launcher started: a world of one, with no process group."""

from __future__ import annotations

from collections.abc import Mapping

from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments.base import LauncherEnvironment

__all__ = ["Single"]


class Single(LauncherEnvironment):
    """The fallback, last in the order: matches every environment."""

    name = "single"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        return DistEnv(cls.name, 0, 1, 0, 1, 0, None, None)
