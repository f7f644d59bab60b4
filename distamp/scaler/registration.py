"""Who a :class:`~distamp.DistributedGradScaler` agrees with, and what it is told about the model.

The ranks whose skip decisions must agree come from the constructor's ``process_group`` (the
whole job by default, a narrower group or mesh, or a ``torchft.Manager``'s replicas); which ranks
hold copies of which gradient element comes from the modules registered here (DDP, FSDP1,
pipeline stages) and from DTensor placements. Both live in the scaler's
:class:`~distamp.agreement.topology.Topology`, asked by the state machine and by clipping alike;
this module is the scaler's public face on it, so that the engine, the plug-ins and the fp8
weight scales share one idea of "every rank" without reaching into the scaler.
"""

from __future__ import annotations

from typing import Any

import torch

from distamp.agreement import reduction
from distamp.scaler.records import StepAgreement

__all__ = ["ScalerRegistration"]


class ScalerRegistration(torch.amp.GradScaler):
    """The agreement's ranks and the registered modules (see module doc); a base of
    :class:`~distamp.DistributedGradScaler`, which sets ``_steps``. None of these syncs."""

    _steps: StepAgreement

    @property
    def collectives_issued(self) -> int:
        """How many found_inf collectives this scaler issued (clips included)."""
        return self._steps.collectives_issued

    @property
    def ft_manager(self) -> Any:
        """The ``torchft.Manager`` this scaler agrees and commits through (its
        ``process_group``), or ``None``."""
        return self._steps.topology.ft_manager

    @property
    def agreement(self) -> reduction.FlagReducer:
        """The ranks whose skip decisions agree (from ``process_group``), as a reducer: other
        per-step reductions that must span the same ranks (the engine's fp8 weight scales) use
        it, so that a job never mixes two ideas of "every rank"."""
        return self._steps.topology.agreement

    def register_module(self, module: Any, *, trust_ddp_sync: bool = False) -> None:
        """Tell the scaler what holds the parameters: names for reports, copies for norms.

        Accepts a ``DistributedDataParallel`` module (its group tells how many ranks hold each
        element; ``trust_ddp_sync=True``, off by default: no flag collective for an optimizer it
        fully synchronises over the job, as its all-reduce spread any inf, right only when nothing
        edits one rank's gradients between backward and step), an FSDP1 module (shards), a
        ``torch.distributed.pipelining`` stage (its plain parameters are replicated over every
        rank running the same stage), or any module (parameter names). FSDP2, TP and expert
        parameters need no registration: their DTensor placements say it all. Call it on every
        rank, like the wrappers themselves; the engine does.
        """
        self._steps.topology.register_module(module, trust_ddp_sync=trust_ddp_sync)
