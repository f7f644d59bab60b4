"""Reference unscale kernels in torch's multi-tensor ops: the CPU path and the fallback.

Same contract as the Triton kernel (see :mod:`distamp.kernels.dispatch`), built from torch's
``_foreach`` family so it runs wherever torch does. Where it can, the check and the sum of squares
come from ONE ``_foreach_norm`` read pass: a per-tensor 2-norm that cannot overflow is non-finite
exactly when the tensor holds an inf or NaN. No branch depends on tensor values, on any device.
By device (timings: torch 2.13 CPU, 2 cores, 10M fp32 elements in 200 tensors):

- CUDA and other devices: norms accumulated in fp64 (``dtype=torch.float64``), where no finite
  fp32/bf16/fp16 value can overflow. Support is probed once per (device type, dtype); where it is
  missing, the check uses the max-abs (``_foreach_norm(ord=inf)``, NaN/inf exact) and the sum
  fp32 norms.
- CPU: fp64 norms take 510 ms there and ``_foreach_norm(ord=inf)`` 248 ms, fp32 norms 1.8 ms and
  a loop of ``torch.aminmax`` 3.4 ms. So the CPU checks with aminmax and sums fp32 norms: two read
  passes when the sum is asked for, one otherwise. 16-bit sums of squares accumulate in fp32
  through one small reusable buffer (:mod:`distamp.kernels.cpu_sumsq`): torch's CPU norm would
  first copy each whole tensor to fp32, a gradient-sized temporary.
- fp32 norms inherit torch's limit: a tensor whose fp32 squares overflow (elements beyond ~1e19)
  gives an infinite sum, as in ``torch.nn.utils.clip_grad_norm_``; tiny ones (below ~1e-19)
  underflow. The check itself is exact everywhere. The Triton kernel has neither limit.
- Writing: ``torch._amp_foreach_non_finite_check_and_unscale_`` (read + write, exactly torch's
  GradScaler). CUDA builds may lack it for bf16 (pytorch issue 127176): support is probed once per
  (device type, dtype) and ``_foreach_mul_`` stands in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from distamp.kernels.cpu_sumsq import sumsq_fp32_chunked
from distamp.torch_compat import amp_unscale_, foreach_mul_, foreach_norm

__all__ = [
    "check_sumsq_cpu_",
    "device_mismatch",
    "host_to_device",
    "reference_subset_",
    "unscale_check_sumsq_torch_",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_amp_support: dict[tuple[str, torch.dtype], bool] = {}
_norm64_support: dict[tuple[str, torch.dtype], bool] = {}


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU table to ``device`` without a host sync.

    A plain ``.to("cuda")`` from pageable memory synchronizes the stream; a pinned source copied
    with ``non_blocking=True`` does not, and torch's host allocator keeps the pinned block alive
    until the copy has run.
    """
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _supported(
    cache: dict[tuple[str, torch.dtype], bool], op: str, device: torch.device, dtype: torch.dtype
) -> bool:
    """Whether ``op`` accepts ``dtype`` on ``device``'s type, probed once on a one-element tensor.

    Dispatch errors are raised on the host, so a probe costs one tiny kernel and no sync.
    """
    key = (device.type, dtype)
    if key not in cache:
        probe = torch.zeros(1, dtype=dtype, device=device)
        try:
            if op == "amp":
                one = torch.ones((), dtype=torch.float32, device=device)
                flag = torch.zeros((), dtype=torch.float32, device=device)
                amp_unscale_([probe], flag, one)
            else:
                foreach_norm([probe], 2, dtype=torch.float64)
            cache[key] = True
        except (RuntimeError, NotImplementedError, TypeError):
            cache[key] = False
    return cache[key]


def _norm_strategy(device: torch.device, dtype: torch.dtype) -> str:
    """ "fp64" (one exact pass), "split" (max-abs check + fp32 norms) or "cpu" (see module doc)."""
    if device.type == "cpu":
        return "cpu"
    if dtype == torch.float64:  # squares of large fp64 values overflow even an fp64 sum
        return "split"
    return "fp64" if _supported(_norm64_support, "norm64", device, dtype) else "split"


def _flags_and_sumsq(
    group: list[torch.Tensor], need_sumsq: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which tensors of ``group`` (non-empty, one dtype) hold an inf or NaN, and (when asked)
    the group's fp64 0-dim sum of squares. Read-only; no host sync and no data-dependent host
    branch."""
    strategy = _norm_strategy(group[0].device, group[0].dtype)
    if strategy == "fp64":
        norms = torch.stack(foreach_norm(group, 2, dtype=torch.float64))
        return ~norms.isfinite(), norms.square().sum() if need_sumsq else None
    if strategy == "cpu":
        # aminmax propagates NaN and exposes both infinities: 3.4 ms vs 248 ms for
        # _foreach_norm(ord=inf) on 10M fp32 elements in 200 tensors (torch 2.13, 2 cores).
        # It copies a non-contiguous input whole first; amin + amax read it in place.
        ends = torch.stack(
            [
                torch.stack(torch.aminmax(g) if g.is_contiguous() else (g.amin(), g.amax()))
                for g in group
            ]
        )
    else:
        ends = torch.stack(foreach_norm(group, float("inf"))).unsqueeze(1)
    bad = ends.isinf().any(dim=1) | ends.isnan().any(dim=1)
    if not need_sumsq:
        return bad, None
    return bad, _fp32_sumsq(group)


def _fp32_sumsq(group: list[torch.Tensor]) -> torch.Tensor:
    """The group's fp32-accumulated sum of squares, as a 0-dim fp64 tensor.

    16-bit CPU tensors go through :func:`distamp.kernels.cpu_sumsq.sumsq_fp32_chunked`: torch's
    CPU norm would copy each whole tensor to fp32 first (see that module). Elsewhere (devices
    without fp64 norms) ``_foreach_norm(dtype=float32)``: CUDA's foreach norm kernel accumulates
    in the requested dtype as it reads.
    """
    if group[0].dtype not in _LOW_PRECISION:
        return torch.stack(foreach_norm(group, 2)).to(torch.float64).square().sum()
    if group[0].device.type == "cpu":
        return sumsq_fp32_chunked(group)
    norms = foreach_norm(group, 2, dtype=torch.float32)
    return torch.stack(norms).to(torch.float64).square().sum()


def device_mismatch(i: int, g: torch.Tensor, device: torch.device) -> ValueError:
    """The error for a gradient that is not on ``found_inf``'s device."""
    return ValueError(
        f"grads[{i}] is on {g.device} but found_inf is on {device}: group gradients by device "
        "and call once per device"
    )


def _groups(
    grads: Sequence[torch.Tensor], slots: Sequence[int], device: torch.device
) -> dict[torch.dtype, tuple[list[torch.Tensor], list[int]]]:
    """Non-empty gradients grouped by dtype (foreach ops need one dtype), with their flag slots."""
    out: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}
    for g, slot in zip(grads, slots, strict=True):
        if g.device != device:
            raise device_mismatch(slot, g, device)
        if g.numel():
            if not g.dtype.is_floating_point:
                raise TypeError(f"gradients must be floating point, got a {g.dtype} gradient")
            tensors, where = out.setdefault(g.dtype, ([], []))
            tensors.append(g)
            where.append(slot)
    return out


def reference_subset_(
    grads: Sequence[torch.Tensor],
    slots: Sequence[int],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool,
    compute_sumsq: bool,
    per_tensor_flags: torch.Tensor | None,
    grouped: bool = False,
) -> torch.Tensor | None:
    """The reference on a subset of a call's gradients; ``slots[i]`` is ``grads[i]``'s flag entry.

    The Triton launcher hands the tensors it does not take (non-dense, other dtypes) to this
    function, so both backends share one implementation of the remainder. ``grouped``: the caller
    guarantees one floating dtype on ``found_inf``'s device (the scaler groups them so already),
    which saves a Python pass over the list.

    Returns:
        The float64 0-dim sum of squares of the unscaled gradients when ``compute_sumsq``.
    """
    device = found_inf.device
    total: torch.Tensor | None = None  # the sum so far; None until a group added its part
    groups = (
        ({grads[0].dtype: (list(grads), list(slots))} if grads else {})
        if grouped
        else _groups(grads, slots, device)
    )
    for dtype, (group, where) in groups.items():
        amp_ok = _supported(_amp_support, "amp", device, dtype)
        if write and amp_ok and not compute_sumsq and per_tensor_flags is None:
            # One read-write pass: check and unscale together, exactly torch's GradScaler.
            amp_unscale_(group, found_inf, inv_scale)
            continue
        cpu = _norm_strategy(device, dtype) == "cpu"
        if amp_ok and per_tensor_flags is None and (cpu or not compute_sumsq):
            # CPU: torch's check-and-unscale op is one call for the whole list, where a per-tensor
            # aminmax is one call per tensor: 0.37 vs 3.9 ms for 400 fp32 tensors of 1K elements,
            # and on par (8.9 vs 9.0 ms) at 100 x 200K (torch 2.13, 1 thread). A check that must
            # not change the gradients multiplies by exactly 1 (bitwise the same values). On a
            # device, a check without the sum is the same one launch (torch's own scaler checks
            # fused optimizers' gradients so), where the norms would take eight.
            if compute_sumsq:
                local = _fp32_sumsq(group)
                total = _add_unscaled(total, local, inv_scale, on_host=not write)
                # A finite sum of squares proves every element finite, so a check-only call
                # needs no second pass; only a non-finite sum (an inf/NaN, or squares beyond
                # fp32) takes the exact check. Reading it is no sync: this is the CPU.
                if not write and math.isfinite(local.item()):
                    continue
            factor = inv_scale if write else torch.ones((), dtype=torch.float32, device=device)
            amp_unscale_(group, found_inf, factor)
            continue
        bad, sumsq = _flags_and_sumsq(group, compute_sumsq)  # of the scaled values, pre-write
        found_inf.copy_(torch.maximum(found_inf, bad.any().to(torch.float32)))
        if per_tensor_flags is not None:
            index = host_to_device(torch.tensor(where, dtype=torch.int64), device)
            current = per_tensor_flags.index_select(0, index)
            per_tensor_flags.index_copy_(
                0, index, torch.maximum(current, bad.to(per_tensor_flags.dtype))
            )
        if sumsq is not None:
            total = _add_unscaled(total, sumsq, inv_scale, on_host=False)
        if write and amp_ok:
            amp_unscale_(group, found_inf, inv_scale)
        elif write:
            # A scalar of the list's own dtype keeps foreach's fast route; a float32 one on a
            # 16-bit list takes the per-tensor slow route (torch checks for equal dtypes): 2.5 ms
            # for 200M fp16 elements in 500 tensors on H100, ~9x one read-write pass. Rounding
            # inv_scale to the gradients' dtype is exact for power-of-two scales (GradScaler's).
            foreach_mul_(group, inv_scale.to(dtype).reshape(()))
    if compute_sumsq and total is None:  # no non-empty gradient
        total = torch.zeros((), dtype=torch.float64, device=device)
    return total


def check_sumsq_cpu_(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> torch.Tensor:
    """Check CPU gradients of one floating dtype for inf/NaN and return the fp64 0-dim sum of
    squares of ``grads * inv_scale``, leaving their values as they are.

    Bitwise the sum and the flag of :func:`unscale_check_sumsq_torch_` with ``write=False,
    compute_sumsq=True, grouped=True`` on the CPU, without the dispatcher's validation and
    routing: a clip's norm on the CPU (:mod:`distamp.scaler.clipping`) costs its read pass and
    a handful of small ops, as torch's ``clip_grad_norm_`` does. One read pass when the sum is
    finite (it proves every element finite), an exact second one (torch's check, by a factor of
    exactly 1) otherwise. ``found_inf`` (CPU, float32) is raised in place; values are read on
    the host, which on the CPU is no sync.
    """
    if not grads or not _supported(_amp_support, "amp", found_inf.device, grads[0].dtype):
        return unscale_check_sumsq_torch_(  # type: ignore[return-value]
            grads,
            found_inf,
            inv_scale,
            write=False,
            compute_sumsq=True,
            sumsq_dtype=torch.float64,
            grouped=True,
        )
    local = _fp32_sumsq(grads)
    # A read on the host (CPU: no sync). Non-finite: an inf/NaN, or squares beyond fp32 (the
    # exact check tells which; it may rewrite a 16-bit NaN's payload, never a value).
    if not math.isfinite(local.item()):
        amp_unscale_(grads, found_inf, torch.ones((), dtype=torch.float32))
    return _add_unscaled(None, local, inv_scale, on_host=True)


def _add_unscaled(
    total: torch.Tensor | None, sumsq: torch.Tensor, inv_scale: torch.Tensor, *, on_host: bool
) -> torch.Tensor:
    """``total + sumsq * inv_scale**2`` in fp64 (``sumsq`` alone when ``total`` is ``None``).

    Bitwise what adding to a zero start gives (``0 + x`` is ``x`` for a sum of squares, NaN
    included), with fewer ops: a call's first group starts the sum, and ``on_host`` (a CPU call
    that reads values anyway, where a read is no sync) a factor of exactly 1, a check-only
    scaler's, is not multiplied in. Five small ops fewer per clip: for a small model's few dozen
    gradients such ops, not the read pass, make up most of a clip's cost on the CPU.
    """
    if not (on_host and inv_scale.item() == 1.0):  # CPU only: a read, no sync
        sumsq = sumsq * inv_scale.to(torch.float64).reshape(()).square()
    return sumsq if total is None else total + sumsq


def unscale_check_sumsq_torch_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
    compute_sumsq: bool = False,
    per_tensor_flags: torch.Tensor | None = None,
    sumsq_dtype: torch.dtype = torch.float32,
    grouped: bool = False,
) -> torch.Tensor | None:
    """The "torch" backend of :func:`distamp.kernels.unscale_check_sumsq_` (same arguments).

    Arguments are assumed validated by the dispatcher. No host sync.
    """
    total = reference_subset_(
        grads,
        range(len(grads)),
        found_inf,
        inv_scale,
        write=write,
        compute_sumsq=compute_sumsq,
        per_tensor_flags=per_tensor_flags,
        grouped=grouped,
    )
    return None if total is None else total.to(sumsq_dtype)
