"""Lightning Trainer precision plugins with distamp's rank-consistent scaler.

``Trainer(plugins=[DistAMPTrainerPrecision("16-mixed")])`` (DDP, single device,
``ModelParallelStrategy``) or ``Trainer(strategy=FSDPStrategy(...),
plugins=[DistAMPFSDPPrecision("16-mixed")])`` (:mod:`distamp.integrations.lightning_fsdp`).
Where Lightning's own ``16-mixed`` falls short in distributed fp16, these plugins:

- skip an overflowing step on every rank or on none (:class:`~distamp.DistributedGradScaler`),
  also when the inf appears on one rank only (FSDP shards, fused optimizers, gradient hooks),
  and report it: :attr:`last_step_skipped`, :attr:`step_was_skipped`, :attr:`skipped_steps`;
- do not step ``interval="step"`` learning-rate schedulers at skipped steps
  (:class:`~distamp.integrations.lightning_scheduler.SkipAwareScheduler`, installed in
  ``connect``);
- clip through ``Trainer(gradient_clip_val=...)`` / ``configure_gradient_clipping`` with the
  scaler's one-pass, one-collective ``clip_grad_norm_``, also for fused optimizers (Lightning
  raises) and under FSDP (Lightning's ``FSDPPrecision`` refuses norm clipping);
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
:class:`~distamp.integrations.lightning_fsdp.DistAMPFSDPPrecision`, built on the same base.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import torch
from torch.nn import Module
from torch.optim import Optimizer

from distamp.integrations import lightning_version

LIGHTNING_VERSION = lightning_version.LIGHTNING_VERSION  # importing it checked the version

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision.precision import Precision  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402

from distamp.integrations.agreement import agree_plugin_settings  # noqa: E402
from distamp.integrations.lightning_scheduler import SkipAwareScheduler  # noqa: E402
from distamp.observe.metrics import AMPMetrics  # noqa: E402
from distamp.precision.adaptive_run import (  # noqa: E402
    AdaptiveRun,
    change_metrics,
    load_plugin_state,
    plugin_state,
)
from distamp.precision.policy import AutocastPolicy, parse_precision  # noqa: E402
from distamp.precision.policy import Precision as ParsedPrecision  # noqa: E402
from distamp.precision.requirements import check_policy_precision  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402

__all__ = [
    "LIGHTNING_VERSION",
    "DistAMPTrainerPrecision",
    "TrainerPrecisionBase",
    "check_plugin_args",
    "lightning_precision_name",
]

UnscaleWhen = Literal["auto", "before_hooks", "at_clip"]


class TrainerPrecisionBase(Precision):
    """What both Trainer plugins share: the scaler, the step, clipping, schedulers, state
    (:class:`DistAMPTrainerPrecision` here, ``DistAMPFSDPPrecision`` in
    :mod:`distamp.integrations.lightning_fsdp`).

    Subclasses put it in front of the Lightning class their strategy demands
    (``MixedPrecision`` or ``FSDPPrecision``); ``super()`` then reaches that class.
    """

    scaler: Any  # Lightning's attribute; `_scaler` is the same object, typed
    device: str
    trust_ddp_sync: bool = False  # see DistAMPTrainerPrecision
    adaptive: AdaptiveRun | None = None
    """The policy's adaptive rules and backward scales at work (``None`` without them)."""

    def _init_distamp(
        self,
        parsed: ParsedPrecision,
        device: str,
        scaler: DistributedGradScaler | None,
        policy: AutocastPolicy | None,
        unscale: UnscaleWhen,
        gate_schedulers: bool,
    ) -> None:
        self.scaler = scaler  # Lightning's attribute (pre_backward scales with it)
        self._scaler = scaler  # the same object, typed as distamp's
        self.device = device
        self.policy = policy
        self.unscale = unscale
        self.gate_schedulers = gate_schedulers
        self.metrics = AMPMetrics(device)
        self._parsed = parsed
        # bf16 has no scaler; a disabled one still clips with one collective and counts FSDP
        # shards and DTensor placements once, which torch.nn.utils.clip_grad_norm_ does not.
        self._clipper = (
            scaler if scaler is not None else DistributedGradScaler(device, enabled=False)
        )
        self._unscaled: set[int] = set()  # optimizers unscaled (or clipped) since the last update
        self._skip_flags: dict[int, torch.Tensor] = {}  # optimizer id -> last step's agreed flag
        self._last_skip: torch.Tensor | None = None
        self._no_clip = False
        self._pending_norm: torch.Tensor | None = None  # for metrics, taken at the step
        self.last_grad_norm: torch.Tensor | None = None
        """The norm returned by the last norm clipping (0-dim tensor, unscaled, no host sync)."""

    # ------------------------------------------------------------------ setup
    def convert_module(self, module: Module) -> Module:
        """Apply the policy's fp32 modules before the strategy wraps the model, and start its
        adaptive rules on it (once per model: a second ``fit`` of the same one keeps them)."""
        if self.policy is not None:
            self.policy.apply(module)
            if self.adaptive is not None and self.adaptive.model is not module:
                self.adaptive.close()
                self.adaptive = None
            if self.adaptive is None:
                self.adaptive = AdaptiveRun.for_plugin(
                    module,
                    policy=self.policy,
                    precision=self._parsed,
                    scaler=self._scaler,
                    owner=type(self).__name__,
                )
        return super().convert_module(module)

    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        """Register the wrapped model with the scaler and gate the per-step schedulers.

        Every strategy calls this after wrapping the model and creating the optimizers, with
        the scheduler configurations it will step, which makes it the one place to swap them
        without touching Lightning's loops.
        """
        model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
        agree_plugin_settings(  # one collective: ranks built differently fail before training
            type(self).__name__,
            precision=self._parsed.name,
            scaler=self._scaler,
            policy=self.policy,
            trust_ddp_sync=self.trust_ddp_sync,
            unscale=self.unscale,
            gate_schedulers=self.gate_schedulers,
        )
        if self.trust_ddp_sync and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self._clipper.register_module(model, trust_ddp_sync=True)
        else:
            self._clipper.register_module(_module_to_register(model))
        if self._scaler is not None and self.gate_schedulers:
            lr_schedulers = [_gated(config, self._optimizer_skipped) for config in lr_schedulers]
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ the step
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward, backward), the hooks and clipping, then the agreed step.

        Order, as Lightning's own AMP plugin: closure, unscale (see ``unscale``),
        ``on_before_optimizer_step`` hooks and ``configure_gradient_clipping``, then
        ``scaler.step`` (skipped on every rank when any rank holds an inf/NaN) and
        ``scaler.update``. No host sync for fused optimizers (one ``.item()`` otherwise, in
        ``scaler.step``).
        """
        scaler = self._scaler
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
            self.unscale == "auto" and _user_code_reads_gradients(model)
        ):
            self._unscale_once(optimizer)
        # `_after_closure` runs the on_before_optimizer_step hooks and configure_gradient_clipping;
        # Lightning's own precision plugins call it at this point (checked on Lightning 2.6).
        self._after_closure(model, optimizer)
        out = scaler.step(optimizer, **kwargs)
        scaler.update()  # an adaptive run decides here, the same on every rank
        self._unscaled.clear()
        self._record_skip(optimizer, scaler.last_step_skipped)
        self.metrics.step(scaler, self._take_norm())
        changes = self.adaptive.take_changes() if self.adaptive is not None else []
        for change in changes:
            rank_zero_info(f"distamp: {change}")
        for logger in model.trainer.loggers if changes else ():
            logger.log_metrics(change_metrics(changes), step=model.trainer.global_step)
        return out

    def _unscale_once(self, optimizer: Optimizer) -> None:
        if self._scaler is not None and id(optimizer) not in self._unscaled:
            self._scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def _record_skip(self, optimizer: Optimizer, flag: torch.Tensor) -> None:
        self._skip_flags[id(optimizer)] = flag
        self._last_skip = flag

    def _take_norm(self) -> torch.Tensor | None:
        norm, self._pending_norm = self._pending_norm, None
        return norm

    def _optimizer_skipped(self, optimizer: Optimizer) -> bool:
        flag = self._skip_flags.get(id(_unwrap(optimizer)))
        # Host sync: a scheduler's step() is a Python decision; asked only when one is due.
        return flag is not None and bool(flag)

    # ------------------------------------------------------------------ clipping
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by norm (the scaler's one-pass ``clip_grad_norm_``) or by value (after unscaling).

        Called by ``LightningModule.clip_gradients`` (the default
        ``configure_gradient_clipping``). Works with fused optimizers: for them the clip
        coefficient is folded into their own unscale.
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

    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        """Unscale and clip to total norm ``clip_val`` over the whole job, in one read pass and
        one collective (which also carries the overflow flag). No host sync."""
        optimizer = _unwrap(optimizer)
        norm = self._clipper.clip_grad_norm_(optimizer, float(clip_val))
        if self._scaler is not None:
            self._unscaled.add(id(optimizer))
        self.last_grad_norm = self._pending_norm = norm.detach()

    def clip_grad_by_value(self, optimizer: Any, clip_val: int | float) -> None:
        """Unscale (once per step), then clamp every gradient element to ``[-clip_val,
        clip_val]``. Element-wise, so shards and replicas need no communication."""
        optimizer = _unwrap(optimizer)
        self._unscale_once(optimizer)
        torch.nn.utils.clip_grad_value_(list(self.main_params(optimizer)), float(clip_val))

    # ------------------------------------------------------------------ reporting
    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last optimizer step was skipped on every rank (inf/NaN
        gradients, or a ``training_step`` that returned ``None``). No host sync."""
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
        (one host sync, on request). 0 for bf16."""
        return 0 if self._scaler is None else self._scaler.skipped_steps

    def metrics_dict(self) -> dict[str, float | int | None]:
        """Loss scale, skipped steps, overflow rate, grad norm and tokens/s of the window since
        the last call (see :class:`~distamp.observe.metrics.AMPMetrics`). Collective: call it on
        every
        rank at the same step, e.g. from ``on_train_batch_end`` every N steps."""
        return self.metrics.compute(self._scaler)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (scale, trackers, skip counter) and the adaptive run's, saved in
        Trainer checkpoints under this class's name; empty for bf16 without a policy's rules."""
        return plugin_state(self._scaler, self.adaptive)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler and replay the adaptive run's changes (the Trainer calls it when
        resuming), both checked first: malformed input raises ``ValueError`` naming the key,
        and changes nothing."""
        load_plugin_state(state_dict, self._scaler, self.adaptive)


class DistAMPTrainerPrecision(TrainerPrecisionBase, MixedPrecision):
    """Trainer precision plugin: autocast (or a policy) plus distamp's rank-consistent scaler.

    For single-device, ``DDPStrategy`` and ``ModelParallelStrategy`` runs (use
    :class:`~distamp.integrations.lightning_fsdp.DistAMPFSDPPrecision` with ``FSDPStrategy``)::

        trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", gradient_clip_val=1.0,
                          plugins=[DistAMPTrainerPrecision("16-mixed", device="cpu")])

    Pass it instead of ``precision=`` (Lightning refuses both at once).

    Args:
        precision: ``"16-mixed"`` or ``"bf16-mixed"`` (or any spelling distamp parses:
            ``"fp16"``, ``torch.float16``...).
        device: the device type for autocast; ``None``: ``"cuda"`` if available, else
            ``"cpu"``. Pass ``"cpu"`` for a CPU run on a machine with GPUs.
        scaler: the fp16 scaler; ``None`` creates a :class:`~distamp.DistributedGradScaler`.
            Must be ``None`` for bf16 (no loss scaling).
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

    Raises:
        ValueError: a precision other than fp16/bf16, a scaler with bf16, a policy for another
            precision, or a bad ``unscale``/``gate_schedulers``.
        TypeError: a scaler that is not a :class:`~distamp.DistributedGradScaler`.
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
    ) -> None:
        parsed, device, scaler = check_plugin_args(
            type(self).__name__, precision, device, scaler, policy, unscale, gate_schedulers
        )
        self.trust_ddp_sync = bool(trust_ddp_sync)
        # bf16 with adaptive rules gets a check-only scaler, which Lightning refuses for bf16
        lightning_scaler = scaler if parsed.needs_scaler else None
        MixedPrecision.__init__(self, lightning_precision_name(parsed), device, lightning_scaler)
        self._init_distamp(parsed, device, scaler, policy, unscale, gate_schedulers)

    @contextmanager
    def forward_context(self) -> Iterator[None]:
        """The policy's context (autocast plus its fp32 ops) if one was given, else autocast."""
        ctx = self.policy.autocast(self.device) if self.policy is not None else None
        with ctx if ctx is not None else self.autocast_context_manager():
            yield


# ---------------------------------------------------------------------------- helpers
def check_plugin_args(
    owner: str,
    precision: Any,
    device: str | None,
    scaler: Any,
    policy: Any,
    unscale: Any,
    gate_schedulers: Any,
) -> tuple[ParsedPrecision, str, DistributedGradScaler | None]:
    """Validate a Trainer plugin's arguments (``owner`` is the plugin's class name, for the
    messages) and return ``(precision, device, scaler)``, the scaler created for fp16 when
    none was given. Shared by both plugins so that they refuse the same things alike.

    Raises:
        ValueError: a precision other than fp16/bf16, a scaler with bf16, a policy for another
            precision, or a bad ``unscale``/``gate_schedulers``.
        TypeError: a scaler that is not a :class:`~distamp.DistributedGradScaler`.
    """
    parsed = parse_precision(precision)
    if parsed.compute_dtype is None:
        raise ValueError(
            f"{owner}(precision={precision!r}): this plugin is for mixed precision ('16-mixed' "
            "or 'bf16-mixed'); for fp32 use the Trainer's default precision"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if scaler is not None and not isinstance(scaler, DistributedGradScaler):
        raise TypeError(
            f"{owner}(scaler={scaler!r}): pass a distamp.DistributedGradScaler (or None to get "
            "one); another scaler would let ranks disagree on skips"
        )
    if scaler is not None and not parsed.needs_scaler:
        raise ValueError(
            f"{owner}(precision={precision!r}, scaler=...): {parsed.name} needs no loss "
            "scaling; leave scaler=None"
        )
    if scaler is None and parsed.needs_scaler:
        scaler = DistributedGradScaler(device=device)
    elif scaler is None and getattr(policy, "adaptive", None) is not None:
        scaler = DistributedGradScaler(device=device, check_only=True)  # drives the rules
    check_policy_precision(policy, parsed, given=f"{owner}(precision={precision!r})")
    if unscale not in ("auto", "before_hooks", "at_clip"):
        raise ValueError(f"{owner}(unscale={unscale!r}): use 'auto', 'before_hooks' or 'at_clip'")
    if not isinstance(gate_schedulers, bool):
        raise ValueError(f"{owner}(gate_schedulers={gate_schedulers!r}) must be a bool")
    return parsed, device, scaler


def lightning_precision_name(parsed: ParsedPrecision) -> Literal["16-mixed", "bf16-mixed"]:
    """The precision string Lightning's own plugin classes take for ``parsed``."""
    return "16-mixed" if parsed.needs_scaler else "bf16-mixed"


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside Lightning's ``LightningOptimizer`` (what ``self.optimizers()``
    returns in manual optimization): the scaler keys its per-step state by the real one."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _module_to_register(model: Module) -> Module:
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


def _user_code_reads_gradients(model: pl.LightningModule) -> bool:
    """Whether a hook that runs between backward and the step may read gradient values:
    an ``on_before_optimizer_step`` of the module or of a callback, or a custom
    ``configure_gradient_clipping``. Lightning promises those hooks unscaled gradients."""
    if is_overridden("on_before_optimizer_step", model) or is_overridden(
        "configure_gradient_clipping", model
    ):
        return True
    callbacks = getattr(model.trainer, "callbacks", [])  # set by Lightning's callback connector
    return any(is_overridden("on_before_optimizer_step", cb, Callback) for cb in callbacks)


def _gated(config: Any, skipped: Callable[[Optimizer], bool]) -> Any:
    """The scheduler config with its scheduler wrapped, for ``interval="step"`` only: an epoch
    scheduler steps once per epoch, after many optimizer steps, whatever the last one did."""
    if getattr(config, "interval", None) != "step" or isinstance(
        config.scheduler, SkipAwareScheduler
    ):
        return config
    return replace(config, scheduler=SkipAwareScheduler(config.scheduler, skipped))
