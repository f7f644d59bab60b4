"""Gradient clipping folded into the unscale pass: the pieces the scaler's ``clip_grad_norm_`` uses.

torch's sequence ``scaler.unscale_(opt)`` + ``clip_grad_norm_(params)`` walks the gradients
about five times: unscale (read + write), the norm (read), the clip (read + write). Here one read
pass gives the non-finite flag and the sum of squares of the *unscaled* gradients
(:func:`distamp.kernels.unscale_check_sumsq_` with ``write=False``); the flag and the local sum
travel in one collective; and the combined factor ``inv_scale * clip_coef`` is applied once: by a
fused optimizer through its ``grad_scale`` argument (no extra pass at all), otherwise in one
multiply pass.

Summing the squares across ranks must count every gradient element exactly once. A rank's local
sum is therefore weighted by ``1 / copies`` per gradient, where ``copies`` is how many ranks of
the reduction group hold the same elements (:meth:`distamp.agreement.topology.Topology.copies`: DDP
replicas, FSDP1 shards, DTensor placements on any mesh, pipeline stages). When no collective runs
(one rank, or DDP has already made the gradients identical) the local sum is the global one and
every weight is 1.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distamp.agreement.topology import grad_device, optimizer_params
from distamp.arguments import as_real
from distamp.kernels import check_sumsq_cpu_, get_default_backend, unscale_check_sumsq_
from distamp.observe.diagnostics import OverflowRecorder
from distamp.scaler.grad_groups import FP16_GRADS, GradGroup
from distamp.scaler.records import StepAgreement, reciprocal
from distamp.torch_compat import OptState, foreach_mul_, foreach_norm, takes_grad_scale

__all__ = [
    "check_clip_args",
    "clip_step_grads_",
    "clip_coefficient",
    "clip_divisor",
    "local_norm_term",
    "reads_on_host",
    "scale_grads_",
    "total_norm",
]

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: keeps the coefficient finite for a zero norm


def check_clip_args(max_norm: Any, norm_type: Any) -> tuple[float, float]:
    """Validate ``max_norm`` (> 0, ``math.inf`` included) and ``norm_type`` (>= 1 or inf);
    return floats.

    ``max_norm=math.inf`` is torch's way to measure without clipping (``clip_grad_norm_`` then
    multiplies by ``min(1, inf) = 1``; the Hugging Face Trainer relies on it): accepted, the norm
    is returned and nothing is clipped. Refused although torch takes them: ``0``, with which
    torch zeroes every gradient (the step then applies only weight decay and momentum), a
    negative value, with which torch flips the gradients' sign (a step uphill), and NaN, with
    which torch makes every gradient NaN; each is a bug or an "off" switch, and ``inf`` is the
    off switch that keeps the norm.
    """
    # Numbers as torch takes them (numpy scalars, 0-d tensors); Python floats as they are, so
    # that inf and nan reach the range checks below and their messages.
    if not isinstance(norm_type, float):
        norm_type = as_real("norm_type", norm_type)
    if not isinstance(max_norm, float):
        max_norm = _real_or_inf("max_norm", max_norm)
    if not max_norm > 0:  # NaN fails this too
        raise ValueError(
            f"`max_norm` must be a number > 0 (math.inf: measure the norm without clipping), "
            f"got {max_norm!r}"
        )
    if not (norm_type >= 1 or norm_type == math.inf) or math.isnan(norm_type):
        raise ValueError(f"`norm_type` must be >= 1 or math.inf, got {norm_type!r}")
    return float(max_norm), float(norm_type)


def _real_or_inf(name: str, value: Any) -> float:
    """``value`` as a float, like :func:`distamp.arguments.as_real` but letting +-inf and NaN
    through (numpy and 0-d tensor infinities included) to the range checks."""
    if isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point():
        value = value.item()  # host sync on a device (as_real's too): an argument, read once
    inexact = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
    if inexact and not math.isfinite(float(value)):
        return float(value)
    return as_real(name, value)


SPARSE_CLIP = (
    "clip_grad_norm_ does not support sparse gradients: clip them with "
    "torch.nn.utils.clip_grad_norm_ after scaler.unscale_(optimizer)"
)


def local_norm_term(
    groups: Sequence[GradGroup],
    *,
    norm_type: float,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    copies: Callable[[torch.Tensor], int] | None = None,
    recorder: OverflowRecorder | None = None,
    host: bool | None = None,
) -> torch.Tensor:
    """This rank's contribution to the global norm of the gradients in ``groups``.

    For ``norm_type == 2`` the flag and the weighted sum of squares of the unscaled gradients come
    from one read pass per (device, dtype, weight) group, and ``found_inf`` (on the result's
    device) is raised in place on a non-finite gradient. Other norms read gradients that are
    already unscaled (``inv_scale`` is then 1) and return the weighted sum of ``|g|^p``, or the
    max for ``inf``. With a ``recorder``, the same pass raises one flag per gradient for overflow
    reports. ``copies`` (from :class:`distamp.agreement.topology.Topology`) says how many ranks of
    the reduction group hold each parameter's elements; ``None`` when no collective follows
    (every weight 1). ``host``: :func:`reads_on_host`, when the caller has asked already; CPU
    gradients then take :func:`distamp.kernels.check_sumsq_cpu_` unless per-gradient flags are
    wanted.

    Returns:
        A 0-dim float32 tensor on ``found_inf``'s device, to be SUM-reduced (MAX for the
        inf-norm).
    """
    home = found_inf.device
    terms: list[torch.Tensor] = []
    host = reads_on_host() if host is None else host
    for group in groups:
        device = group.device
        for n, grads, owners in _by_copies(group, copies):
            if norm_type == 2.0:
                flag = found_inf if device == home else torch.zeros((), device=device)
                factor = inv_scale * group.factor if group.factor != 1.0 else inv_scale
                flags = None if recorder is None else recorder.new_flags(owners, device)
                if host and flags is None and device.type == "cpu":
                    # the torch backend's CPU check and sum, called without its dispatcher
                    sumsq: torch.Tensor | None = check_sumsq_cpu_(grads, flag, factor.to(device))
                else:
                    sumsq = unscale_check_sumsq_(
                        grads,
                        flag,
                        factor.to(device),
                        write=False,
                        compute_sumsq=True,
                        per_tensor_flags=flags,
                        grouped=True,
                    )
                assert sumsq is not None
                if flag is not found_inf:
                    torch.maximum(found_inf, flag.to(home), out=found_inf)
                term = sumsq.float()
            else:
                nonempty = [g for g in grads if g.numel()]
                if not nonempty:
                    continue
                # torch's foreach norm (what clip_grad_norm_ uses): one launch per group, no
                # public alias in torch 2.13
                norms = torch.stack(foreach_norm(nonempty, norm_type)).float()
                term = norms.max() if norm_type == math.inf else norms.pow(norm_type).sum()
            terms.append((term / n if n > 1 and norm_type != math.inf else term).to(home))
    if not terms:
        return torch.zeros((), dtype=torch.float32, device=home)
    if len(terms) == 1:  # the usual case: no stack and sum launched for nothing
        return terms[0]
    stacked = torch.stack(terms)
    return stacked.max() if norm_type == math.inf else stacked.sum()


def _by_copies(
    group: GradGroup, copies: Callable[[torch.Tensor], int] | None
) -> list[tuple[int, list[torch.Tensor], list[torch.Tensor]]]:
    """Split a group by how many ranks hold each gradient (one split in the usual case)."""
    if copies is None:
        return [(1, group.grads, group.params)]
    counts = [copies(p) for p in group.params]
    first = counts[0]
    if all(c == first for c in counts):
        return [(first, group.grads, group.params)]
    split: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for c, g, p in zip(counts, group.grads, group.params, strict=True):
        grads, owners = split.setdefault(c, ([], []))
        grads.append(g)
        owners.append(p)
    return [(c, grads, owners) for c, (grads, owners) in split.items()]


def reads_on_host() -> bool:
    """Whether the clip may take its CPU route for CPU gradients (:func:`local_norm_term`,
    :func:`scale_grads_`): reading a CPU value on the host is no sync, so the norm needs no
    dispatcher and a factor of 1 no pass. Not while ``torch.compile`` traces (a read would break
    the graph; the kernels' custom op stays one opaque node) nor when the Triton backend was
    requested by name (its interpreter runs on CPU tensors, and a test asking for it gets it)."""
    return get_default_backend() != "triton" and not torch.compiler.is_compiling()


def total_norm(term: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The global norm from the reduced term of :func:`local_norm_term`."""
    if norm_type == math.inf:
        return term
    if norm_type == 2.0:
        return term.sqrt()
    return term.pow(1.0 / norm_type)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + eps))`` on device, as torch's ``clip_grad_norm_`` computes it."""
    return (max_norm / (norm + EPS)).clamp(max=1.0)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``max(1, (norm + eps) / max_norm)``, the reciprocal of :func:`clip_coefficient`, and 1
    where ``norm`` is not finite.

    What a loss-scaled step folds into its factor: ``grad_scale = scale * divisor`` for a fused
    optimizer, ``inv_scale / divisor`` for one multiply pass. Four small ops on device instead
    of the eleven that the coefficient, a finiteness test and a select take: at hundreds of
    millions of elements these launches, not the gradient read, decide whether the clipped
    step costs more than one pass. A non-finite norm means the step is skipped (or, in fp32, that
    the sum of squares overflowed): the gradients are then left as they are, so an inf gradient
    stays inf for the overflow report instead of becoming ``inf * 0 = nan``.
    """
    divisor = ((norm + EPS) / max_norm).clamp_(min=1.0)
    return divisor.nan_to_num_(nan=1.0, posinf=1.0)


def scale_grads_(
    groups: Sequence[GradGroup], factor: torch.Tensor, host: bool | None = None
) -> None:
    """Multiply every gradient by the 0-dim fp32 ``factor`` in one read-write pass per group.

    On a device, through the unscale kernel rather than ``_foreach_mul_``: torch's foreach
    multiply by an fp32 tensor takes a per-tensor slow route on 16-bit gradients there (measured
    1.4 ms instead of 0.04 ms for 10M bf16 elements in 500 tensors on an H100), and rounding the
    factor to bf16 would move the clip coefficient by up to 0.4%. Its overflow check is
    redundant here and free. On the CPU see :func:`_scale_on_host_` (``host``:
    :func:`reads_on_host`, when the caller has asked already).
    """
    factors: dict[tuple[torch.device, float], torch.Tensor] = {}
    host = reads_on_host() if host is None else host
    for group in groups:
        device = group.device
        key = (device, group.factor)  # backward-scale parts: their own power of two on top
        if key not in factors:
            base = factor.to(device, torch.float32)  # the same tensor when it is there already
            base = base.reshape(()) if base.dim() else base
            factors[key] = base * group.factor if group.factor != 1.0 else base
        if host and device.type == "cpu":
            _scale_on_host_(group.grads, factors[key])
            continue
        scratch = torch.zeros((), dtype=torch.float32, device=device)
        unscale_check_sumsq_(group.grads, scratch, factors[key], grouped=True)


def _scale_on_host_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """:func:`scale_grads_` on the CPU, where reading ``factor`` is no sync.

    A factor of exactly 1 (a check-only scaler's step whose norm is within ``max_norm``) changes
    no bit, so the read-write pass is skipped: torch's ``clip_grad_norm_`` makes it at every
    step. Otherwise ``_foreach_mul_`` by the fp32 tensor: bitwise the unscale kernel's product
    (the same fp32 multiply, for fp32, bf16 and fp16 gradients) without its per-element check,
    10.5 instead of 13.3 ms for the medium GPT's 86 MB of fp32 gradients (torch 2.13, 1 thread).
    """
    if factor.item() == 1.0:  # CPU: a read, no sync
        return
    foreach_mul_(grads, factor)


def _reject_fp16_grads(groups: Sequence[GradGroup]) -> None:
    """``ValueError`` when a gradient is fp16 (its parameter is): checked on the groups, one
    dtype each, instead of walking every parameter again."""
    if any(group.dtype == torch.float16 for group in groups):
        raise ValueError(FP16_GRADS)


def clip_step_grads_(
    steps: StepAgreement,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    scale: torch.Tensor | None,
    unscale: Callable[[torch.optim.Optimizer], None],
    recorder: OverflowRecorder | None = None,
    host_reads: bool = True,
) -> torch.Tensor:
    """Clip ``optimizer``'s gradients to total norm ``max_norm`` within the step that ``steps``
    keeps: the body of :meth:`DistributedGradScaler.clip_grad_norm_` (see there).

    Args:
        steps: the scaler's per-step records, plans and agreement; the norm term travels in the
            step's one collective with every pending flag.
        scale: the scaler's scale tensor, ``None`` when the scaler is disabled (then only the
            clip runs, and no per-step state is kept).
        unscale: the scaler's ``unscale_``, for norms other than 2 (they read unscaled
            gradients).
        recorder: where the 2-norm pass raises per-gradient overflow flags, when it also checks.
        host_reads: whether CPU values may be read on the host (:func:`reads_on_host`); a
            sync-free scaler reads none, not even on the CPU where a read is no sync.

    Returns:
        The total norm of the unscaled gradients before clipping (0-dim float32, no host sync).
    """
    max_norm, norm_type = check_clip_args(max_norm, norm_type)
    enabled = scale is not None
    record = steps.record(optimizer)
    if record.stage is OptState.STEPPED:
        raise RuntimeError(
            "clip_grad_norm_() is being called after step(): clip before stepping, then "
            "call update() to start the next iteration."
        )
    if record.clipped:
        raise RuntimeError(
            "clip_grad_norm_() has already been called on this optimizer since the last "
            "update(): clip once per optimizer step."
        )
    steps.start_reading()
    fused = takes_grad_scale(optimizer)
    # per-block backward scales: a fused step's one grad_scale cannot unscale them, so unscale
    deferred = enabled and record.stage is OptState.READY and norm_type == 2.0
    deferred = deferred and not (fused and steps.factored(optimizer))
    if scale is not None:
        home = scale.device
        if record.stage is OptState.READY and not deferred:
            unscale(optimizer)  # p-norms other than 2 read unscaled gradients
    else:
        home = grad_device(optimizer_params(optimizer))
    plan = steps.prepare(optimizer, record)
    groups = plan.groups(sparse_error=SPARSE_CLIP, by_factor=deferred)
    found_inf = torch.zeros((), dtype=torch.float32, device=home)
    if deferred:
        assert scale is not None
        if not fused:
            _reject_fp16_grads(groups)
        inv_scale = reciprocal(scale)
        record.local_flags = {home: found_inf}  # filled by the pass below
        record.found_inf = None
    else:  # the gradients are unscaled already (or were never scaled)
        inv_scale = torch.ones((), dtype=torch.float32, device=home)
    reducer = steps.reducer_for([*steps.pending(), record])
    host = host_reads and reads_on_host()
    term = local_norm_term(
        groups,
        norm_type=norm_type,
        inv_scale=inv_scale,
        found_inf=found_inf,
        copies=None if reducer.is_noop else steps.copies,
        recorder=recorder if deferred else None,  # else unscale_ recorded them
        host=host,
    )
    op = "max" if norm_type == float("inf") else "sum"
    norm = total_norm(steps.reduce_pending(term, op, reducer), norm_type)  # type: ignore[arg-type]
    clips = max_norm != math.inf  # inf: the norm only (torch multiplies by 1), no clip pass
    if scale is not None:  # a skipped step keeps inf as inf (not inf * 0 = nan) for the report
        divisor = clip_divisor(norm, max_norm) if clips else torch.ones_like(norm)
        if deferred and fused:
            record.grad_scale = scale * divisor  # the fused step divides by it
        elif deferred:
            scale_grads_(groups, inv_scale / divisor, host)  # the unscale pass, clipped or not
        elif fused:
            record.grad_scale = divisor  # gradients already unscaled
        elif clips:
            scale_grads_(groups, divisor.reciprocal(), host)
    elif clips:
        scale_grads_(groups, clip_coefficient(norm, max_norm), host)
    if deferred:
        record.stage = OptState.UNSCALED
    record.clipped = enabled  # a disabled scaler keeps no per-step state
    if error_if_nonfinite and not bool(torch.isfinite(norm).item()):  # host sync, opt-in
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it "
            "cannot be clipped. With a loss scaler this step is skipped anyway: pass "
            "error_if_nonfinite=False (the default)."
        )
    if not enabled:
        steps.discard(optimizer)
    return norm
