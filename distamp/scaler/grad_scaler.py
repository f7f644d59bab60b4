"""DistributedGradScaler: torch.amp.GradScaler whose skip decision is identical on every rank.

torch's scalers decide "skip this step?" from each rank's own gradients. Under FSDP (sharded
gradients), with fused optimizers, with parameters DDP does not synchronise, or with pipeline
stages that never see each other's gradients, one rank can see an inf that another does not: one
rank skips and backs off, the other steps, and the model diverges silently. This scaler keeps
torch's state machine (READY -> UNSCALED -> STEPPED -> update) and changes one thing: before any
decision is taken, every pending found_inf flag of the step is packed into one tensor and
MAX-reduced over the whole job (:mod:`distamp.agreement.reduction`, over the ranks
:mod:`distamp.agreement.topology` names). Everything after that (optimizer gating, scale update)
then runs on identical numbers on every rank.

Beyond torch it adds hysteresis, min/max scale, one-pass clipping whose norm counts every element
of the job once, skip reporting without host syncs, and a ``state_dict`` that carries all of it.

This module is the state machine (unscale -> step -> update, and the order each call checks); its
bases hold what surrounds it: scaling the loss (:mod:`~distamp.scaler.loss_scaling`), torch's
private members answered from the agreement (:mod:`~distamp.scaler.torch_protocol`), the
agreement's ranks and registered modules (:mod:`~distamp.scaler.registration`), the checked
setters (:mod:`~distamp.scaler.settings`), reporting and state_dict
(:mod:`~distamp.scaler.reporting`); how each kind of optimizer is gated is
:mod:`~distamp.scaler.sync_free`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from distamp.agreement import reduction
from distamp.agreement.replicas import ReplicaCommit
from distamp.observe.diagnostics import NonFiniteTracer, OverflowRecorder
from distamp.scaler.clipping import check_clip_args, clip_step_grads_
from distamp.scaler.config import check_device, check_new_scale, check_scaler_args
from distamp.scaler.loss_scaling import LossScaling
from distamp.scaler.records import OptimizerStep, ScalerStateError, StepAgreement, reciprocal
from distamp.scaler.registration import ScalerRegistration
from distamp.scaler.reporting import ScalerReporting
from distamp.scaler.scale_state import ScaleState, ScaleUnderflowError
from distamp.scaler.scale_update import RuleCache, ScaleRule, update_scale_
from distamp.scaler.settings import ScalerSettings
from distamp.scaler.sync_free import gated_step, grad_scaler_step, takes_grad_scaler
from distamp.scaler.torch_protocol import TorchProtocol
from distamp.torch_compat import OptState, takes_grad_scale

__all__ = ["DistributedGradScaler", "OptimizerStep", "ScaleUnderflowError", "ScalerStateError"]


class DistributedGradScaler(
    LossScaling, TorchProtocol, ScalerRegistration, ScalerSettings, ScalerReporting
):
    """Drop-in for :class:`torch.amp.GradScaler` that never lets ranks disagree on a skip.

    The canonical loop is torch's, unchanged::

        device = "cuda" if torch.cuda.is_available() else "cpu"
        scaler = distamp.DistributedGradScaler(device)
        for x, y in loader:
            optimizer.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)  # skipped on EVERY rank if any rank saw an inf/NaN
            scaler.update()

    Args:
        device: where the scale lives; this and the next five are :class:`torch.amp.GradScaler`'s.
        init_scale: the first loss scale.
        growth_factor: what the scale is multiplied by after ``growth_interval`` clean steps.
        backoff_factor: what the scale is multiplied by after an overflow.
        growth_interval: consecutive steps without an overflow before the scale grows.
        enabled: ``False``: ``scale()`` returns the loss, ``step()`` calls ``optimizer.step()``.
        hysteresis: overflows tolerated before backing off. The counter drops by one per overflow
            and the scale backs off once it reaches zero (and on every further overflow); it is
            refilled only when the scale grows (Megatron-LM's rule). ``1`` is torch's behaviour.
        min_scale: floor of the scale. An overflow while the scale is already at the floor raises
            :class:`ScaleUnderflowError` (checking this costs one host sync per ``update``, so it is
            off by default).
        max_scale: ceiling of the scale (growth stops there). ``None`` (default): no ceiling, as
            torch, so the scale follows torch's trajectory.
        process_group: the ranks that must agree. ``None`` (default): every rank of the job, in
            one collective over the default group, whatever meshes the parameters live on (data,
            tensor, pipeline and expert parallelism alike). A ``ProcessGroup``, a ``DeviceMesh``
            or any object with ``rank()`` and ``size()`` narrows it: right only when those ranks
            train a model of their own. A ``torchft.Manager``: fault-tolerant replica groups
            (:mod:`distamp.agreement.replicas`). Anything else: ``TypeError``.
        sync_free: ``step()`` never waits for the device: the skip is decided on device, through
            the optimizer's ``found_inf`` argument (fused optimizers) or a masked update.
        check_only: for bf16 and fp32, which need no loss scaling: ``scale()`` returns the loss,
            ``unscale_`` only checks (one read, no write), the scale stays 1, and a step whose
            gradients hold an inf/NaN is still skipped on every rank, counted and reported.
        report_overflow: one non-finite flag per gradient tensor for :meth:`overflow_report`,
            computed at ``update()`` of a skipped step only (sync-free: raised by the unscale
            pass at every step, on device), so that a clean step unscales with torch's fused op.

    Collectives: one per iteration that has unreduced flags, whatever the number of optimizers
    (their flags, and a clipping norm, are packed together when the first of them needs the
    agreed value); zero when no process group is initialized, and zero for an optimizer whose
    parameters are all synchronised by a DDP module over the whole job that was passed to
    :meth:`register_module` with ``trust_ddp_sync=True`` (its all-reduce spread any inf).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        process_group: reduction.GroupSpec = None,
        sync_free: bool = False,
        report_overflow: bool = True,
        check_only: bool = False,
    ) -> None:
        device = check_device(device)
        init_scale, growth_factor, backoff_factor, growth_interval = check_scaler_args(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            sync_free=sync_free,
            check_only=check_only,
        )
        self._check_only = check_only
        if check_only:
            init_scale = 1.0  # nothing is scaled: the scale only reports 1
        # Before torch's __init__, which assigns _per_optimizer_states (kept in here).
        self._steps = StepAgreement(process_group, host_decisions=report_overflow and not sync_free)
        self._steps.settings = self.settings  # compared across ranks at the first collective
        self._steps.plans.rule.scaling = not check_only  # which 16-bit parameters are refused
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._hysteresis = int(hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._sync_free = sync_free
        self._counters = ScaleState(self._hysteresis)
        self._rules = RuleCache()
        manager = self._steps.topology.ft_manager  # torchft hook: commit vote, state that heals
        self._replicas = (
            None if manager is None else ReplicaCommit(manager, self, self._steps.current_records)
        )
        self._overflow = OverflowRecorder(lazy=not sync_free) if report_overflow else None
        self._tracer: NonFiniteTracer | None = None

    # ------------------------------------------------------------------ lazily created state
    @override
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        on_host = self._steps.host_decisions or (dev.type == "cpu" and not self._sync_free)
        self._counters.create(dev, on_host=on_host)
        self._steps.home = dev  # flags are agreed where the scale lives

    @override
    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None and self._check_only:
            # Nothing is ever scaled: a rank that computed no loss (a pipeline stage before the
            # last) may check and step all the same.
            self._lazy_init_scale_growth_tracker(self._home_device())
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(
                f"{funcname}() was called before scale(): call `scaler.scale(loss).backward()` "
                "first in every iteration, then unscale_/step/update. Pipeline stages that "
                "compute no loss: build the schedule with `loss_fn=scaler.scaled_loss_fn(...)`."
            )
        return self._scale, self._growth_tracker

    # ------------------------------------------------------------------ unscale / check
    @override
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record a local flag.

        Call it before anything that reads gradient values (clipping). No collective and no host
        sync here: the flag is agreed across ranks in the step's single collective, together
        with those of every other optimizer unscaled this iteration, when the value is first
        needed (``step()``, ``update()``, a clip, or reading ``found_inf_per_device``).
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        record = self._steps.record(optimizer)
        if record.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update() "
                "(clip_grad_norm_ unscales too): call it once per optimizer step, after the last "
                "micro-batch's backward."
            )
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(): unscale before stepping, then call "
                "update() to start the next iteration."
            )
        self._steps.check_(
            optimizer,
            record,
            scale.device,
            None if self._check_only else reciprocal(scale),  # check-only: read, never write
            allow_fp16=False,  # divided in fp16, small gradients would flush to zero
            recorder=self._overflow,
        )
        record.stage = OptState.UNSCALED

    # ------------------------------------------------------------------ clipping
    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Unscale and clip the optimizer's gradients to total norm ``max_norm``, across ranks.

        Replaces ``scaler.unscale_(opt)`` + ``torch.nn.utils.clip_grad_norm_(params, max_norm)``
        (same numbers within fp32 rounding) at a fraction of the memory traffic: for the 2-norm
        ONE read pass yields the overflow flag and the sum of squares of the unscaled gradients,
        the flag and the sum travel in ONE collective (none under a registered DDP module), and
        ``inv_scale * clip_coef`` is applied once: by fused optimizers (``fused=True``) inside
        their own step through ``grad_scale`` (their ``.grad`` then stays scaled), otherwise in
        one multiply pass. The norm is the whole job's: every gradient element counts once
        whatever holds it (DDP replicas, FSDP1 shards registered with :meth:`register_module`,
        FSDP2/HSDP/TP/expert DTensors, pipeline stages), so every rank of every stage clips with
        the same coefficient. Other ``norm_type`` values unscale first, then reduce likewise.
        With the scaler disabled it clips (bf16/fp32 training) with the same one collective.
        ``max_norm=math.inf`` measures without clipping (as torch, which the Hugging Face Trainer
        uses to turn clipping off); 0, negative and NaN raise ``ValueError`` (see check_clip_args).

        Returns:
            The total norm of the unscaled gradients before clipping, a 0-dim float32 tensor
            (no host sync; non-finite when a gradient is, and the step is then skipped).
        """
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        scale = self._check_scale_growth_tracker("clip_grad_norm_")[0] if self._enabled else None
        return clip_step_grads_(
            self._steps,
            optimizer,
            max_norm,
            norm_type,
            error_if_nonfinite,
            scale=scale,
            unscale=self.unscale_,
            recorder=self._overflow,
            host_reads=not self._sync_free,  # sync-free: not even a CPU value is read
        )

    # ------------------------------------------------------------------ step / update
    @override
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, agree on found_inf across ranks, and step unless it is set.

        Returns what ``optimizer.step`` returns, or ``None`` when the step was skipped. Host
        syncs: none for fused optimizers (they take ``found_inf`` on device) or with
        ``sync_free=True``; otherwise one ``.item()`` on the agreed flag to decide whether to call
        ``optimizer.step`` at all. A fused optimizer's preset ``grad_scale`` attribute multiplies
        into the one passed (and is removed afterwards), as with torch's scaler.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        record = self._steps.record(optimizer)
        if record.stage is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(): call update() once "
                "per iteration, after stepping every optimizer."
            )
        fused = takes_grad_scale(optimizer)
        if fused and record.stage is OptState.READY and self._steps.factored(optimizer):
            self.unscale_(optimizer)  # per-block factors: a fused step's one grad_scale cannot
        if fused and takes_grad_scaler(optimizer):
            # The optimizer asks the scaler itself (through _check_inf_per_device /
            # _found_inf_per_device, which agree across ranks here).
            retval = grad_scaler_step(optimizer, self, *args, **kwargs)
            record.stage = OptState.STEPPED
            return retval
        if record.stage is OptState.READY:
            if fused:
                self._check_inf(optimizer)
            else:
                self.unscale_(optimizer)
        self._steps.reduce_pending()
        found_inf = record.found_inf
        if found_inf is None:
            raise AssertionError("No inf checks were recorded for this optimizer.")
        if self._replicas is not None:  # torchft hook: every replica votes, skipping or not
            found_inf, optimizer = self._replicas.gate(optimizer, found_inf)
        if self._counters.ready:
            self._counters.last_skipped = found_inf  # compared with 0 when read
        retval = gated_step(  # fused: in its kernel; sync-free: undone on device; else .item()
            optimizer,
            found_inf,
            grad_scale=scale if record.stage is OptState.READY else record.grad_scale,
            fused=fused,
            sync_free=self._sync_free,
            args=args,
            kwargs=kwargs,
        )
        record.stage = OptState.STEPPED
        return retval

    @override
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale on device from the agreed flags of every optimizer of this step.

        Growth, backoff, hysteresis and the min/max bounds are applied without a host sync; only
        ``min_scale`` (set, not ``sync_free``) syncs once to raise :class:`ScaleUnderflowError` at
        the floor, and ``report_overflow`` waits for the agreed flag's copy (there by then after a
        non-fused step). ``new_scale`` sets the scale by hand, as torch, but only to a normal finite
        float32 within the bounds (``ValueError`` otherwise): 0 or inf would train on silently.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            self._set_scale(check_new_scale(new_scale, self._min_scale, self._max_scale))
            self._steps.end_iteration(self.last_step_skipped)
            return
        self._steps.reduce_pending()
        if self._replicas is not None and not self._replicas.end_iteration():
            self._set_scale(scale)  # torchft hook: uncommitted, scale and counters kept
            self._steps.end_iteration(self.last_step_skipped)
            return
        found_inf = self._steps.agreed_found_inf(scale.device)
        if found_inf is None:
            raise ScalerStateError(
                "update() found no inf checks for this iteration: call scaler.step(optimizer) "
                "(or unscale_) for at least one optimizer before update()."
            )
        counters = self._counters
        assert counters.hysteresis is not None
        # The agreed decision read once on the host (the CPU's, or a device flag's host copy) spares
        # the bookkeeping its device ops; sync-free, all stays on device (StepAgreement.decision).
        on_host = self._steps.decision(found_inf) if counters.on_host else None
        if not self._check_only:  # check-only: the scale stays 1
            args = (self._rule(), scale, tracker, counters.hysteresis, found_inf, on_host)
            counters.flag_underflow(update_scale_(*args))
        found = found_inf if on_host is not None else found_inf > 0
        counters.record(found, on_host)
        if self._overflow is not None:
            self._overflow.commit(found, on_host)
        if self._tracer is not None:
            self._tracer.commit(found_inf > 0)
        self._steps.new_iteration()
        self._steps.end_iteration(self.last_step_skipped)
        if self._min_scale is not None and not self._sync_free:
            self._counters.raise_if_underflow(self._min_scale)  # one host sync, opt-in

    def _set_scale(self, new_scale: float | torch.Tensor) -> None:
        """Set the scale by hand and start a clean iteration (torch's ``update(new_scale)``)."""
        super().update(new_scale)
        self._steps.new_iteration()
        if self._overflow is not None:
            self._overflow.discard()

    def _rule(self) -> ScaleRule:
        return self._rules.get(
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
            self._hysteresis,
            self._min_scale,
            self._max_scale,
        )

    @override
    def get_scale(self) -> float:
        """The current scale as a Python float (one host sync)."""
        if self._sync_free or self._min_scale is None:  # else update() raised it already
            self._counters.raise_if_underflow(self._min_scale)
        return super().get_scale()
