"""The engine's state in and out of checkpoints: :meth:`~distamp.DistAMP.state_dict`,
:meth:`~distamp.DistAMP.save_state` and :meth:`~distamp.DistAMP.load_state`.

The engine's side of a checkpoint: which of its parts are saved (model and optimizer through
DCP, the small rank-identical trainer state, each rank's comm-hook residuals) and in which order
a load applies them (read and check everything, :mod:`distamp.engine.resume`; then the tensors;
then the trainer state). How files are written, verified and read is
:mod:`distamp.engine.checkpoint`'s. Kept apart from :mod:`distamp.engine.core`, which owns the
step, and written against :class:`Persisted` (the engine's public face) so that it does not
import the engine back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from distamp.cluster import named_collective
from distamp.engine.accounting import MicroBatchCycle, SkipReports
from distamp.engine.checkpoint import apply_checkpoint, read_checkpoint, save_checkpoint
from distamp.engine.config import AMPConfig
from distamp.engine.guards import StepGuards
from distamp.engine.resume import check_resume
from distamp.engine.step_ownership import StepOwnership
from distamp.observe.metrics import Metrics
from distamp.parallel.comm_hooks import comm_state_dict, load_comm_state
from distamp.precision.adaptive_run import AdaptiveRun
from distamp.precision.fp8 import Float8Training
from distamp.precision.policy import Precision
from distamp.scaler import DistributedGradScaler

__all__ = ["EnginePersistence", "Persisted"]


class Persisted(Protocol):
    """What saving and loading ask of the engine (:class:`~distamp.DistAMP` is one)."""

    config: AMPConfig
    step_count: int
    cycle: MicroBatchCycle
    skips: SkipReports
    guards: StepGuards
    metrics: Metrics
    scaler: DistributedGradScaler
    scheduler: Any
    adaptive: AdaptiveRun | None
    fp8: Float8Training | None
    comm_hook_state: Any
    ownership: StepOwnership

    @property
    def precision(self) -> Precision: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def state_dict(self) -> dict[str, Any]: ...


class EnginePersistence:
    """``state_dict``, ``save_state`` and ``load_state`` of :class:`~distamp.DistAMP` (see
    module doc); a base of the engine, written against :class:`Persisted` only."""

    def state_dict(self: Persisted) -> dict[str, Any]:
        """The small, rank-identical state: step counter, scaler, scheduler, the spike guard's
        history (syncs: the scaler, the guard's last overflow flag)."""
        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        state = {"step": self.step_count, "precision": self.precision.name}  # resume converts
        state.update(scaler=self.scaler.state_dict(), scheduler=sched)
        if self.adaptive is not None:  # precision changes, replayed by load_state
            state["adaptive"] = self.adaptive.state_dict()
        if self.guards.spike is not None:  # a resumed run decides as this one would have
            state["spike_guard"] = self.guards.spike.state_dict()
        return state

    def save_state(self: Persisted, directory: str | Path, *, keep: int = 2) -> Path:
        """Save model, optimizer, scheduler, scaler, step counter and RNG streams atomically
        (see :mod:`distamp.engine.checkpoint`). Collective: call on every rank.

        ``directory`` must be one filesystem shared by every rank; a save finds out only after
        writing, so a loop of your own checks it before training with
        :func:`distamp.check_shared_directory` (as ``fit(checkpoint_dir=...)`` does)."""
        self.cycle.require_idle(
            "save_state() in the middle of an accumulation cycle: call it after step()"
        )
        # A peer that stalls mid-save fails this rank with the save named, not a bare "recv".
        with named_collective("save_state (checkpoint write)", self.config.timeout):
            return save_checkpoint(
                directory,
                step=self.step_count,
                model=self.model,
                optimizer=self.optimizer,
                trainer_state=self.state_dict(),
                keep=keep,
                rank_state=comm_state_dict(self.comm_hook_state),
            )

    def load_state(self: Persisted, directory: str | Path) -> bool:
        """Load the latest checkpoint of ``directory``, if any. Collective: call on every rank.

        Everything is checked before anything is applied (every file's size and CRC, entries and
        shapes, every trainer field: :mod:`distamp.engine.resume`), and every rank loads or none
        does; the loss scale is carried over only between fp16 runs (a log line says so).

        Returns:
            True if a checkpoint was loaded, False if ``directory`` holds none.

        Raises:
            CheckpointError: a file is damaged, the path is not a checkpoint directory, or the
                checkpoint does not fit this model; nothing changed (file and rank are named).
            ValueError: a trainer field is malformed or does not fit; nothing changed.
        """
        with named_collective("load_state (checkpoint read)", self.config.timeout):
            read = read_checkpoint(
                directory,
                model=self.model,
                optimizer=self.optimizer,
                check=lambda r: check_resume(
                    r,
                    precision=self.precision,
                    scaler=self.scaler,
                    scheduler=self.scheduler,
                    adaptive=self.adaptive,
                    comm_state=self.comm_hook_state,
                    spike=self.guards.spike,
                ),
            )
            if read is None:
                return False
            apply_checkpoint(read, model=self.model, optimizer=self.optimizer)
            load_comm_state(self.comm_hook_state, read.rank_state)  # error-feedback residuals
            if self.fp8 is not None:
                self.fp8.after_step(self.model)  # the loaded weights' float8 scales
        self.step_count = read.checked.apply(self.scaler, self.scheduler, self.adaptive, self.skips)
        self.ownership.resync()  # the restored scheduler count is the engine's own
        if self.guards.spike is not None and read.checked.spike_guard is not None:
            self.guards.spike.load_state_dict(read.checked.spike_guard)
            self.metrics.spike_skips = self.guards.spike.spike_skips
        return True
