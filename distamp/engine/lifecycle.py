"""The process group around one engine: made at ``DistAMP.setup`` only when none exists, and
destroyed at ``close`` only if made there.

Why a rule of its own: a job that initialised its group (torchrun scripts, Lightning, Ray Train)
owns it and may go on using it after the engine closes, so the engine must not destroy it; a
one-process run or a script that let ``setup`` rendezvous expects ``close`` to end the group
cleanly. Either way the engine's DDP reducer and group handles must die *before* exit, in order
(a group only freed during interpreter shutdown can abort the process from gloo's threads), hence
the collection when the group stays.
"""

from __future__ import annotations

import gc
from datetime import timedelta

from distamp.cluster import init_distributed, is_distributed, shutdown_distributed

__all__ = ["join_group", "leave_group"]


def join_group(timeout: float | timedelta) -> bool:
    """Initialise the process group if none exists (bounded by ``timeout``; one process: none is
    made, without a warning). Collective when it rendezvouses.

    Returns:
        Whether this call made the group, so that :func:`leave_group` destroys it.
    """
    if is_distributed():
        return False
    init_distributed(timeout=timeout, warn_if_single=False)  # one process: none
    return is_distributed()


def leave_group(*, owned: bool) -> None:
    """End the engine's part of the job: the group destroyed if :func:`join_group` made it
    (barrier, collection, destroy; collective), else a collection, so that the references the
    caller just dropped (wrapped model, optimizer, scaler) are freed now."""
    if owned:
        shutdown_distributed()  # barrier, collection, destroy
    else:
        gc.collect()
