"""``distamp.parallel.replicas``: the old import path of :mod:`distamp.agreement.replicas`.

That module (agreement and commit across a torchft ``Manager``'s quorum) belongs to what ranks
must agree on, a layer below the wrappers, so it lives in :mod:`distamp.agreement`; its names
are re-exported here so that ``from distamp.parallel.replicas import ...`` keeps working.

:func:`wrap_replicas` wraps a model in torchft's DDP, which is a wrapper's job: it is
:func:`distamp.parallel.strategies.wrap_replicas`, re-exported here as before.
"""

from distamp.agreement.replicas import (
    STATE_KEY,
    SUPPORTED_TORCHFT,
    ManagerGroup,
    QuorumSchedule,
    ReplicaCommit,
    StateOwner,
    check_torchft_version,
    is_ft_ddp,
    is_ft_manager,
    unwrap_ft_optimizer,
)
from distamp.parallel.strategies import wrap_replicas

__all__ = [
    "ManagerGroup",
    "QuorumSchedule",
    "ReplicaCommit",
    "STATE_KEY",
    "SUPPORTED_TORCHFT",
    "StateOwner",
    "check_torchft_version",
    "is_ft_ddp",
    "is_ft_manager",
    "unwrap_ft_optimizer",
    "wrap_replicas",
]
