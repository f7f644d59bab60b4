"""``DistAMPPrecision``: the Lightning Fabric precision plug-in with distamp's scaler, policy and
metrics (``Fabric(plugins=[DistAMPPrecision()])``).

It differs from Lightning's own ``MixedPrecision`` where that one falls short in distributed fp16:

- the scaler is a :class:`~distamp.DistributedGradScaler` (ranks agree on every skip, also under
  FSDP and with fused optimizers), and one you pass is kept whatever the strategy;
- unscaling works with fused optimizers (Lightning raises "not implemented"), and
  :meth:`DistAMPPrecision.clip_grad_norm_` clips in one pass and one collective, folding the clip
  into a fused optimizer's own unscale;
- :attr:`DistAMPPrecision.step_was_skipped` and :meth:`DistAMPPrecision.metrics_dict` report the
  rank-agreed skip and the loss-scale health without a host sync per step.

It keeps Lightning's contract where that one is explicit: the same precision values
(``"16-mixed"``, ``"bf16-mixed"``), a constructor that touches no device, and a public
``scaler`` that is honoured when replaced (see :mod:`~distamp.integrations.scaler_slot`).

It stands on Fabric's ``MixedPrecision``, not on the Trainer plug-ins' base
(:class:`~distamp.integrations.lightning.base.TrainerPrecisionBase`): Fabric's precision hooks
take neither the step's closure nor the schedulers (the user's loop calls the step), and Fabric's
``Precision`` is a base of the Trainer's, not the other way round.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
from typing_extensions import override

from distamp.integrations.lightning import version as lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

from lightning.fabric.plugins.precision import MixedPrecision  # noqa: E402
from lightning.fabric.utilities import rank_zero_info  # noqa: E402

from distamp.engine.guards import SpikeGuard  # noqa: E402
from distamp.integrations.agreement import agree_plugin_settings  # noqa: E402
from distamp.integrations.lightning.arguments import check_precision  # noqa: E402
from distamp.integrations.scaler_slot import SkipProbe, check_scaler  # noqa: E402
from distamp.integrations.step_guards import PluginGuards  # noqa: E402
from distamp.observe.metrics import AMPMetrics  # noqa: E402
from distamp.precision.adaptive_run import (  # noqa: E402
    AdaptiveRun,
    change_metrics,
    load_plugin_state,
    plugin_state,
)
from distamp.precision.requirements import check_policy_precision  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

__all__ = ["LIGHTNING_VERSION", "DistAMPPrecision"]


class DistAMPPrecision(MixedPrecision):
    """Fabric precision plugin: autocast (or a policy) plus distamp's rank-consistent scaler.

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"``, the values Lightning's ``MixedPrecision``
            accepts (any other is refused as Lightning refuses it).
        device: the device type for autocast; ``None``: ``"cuda"`` if available, else ``"cpu"``.
            Nothing is allocated on it before the plug-in is used.
        scaler: the fp16 scaler; ``None`` creates a :class:`~distamp.DistributedGradScaler`.
            Must be ``None`` for bf16 (no loss scaling needed; with a policy's adaptive rules a
            check-only one is made to drive them). Kept in :attr:`scaler`, which may be
            replaced later (by any ``torch.amp.GradScaler``-like object): the next step uses and
            reads its skip from what is there, or refuses it before anything is applied
            (``TypeError``/``ValueError`` naming the fix). Only a
            :class:`~distamp.DistributedGradScaler` makes the ranks agree on every skip.
        policy: an :class:`~distamp.AutocastPolicy` (or any object with ``apply(model)`` and
            ``autocast(device_type)``): applied in ``convert_module`` and used as the forward
            context instead of bare autocast. Its adaptive rules and backward scales run on the
            first model set up, exactly as in :class:`~distamp.DistAMP` (:attr:`adaptive`);
            their changes appear in :meth:`metrics_dict` (for ``fabric.log_dict``) and in
            Lightning's console log, and :meth:`state_dict` carries them into checkpoints
            (``fabric.save(path, {..., "amp": plugin})``).
        trust_ddp_sync: as in :class:`~distamp.DistAMP`: ``True`` lets the scaler skip its flag
            collective under DDP (the DDP module is registered at the first backward); off by
            default, so a gradient changed on one rank after the all-reduce is still agreed on.
        spike_guard: a :class:`~distamp.SpikeGuard`, as in :class:`~distamp.DistAMP`: a step
            whose loss (the mean of the losses passed to ``fabric.backward`` since the last
            step, maximum over the ranks) or, after :meth:`clip_grad_norm_` with a distamp
            scaler, gradient norm spikes is skipped on every rank (:attr:`step_was_skipped`
            says so: gate your scheduler on it), the scale not backed off; counted in
            :meth:`metrics_dict`'s ``spike_skips``. One small all-reduce and one host sync a
            step.
        max_consecutive_skips: as in :class:`~distamp.DistAMP`: this many skipped steps in a
            row (overflow and spike alike) raise :class:`~distamp.ConsecutiveSkipsError` from
            the optimizer step on every rank; ``None``: no limit.

    Raises:
        ValueError: a precision other than ``"16-mixed"``/``"bf16-mixed"``, a scaler with bf16,
            a policy for another precision (:mod:`~distamp.precision.requirements`), or a bad
            ``max_consecutive_skips`` (``TypeError`` for a ``spike_guard`` of the wrong kind).
    """

    scaler: Any
    """The loss scaler Fabric's hooks and this plug-in step (``None``: bf16, no scaling)."""

    adaptive: AdaptiveRun | None = None
    """The policy's adaptive rules and backward scales at work (``None`` without them)."""

    def __init__(
        self,
        precision: Any = "16-mixed",
        device: str | None = None,
        scaler: DistributedGradScaler | None = None,
        policy: Any = None,
        *,
        trust_ddp_sync: bool = False,
        spike_guard: SpikeGuard | None = None,
        max_consecutive_skips: int | None = 100,
    ) -> None:
        parsed = check_precision(type(self).__name__, precision)
        guards = PluginGuards(spike_guard, max_consecutive_skips)  # refused before anything
        given = f"DistAMPPrecision(precision={precision!r})"
        check_policy_precision(policy, parsed, given=given)  # before a scaler is chosen for it
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if scaler is None and parsed.needs_scaler:
            scaler = DistributedGradScaler(device=device)
        name: Literal["16-mixed", "bf16-mixed"] = (
            "16-mixed" if parsed.needs_scaler else "bf16-mixed"
        )
        super().__init__(name, device, scaler)  # raises for a scaler with bf16
        if scaler is None and getattr(policy, "adaptive", None) is not None:
            self.scaler = DistributedGradScaler(device=device, check_only=True)  # drives them
        self.policy = policy
        self.trust_ddp_sync = bool(trust_ddp_sync)
        self._trusted: set[int] = set()  # DDP modules registered with trust_ddp_sync=True
        self._metrics: AMPMetrics | None = None  # built at first use: no device touched here
        self._needs_scaler = parsed.needs_scaler
        self._checked_scaler = self.scaler  # a replacement is checked at its first use
        self._pinned_scaler: Any = None  # the one a policy's adaptive rules watch
        self._probe = SkipProbe()
        self._last_norm: torch.Tensor | None = None
        self._agreed_norm = False  # the last norm came from a distamp scaler (same on every rank)
        self._unscaled: set[int] = set()  # optimizers unscaled (or clipped) since the last step
        self._skipped: torch.Tensor | None = None
        self.guards = guards
        """The spike guard and the consecutive-skip limit (the engine's, driven from here)."""

    @property
    def metrics(self) -> AMPMetrics:
        """The loss-scale health and throughput window, built on ``device`` at first use (so
        that building the plug-in touches no device, as Lightning's own plug-ins)."""
        if self._metrics is None:
            self._metrics = AMPMetrics(self.device)
        return self._metrics

    def _scaler_now(self) -> Any:
        """The scaler in :attr:`scaler`, checked once after each replacement, before anything
        of the step is applied (see :func:`~distamp.integrations.scaler_slot.check_scaler`)."""
        scaler = self.scaler
        if scaler is not self._checked_scaler:
            check_scaler(
                scaler,
                owner=f"{type(self).__name__}.scaler",
                needs_scaler=self._needs_scaler,
                pinned=self._pinned_scaler,
            )
            self._checked_scaler = scaler
        return scaler

    # ------------------------------------------------------------------ forward
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Apply the policy's fp32 modules and start its adaptive rules (before the strategy
        wraps the model)."""
        if self.policy is not None:
            self.policy.apply(module)
            if self.adaptive is None:
                self.adaptive = AdaptiveRun.for_plugin(
                    module,
                    policy=self.policy,
                    precision=self.precision,
                    scaler=self._scaler_now(),
                    owner=type(self).__name__,
                )
                self._pinned_scaler = self.scaler if self.adaptive is not None else None
        scaler = self._scaler_now()
        if isinstance(scaler, DistributedGradScaler):
            scaler.register_module(module)  # parameter names for overflow reports
        agree_plugin_settings(  # one collective per setup(): ranks built differently fail here
            type(self).__name__,
            precision=self.precision,
            scaler=scaler,
            policy=self.policy,
            trust_ddp_sync=self.trust_ddp_sync,
            **self.guards.settings(),
        )
        return super().convert_module(module)

    @override
    def forward_context(self) -> AbstractContextManager[Any]:
        """The policy's context (autocast plus fp32 ops) if one was given, else autocast."""
        if self.policy is not None:
            return self.policy.autocast(self.device)  # type: ignore[no-any-return]
        return super().forward_context()

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        """Register the DDP module (once) when ``trust_ddp_sync=True``: only now is it built."""
        ddp = isinstance(module, torch.nn.parallel.DistributedDataParallel)
        scaler = self._scaler_now()  # a replacement is checked before the loss is scaled
        if ddp and self.trust_ddp_sync and id(module) not in self._trusted:
            if isinstance(scaler, DistributedGradScaler):
                scaler.register_module(module, trust_ddp_sync=True)
            self._trusted.add(id(module))
        self.guards.record_loss(self.metrics, tensor)  # the spike guard's loss of the step
        return super().pre_backward(tensor, module)

    # ------------------------------------------------------------------ step
    @override
    def unscale_gradients(self, optimizer: Any) -> None:
        """Unscale in place (before reading gradient values). Unlike Lightning's plugin this
        also works for fused optimizers: the scaler then tells their step not to unscale again."""
        scaler = self._scaler_now()
        if scaler is not None:
            scaler.unscale_(optimizer)
            self._unscaled.add(id(getattr(optimizer, "optimizer", optimizer)))

    def clip_grad_norm_(
        self, optimizer: Any, max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Unscale and clip ``optimizer``'s gradients to total norm ``max_norm``, across ranks.

        Prefer it to ``fabric.clip_gradients`` under fp16: one read pass and one collective, a
        clip folded into a fused optimizer's own step, and no error at an overflow step (the
        norm is then inf and the step is skipped on every rank). Call it once per step, after
        the last backward and before ``optimizer.step()``.

        Returns:
            The total gradient norm before clipping (0-dim tensor; no host sync).
        """
        optimizer = getattr(optimizer, "optimizer", optimizer)  # a _FabricOptimizer
        scaler = self._scaler_now()
        self._agreed_norm = isinstance(scaler, DistributedGradScaler)
        if self._agreed_norm:
            norm = scaler.clip_grad_norm_(optimizer, max_norm, norm_type)
            self._unscaled.add(id(optimizer))
        else:
            self.unscale_gradients(optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        self._last_norm = norm.detach()
        return norm

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step (skipped on every rank if any rank saw inf/NaN, or for a spike with
        ``spike_guard``), update the scale, record.

        The skip is read from the scaler in :attr:`scaler` (a replaced one is checked first): a
        distamp scaler's agreed flag without a host sync, another's scale drop with one.

        Raises:
            ConsecutiveSkipsError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        scaler = self._scaler_now()
        norm, self._last_norm = self._last_norm, None
        unwrapped = getattr(optimizer, "optimizer", optimizer)
        spike = self.guards.before(self.metrics, norm if self._agreed_norm else None, scaler)
        self._probe.before(scaler)
        if spike:  # on every rank alike: no optimizer step, the scale not backed off
            out = None
            self.guards.skip(scaler, unwrapped, unscaled=id(unwrapped) in self._unscaled)
        else:
            out = super().optimizer_step(optimizer, **kwargs)
        self._unscaled.clear()
        flag = None if scaler is None else self._probe.after(scaler)
        spike = self.guards.after(self.metrics, scaler, spike=spike, overflow=flag, norm=norm)
        self._skipped = torch.ones((), dtype=torch.bool) if spike else flag
        if self.adaptive is not None:  # decided inside scaler.update(), the same on every rank
            for change in self.adaptive.take_changes("console"):
                rank_zero_info(f"distamp: {change}")
        return out

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped on every rank, for inf/NaN gradients or
        for a spike (``spike_guard``).

        One host sync (reads the scaler's on-device flag), only when asked.
        """
        return False if self._skipped is None else bool(self._skipped)  # host sync, on request

    def metrics_dict(self) -> dict[str, float | int | None]:
        """Loss scale, skipped steps, overflow rate, unscaled grad norm and tokens/s of the
        window since the last call. Collective: call on every rank at the same step; count
        tokens with ``plugin.metrics.add_tokens``. With adaptive rules, the changes made in
        the window too (see :func:`~distamp.precision.adaptive_run.change_metrics`)."""
        out: dict[str, float | int | None] = dict(self.metrics.compute(self.scaler))
        if self.adaptive is not None:
            out.update(change_metrics(self.adaptive.take_changes("metrics")))
        return out

    @override
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state and the adaptive run's (Fabric saves it when the plugin is in
        the state passed to ``fabric.save``)."""
        return plugin_state(self._scaler_now(), self.adaptive)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler and replay the adaptive run's changes, both checked first (a
        refused state changes nothing)."""
        load_plugin_state(state_dict, self._scaler_now(), self.adaptive)
