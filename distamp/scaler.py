"""DistributedGradScaler: torch.amp.GradScaler whose skip decision is identical on every rank.

torch's scalers decide "skip this step?" from each rank's own gradients. Under FSDP (sharded
gradients), with fused optimizers, or with parameters DDP does not synchronise, one rank can see an
inf that another does not: one rank skips and backs off, the other steps, and the replicas diverge
silently. This scaler keeps torch's state machine (READY -> UNSCALED -> STEPPED -> update) and
changes one thing: before any decision is taken, every pending found_inf flag of the step is packed
into one tensor and MAX-reduced over the right group (:mod:`distamp.reduction`). Everything after
that (optimizer gating, scale update) then runs on identical numbers on every rank.

Beyond torch it adds hysteresis, min/max scale, skip reporting without host syncs, and a
``state_dict`` that carries all of it.
"""

from __future__ import annotations

import inspect
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from distamp import reduction
from distamp.clipping import (
    check_clip_args,
    clip_coefficient,
    clip_divisor,
    local_norm_term,
    scale_grads_,
    total_norm,
)
from distamp.diagnostics import NonFiniteTracer, OverflowRecorder, OverflowReport, build_report
from distamp.kernels import unscale_check_sumsq_
from distamp.scale_update import ScaleRule, update_scale_
from distamp.scaler_config import check_device, check_scaler_args, validate_state_dict
from distamp.sync_free import masked_step

__all__ = ["DistributedGradScaler", "ScaleUnderflowError", "ScalerStateError"]


FP16_GRADS = (
    "Attempting to unscale FP16 gradients: the parameters themselves are fp16. Keep parameters "
    "in fp32 and let autocast cast them per op (or use precision='bf16', which needs no scaler)."
)


class ScaleUnderflowError(RuntimeError):
    """The loss scale hit ``min_scale`` and the gradients still overflow."""


class ScalerStateError(RuntimeError, AssertionError):
    """A scaler method was called out of order.

    Subclasses ``AssertionError`` too, because torch's GradScaler raises that type for the same
    misuse (e.g. ``step()`` before ``scale()``) and drop-in code may catch it.
    """


def _refresh_state() -> dict[str, Any]:
    # "found_inf": the rank-agreed flag once reduced; "pending": local flags not yet reduced.
    return {"stage": OptState.READY, "found_inf_per_device": {}, "found_inf": None}


class DistributedGradScaler(torch.amp.GradScaler):
    """Drop-in for :class:`torch.amp.GradScaler` that never lets ranks disagree on a skip.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as in
            :class:`torch.amp.GradScaler`, with the same defaults.
        hysteresis: overflows tolerated before backing off. The counter drops by one per overflow
            and the scale backs off once it reaches zero (and on every further overflow); it is
            refilled only when the scale grows (Megatron-LM's rule). ``1`` is torch's behaviour.
        min_scale: floor of the scale. An overflow while the scale is already at the floor raises
            :class:`ScaleUnderflowError` (checking this costs one host sync per ``update``, so it is
            off by default).
        max_scale: ceiling of the scale (growth stops there). ``None``: no ceiling.
        process_group: the ranks that must agree: a ``ProcessGroup`` or a ``DeviceMesh``. ``None``
            chooses the mesh of FSDP2 (DTensor) parameters or the default group.
        sync_free: ``step()`` never waits for the device: the skip is decided on device, through
            the optimizer's ``found_inf`` argument (fused optimizers) or a masked update.
        check_only: for bf16 and fp32 training, which need no loss scaling: ``scale()`` returns
            the loss unchanged, ``unscale_`` only checks (one read, no write), the scale stays 1,
            and a step whose gradients hold an inf/NaN is still skipped on every rank, counted and
            reported. Clipping keeps its single pass.
        report_overflow: keep one non-finite flag per gradient tensor, raised by the unscale pass
            itself and kept on device, for :meth:`overflow_report`. Free with the Triton kernel
            and for fused optimizers; the torch reference's in-place unscale then checks and
            writes in two passes instead of one.

    Collectives: one per ``step`` call that has unreduced flags (explicitly unscaled optimizers are
    reduced together in that one call); zero when no process group is initialized, and zero for an
    optimizer whose parameters are all synchronised by a DDP module passed to
    :meth:`register_module` (its all-reduce already spread any inf to every rank).
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
        max_scale: float | None = 2.0**24,
        process_group: reduction.GroupSpec = None,
        sync_free: bool = False,
        report_overflow: bool = True,
        check_only: bool = False,
    ) -> None:
        device = check_device(device)
        check_scaler_args(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            sync_free=sync_free,
        )
        if not isinstance(check_only, bool):
            raise ValueError(f"`check_only` must be a bool, got {check_only!r}")
        self._check_only = check_only
        if check_only:
            init_scale = 1.0  # nothing is scaled: the scale only reports 1
        super().__init__(
            device, init_scale, growth_factor, backoff_factor, growth_interval, enabled
        )
        self._per_optimizer_states = defaultdict(_refresh_state)
        self._hysteresis = int(hysteresis)
        self._min_scale = None if min_scale is None else float(min_scale)
        self._max_scale = None if max_scale is None else float(max_scale)
        self._process_group = process_group
        self._sync_free = sync_free
        self._init_hysteresis_tracker = self._hysteresis
        self._init_skipped_steps = 0
        self._hysteresis_tracker: torch.Tensor | None = None
        self._skipped: torch.Tensor | None = None
        self._streak: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | None = None
        self._underflow: torch.Tensor | None = None
        self._reducers: dict[int, reduction.FlagReducer] = {}
        self._ddp_param_ids: set[int] = set()
        self._ddp_synced_forward = False
        self._param_names: dict[int, str] = {}
        self._shard_groups: dict[int, int] = {}  # FSDP1 parameter id -> its shard group's size
        self._overflow = OverflowRecorder() if report_overflow else None
        self._replica_cache: dict[int, dict[int, int]] = {}  # group size -> param id -> replicas
        self._tracer: NonFiniteTracer | None = None
        self.collectives_issued = 0  # how many found_inf collectives this scaler issued

    # ------------------------------------------------------------------ lazily created state
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._hysteresis_tracker = torch.full(
            (), self._init_hysteresis_tracker, dtype=torch.int32, device=dev
        )
        self._skipped = torch.full((), self._init_skipped_steps, dtype=torch.int64, device=dev)
        self._streak = torch.zeros((), dtype=torch.int64, device=dev)
        self._last_skipped = torch.zeros((), dtype=torch.bool, device=dev)
        self._underflow = torch.zeros((), dtype=torch.bool, device=dev)

    def _check_scale_growth_tracker(self, funcname: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerStateError(
                f"{funcname}() was called before scale(): call `scaler.scale(loss).backward()` "
                "first in every iteration, then unscale_/step/update."
            )
        return self._scale, self._growth_tracker

    # ------------------------------------------------------------------ scaling the loss
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or a (nested) list/tuple/iterable of tensors, by the scale.

        Same contract as torch's; defined here rather than inherited because ``torch.compile``
        refuses to trace torch's own GradScaler methods (a graph break at every ``scale()``),
        while it traces this one. No host sync.
        """
        if not self._enabled:
            return outputs
        if self._check_only:
            if self._scale is None:
                device = torch.device(self._device)
                if device.type == "cuda" and device.index is None:
                    device = torch.device("cuda", torch.cuda.current_device())
                self._lazy_init_scale_growth_tracker(device)
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def factor(device: torch.device) -> torch.Tensor:
            if self._scale is None:
                self._lazy_init_scale_growth_tracker(device)
            assert self._scale is not None
            if device not in per_device:
                per_device[device] = self._scale.to(device=device, non_blocking=True)
            return per_device[device]

        def apply(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value * factor(value.device)
            if isinstance(value, (list, tuple)):
                return type(value)(apply(v) for v in value)
            if isinstance(value, Iterable):
                return map(apply, value)
            raise ValueError(
                f"scale() takes a Tensor or an iterable of Tensors, got {type(value).__name__}"
            )

        return apply(outputs)

    # ------------------------------------------------------------------ module registration
    def register_module(self, module: torch.nn.Module) -> None:
        """Tell the scaler about the model, for parameter names and DDP's guarantee.

        For an FSDP1 module it records which parameters are shards, so that
        :meth:`clip_grad_norm_` counts each element once. For a ``DistributedDataParallel``
        module, an optimizer whose parameters are all synchronised
        by it needs no extra collective: DDP's all-reduce already carried any inf/NaN to every rank.
        The guarantee is re-checked every step: if the last forward ran under ``no_sync()`` (or a
        parameter is not synchronised by DDP), the flags are reduced as usual.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        inner = module.module if isinstance(module, DistributedDataParallel) else module
        for name, p in inner.named_parameters():
            self._param_names[id(p)] = name
        if isinstance(module, FullyShardedDataParallel):  # clipping counts each shard once
            shard = torch.distributed.get_world_size(module.process_group)
            self._shard_groups.update((id(p), shard) for p in module.parameters())
            self._replica_cache.clear()
        if not isinstance(module, DistributedDataParallel):
            return
        ignored = set(getattr(module, "parameters_to_ignore", ()))
        self._ddp_param_ids |= {
            id(p) for n, p in inner.named_parameters() if p.requires_grad and n not in ignored
        }
        ref = weakref.ref(self)

        def _record_sync(mod: torch.nn.Module, _args: Any) -> None:
            scaler = ref()
            if scaler is not None:
                scaler._ddp_synced_forward = bool(
                    getattr(mod, "require_backward_grad_sync", False) and torch.is_grad_enabled()
                )

        module.register_forward_pre_hook(_record_sync)

    def _ddp_covers(self, optimizer: torch.optim.Optimizer) -> bool:
        if not (self._ddp_synced_forward and self._ddp_param_ids):
            return False
        return all(id(p) in self._ddp_param_ids for p in _params(optimizer))

    # ------------------------------------------------------------------ unscale / check
    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor | None,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscale (or, with ``inv_scale`` None, only check) the optimizer's local gradients.

        Returns one local flag per device, always including the scale's device, so that a rank
        whose optimizer holds no gradient (empty shard, frozen parameters) still contributes a
        flag to the collective instead of skipping it.
        """
        write = inv_scale is not None
        per_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        owners: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for p in _params(optimizer):
                grad = p.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError(FP16_GRADS)
                if hasattr(grad, "to_local"):  # DTensor (FSDP2): each rank checks its own shard
                    grad = grad.to_local()
                if grad.is_sparse:
                    if grad.dtype is torch.float16:
                        grad = grad.coalesce()
                        p.grad = grad
                    grad = grad._values()
                per_device[grad.device].append(grad)
                owners[grad.device].append(p)
        flags = {found_inf.device: found_inf}
        for device, grads in per_device.items():
            flag = flags.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
            factor = (
                inv_scale.to(device, non_blocking=True)
                if inv_scale is not None
                else torch.ones((), dtype=torch.float32, device=device)
            )
            per_tensor = (
                None if self._overflow is None else self._overflow.new_flags(owners[device], device)
            )
            unscale_check_sumsq_(grads, flag, factor, write=write, per_tensor_flags=per_tensor)
        return flags

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and record a local flag.

        Call it before anything that reads gradient values (clipping). The flag is reduced across
        ranks lazily, in the same single collective as every other optimizer unscaled this step,
        when ``step()`` or ``update()`` first needs it. No host sync.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update() "
                "(clip_grad_norm_ unscales too): call it once per optimizer step, after the last "
                "micro-batch's backward."
            )
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(): unscale before stepping, then call "
                "update() to start the next iteration."
            )
        self._prepare(optimizer)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = self._unscale_grads_(
            optimizer,
            None if self._check_only else _reciprocal(scale),  # check-only: read, never write
            found_inf,
            False,
        )
        state["found_inf"] = None
        state["stage"] = OptState.UNSCALED

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Read-only non-finite check for fused optimizers, which unscale inside their kernel."""
        scale, _ = self._check_scale_growth_tracker("_check_inf_per_device")
        self._prepare(optimizer)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._unscale_grads_(optimizer, None, found_inf, True)
        state["found_inf"] = None
        return state["found_inf_per_device"]

    # ------------------------------------------------------------------ the one collective
    def _pending(self) -> list[tuple[int, dict[str, Any]]]:
        return [
            (key, st)
            for key, st in self._per_optimizer_states.items()
            if st["found_inf_per_device"] and st["found_inf"] is None
        ]

    def _reducer_for(self, keys: list[int]) -> reduction.FlagReducer:
        """The group that must agree for these optimizers; a no-op when DDP covers them all."""
        need = [k for k in keys if not self._per_optimizer_states[k].get("ddp_covered", False)]
        reducers = {id(self._reducers[k]): self._reducers[k] for k in need}
        if len(reducers) == 1:
            return next(iter(reducers.values()))
        if not reducers:
            return reduction.FlagReducer((), None)
        # Optimizers on different groups: the default group is a superset of all of them.
        return reduction.resolve_group(self._process_group or _world(), ())

    def _reduce_pending(
        self,
        extra: torch.Tensor | None = None,
        extra_op: str = "max",
        reducer: reduction.FlagReducer | None = None,
    ) -> torch.Tensor | None:
        """Agree on every unreduced flag of this step (and ``extra``, a norm term) with ONE
        collective; return the reduced ``extra``.

        The order of optimizers is the order in which they were unscaled, which is the same on
        every rank in SPMD code, so the packed tensor lines up across ranks.
        """
        pending = self._pending()
        if not pending and extra is None:
            return None
        if reducer is None:
            reducer = self._reducer_for([key for key, _ in pending])
        scale = getattr(self, "_scale", None)  # torch does not create it when disabled
        scale_device = (
            scale.device
            if scale is not None
            else (extra.device if extra is not None else torch.device("cpu"))
        )
        local = []
        for _, st in pending:
            flags = [
                f.to(scale_device, non_blocking=True) for f in st["found_inf_per_device"].values()
            ]
            local.append(flags[0] if len(flags) == 1 else torch.stack(flags).amax())
        if not reducer.is_noop:
            self.collectives_issued += len(reducer.groups)
        agreed, extra = reduction.reduce_flags(reducer, local, extra, extra_op)
        if agreed:
            # Optimizers unscaled together are skipped together: whatever ran between unscale_
            # and step (typically one clip_grad_norm_ over all parameters) mixed their gradients,
            # so an inf in one made the others' gradients rank-dependent (clip coefficient 0 on
            # one rank).
            flag = agreed[0] if len(agreed) == 1 else torch.stack(agreed).amax()
            for _, st in pending:
                st["found_inf"] = flag
                st["found_inf_per_device"] = {scale_device: flag}
        return extra

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
        one multiply pass. The norm counts every element once whatever holds it: DDP replicas,
        FSDP1 shards (register the FSDP module with :meth:`register_module`; the engine does),
        FSDP2/HSDP DTensors. Other ``norm_type`` values unscale first, then reduce likewise.
        With the scaler disabled it clips (bf16/fp32 training) with the same one collective.

        Returns:
            The total norm of the unscaled gradients before clipping, a 0-dim float32 tensor
            (no host sync; non-finite when a gradient is, and the step is then skipped).
        """
        max_norm, norm_type = check_clip_args(max_norm, norm_type)
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "clip_grad_norm_() is being called after step(): clip before stepping, then "
                "call update() to start the next iteration."
            )
        if state.get("clipped"):
            raise RuntimeError(
                "clip_grad_norm_() has already been called on this optimizer since the last "
                "update(): clip once per optimizer step."
            )
        fused = _is_fused(optimizer)
        deferred = self._enabled and state["stage"] is OptState.READY and norm_type == 2.0
        if self._enabled:
            scale, _ = self._check_scale_growth_tracker("clip_grad_norm_")
            home = scale.device
            if state["stage"] is OptState.READY and not deferred:
                self.unscale_(optimizer)  # p-norms other than 2 read unscaled gradients
        else:
            scale, home = None, _grad_device(optimizer)
        self._prepare(optimizer)
        found_inf = torch.zeros((), dtype=torch.float32, device=home)
        if deferred:
            assert scale is not None
            if not fused:
                _reject_fp16_grads(optimizer)
            inv_scale = _reciprocal(scale)
            state["found_inf_per_device"] = {home: found_inf}  # filled by the pass below
            state["found_inf"] = None
        else:  # the gradients are unscaled already (or were never scaled)
            inv_scale = torch.ones((), dtype=torch.float32, device=home)
        reducer = self._reducer_for([k for k, _ in self._pending()] + [id(optimizer)])
        term, grads = local_norm_term(
            _params(optimizer),
            norm_type=norm_type,
            inv_scale=inv_scale,
            found_inf=found_inf,
            group_size=reducer.size,
            shard_groups=self._shard_groups,
            recorder=self._overflow if deferred else None,  # else unscale_ recorded them
            replica_cache=self._replica_cache.setdefault(reducer.size, {}),
        )
        op = "max" if norm_type == float("inf") else "sum"
        norm = total_norm(self._reduce_pending(term, op, reducer), norm_type)  # type: ignore[arg-type]
        if self._enabled:  # a skipped step keeps inf as inf (not inf * 0 = nan) for the report
            divisor = clip_divisor(norm, max_norm)
            if deferred and fused and scale is not None:
                state["grad_scale"] = scale * divisor  # the fused step divides by it
            elif deferred:
                scale_grads_(grads, inv_scale / divisor)
            elif fused:
                state["grad_scale"] = divisor  # gradients already unscaled
            else:
                scale_grads_(grads, divisor.reciprocal())
        else:
            scale_grads_(grads, clip_coefficient(norm, max_norm))
        if deferred:
            state["stage"] = OptState.UNSCALED
        state["clipped"] = self._enabled  # a disabled scaler keeps no per-step state
        if error_if_nonfinite and not bool(torch.isfinite(norm).item()):  # host sync, opt-in
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite, so it "
                "cannot be clipped. With a loss scaler this step is skipped anyway: pass "
                "error_if_nonfinite=False (the default)."
            )
        return norm

    def _prepare(self, optimizer: torch.optim.Optimizer) -> None:
        key = id(optimizer)
        if key not in self._reducers:
            self._reducers[key] = reduction.resolve_group(self._process_group, _params(optimizer))
        self._per_optimizer_states[key]["ddp_covered"] = self._ddp_covers(optimizer)

    # ------------------------------------------------------------------ step / update
    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, agree on found_inf across ranks, and step unless it is set.

        Returns what ``optimizer.step`` returns, or ``None`` when the step was skipped. Host
        syncs: none for fused optimizers (they take ``found_inf`` on device) or with
        ``sync_free=True``; otherwise one ``.item()`` on the agreed flag to decide whether to call
        ``optimizer.step`` at all.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(): call update() once "
                "per iteration, after stepping every optimizer."
            )
        fused = _is_fused(optimizer)
        if fused and "grad_scaler" in inspect.signature(optimizer.step).parameters:
            raise TypeError(
                f"{type(optimizer).__name__}.step takes the deprecated `grad_scaler` argument; "
                "DistributedGradScaler passes `grad_scale`/`found_inf` attributes instead."
            )
        if state["stage"] is OptState.READY:
            if fused:
                self._check_inf_per_device(optimizer)
            else:
                self.unscale_(optimizer)
        self._reduce_pending()
        found_inf = state["found_inf"]
        if self._last_skipped is not None:
            self._last_skipped = found_inf > 0
        if fused:
            optimizer.grad_scale = (  # type: ignore[attr-defined]
                state.get("grad_scale") if state["stage"] is OptState.UNSCALED else scale
            )
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
            try:
                retval = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
        elif self._sync_free:
            retval = masked_step(optimizer, found_inf, *args, **kwargs)
        else:
            # Host sync (one per step): whether optimizer.step runs at all is a Python decision.
            retval = None if found_inf.item() else optimizer.step(*args, **kwargs)
        state["stage"] = OptState.STEPPED
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale on device from the agreed flags of every optimizer of this step.

        Growth, backoff, hysteresis and the min/max bounds are applied without a host sync; only
        ``min_scale`` (when set and ``sync_free`` is off) costs one sync to raise
        :class:`ScaleUnderflowError` at the step where the floor is hit.
        """
        if not self._enabled:
            return
        scale, tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None:
            super().update(new_scale)
            self._per_optimizer_states = defaultdict(_refresh_state)
            if self._overflow is not None:
                self._overflow.discard()
            return
        self._reduce_pending()
        flags = [
            st["found_inf"]
            for st in self._per_optimizer_states.values()
            if st["found_inf"] is not None
        ]
        if not flags:
            raise ScalerStateError(
                "update() found no inf checks for this iteration: call scaler.step(optimizer) "
                "(or unscale_) for at least one optimizer before update()."
            )
        found_inf = (
            flags[0] if len(flags) == 1 else torch.stack([f.to(scale.device) for f in flags]).amax()
        )
        found = found_inf > 0
        assert self._hysteresis_tracker is not None and self._skipped is not None
        assert self._underflow is not None
        if not self._check_only:  # check-only: the scale stays 1
            underflow = update_scale_(
                self._rule(), scale, tracker, self._hysteresis_tracker, found_inf
            )
            if underflow is not None:
                self._underflow |= underflow
        self._skipped.add_(found)
        if self._streak is not None:
            torch.mul(self._streak + 1, found, out=self._streak)  # +1 on a skip, else 0
        self._last_skipped = found
        if self._overflow is not None:
            self._overflow.commit(found)
        if self._tracer is not None:
            self._tracer.commit(found)
        self._per_optimizer_states = defaultdict(_refresh_state)
        if self._min_scale is not None and not self._sync_free:
            self._raise_if_underflow()  # one host sync, only when min_scale is set

    def _rule(self) -> ScaleRule:
        return ScaleRule(
            growth_factor=self._growth_factor,
            backoff_factor=self._backoff_factor,
            growth_interval=self._growth_interval,
            hysteresis=self._hysteresis,
            min_scale=self._min_scale,
            max_scale=self._max_scale,
        )

    def _raise_if_underflow(self) -> None:
        # Host sync: reads the on-device underflow flag.
        if self._underflow is not None and bool(self._underflow.item()):
            self._underflow.zero_()
            raise ScaleUnderflowError(
                f"the loss scale is at min_scale={self._min_scale} and gradients still overflow. "
                "Likely causes: NaN/inf in the inputs or the loss itself (check the batch), a "
                "diverged model (lower the learning rate), or fp16 overflow in activations (use "
                "precision='bf16', or keep the overflowing module in fp32 with an AutocastPolicy)."
            )

    # ------------------------------------------------------------------ reporting
    @property
    def check_only(self) -> bool:
        """Whether this scaler only checks (bf16/fp32: no scaling, non-finite steps skipped)."""
        return self._check_only

    @property
    def last_step_skipped(self) -> torch.Tensor:
        """0-dim bool tensor: whether the last step/update skipped (no host sync to get it)."""
        if self._last_skipped is None:
            return torch.zeros((), dtype=torch.bool)
        return self._last_skipped

    @property
    def skipped_steps(self) -> int:
        """Number of skipped iterations since the start (synced: reads a device counter)."""
        if not self._enabled:
            return 0
        if self._skipped is None:
            return self._init_skipped_steps
        return int(self._skipped.item())  # host sync, on request only

    @property
    def skip_streak(self) -> int:
        """Consecutive skipped iterations up to the last ``update()`` (synced: read on request)."""
        return 0 if self._streak is None else int(self._streak.item())

    def get_scale(self) -> float:
        """The current scale as a Python float (one host sync)."""
        if self._sync_free and self._min_scale is not None:
            self._raise_if_underflow()
        return super().get_scale()

    def attach_tracer(self, tracer: NonFiniteTracer | None) -> None:
        """Follow a :class:`~distamp.diagnostics.NonFiniteTracer`: its forward record is kept
        for skipped steps and appears in :meth:`overflow_report`. ``None`` detaches."""
        self._tracer = tracer

    def overflow_report(self) -> OverflowReport | None:
        """Which parameters (and modules, ranks, inf or NaN) overflowed at the last skipped step.

        Reads the per-gradient flags the unscale pass kept on device (nothing is computed again)
        and gathers every rank's, so the report is the same on every rank. Host syncs and, with a
        process group, one gather: call it on every rank, on request or after a skip (the engine
        does it at a logging step whose window skipped). Parameter names come from
        :meth:`register_module`. ``None`` when no step was skipped (or ``report_overflow=False``).
        """
        if not self._enabled or self._overflow is None:
            return None
        group = self._process_group if _is_process_group(self._process_group) else None
        return build_report(
            self._overflow, self._param_names, self._overflow.params(), group, self._tracer
        )

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """torch's keys plus hysteresis, bounds and the skip counter; identical on every rank."""
        if not self._enabled:
            return {}
        sd = super().state_dict()
        sd.update(
            hysteresis=self._hysteresis,
            _hysteresis_tracker=(
                self._init_hysteresis_tracker
                if self._hysteresis_tracker is None
                else int(self._hysteresis_tracker.item())
            ),
            min_scale=self._min_scale,
            max_scale=self._max_scale,
            skipped_steps=self.skipped_steps,
        )
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from this class or from ``torch.amp.GradScaler.state_dict()``.

        Works before the first ``scale()``. Malformed input raises ``ValueError`` naming the key,
        and nothing is changed.
        """
        if not self._enabled:
            return
        sd = validate_state_dict(state_dict, default_hysteresis=self._hysteresis)
        super().load_state_dict(sd)
        self._hysteresis = int(sd["hysteresis"])
        self._init_hysteresis_tracker = int(sd["_hysteresis_tracker"])
        self._init_skipped_steps = int(sd["skipped_steps"])
        for key in ("min_scale", "max_scale"):
            if key in state_dict:
                setattr(self, f"_{key}", None if sd[key] is None else float(sd[key]))
        if self._hysteresis_tracker is not None and self._skipped is not None:
            self._hysteresis_tracker.fill_(self._init_hysteresis_tracker)
            self._skipped.fill_(self._init_skipped_steps)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._enabled:
            state["_init_hysteresis_tracker"] = self.state_dict()["_hysteresis_tracker"]
            state["_init_skipped_steps"] = self.skipped_steps
            for key in (
                "_hysteresis_tracker",
                "_skipped",
                "_streak",
                "_last_skipped",
                "_underflow",
            ):
                state[key] = None
        # Process groups and module hooks do not survive pickling; they are re-resolved lazily.
        state["_process_group"] = None
        state["_reducers"] = {}
        state["_ddp_param_ids"] = set()
        state["_ddp_synced_forward"] = False
        state["_param_names"] = {}
        state["_shard_groups"] = {}
        state["_replica_cache"] = {}
        state["_overflow"] = None if self._overflow is None else OverflowRecorder()
        state["_tracer"] = None
        return state


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer takes ``grad_scale``/``found_inf`` (torch's fused=True ones)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _reciprocal(scale: torch.Tensor) -> torch.Tensor:
    # FP32 division can be imprecise for some scales: take the reciprocal in FP64 (as torch).
    return scale.double().reciprocal().float() if scale.device.type != "mps" else scale.reciprocal()


def _grad_device(optimizer: torch.optim.Optimizer) -> torch.device:
    for p in _params(optimizer):
        if p.grad is not None:
            return p.grad.device
    return torch.device("cpu")


def _reject_fp16_grads(optimizer: torch.optim.Optimizer) -> None:
    if any(p.grad is not None and p.grad.dtype == torch.float16 for p in _params(optimizer)):
        raise ValueError(FP16_GRADS)


def _is_process_group(group: Any) -> bool:
    return group is not None and isinstance(group, torch.distributed.ProcessGroup)


def _world() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD
