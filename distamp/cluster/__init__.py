"""Which launcher started this process, joining the process group it implies, and collectives
that name what was waiting when a peer stops answering.

- :mod:`~distamp.cluster.detection`: :func:`detect_environment`, a pure function of an
  environment mapping (one module per launcher family in :mod:`~distamp.cluster.environments`,
  tried in the order of :data:`~distamp.cluster.detection.ENVIRONMENTS`).
- :mod:`~distamp.cluster.rendezvous`: :func:`init_distributed`, whose rendezvous always ends, in
  success or in a :class:`RendezvousError` naming the address, the port, the launcher and the
  fix; :func:`shutdown_distributed`.
- :mod:`~distamp.cluster.collectives`: :func:`named_collective`, :func:`is_distributed`.
- :mod:`~distamp.cluster.agreement`: :func:`agree_settings`, settings compared across ranks once.
- :mod:`~distamp.cluster.shared_directory`: :func:`check_shared_directory`, a checkpoint
  directory that every rank sees, checked before training.
- :mod:`~distamp.cluster.launching`: what ``distamp launch`` starts and how: the launch spec,
  the ``auto`` rule, the launcher -> command mapping.
- :mod:`~distamp.cluster.supervise`: what ``distamp launch`` runs: signals passed on to every
  rank, no process left behind, the job's exit code.
"""

from __future__ import annotations

from distamp.cluster.agreement import SettingsMismatchError, agree_settings
from distamp.cluster.collectives import CollectiveTimeoutError, is_distributed, named_collective
from distamp.cluster.detection import LAUNCHERS, detect_environment
from distamp.cluster.dist_env import DistEnv
from distamp.cluster.environments.slurm import expand_nodelist
from distamp.cluster.main_address import free_port
from distamp.cluster.rendezvous import RendezvousError, init_distributed, shutdown_distributed
from distamp.cluster.shared_directory import check_shared_directory

__all__ = [
    "LAUNCHERS",
    "DistEnv",
    "CollectiveTimeoutError",
    "RendezvousError",
    "SettingsMismatchError",
    "agree_settings",
    "check_shared_directory",
    "detect_environment",
    "expand_nodelist",
    "free_port",
    "init_distributed",
    "is_distributed",
    "named_collective",
    "shutdown_distributed",
]
