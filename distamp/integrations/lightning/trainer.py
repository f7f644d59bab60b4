"""``DistAMPTrainerPrecision``: the Lightning Trainer precision plug-in with distamp's
rank-consistent scaler.

``Trainer(plugins=[DistAMPTrainerPrecision("16-mixed")])`` (DDP, single device,
``ModelParallelStrategy``) or ``Trainer(strategy=FSDPStrategy(...),
plugins=[DistAMPFSDPPrecision("16-mixed")])`` (:mod:`distamp.integrations.lightning.fsdp`).
Where Lightning's own ``16-mixed`` falls short in distributed fp16, these plugins (through their
base, :class:`~distamp.integrations.lightning.base.TrainerPrecisionBase`):

- skip an overflowing step on every rank or on none (:class:`~distamp.DistributedGradScaler`),
  also when the inf appears on one rank only (FSDP shards, fused optimizers, gradient hooks),
  and report it: ``last_step_skipped``, ``step_was_skipped``, ``skipped_steps``;
- do not step ``interval="step"`` learning-rate schedulers at skipped steps
  (:class:`~distamp.integrations.lightning.scheduler.SkipAwareScheduler`, installed in
  ``connect``);
- clip through ``Trainer(gradient_clip_val=...)`` / ``configure_gradient_clipping`` with the
  scaler's one-pass, one-collective ``clip_grad_norm_``, also for fused optimizers and under FSDP
  (Lightning's ``FSDPPrecision`` refuses norm clipping). A deliberate difference: Lightning's
  ``MixedPrecision`` raises for a fused optimizer ("does not allow for gradient clipping"), as
  such an optimizer unscales inside its step; distamp folds the clip coefficient into that
  unscale instead, so the clip is exact and costs no extra pass;
- save and restore the scaler (scale, growth and hysteresis trackers, skip counter) in Trainer
  checkpoints;
- take an :class:`~distamp.AutocastPolicy` for the modules and ops that stay in fp32, and run
  its adaptive rules and backward scales exactly as :class:`~distamp.DistAMP` does (the same
  :class:`~distamp.precision.adaptive_run.AdaptiveRun`, driven by the scaler's step), each change
  logged to the Trainer's loggers and kept in its checkpoints.

Lightning refuses ``Trainer(precision="16-mixed", strategy=ModelParallelStrategy(...))`` by
checking the *string* flag only (``_AcceleratorConnector._validate_precision_choice`` in
Lightning 2.6); a precision plugin passed in ``plugins=`` is accepted, so fp16 runs there with
:class:`DistAMPTrainerPrecision`. ``FSDPStrategy`` demands an ``FSDPPrecision`` instance (its
``precision_plugin`` setter), hence
:class:`~distamp.integrations.lightning.fsdp.DistAMPFSDPPrecision`, built on the same base.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from distamp.engine.guards import SpikeGuard  # noqa: E402
from distamp.integrations.lightning.arguments import (  # noqa: E402
    UnscaleWhen,
    check_plugin_args,
    lightning_precision_name,
)
from distamp.integrations.lightning.base import TrainerPrecisionBase  # noqa: E402
from distamp.integrations.step_guards import PluginGuards  # noqa: E402
from distamp.precision.policy import AutocastPolicy  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

__all__ = ["LIGHTNING_VERSION", "DistAMPTrainerPrecision"]


class DistAMPTrainerPrecision(TrainerPrecisionBase, MixedPrecision):
    """Trainer precision plugin: autocast (or a policy) plus distamp's rank-consistent scaler.

    For single-device, ``DDPStrategy`` and ``ModelParallelStrategy`` runs (use
    :class:`~distamp.integrations.lightning.fsdp.DistAMPFSDPPrecision` with ``FSDPStrategy``)::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", gradient_clip_val=1.0,
                          plugins=[DistAMPTrainerPrecision("16-mixed", device="cpu")])

    Pass it instead of ``precision=`` (Lightning refuses both at once).

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``, the values Lightning's ``MixedPrecision``
            accepts (any other is refused as Lightning refuses it).
        device: the device type for autocast; ``None``: ``"cuda"`` if available, else
            ``"cpu"``. Pass ``"cpu"`` for a CPU run on a machine with GPUs. Nothing is allocated
            on it before the plug-in is used (it builds on a host without that device).
        scaler: the fp16 scaler; ``None`` creates a :class:`~distamp.DistributedGradScaler`.
            Must be ``None`` for bf16 (no loss scaling). Kept in ``scaler``, which may be
            replaced later by any ``torch.amp.GradScaler``-like object: the next step uses it
            and reads its skip from it, or refuses it before anything is applied (see
            :class:`~distamp.integrations.lightning.base.TrainerPrecisionBase`).
        policy: an :class:`~distamp.AutocastPolicy`: its fp32 modules are set up in
            ``convert_module`` and its context replaces bare autocast in the forward pass.
        unscale: when the gradients are unscaled. ``"before_hooks"``: right after backward, so
            ``on_before_optimizer_step`` hooks and a custom ``configure_gradient_clipping`` see
            true gradients (Lightning's contract). ``"at_clip"``: inside the norm clipping, in
            the same read pass as the norm (fused optimizers: inside their step); hooks then
            see scaled gradients. ``"auto"`` (default): ``"before_hooks"`` when the
            LightningModule or a callback overrides one of those hooks, else ``"at_clip"``.
        gate_schedulers: do not step ``interval="step"`` schedulers after a skipped step.
        trust_ddp_sync: as in :class:`~distamp.DistAMP`: ``True`` registers the DDP module so
            the scaler takes no flag collective; off by default, so a gradient changed on one
            rank after the all-reduce (``on_after_backward`` hooks) is still agreed on.
        spike_guard: a :class:`~distamp.SpikeGuard`, as in :class:`~distamp.DistAMP`: a step
            whose loss (the mean over the step's micro-batches, maximum over the ranks) or, with
            ``gradient_clip_val`` (norm), gradient norm spikes is skipped on every rank: no
            optimizer step, no step of the gated schedulers, the scale not backed off;
            counted in :meth:`metrics_dict`'s ``spike_skips``. Lightning still counts the step
            in ``global_step`` and runs its hooks. With bf16, a check-only scaler is made to
            step through. One small all-reduce and one host sync a step.
        max_consecutive_skips: as in :class:`~distamp.DistAMP`: this many skipped steps in a
            row (overflow and spike alike) raise :class:`~distamp.ConsecutiveSkipsError` from
            the optimizer step on every rank (``trainer.fit`` ends with it); ``None``: no limit.

    Raises:
        ValueError: a precision other than ``"16-mixed"``/``"bf16-mixed"``, a scaler with bf16,
            a policy for another precision, a bad ``unscale``/``gate_schedulers``, or a bad
            ``max_consecutive_skips``.
        TypeError: a scaler that is not a :class:`~distamp.DistributedGradScaler`, a
            ``spike_guard`` that is no :class:`~distamp.SpikeGuard`.
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
        trust_ddp_sync: bool = False,
        spike_guard: SpikeGuard | None = None,
        max_consecutive_skips: int | None = 100,
    ) -> None:
        guards = PluginGuards(spike_guard, max_consecutive_skips)  # refused before anything
        parsed, device, scaler = check_plugin_args(
            type(self).__name__, precision, device, scaler, policy, unscale, gate_schedulers
        )
        self.trust_ddp_sync = bool(trust_ddp_sync)
        # bf16 with adaptive rules gets a check-only scaler, which Lightning refuses for bf16
        lightning_scaler = scaler if parsed.needs_scaler else None
        MixedPrecision.__init__(self, lightning_precision_name(parsed), device, lightning_scaler)
        self._init_distamp(parsed, device, scaler, policy, unscale, gate_schedulers, guards)

    @override
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """The policy's context (autocast plus its fp32 ops) if one was given, else autocast."""
        ctx = self.policy.autocast(self.device) if self.policy is not None else None
        with ctx if ctx is not None else self.autocast_context_manager():
            yield
