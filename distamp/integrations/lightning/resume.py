"""Refuse a resumed Trainer checkpoint that the precision plug-in would refuse, before Lightning
restores the model from it.

Why a callback: Lightning 2.6 restores a checkpoint in this order
(``_CheckpointConnector._restore_modules_and_callbacks``, then ``restore_training_state``): the
strategy's ``load_checkpoint`` reads the file, the LightningModule's ``on_load_checkpoint`` runs
and the model's weights are loaded, then the callbacks' ``on_load_checkpoint``, and only then
the precision plug-in's ``on_load_checkpoint`` and ``load_state_dict``. Under DDP and on one
device this happens before the strategy's ``setup``, so the plug-in is called for the first time
after the model already holds the checkpoint's weights: a scaler state it refuses then leaves a
half-restored model. The first code Lightning runs that can see the checkpoint before the model
is restored is the strategy's checkpoint IO, and a callback's ``setup`` hook runs before it
loads. So :class:`DistAMPResumeCheck` puts a checking wrapper around the strategy's
``checkpoint_io`` in ``setup`` (through its public setter) and takes it off in ``teardown``.

The check is the plug-in's own (:func:`~distamp.precision.adaptive_run.check_plugin_state`:
the scaler's state whole, the adaptive run's part), agreed across the ranks: every rank refuses,
naming the file, or none does. Strategies that load the model inside their own
``load_checkpoint`` (FSDP, ``ModelParallelStrategy``) do not read through ``checkpoint_io``;
there the plug-in's own check at ``load_state_dict`` remains the refusal.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

import lightning.pytorch as pl  # noqa: E402
from lightning.fabric.plugins.io import CheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from distamp.cluster.agreement import agree_failures  # noqa: E402
from distamp.precision.adaptive_run import check_plugin_state  # noqa: E402

__all__ = ["DistAMPResumeCheck", "check_trainer_checkpoint"]

# Lightning's key for the scaler state of checkpoints written before precision plug-ins had
# their own entry (its restore_precision_plugin_state loads it into a MixedPrecision plug-in).
_LEGACY_KEY = "native_amp_scaling_state"


def check_trainer_checkpoint(plugin: Any, checkpoint: Any, path: Any) -> None:
    """Check the precision ``plugin``'s entries of a Trainer ``checkpoint`` dict (read from
    ``path``) as its ``load_state_dict`` would, changing nothing. Collective when distributed:
    every rank refuses or none does.

    Raises:
        ValueError: naming the file, the entry and the rank(s) whose check refused it.
    """
    error = None
    scaler, adaptive = getattr(plugin, "scaler", None), getattr(plugin, "adaptive", None)
    if isinstance(checkpoint, dict) and (scaler is not None or adaptive is not None):
        for key in (type(plugin).__qualname__, _LEGACY_KEY):
            if key in checkpoint:
                try:
                    check_plugin_state(checkpoint[key], scaler, adaptive)
                except (ValueError, TypeError, KeyError, RuntimeError) as exc:
                    error = f"checkpoint {path}: entry {key!r}: {exc}; nothing was restored"
                    break
    failures, _ = agree_failures(error)
    if failures:
        raise ValueError("; ".join(failures))


class _CheckingIO(CheckpointIO):
    """The strategy's checkpoint IO, with :func:`check_trainer_checkpoint` after each load."""

    def __init__(self, inner: CheckpointIO, trainer: pl.Trainer) -> None:
        self.inner, self.trainer = inner, trainer

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    @override
    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoint = self.inner.load_checkpoint(
            path, map_location=map_location, weights_only=weights_only
        )
        check_trainer_checkpoint(self.trainer.precision_plugin, checkpoint, path)
        return checkpoint

    @override
    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    @override
    def teardown(self) -> None:
        self.inner.teardown()


class DistAMPResumeCheck(Callback):  # type: ignore[misc]
    """Refuse a checkpoint the precision plug-in would refuse before Lightning restores the
    model from it (see the module doc)::

        trainer = Trainer(plugins=[DistAMPTrainerPrecision("16-mixed")],
                          callbacks=[DistAMPResumeCheck()], strategy="ddp", ...)
        trainer.fit(model, ckpt_path="last.ckpt")  # a bad scaler state: ValueError, model as it was

    Without it the plug-in still refuses the state, but Lightning has restored the model's
    weights by then.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Put the check around the strategy's checkpoint IO (before Lightning restores)."""
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, _CheckingIO):
            trainer.strategy.checkpoint_io = _CheckingIO(io, trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Give the strategy its own checkpoint IO back."""
        io = trainer.strategy.checkpoint_io
        if isinstance(io, _CheckingIO):
            trainer.strategy.checkpoint_io = io.inner
