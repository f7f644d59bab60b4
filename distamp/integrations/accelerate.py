"""Run an Accelerate training loop with distamp's scaler, policy and metrics.

Why a subclass of ``accelerate.Accelerator``: Accelerate has no supported way to plug in another
scaler (its ``kwargs_handlers`` match exact classes, so a subclass of ``GradScalerKwargs`` raises
``KeyError``), it creates no scaler at all for ``mixed_precision="fp16"`` on CPU (and then trains
in fp32 without a word), and its ``step_was_skipped`` is inferred from whether the patched
``optimizer.step`` was called, which a fused optimizer always is (it skips inside the kernel).
:class:`DistAMPAccelerator` keeps every user-facing method and changes only these places, each
through an Accelerate *public* method that it overrides and then calls:

- ``__init__``: after Accelerate's own set-up, the fp16 scaler is a
  :class:`~distamp.DistributedGradScaler` (honouring ``GradScalerKwargs``), on CPU too, and
  fp16 autocast is switched on for CPU;
- ``prepare_model``: applies the optional policy (fp32 modules and ops) under Accelerate's
  autocast, and runs its adaptive rules and backward scales (:class:`~distamp.precision.
  adaptive_run.AdaptiveRun`, the engine's own: it watches the scaler, so Accelerate's
  ``optimizer.step`` drives it); each change is logged (Accelerate's logger and
  ``accelerator.log``'s trackers);
- ``prepare_optimizer``: the returned optimizer reports ``step_was_skipped`` from the scaler's
  rank-agreed on-device flag, and feeds :class:`~distamp.observe.metrics.AMPMetrics`;
- ``prepare`` (its base, :class:`~distamp.integrations.accelerate_weights.WeightsAccelerator`):
  with ``weights=``, the model's weights cast to 16 bits and the optimizer's masters kept;
- ``clip_grad_norm_``: one scaler call (unscale + overflow check + norm + clip, one collective,
  correct for fused optimizers) instead of unscale, then a norm of its own;
- ``save_state`` / ``load_state``: the adaptive run's state in the checkpoint folder
  (``distamp_adaptive.pt``, replayed on load); the scaler reloaded after Accelerate's load, so
  it round-trips under FSDP2 as well; both checked before anything is loaded.

The attributes it relies on (``Accelerator.scaler``, ``native_amp``, ``scaler_handler``,
``AcceleratedOptimizer.scaler``/``gradient_state``) were checked on the releases in
:data:`SUPPORTED`; older ones are refused at import with the window in the message, newer ones
warn.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import override

from distamp.integrations import accelerate_optimizer

ACCELERATE_VERSION = accelerate_optimizer.ACCELERATE_VERSION  # importing it checked the version
SUPPORTED = accelerate_optimizer.SUPPORTED
"""The Accelerate releases this adapter was verified with (see :mod:`distamp.versions`)."""

from accelerate.logging import get_logger  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

from distamp.cluster.agreement import agree_failures  # noqa: E402
from distamp.engine.guards import SpikeGuard  # noqa: E402
from distamp.integrations.accelerate_optimizer import DistAMPOptimizer  # noqa: E402
from distamp.integrations.accelerate_weights import WeightsAccelerator  # noqa: E402
from distamp.integrations.agreement import agree_plugin_settings  # noqa: E402
from distamp.integrations.scaler_slot import check_scaler  # noqa: E402
from distamp.integrations.step_guards import PluginGuards  # noqa: E402
from distamp.observe.metrics import AMPMetrics  # noqa: E402
from distamp.precision.adaptive_run import AdaptiveRun, change_metrics  # noqa: E402
from distamp.precision.policy import parse_precision  # noqa: E402
from distamp.precision.requirements import check_policy_precision  # noqa: E402
from distamp.scaler import DistributedGradScaler  # noqa: E402
from distamp.torch_compat import accelerate_prepared  # noqa: E402

__all__ = ["ACCELERATE_VERSION", "SUPPORTED", "DistAMPAccelerator", "DistAMPOptimizer"]

SCALER_FILE = "scaler.pt"  # the name Accelerate's save_state gives the scaler's state
ADAPTIVE_FILE = "distamp_adaptive.pt"  # the adaptive run's state, beside Accelerate's files
_logger = get_logger("distamp.precision")


def _check_policy(policy: Any, mode: str) -> None:
    """The policy's precision is the accelerator's (``ValueError``, see
    :func:`~distamp.precision.requirements.check_policy_precision`): an fp16 policy in a bf16
    accelerator would compute in fp16 under a check-only scaler, with no loss scaling and no
    word. A mode distamp does not parse is left to Accelerate to refuse."""
    try:
        precision = parse_precision(mode)
    except ValueError:
        return
    check_policy_precision(policy, precision, given=f"mixed_precision={str(mode)!r}")


class DistAMPAccelerator(WeightsAccelerator):
    """An ``accelerate.Accelerator`` whose fp16 training uses distamp's rank-consistent scaler.

    Use it exactly like ``Accelerator`` (same arguments, same loop: ``prepare``, ``autocast``,
    ``backward``, ``accumulate``, ``clip_grad_norm_``, ``save_state``/``load_state``); three
    keyword arguments are added.

    ``accelerator.scaler`` stays Accelerate's public attribute and is honoured when replaced
    (``trainer.accelerator.scaler = torch.amp.GradScaler()``, before or after ``prepare``):
    ``backward`` scales with it, the prepared optimizers step with it and read their skip from
    it. One that cannot be honoured (no ``GradScaler`` methods, ``None`` with fp16, a loss
    scaler with bf16, another than the one a policy's adaptive rules watch) is refused at the
    next ``backward`` or step, before anything is applied
    (:mod:`~distamp.integrations.scaler_slot`).

    Args:
        *args, **kwargs: passed to ``accelerate.Accelerator``, but ``weights`` (a
            :class:`~distamp.WeightPrecision`: 16-bit weights with an exact master, made by
            ``prepare``; see :mod:`~distamp.integrations.accelerate_weights`; default ``None``).
        scaler: the scaler to use (e.g. ``DistributedGradScaler(sync_free=True)``). ``None``:
            for fp16 a :class:`~distamp.DistributedGradScaler` on the accelerator's device, with
            the arguments of a ``GradScalerKwargs`` handler if one was given; for bf16 and fp8
            (torchao/Transformer Engine: bf16 compute, no loss scaling) a check-only one, so a
            step with an inf/NaN gradient is skipped on every rank. fp8 with MS-AMP keeps
            Accelerate's own scaler (MS-AMP's optimizer owns the scaling; not rank-agreed).
        policy: an :class:`~distamp.AutocastPolicy` (or any object with ``apply(model)`` and
            ``autocast(device_type)``): applied to each prepared model, and its autocast context
            wraps the model's forward inside Accelerate's. Its adaptive rules and backward
            scales (fp16 or bf16, the accelerator's ``mixed_precision``) run on the first
            prepared model, as in :class:`~distamp.DistAMP`; read them in :attr:`adaptive`.
        trust_ddp_sync: let the scaler skip its found_inf collective when DDP's all-reduce
            already spread any inf to every rank (see ``DistributedGradScaler.register_module``).
            Off by default: an inf written into a gradient after the all-reduce (a gradient hook,
            a rank-local transformation) would then go unseen by the other ranks. Same name and
            meaning as in :class:`~distamp.DistAMP` and the Lightning plug-ins.
        spike_guard: a :class:`~distamp.SpikeGuard`, as in :class:`~distamp.DistAMP`: a step
            whose loss (the mean of the losses given to ``backward`` since the last step,
            maximum over the ranks) or, after ``clip_grad_norm_`` over one prepared optimizer's
            parameters with a distamp scaler, gradient norm spikes is skipped on every rank
            (the prepared optimizer does not step, its ``step_was_skipped`` is true, so
            Accelerate's prepared schedulers and the HF Trainer's scheduler do not step), the
            scale not backed off; counted in :meth:`amp_metrics_dict`'s ``spike_skips``. One
            small all-reduce and one host sync a step.
        max_consecutive_skips: as in :class:`~distamp.DistAMP`: this many skipped steps in a
            row (overflow and spike alike) raise :class:`~distamp.ConsecutiveSkipsError` from
            the prepared optimizer's ``step`` on every rank; ``None``: no limit.

    Raises:
        ValueError: ``scaler`` given without mixed precision, or with DeepSpeed, Megatron-LM or
            MS-AMP, which own loss scaling themselves; a policy whose precision is not the
            accelerator's (:mod:`~distamp.precision.requirements`); an adaptive policy with no
            distamp scaler to drive it; a bad ``max_consecutive_skips`` (``TypeError`` for a
            ``spike_guard`` that is no :class:`~distamp.SpikeGuard`).
    """

    adaptive: AdaptiveRun | None = None
    """The policy's adaptive rules and backward scales at work (``None`` without them)."""

    def __init__(
        self,
        *args: Any,
        scaler: DistributedGradScaler | None = None,
        policy: Any = None,
        trust_ddp_sync: bool = False,
        spike_guard: SpikeGuard | None = None,
        max_consecutive_skips: int | None = 100,
        **kwargs: Any,
    ) -> None:
        guards = PluginGuards(spike_guard, max_consecutive_skips)  # refused before anything
        if isinstance(kwargs.get("mixed_precision"), str):  # refused before Accelerate's state
            _check_policy(policy, kwargs["mixed_precision"])  # exists: it can be set only once
        super().__init__(*args, **kwargs)
        self.policy = policy
        self.trust_ddp_sync = bool(trust_ddp_sync)
        self.amp_metrics = AMPMetrics(self.device)
        self.guards = guards
        self._unscaled: set[int] = set()  # optimizers unscaled (or clipped) since their step
        self._agreed_norm = False  # the last clipping norm is a distamp scaler's (agreed)
        self._last_grad_norm: torch.Tensor | None = None
        self._pending_scaler: dict[str, Any] | None = None  # checked before a load, applied after
        self._pending_adaptive: dict[str, Any] | None = None  # likewise
        mode = self.state.mixed_precision
        _check_policy(policy, mode)  # also when the precision came from Accelerate's config
        fp16 = mode == "fp16"
        own_scaling = self.distributed_type in (
            DistributedType.DEEPSPEED,
            DistributedType.MEGATRON_LM,
        ) or (mode == "fp8" and getattr(self, "scaler", None) is not None)  # MS-AMP's own
        if scaler is not None and (mode not in ("fp16", "bf16", "fp8") or own_scaling):
            raise ValueError(
                f"scaler={scaler!r} with mixed_precision={mode!r} and {self.distributed_type}: "
                "a distamp scaler is used for 'fp16' (loss scaling) and 'bf16'/'fp8' (check-only) "
                "without DeepSpeed/Megatron-LM/MS-AMP (they scale the loss themselves); drop it"
            )
        if mode in ("fp16", "bf16", "fp8") and not own_scaling:
            if scaler is None and fp16:
                handler = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
                scaler = DistributedGradScaler(device=self.device.type, **handler)
            elif scaler is None:  # bf16/fp8 need no scaling: check-only, so NaN skips everywhere
                scaler = DistributedGradScaler(device=self.device.type, check_only=True)
            # Accelerate leaves `native_amp` off for fp16 on CPU (so no autocast, no scaler);
            # CPU autocast supports fp16 since torch 2.3, so turn it on with the scaler.
            if fp16:
                self.native_amp = True
            self.scaler = scaler
        # `scaler` stays Accelerate's public attribute: a replacement is honoured (stepped, its
        # skip read from it) or refused at its first use, before anything of that step.
        self._checked_scaler: Any = self.scaler
        self._own_scaling = own_scaling  # DeepSpeed, Megatron-LM, MS-AMP: their scaler, unchecked
        self._pinned_scaler: Any = None  # the one a policy's adaptive rules watch
        self._registered: list[Any] = []  # prepared models, registered with a new distamp scaler
        self.register_load_state_pre_hook(self._check_scaler_file)
        agree_plugin_settings(  # one collective, now: ranks built differently fail here
            type(self).__name__,
            precision=str(mode),
            scaler=self.scaler,
            policy=policy,
            trust_ddp_sync=self.trust_ddp_sync,
            distributed_type=str(self.distributed_type),
            weights=self.weights,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            **guards.settings(),
        )

    # ------------------------------------------------------------------ preparing
    @override
    def prepare_model(
        self,
        model: torch.nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
    ) -> Any:
        """Accelerate's ``prepare_model``, plus the policy and the scaler's registration.

        The policy's context is put *inside* Accelerate's autocast: nesting autocast with the
        same dtype changes nothing, and the policy's fp32 modules and ops then win.
        """
        if self.policy is not None and not accelerate_prepared(model):
            self.policy.apply(model)
            if self.adaptive is None and not evaluation_mode:
                self.adaptive = AdaptiveRun.for_plugin(
                    model,
                    policy=self.policy,
                    scaler=self._scaler_now(),
                    owner=type(self).__name__,
                    precision=str(self.state.mixed_precision),
                )
                self._pinned_scaler = self.scaler if self.adaptive is not None else None
            inner, policy, device_type = model.forward, self.policy, self.device.type

            @functools.wraps(inner)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with policy.autocast(device_type):
                    return inner(*args, **kwargs)

            model.forward = forward  # type: ignore[method-assign]
        prepared = super().prepare_model(
            model, device_placement=device_placement, evaluation_mode=evaluation_mode
        )
        scaler = self._scaler_now()
        if not evaluation_mode:
            self._registered.append(prepared)
        if isinstance(scaler, DistributedGradScaler) and not evaluation_mode:
            # names; DDP/FSDP1 copies for clipping; DDP's all-reduce relied on only if trusted
            scaler.register_module(prepared, trust_ddp_sync=self.trust_ddp_sync)
        return prepared

    def _scaler_now(self) -> Any:
        """The scaler in ``accelerator.scaler``, checked once after each replacement (before
        its first backward or step; see :func:`~distamp.integrations.scaler_slot.check_scaler`)
        and, if distamp's, registered with the prepared models as the first one was."""
        scaler = getattr(self, "scaler", None)
        if scaler is self._checked_scaler or self._own_scaling:
            return scaler
        check_scaler(
            scaler,
            owner=f"{type(self).__name__}.scaler",
            needs_scaler=self.state.mixed_precision == "fp16",
            pinned=self._pinned_scaler,
        )
        if isinstance(scaler, DistributedGradScaler):
            for model in self._registered:
                scaler.register_module(model, trust_ddp_sync=self.trust_ddp_sync)
        self._checked_scaler = scaler
        return scaler

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's ``backward``, which scales the loss with ``accelerator.scaler``; a
        replaced scaler is checked first, so one that cannot be honoured is refused before any
        gradient is written."""
        self._scaler_now()
        self.guards.record_loss(self.amp_metrics, loss)  # the spike guard's loss of the step
        super().backward(loss, **kwargs)

    @override
    def prepare_optimizer(
        self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
    ) -> Any:
        """Accelerate's ``prepare_optimizer``; the wrapper it returns is switched to
        :class:`DistAMPOptimizer` (same state, an exact skip report and metrics)."""
        wrapped = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(wrapped) is AcceleratedOptimizer:
            # Re-classing, not re-wrapping: Accelerate keeps this very object in its list of
            # optimizers (for save/load and schedulers), and the subclass adds no state.
            wrapped.__class__ = DistAMPOptimizer
            wrapped.call_after_step(self._after_step)
            wrapped.follow_scaler(self._scaler_now)
            wrapped.guard_with(self._guard_step)
        return wrapped

    # ------------------------------------------------------------------ the step
    @override
    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2
    ) -> Any:
        """Clip like ``torch.nn.utils.clip_grad_norm_``, on unscaled gradients, across ranks.

        When ``parameters`` are exactly one prepared optimizer's, the scaler does it all in one
        pass and one collective (and for fused optimizers folds the clip into the optimizer's
        own unscale). Otherwise (a subset of parameters), the scaler unscales and Accelerate
        clips. Call it once per optimizer step (under ``if accelerator.sync_gradients:``).

        Returns:
            The total norm before clipping (0-dim tensor; no host sync).
        """
        scaler = self._scaler_now()
        params = list(parameters)
        self._agreed_norm = False
        if not (isinstance(scaler, DistributedGradScaler) and scaler.is_enabled()):
            norm = super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        else:
            opt = self._optimizer_owning(params)
            if opt is not None and hasattr(scaler, "clip_grad_norm_"):
                norm = scaler.clip_grad_norm_(opt, max_norm, norm_type)
                self._unscaled.add(id(opt))
                self._agreed_norm = True
            else:
                # Accelerate unscales every prepared optimizer through the scaler, then clips.
                norm = super().clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if isinstance(norm, torch.Tensor):
            self._last_grad_norm = norm.detach()
        return norm

    def _optimizer_owning(self, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        """The one unwrapped optimizer whose parameters are exactly ``params``, if any."""
        wanted = {id(p) for p in params}
        for acc_opt in self._optimizers:
            opt = acc_opt
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            owned = {id(p) for group in opt.param_groups for p in group["params"]}
            if owned == wanted:
                return opt
        return None

    @override
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Accelerate's ``unscale_gradients``, noting which optimizers it unscaled (a spike skip
        then does not unscale them twice)."""
        super().unscale_gradients(optimizer)
        if self.native_amp and self.mixed_precision == "fp16":  # where Accelerate unscales
            given = self._optimizers if optimizer is None else optimizer
            for opt in given if isinstance(given, (list, tuple)) else [given]:
                while isinstance(opt, AcceleratedOptimizer):
                    opt = opt.optimizer
                self._unscaled.add(id(opt))

    def _guard_step(self, scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
        """Before a prepared optimizer's real step: whether the spike guard skips it (then
        done here, on every rank alike: see :class:`~distamp.integrations.step_guards.
        PluginGuards`)."""
        norm = self._last_grad_norm if self._agreed_norm else None
        spike = self.guards.before(self.amp_metrics, norm, scaler)
        if spike:
            self.guards.skip(scaler, optimizer, unscaled=id(optimizer) in self._unscaled)
        self._unscaled.discard(id(optimizer))
        return spike

    def _after_step(self, scaler: Any, overflow: Any, spike: bool) -> bool:
        norm, self._last_grad_norm, self._agreed_norm = self._last_grad_norm, None, False
        spike = self.guards.after(
            self.amp_metrics, scaler, spike=spike, overflow=overflow, norm=norm
        )
        if self.adaptive is not None:  # decided inside scaler.update(), the same on every rank
            changes = self.adaptive.take_changes()
            for change in changes:
                _logger.info("%s", change, main_process_only=True)
            if changes:
                self.log(change_metrics(changes), step=changes[-1].step)
        return spike

    # ------------------------------------------------------------------ metrics
    def amp_metrics_dict(self) -> dict[str, float | int | None]:
        """Loss scale, skipped steps, overflow rate, unscaled grad norm and tokens/s of the window
        since the previous call (see :class:`~distamp.observe.metrics.AMPMetrics`). Collective:
        call it on every rank at the same step; count tokens with
        ``accelerator.amp_metrics.add_tokens``."""
        return self.amp_metrics.compute(self.scaler)

    # ------------------------------------------------------------------ state
    def _check_scaler_file(self, _models: list[Any], input_dir: str) -> None:
        """Before Accelerate loads anything: read and check distamp's files, so that a bad one
        is refused (on every rank) while the model and optimizer are still as they were."""
        self._pending_scaler, self._pending_adaptive = self.check_checkpoint(input_dir)

    def check_checkpoint(self, folder: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """Read and check distamp's files of the checkpoint ``folder`` (the scaler's
        ``scaler.pt``, ``distamp_adaptive.pt``); changes nothing. Collective: a file one rank
        refuses is refused on every rank, so none trains on while another has stopped.

        :meth:`load_state` calls it before Accelerate loads anything, ``DistAMPTrainer`` before
        the Trainer loads the model. Before the adaptive run exists (the model not prepared
        yet), its file is read and its structure checked; the rest when it is loaded.

        Returns:
            The scaler's state and the adaptive state, checked (``None`` where there is none).

        Raises:
            ValueError: a file is unreadable or does not fit this run, naming it and the rank.
        """
        error: str | None = None
        states: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None)
        try:
            states = (self._read_scaler(folder), self._read_adaptive(folder))
        except ValueError as exc:
            error = str(exc)
        failures, _ = agree_failures(error)
        if failures:
            raise ValueError("; ".join(failures))
        return states

    def _read_scaler(self, input_dir: str) -> dict[str, Any] | None:
        scaler = self.scaler
        path = os.path.join(input_dir, SCALER_FILE)
        ours = isinstance(scaler, DistributedGradScaler) and scaler.is_enabled()
        if not ours or not os.path.exists(path):
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            return scaler.check_state_dict(state)  # type: ignore[no-any-return]
        except Exception as exc:  # unreadable, or a value the scaler refuses
            raise ValueError(f"checkpoint file {path}: {exc}; nothing was loaded") from None

    @override
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """Accelerate's ``load_state``, the scaler's file checked first (a bad one refuses the
        whole load before anything changed) and loaded again afterwards.

        Accelerate loads the scaler on one of two paths depending on FSDP2; loading the checked
        state once more afterwards makes the round-trip independent of that branch.
        """
        self._pending_scaler = self._pending_adaptive = None
        out = super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        if self._pending_scaler is not None:
            self.scaler.load_state_dict(self._pending_scaler)
        if self.adaptive is not None and self._pending_adaptive is not None:
            self.adaptive.load_state_dict(self._pending_adaptive)  # promotions replayed
        return out

    @override
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ) -> str:
        """Accelerate's ``save_state``, plus the adaptive run's state (``distamp_adaptive.pt``,
        written by the main process: it is the same on every rank)."""
        location: str = super().save_state(
            output_dir, safe_serialization=safe_serialization, **kwargs
        )
        self.save_adaptive(location)
        return location

    def save_adaptive(self, folder: str) -> None:
        """Write the adaptive run's state to ``folder/distamp_adaptive.pt`` (by the main
        process: it is the same on every rank); nothing without a run. Collective (a barrier):
        call it on every rank. :meth:`save_state` calls it; so does ``DistAMPTrainer``."""
        if self.adaptive is not None:
            if self.is_main_process and os.path.isdir(folder):
                torch.save(self.adaptive.state_dict(), os.path.join(folder, ADAPTIVE_FILE))
            self.wait_for_everyone()

    def load_adaptive(self, folder: str) -> bool:
        """Check, then replay the adaptive run's state saved in ``folder`` (see
        :meth:`save_adaptive`); whether there was one to load.

        Raises:
            ValueError: the file is unreadable or does not fit this run (nothing changed).
        """
        state = self._read_adaptive(folder)
        if self.adaptive is None or state is None:
            return False
        self.adaptive.load_state_dict(state)
        return True

    def _read_adaptive(self, input_dir: str) -> dict[str, Any] | None:
        """The checkpoint's adaptive state, checked against this run (``None`` when either has
        none: a run that starts adapting from a plain checkpoint starts with no changes); its
        structure only while the policy's run is not built yet."""
        path = os.path.join(input_dir, ADAPTIVE_FILE)
        parts = (getattr(self.policy, k, None) for k in ("adaptive", "backward_scales"))
        if (self.adaptive is None and all(p is None for p in parts)) or not os.path.exists(path):
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if self.adaptive is not None:
                self.adaptive.check_state_dict(state)
            elif not isinstance(state, dict) or "monitor" not in state:
                raise ValueError(f"expected a dict with a 'monitor' entry, got {state!r:.120}")
        except Exception as exc:  # unreadable, or modules/values this run refuses
            raise ValueError(f"checkpoint file {path}: {exc}; nothing was loaded") from None
        return state  # type: ignore[no-any-return]
