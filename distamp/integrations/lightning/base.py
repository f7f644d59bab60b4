"""The base of the Trainer precision plug-ins: the scaler, the step, clipping, the scheduler gate
and checkpoints, behind Lightning's ``Precision`` hooks.

Lightning keeps one precision plug-in per variant on one ``Precision`` base; distamp does the
same. :class:`TrainerPrecisionBase` holds what both Trainer plug-ins do the same way, and each
plug-in puts it in front of the Lightning class its strategy demands:
:class:`~distamp.integrations.lightning.trainer.DistAMPTrainerPrecision` (``MixedPrecision``:
single device, DDP, ``ModelParallelStrategy``) and
:class:`~distamp.integrations.lightning.fsdp.DistAMPFSDPPrecision` (``FSDPPrecision``:
``FSDPStrategy``). Every hook it overrides says in its docstring why Lightning calls it and what
distamp does there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.plugins.precision.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info  # noqa: E402

from distamp.integrations.agreement import agree_plugin_settings  # noqa: E402
from distamp.integrations.lightning.arguments import UnscaleWhen  # noqa: E402
from distamp.integrations.lightning.hooks import (  # noqa: E402
    gated_scheduler,
    module_to_register,
    unwrap_optimizer,
    user_code_reads_gradients,
)
from distamp.integrations.scaler_slot import SkipProbe, check_scaler  # noqa: E402
from distamp.integrations.step_guards import PluginGuards  # noqa: E402
from distamp.observe.metrics import AMPMetrics  # noqa: E402
from distamp.optim import MasterWeightOptimizer  # noqa: E402
from distamp.precision.adaptive_run import (  # noqa: E402
    AdaptiveRun,
    change_metrics,
    load_plugin_state,
    plugin_state,
)
from distamp.precision.policy import AutocastPolicy  # noqa: E402
from distamp.precision.policy import Precision as ParsedPrecision  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

if TYPE_CHECKING:
    from distamp.integrations.lightning.weights import TrainerWeights

__all__ = ["LIGHTNING_VERSION", "TrainerPrecisionBase"]


class TrainerPrecisionBase(Precision):
    """What both Trainer plugins share: the scaler, the step, clipping, schedulers, state
    (:class:`~distamp.integrations.lightning.trainer.DistAMPTrainerPrecision` and
    :class:`~distamp.integrations.lightning.fsdp.DistAMPFSDPPrecision`).

    Subclasses put it in front of the Lightning class their strategy demands
    (``MixedPrecision`` or ``FSDPPrecision``); ``super()`` then reaches that class. Each
    subclass checks its arguments
    (:func:`~distamp.integrations.lightning.arguments.check_plugin_args`), calls its Lightning
    base's ``__init__``, then ``_init_distamp``, and supplies its own ``forward_context``
    (autocast, a policy's context, or none where FSDP casts).

    The Lightning hooks it takes over, in the order a run meets them: ``convert_module``
    (policy, adaptive rules), ``connect`` (settings agreement, scaler registration, scheduler
    gate), ``optimizer_step`` (the agreed step), ``clip_gradients`` / ``clip_grad_by_norm`` /
    ``clip_grad_by_value`` (clipping through the scaler), ``state_dict`` / ``load_state_dict``
    (checkpoints).

    ``scaler`` is Lightning's public attribute and is honoured when replaced, as Lightning's own
    plug-ins honour it (``plugin.scaler = Mock(wraps=plugin.scaler)``, a ``torch.amp.GradScaler``):
    every step scales, unscales, steps and reads its skip from whatever is there
    (:mod:`~distamp.integrations.scaler_slot`). A replacement that cannot be honoured (no
    ``GradScaler`` methods, ``None`` with fp16, a scaler with bf16, another scaler than the one
    a policy's adaptive rules watch) is refused at the next step, before anything is applied.
    Only a :class:`~distamp.DistributedGradScaler` makes the ranks agree on every skip.
    """

    scaler: Any
    """The loss scaler Lightning's hooks and this plug-in step (``None``: bf16, no scaling)."""
    device: str
    trust_ddp_sync: bool = False  # see DistAMPTrainerPrecision
    adaptive: AdaptiveRun | None = None
    """The policy's adaptive rules and backward scales at work (``None`` without them)."""
    weights: TrainerWeights | None = None
    """16-bit weights with their masters (:mod:`~distamp.integrations.lightning.weights`),
    ``None`` for fp32 weights."""

    def _init_distamp(
        self,
        parsed: ParsedPrecision,
        device: str,
        scaler: DistributedGradScaler | None,
        policy: AutocastPolicy | None,
        unscale: UnscaleWhen,
        gate_schedulers: bool,
        guards: PluginGuards,
    ) -> None:
        if scaler is None and guards.spike_guard is not None:  # bf16: a check-only one steps
            scaler = DistributedGradScaler(device=device, check_only=True)  # (and skips) here
        self.scaler = scaler  # Lightning's attribute (pre_backward scales with it)
        self._checked_scaler = scaler  # checked by check_plugin_args; a replacement at its step
        self._pinned_scaler: Any = None  # the one a policy's adaptive rules watch
        self._registered: tuple[Module, bool] | None = None  # (model, trusted) from connect
        self._probe = SkipProbe()
        self._foreign_skips = 0  # skips read from a scaler that keeps no count (not distamp's)
        self.device = device
        self.policy = policy
        self.unscale = unscale
        self.gate_schedulers = gate_schedulers
        self.guards = guards
        """The spike guard and the consecutive-skip limit (the engine's, driven from here)."""
        self._metrics: AMPMetrics | None = None  # built at first use: no device touched here
        self._parsed = parsed
        # Without a distamp scaler (bf16, or a replaced one), a disabled one still clips with one
        # collective and counts FSDP shards and DTensor placements once, which
        # torch.nn.utils.clip_grad_norm_ does not. A disabled scaler allocates nothing.
        self._norm_clipper = DistributedGradScaler(device, enabled=False)
        self._unscaled: set[int] = set()  # optimizers unscaled (or clipped) since the last update
        self._skip_flags: dict[int, torch.Tensor] = {}  # optimizer id -> last step's agreed flag
        self._last_skip: torch.Tensor | None = None
        self._no_clip = False
        self._pending_norm: torch.Tensor | None = None  # for metrics, taken at the step
        self.last_grad_norm: torch.Tensor | None = None
        """The norm returned by the last norm clipping (0-dim tensor, unscaled, no host sync)."""

    @property
    def metrics(self) -> AMPMetrics:
        """The loss-scale health and throughput window (:class:`~distamp.observe.metrics.
        AMPMetrics`), built on ``device`` at first use, so that building the plug-in touches no
        device (as Lightning's own plug-ins: a job can be configured on a host without its GPU).
        """
        if self._metrics is None:
            self._metrics = AMPMetrics(self.device)
        return self._metrics

    def _scaler_now(self) -> Any:
        """The scaler in :attr:`scaler`, checked once after each replacement (before anything
        of the step is applied) and, if distamp's, registered with the model as the first was."""
        scaler = self.scaler
        if scaler is not self._checked_scaler:
            check_scaler(
                scaler,
                owner=f"{type(self).__name__}.scaler",
                needs_scaler=self._parsed.needs_scaler,
                pinned=self._pinned_scaler,
            )
            if isinstance(scaler, DistributedGradScaler) and self._registered is not None:
                model, trusted = self._registered
                scaler.register_module(model, trust_ddp_sync=trusted)
            self._checked_scaler = scaler
        return scaler

    def _clipper(self) -> DistributedGradScaler:
        """distamp's scaler when it is the one there (one pass: unscale, check, norm, clip),
        else the disabled one, after the scaler there unscaled."""
        scaler = self._scaler_now()
        return scaler if isinstance(scaler, DistributedGradScaler) else self._norm_clipper

    # ------------------------------------------------------------------ setup
    @override
    def convert_module(self, module: Module) -> Module:
        """Apply the policy's fp32 modules and start its adaptive rules on the model.

        Why this hook: the strategy calls it on the bare LightningModule before wrapping it
        (DDP, FSDP), the last moment the policy's fp32 modules can be marked by name and
        travel into the wrapper. The adaptive rules start once per model: a second ``fit`` of
        the same one keeps them, another model closes them and starts anew.
        """
        if self.policy is not None:
            self.policy.apply(module)
            if self.adaptive is not None and self.adaptive.model is not module:
                self.adaptive.close()
                self.adaptive = None
            if self.adaptive is None:
                scaler = self._scaler_now()
                self.adaptive = AdaptiveRun.for_plugin(
                    module,
                    policy=self.policy,
                    precision=self._parsed,
                    scaler=scaler,
                    owner=type(self).__name__,
                )
                self._pinned_scaler = scaler if self.adaptive is not None else None
        return super().convert_module(module)

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        """Agree on the settings across ranks, register the wrapped model with the scaler and
        gate the per-step schedulers.

        Why this hook: every strategy calls it after wrapping the model and creating the
        optimizers, with the scheduler configurations it will step, which makes it the one
        place to see the wrapped model (FSDP shards count once in clipping) and to swap the
        schedulers for :class:`~distamp.integrations.lightning.scheduler.SkipAwareScheduler`
        without touching Lightning's loops. The settings agreement is one collective, so ranks
        built differently fail here, before training.
        """
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        scaler = self._scaler_now()
        agree_plugin_settings(  # one collective: ranks built differently fail before training
            type(self).__name__,
            precision=self._parsed.name,
            scaler=scaler,
            policy=self.policy,
            trust_ddp_sync=self.trust_ddp_sync,
            unscale=self.unscale,
            gate_schedulers=self.gate_schedulers,
            weights="fp32" if self.weights is None else self.weights.precision.short(),
            **self.guards.settings(),
        )
        if self.trust_ddp_sync and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._registered = (model, True)
        else:
            self._registered = (module_to_register(model), False)
        for clipper in {id(c): c for c in (self._clipper(), self._norm_clipper)}.values():
            clipper.register_module(self._registered[0], trust_ddp_sync=self._registered[1])
        if scaler is not None and self.gate_schedulers:
            lr_schedulers = [
                gated_scheduler(config, self._optimizer_skipped) for config in lr_schedulers
            ]
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ the step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward), the hooks and clipping, then the agreed step.

        Why this hook: Lightning hands the precision plug-in the whole step (the closure
        included), so it is where distamp's scaler replaces torch's: the skip is decided on
        every rank alike and recorded for the scheduler gate and the metrics. Order, as
        Lightning's own AMP plugin: closure, unscale (see ``unscale``),
        ``on_before_optimizer_step`` hooks and ``configure_gradient_clipping``, then
        ``scaler.step`` (skipped on every rank when any rank holds an inf/NaN) and
        ``scaler.update``. No host sync for fused optimizers (one ``.item()`` otherwise, in
        ``scaler.step``); a scaler that is not distamp's costs one more, to read its skip.
        A replaced :attr:`scaler` is checked first, before the closure runs. With a spike
        guard, the decision comes before ``scaler.step`` (one small all-reduce, one host sync):
        a spike skips the optimizer step on every rank, and the gated schedulers with it.

        Raises:
            ConsecutiveSkipsError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        scaler = self._scaler_now()
        if scaler is None:  # bf16: nothing to scale or skip
            out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            self.metrics.step(None, self._take_norm())
            return out
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer: LBFGS re-evaluates the loss inside step(), which a loss scaler cannot "
                "gate; use another optimizer, or precision='bf16-mixed' (no scaler)"
            )
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning ran no backward. Hooks still run (as in
            # Lightning's plugin); there is nothing to clip or step, and schedulers must wait.
            self._no_clip = True
            try:
                self._after_closure(model, optimizer)
            finally:
                self._no_clip = False
            self._record_skip(optimizer, torch.ones((), dtype=torch.bool))
            return closure_result
        if self.unscale == "before_hooks" or (
            self.unscale == "auto" and user_code_reads_gradients(model)
        ):
            self._unscale_once(optimizer)
        # `_after_closure` runs the on_before_optimizer_step hooks and configure_gradient_clipping;
        # Lightning's own precision plugins call it at this point (checked on Lightning 2.6).
        self._after_closure(model, optimizer)
        norm = self._take_norm()  # a distamp scaler's clip: agreed, so the guard may watch it
        spike = self.guards.before(self.metrics, norm, scaler)
        self._probe.before(scaler)
        if spike:  # on every rank alike: no optimizer step, the scale not backed off
            out = None
            self.guards.skip(scaler, optimizer, unscaled=id(optimizer) in self._unscaled)
        else:
            out = scaler.step(optimizer, **kwargs)
            scaler.update()  # an adaptive run decides here, the same on every rank
        self._unscaled.clear()
        flag = self._probe.after(scaler)
        if not isinstance(scaler, DistributedGradScaler):
            self._foreign_skips += int(flag)  # a CPU flag: read without a device sync
        spike = self.guards.after(self.metrics, scaler, spike=spike, overflow=flag, norm=norm)
        self._record_skip(optimizer, torch.ones((), dtype=torch.bool) if spike else flag)
        changes = self.adaptive.take_changes() if self.adaptive is not None else []
        for change in changes:
            rank_zero_info(f"distamp: {change}")
        for logger in model.trainer.loggers if changes else ():
            logger.log_metrics(change_metrics(changes), step=model.trainer.global_step)
        return out

    @override
    def pre_backward(  # type: ignore[override]
        self, tensor: torch.Tensor, module: pl.LightningModule
    ) -> torch.Tensor:
        """Check a replaced :attr:`scaler`, then scale the loss with it (Lightning's base).

        Why this hook: Lightning scales the loss here, with whatever ``scaler`` holds; in manual
        optimization it is the first use of a replacement, before any optimizer step. The
        spike guard's loss of the step is recorded here too (Lightning passes the loss divided
        by ``accumulate_grad_batches``: a constant factor, which the guard's limits share).
        """
        self._scaler_now()
        self.guards.record_loss(self.metrics, tensor)
        return super().pre_backward(tensor, module)  # type: ignore[no-any-return]

    def _unscale_once(self, optimizer: Optimizer) -> None:
        scaler = self._scaler_now()
        if scaler is not None and id(optimizer) not in self._unscaled:
            scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def _record_skip(self, optimizer: Optimizer, flag: torch.Tensor) -> None:
        self._skip_flags[id(optimizer)] = flag
        if isinstance(optimizer, MasterWeightOptimizer):  # its schedulers hold the inner one
            self._skip_flags[id(optimizer.inner)] = flag
        self._last_skip = flag

    def _take_norm(self) -> torch.Tensor | None:
        norm, self._pending_norm = self._pending_norm, None
        return norm

    def _optimizer_skipped(self, optimizer: Optimizer) -> bool:
        flag = self._skip_flags.get(id(unwrap_optimizer(optimizer)))
        # Host sync: a scheduler's step() is a Python decision; asked only when one is due.
        return flag is not None and bool(flag)

    # ------------------------------------------------------------------ clipping
    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by norm (the scaler's one-pass ``clip_grad_norm_``) or by value (after unscaling).

        Why this hook: ``LightningModule.clip_gradients`` (the default
        ``configure_gradient_clipping``, fed by ``Trainer(gradient_clip_val=...)``) calls it,
        and Lightning's own plugins refuse it for fused optimizers and FSDP's norm. distamp
        clips through its scaler instead, also for fused optimizers (the clip coefficient is
        folded into their own unscale); nothing to clip at a step whose ``training_step``
        returned ``None``.
        """
        if self._no_clip:
            return
        if isinstance(clip_val, bool) or not isinstance(clip_val, (int, float)):
            raise ValueError(f"clip_val={clip_val!r} must be a number (0 turns clipping off)")
        if clip_val <= 0:
            return
        if gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.clip_grad_by_norm(optimizer, clip_val)
        elif gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self.clip_grad_by_value(optimizer, clip_val)
        else:
            raise ValueError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r}: use 'norm' or 'value'"
            )

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Unscale and clip to total norm ``clip_val`` over the whole job, in one read pass and
        one collective (which also carries the overflow flag). No host sync.

        Why this hook: Lightning's version norms with ``torch.nn.utils.clip_grad_norm_``,
        which does not count FSDP shards and DTensor placements once (and ``FSDPPrecision``
        refuses it); the scaler's ``clip_grad_norm_`` counts each element once. The norm is
        kept for :attr:`last_grad_norm` and the metrics.
        """
        optimizer = unwrap_optimizer(optimizer)
        clipper = self._clipper()
        if clipper is self._norm_clipper:  # no distamp scaler there: unscale with the one there
            self._unscale_once(optimizer)
        norm = clipper.clip_grad_norm_(optimizer, float(clip_val))
        if self.scaler is not None:
            self._unscaled.add(id(optimizer))
        self.last_grad_norm = self._pending_norm = norm.detach()

    @override
    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        """Unscale (once per step), then clamp every gradient element to ``[-clip_val,
        clip_val]``. Element-wise, so shards and replicas need no communication.

        Why this hook: the clamp must see unscaled values, and an optimizer unscaled twice in
        one step would be wrong; distamp unscales through its scaler once per optimizer and
        step, whoever asks first (this hook, ``unscale="before_hooks"``).
        """
        optimizer = unwrap_optimizer(optimizer)
        self._unscale_once(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), float(clip_val))

    # ------------------------------------------------------------------ reporting
    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last optimizer step was skipped on every rank (inf/NaN
        gradients, a spike with ``spike_guard``, or a ``training_step`` that returned ``None``).
        No host sync."""
        if self._last_skip is None:
            return torch.zeros((), dtype=torch.bool)
        return self._last_skip

    @property
    def step_was_skipped(self) -> bool:
        """:attr:`last_step_skipped` as a bool (one host sync, on request)."""
        return bool(self.last_step_skipped)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients since the start, restored from checkpoints
        (one host sync, on request). 0 for bf16; with a scaler that is not distamp's, the skips
        this plug-in read from it (not restored from checkpoints: that scaler keeps no count)."""
        scaler = self.scaler
        if isinstance(scaler, DistributedGradScaler):
            return scaler.skipped_steps
        return self._foreign_skips

    def metrics_dict(self) -> dict[str, float | int | None]:
        """Loss scale, skipped steps, overflow rate, grad norm and tokens/s of the window since
        the last call (see :class:`~distamp.observe.metrics.AMPMetrics`). Collective: call it on
        every rank at the same step, e.g. from ``on_train_batch_end`` every N steps."""
        return self.metrics.compute(self.scaler)

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, trackers, skip counter) and the adaptive run's, saved in
        Trainer checkpoints under this class's name; empty for bf16 without a policy's rules.

        Why this hook: the Trainer saves every precision plug-in's ``state_dict`` in its
        checkpoints; without it a resumed fp16 run would restart at the initial loss scale and
        lose the adaptive run's promotions.
        """
        return plugin_state(self._scaler_now(), self.adaptive)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler and replay the adaptive run's changes (the Trainer calls it when
        resuming), both checked first: malformed input raises ``ValueError`` naming the key,
        and changes nothing.

        Why this hook: the Trainer hands back what :meth:`state_dict` saved. Under DDP and on
        one device it runs after Lightning restored the model's weights, so a refused state
        leaves them restored:
        :class:`~distamp.integrations.lightning.resume.DistAMPResumeCheck` refuses it earlier.
        """
        load_plugin_state(state_dict, self._scaler_now(), self.adaptive)
