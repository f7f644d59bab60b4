"""``DistAMPFSDPPrecision``: the Trainer plugin for Lightning's ``FSDPStrategy`` (FSDP1).

``FSDPStrategy`` accepts only ``FSDPPrecision`` instances (its ``precision_plugin`` setter raises
``TypeError`` for anything else), so this class puts the shared Trainer logic of
:class:`~distamp.integrations.lightning.base.TrainerPrecisionBase` in front of ``FSDPPrecision``.

Where it runs: Lightning 2.6 lets ``FSDPStrategy`` run with CUDA accelerators only
(``_AcceleratorConnector._check_strategy_and_fallback`` raises "requires a GPU accelerator" when
``type(strategy) is FSDPStrategy`` and the accelerator is not CUDA), and the strategy wraps the
model with ``device_id=root_device.index``, which is ``None`` on CPU and which torch's FSDP1
refuses on a machine without an accelerator. The plugin itself has no CUDA dependency.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

from lightning.pytorch.plugins.precision import FSDPPrecision  # noqa: E402

from distamp.engine.guards import SpikeGuard  # noqa: E402
from distamp.integrations.lightning.arguments import (  # noqa: E402
    UnscaleWhen,
    check_plugin_args,
    lightning_precision_name,
)
from distamp.integrations.lightning.base import TrainerPrecisionBase  # noqa: E402
from distamp.integrations.step_guards import PluginGuards  # noqa: E402
from distamp.parallel.fsdp import fsdp1_mixed_precision  # noqa: E402
from distamp.precision.policy import AutocastPolicy, select_mp_owner  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

__all__ = ["LIGHTNING_VERSION", "DistAMPFSDPPrecision"]


class DistAMPFSDPPrecision(TrainerPrecisionBase, FSDPPrecision):
    """The same plugin for ``FSDPStrategy``, which accepts only ``FSDPPrecision`` instances.

    Lightning's ``FSDPPrecision("16-mixed")`` uses torch's ``ShardedGradScaler``, whose skip
    decision can differ between ranks (fused optimizers), casts with autocast on CUDA only,
    reduces gradients in fp16 and refuses norm clipping. This one keeps the guarantees of
    :class:`~distamp.integrations.lightning.trainer.DistAMPTrainerPrecision`, clips by norm
    counting every shard once, and leaves casting to distamp's selector
    (:func:`distamp.precision.policy.select_mp_owner`): on CUDA, FSDP's ``MixedPrecision`` gathers
    parameters in the compute dtype and reduces gradients in fp32; on CPU, or with a policy,
    autocast casts (FSDP's ``mixed_precision`` is then ``None``).

    Lightning (2.6) lets ``FSDPStrategy`` run with CUDA accelerators only: its accelerator
    connector raises "requires a GPU accelerator" otherwise.

    Args: as :class:`~distamp.integrations.lightning.trainer.DistAMPTrainerPrecision`.
    """

    def __init__(
        self,
        precision: Any = "16-mixed",
        device: str | None = None,
        scaler: DistributedGradScaler | None = None,
        policy: AutocastPolicy | None = None,
        *,
        unscale: UnscaleWhen = "auto",
        gate_schedulers: bool = True,
        spike_guard: SpikeGuard | None = None,
        max_consecutive_skips: int | None = 100,
    ) -> None:
        guards = PluginGuards(spike_guard, max_consecutive_skips)  # refused before anything
        parsed, device, scaler = check_plugin_args(
            type(self).__name__, precision, device, scaler, policy, unscale, gate_schedulers
        )
        # FSDPPrecision builds a ShardedGradScaler for "16-mixed"; it cannot be handed ours
        # (Lightning 2.6 checks a passed scaler against `self.precision` before setting it, so
        # FSDPPrecision("16-mixed", scaler=...) raises). Replaced by distamp's before anything
        # uses it; without CUDA it warns that it disables itself, which does not concern us.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
            FSDPPrecision.__init__(self, lightning_precision_name(parsed))
        self._init_distamp(parsed, device, scaler, policy, unscale, gate_schedulers, guards)
        self._mp_owner = (
            "autocast" if policy is not None else select_mp_owner(parsed, "fsdp", device)
        )

    @property
    @override
    def mixed_precision_config(self) -> Any:
        """FSDP's ``MixedPrecision`` when FSDP casts (CUDA, no policy), else ``None``."""
        if self._mp_owner != "fsdp" or self._parsed.compute_dtype is None:
            return None
        return fsdp1_mixed_precision(self._parsed.compute_dtype)

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        """Policy context, else autocast on ``device`` unless FSDP's policy casts."""
        if self.policy is not None:
            return self.policy.autocast(self.device)  # type: ignore[no-any-return]
        if self._mp_owner != "autocast":
            return nullcontext()
        return torch.autocast(self.device, dtype=self._parsed.compute_dtype)
