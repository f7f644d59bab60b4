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
- take Lightning's ``"bf16-true"``/``"16-true"`` (or ``weights=``) as 16-bit weights with an
  exact fp32 master, where Lightning's ``HalfPrecision`` keeps none
  (:mod:`~distamp.integrations.lightning.weights`): cast in ``convert_module``, the optimizers
  wrapped in :class:`~distamp.MasterWeightOptimizer` in ``connect``, the masters in the
  checkpoints (``DDPStrategy`` and one device).

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
from typing import Any, cast

import torch
from torch.nn import Module
from torch.optim import Optimizer
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
from distamp.integrations.lightning.weights import TrainerWeights, check_weights  # noqa: E402
from distamp.integrations.step_guards import PluginGuards  # noqa: E402
from distamp.optim import WeightPrecision  # noqa: E402
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

    With ``"bf16-true"`` or ``"16-true"`` (or ``weights=``) the parameters themselves are
    16-bit, each with an exact fp32 master, and the optimizer ``configure_optimizers`` returns
    is stepped as a :class:`~distamp.MasterWeightOptimizer`
    (:mod:`~distamp.integrations.lightning.weights`)::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp",
                          plugins=[DistAMPTrainerPrecision("bf16-true", device="cpu")])

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``, the values Lightning's ``MixedPrecision``
            accepts, or ``"bf16-true"``/``"16-true"``: Lightning's spellings of 16-bit weights,
            here with an exact master (``weights=WeightPrecision("bf16")`` or ``("fp16")``)
            where Lightning's ``HalfPrecision`` keeps none; the forward still runs under
            autocast (or the policy). Any other value is refused as Lightning refuses it.
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
        weights: a :class:`~distamp.WeightPrecision` (its dtype the precision's): 16-bit
            weights with the master it names, also with ``"bf16-mixed"``/``"16-mixed"``;
            ``None``: ``WeightPrecision(dtype)`` (exact master, fp32 states) for the
            ``"-true"`` spellings, fp32 weights for the ``"-mixed"`` ones. Under DDP or on one
            device (``master="sharded"``: DDP only); another strategy is refused when the
            Trainer sets the model up, before any weight is cast. bf16 weights step through a
            check-only scaler (an inf or NaN on any rank skips the step on every rank); fp16
            weights need loss scaling, and their gradients are never unscaled in fp16: hooks see
            them scaled (``unscale="auto"`` is ``"at_clip"``), clipping is by norm.

    Raises:
        ValueError: a precision other than ``"16-mixed"``/``"bf16-mixed"``/``"bf16-true"``/
            ``"16-true"``, a scaler with bf16, a policy for another precision, a bad
            ``unscale``/``gate_schedulers``, a bad ``max_consecutive_skips``, a ``weights``
            dtype other than the precision's, or with fp16 weights a scaler that does not
            scale, ``unscale="before_hooks"`` or a ``spike_guard``.
        TypeError: a scaler that is not a :class:`~distamp.DistributedGradScaler`, a
            ``spike_guard`` that is no :class:`~distamp.SpikeGuard`, ``weights`` that is no
            :class:`~distamp.WeightPrecision`.
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
        weights: WeightPrecision | None = None,
    ) -> None:
        owner = type(self).__name__
        guards = PluginGuards(spike_guard, max_consecutive_skips)  # refused before anything
        given = scaler
        parsed, device, scaler = check_plugin_args(
            owner, precision, device, scaler, policy, unscale, gate_schedulers, weights=True
        )
        kept = check_weights(
            owner, precision, parsed, weights, given, unscale=unscale, spike_guard=spike_guard
        )
        if kept is not None and scaler is None:  # bf16 weights: the skip is agreed all the same
            scaler = DistributedGradScaler(device=device, check_only=True)
        if kept is not None and kept.needs_scaler and unscale == "auto":
            unscale = "at_clip"  # fp16 gradients are never unscaled in fp16 (see weights)
        self.trust_ddp_sync = bool(trust_ddp_sync)
        # bf16 with adaptive rules gets a check-only scaler, which Lightning refuses for bf16
        lightning_scaler = scaler if parsed.needs_scaler else None
        MixedPrecision.__init__(self, lightning_precision_name(parsed), device, lightning_scaler)
        self.precision = cast(Any, precision)  # as given: "bf16-true" for Lightning's summary
        self._init_distamp(parsed, device, scaler, policy, unscale, gate_schedulers, guards)
        self.weights = None if kept is None else TrainerWeights(kept, owner)

    @override
    def autocast_context_manager(self) -> torch.autocast:
        """Autocast to the compute dtype (Lightning's reads it from the ``"-mixed"`` string)."""
        return torch.autocast(self.device, dtype=self._parsed.compute_dtype, cache_enabled=False)

    @override
    def convert_module(self, module: Module) -> Module:
        """The base's (policy, adaptive rules), then with 16-bit weights the cast.

        Why this hook: the strategy calls it on the bare LightningModule before it moves and
        wraps it (DDP), so the cast parameters are the ones DDP buckets and
        ``configure_optimizers`` sees. What the weights do not cover is refused first, with the
        module unchanged (:meth:`~distamp.integrations.lightning.weights.TrainerWeights.check`).
        """
        if self.weights is not None:
            self.weights.check(module, self.policy)
        module = super().convert_module(module)
        if self.weights is not None:
            self.weights.cast(module, self.policy)
        return module

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        """The base's (settings agreement, scaler registration, scheduler gate), then with
        16-bit weights each optimizer wrapped in a :class:`~distamp.MasterWeightOptimizer`.

        Why this hook: the strategy calls it after DDP wrapped the model (and made its weights
        rank 0's) and after ``configure_optimizers``, and takes the optimizers it returns: the
        Trainer steps, checkpoints and restores the wrapped ones. The weight precision is one
        of the agreed settings, so ranks built differently fail before the masters' broadcast.
        """
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        if self.weights is not None:
            optimizers = self.weights.wrap(model, optimizers)
            rules = self.adaptive.adaptive if self.adaptive is not None else None
            if rules is not None:  # promoted islands compute from the masters
                rules.exact_weights = self.weights.exact_weight
        return model, optimizers, lr_schedulers

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        """The base's; refused for fp16 weights, whose gradients stay scaled until the step."""
        if self.weights is not None and self.weights.precision.needs_scaler:
            raise ValueError(
                "gradient_clip_algorithm='value' with fp16 weights: their gradients stay "
                "scaled until the step divides them in fp32 (unscaled in fp16, small ones "
                "would flush to zero); clip by norm (gradient_clip_algorithm='norm'), or use "
                "precision='bf16-true'"
            )
        super().clip_grad_by_value(optimizer, clip_val)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """With 16-bit weights, the model's entries become their fp32 masters.

        Why this hook: the Trainer calls it with the whole checkpoint (after the optimizers'
        states, which hold each master as ``"master"``), so the checkpoint's weights are the
        masters, as an fp32 run's would be: ``load_from_checkpoint`` into an fp32 module gives
        them bit for bit, and a resumed run casts them again. Not called for
        ``weights_only=True`` checkpoints, which keep the 16-bit weights.
        """
        super().on_save_checkpoint(checkpoint)
        if self.weights is not None:
            self.weights.masters_into(checkpoint)

    @override
    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """The policy's context (autocast plus its fp32 ops) if one was given, else autocast."""
        ctx = self.policy.autocast(self.device) if self.policy is not None else None
        with ctx if ctx is not None else self.autocast_context_manager():
            yield
