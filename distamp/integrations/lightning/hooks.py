"""What the Trainer plug-ins' hooks need to know about Lightning's objects: the optimizer inside a
``LightningOptimizer``, the module a scaler should be registered with, the strategy a module is
set up by, whether user code reads gradients between backward and the step, and the scheduler
configurations to gate.

Kept apart from :mod:`~distamp.integrations.lightning.base` (the hooks themselves): these read
Lightning's objects and decide nothing about the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch.nn import Module
from torch.optim import Optimizer

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402

from distamp.integrations.lightning.scheduler import SkipAwareScheduler  # noqa: E402

__all__ = [
    "gated_scheduler",
    "module_to_register",
    "strategy_of",
    "unwrap_optimizer",
    "user_code_reads_gradients",
]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (what ``self.optimizers()``
    returns in manual optimization): the scaler keys its per-step state by the real one."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def module_to_register(model: Module) -> Module:
    """The module the scaler should know: the outermost FSDP1 module (its shards count once in
    clipping), else the LightningModule (parameter names for overflow reports).

    Never the DDP wrapper: registering it tells the scaler that DDP's all-reduce already spread
    any inf to every rank, so no collective is needed; under the Trainer, hooks that run
    between backward and the step (``on_after_backward``, ``on_before_optimizer_step``) can
    still change one rank's gradients, and one flag in one small collective is cheap insurance.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model = model.module
    for found in model.modules():
        if isinstance(found, FullyShardedDataParallel):
            return found
    for found in model.modules():
        if isinstance(found, pl.LightningModule):
            return found
    return model


def strategy_of(module: Module) -> Any:
    """The strategy of the Trainer ``module`` is attached to, ``None`` for a module outside a
    Trainer (the strategy calls ``convert_module`` on the attached LightningModule)."""
    if not isinstance(module, pl.LightningModule):
        return None
    try:
        return module.trainer.strategy
    except RuntimeError:  # "... is not attached to a `Trainer`"
        return None


def user_code_reads_gradients(model: pl.LightningModule) -> bool:
    """Whether a hook that runs between backward and the step may read gradient values:
    an ``on_before_optimizer_step`` of the module or of a callback, or a custom
    ``configure_gradient_clipping``. Lightning promises those hooks unscaled gradients."""
    if is_overridden("on_before_optimizer_step", model) or is_overridden(
        "configure_gradient_clipping", model
    ):
        return True
    callbacks = getattr(model.trainer, "callbacks", [])  # set by Lightning's callback connector
    return any(is_overridden("on_before_optimizer_step", cb, Callback) for cb in callbacks)


def gated_scheduler(config: Any, skipped: Callable[[Optimizer], bool]) -> Any:
    """The scheduler config with its scheduler wrapped, for ``interval="step"`` only: an epoch
    scheduler steps once per epoch, after many optimizer steps, whatever the last one did."""
    if getattr(config, "interval", None) != "step" or isinstance(
        config.scheduler, SkipAwareScheduler
    ):
        return config
    return replace(config, scheduler=SkipAwareScheduler(config.scheduler, skipped))
