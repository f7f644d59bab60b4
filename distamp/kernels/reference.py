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
  passes when the sum is asked for, one otherwise. 16-bit norms accumulate in fp32 over pieces
  of at most 1M elements (a whole-tensor upcast is 5x slower there).
- fp32 norms inherit torch's limit: a tensor whose fp32 squares overflow (elements beyond ~1e19)
  gives an infinite sum, as in ``torch.nn.utils.clip_grad_norm_``; tiny ones (below ~1e-19)
  underflow. The check itself is exact everywhere. The Triton kernel has neither limit.
- Writing: ``torch._amp_foreach_non_finite_check_and_unscale_`` (read + write, exactly torch's
  GradScaler). CUDA builds may lack it for bf16 (pytorch issue 127176): support is probed once per
  (device type, dtype) and ``_foreach_mul_`` stands in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "device_mismatch",
    "host_to_device",
    "reference_subset_",
    "unscale_check_sumsq_torch_",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_CPU_PIECE = 1 << 20  # elements per piece when a CPU 16-bit norm upcasts (see _cpu_pieces)
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
                torch._amp_foreach_non_finite_check_and_unscale_([probe], flag, one)
            else:
                torch._foreach_norm([probe], 2, dtype=torch.float64)
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


def _flags_and_norms(
    group: list[torch.Tensor], need_norms: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which tensors of ``group`` (non-empty, one dtype) hold an inf or NaN, and (when asked)
    fp64 2-norms whose squares sum to the group's sum of squares (one per tensor, or per piece of
    a large CPU tensor). Read-only; no host sync and no data-dependent host branch."""
    strategy = _norm_strategy(group[0].device, group[0].dtype)
    if strategy == "fp64":
        norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float64))
        return ~norms.isfinite(), norms
    if strategy == "cpu":
        # aminmax propagates NaN and exposes both infinities: 3.4 ms vs 248 ms for
        # _foreach_norm(ord=inf) on 10M fp32 elements in 200 tensors (torch 2.13, 2 cores).
        ends = torch.stack([torch.stack(torch.aminmax(g)) for g in group])
    else:
        ends = torch.stack(torch._foreach_norm(group, float("inf"))).unsqueeze(1)
    bad = ends.isinf().any(dim=1) | ends.isnan().any(dim=1)
    if not need_norms:
        return bad, None
    return bad, _fp32_norms(group, pieces=strategy == "cpu")


def _fp32_norms(group: list[torch.Tensor], *, pieces: bool) -> torch.Tensor:
    """fp32-accumulated 2-norms, as fp64, whose squares sum to the group's sum of squares (16-bit
    tensors in pieces when ``pieces``: see :func:`_cpu_pieces`)."""
    if group[0].dtype not in _LOW_PRECISION:
        return torch.stack(torch._foreach_norm(group, 2)).to(torch.float64)
    if pieces:
        group = _cpu_pieces(group)
    return torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).to(torch.float64)


def _cpu_pieces(group: list[torch.Tensor]) -> list[torch.Tensor]:
    """``group`` with each large contiguous tensor split into views of ``_CPU_PIECE`` elements.

    On CPU, ``_foreach_norm(dtype=float32)`` of a 16-bit tensor first copies the whole tensor to
    fp32: a fresh allocation as large as the tensor, page-faulted in at every step. Pieces keep
    that copy small and in cache: 36 -> 6.5 ms (bf16) and 25 -> 6.0 ms (fp16) for 20M elements in
    100 log-normal-sized tensors (torch 2.13, 2 cores). The sum of the pieces' squares is the
    group's sum of squares, which is all the caller needs.
    """
    pieces: list[torch.Tensor] = []
    for g in group:
        if g.numel() > _CPU_PIECE and g.is_contiguous():
            pieces.extend(g.view(-1).split(_CPU_PIECE))
        else:
            pieces.append(g)
    return pieces


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
    total = torch.zeros((), dtype=torch.float64, device=device) if compute_sumsq else None
    groups = (
        ({grads[0].dtype: (list(grads), list(slots))} if grads else {})
        if grouped
        else _groups(grads, slots, device)
    )
    for dtype, (group, where) in groups.items():
        amp_ok = _supported(_amp_support, "amp", device, dtype)
        if write and amp_ok and not compute_sumsq and per_tensor_flags is None:
            # One read-write pass: check and unscale together, exactly torch's GradScaler.
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
            continue
        if amp_ok and per_tensor_flags is None and _norm_strategy(device, dtype) == "cpu":
            # CPU: torch's check-and-unscale op is one call for the whole list, where a per-tensor
            # aminmax is one call per tensor: 0.37 vs 3.9 ms for 400 fp32 tensors of 1K elements,
            # and on par (8.9 vs 9.0 ms) at 100 x 200K (torch 2.13, 1 thread). A check that must
            # not change the gradients multiplies by exactly 1 (bitwise the same values).
            if total is not None:
                sumsq = _fp32_norms(group, pieces=True).square().sum()
                total = total + sumsq * inv_scale.to(torch.float64).reshape(()).square()
                # A finite sum of squares proves every element finite, so a check-only call
                # needs no second pass; only a non-finite sum (an inf/NaN, or squares beyond
                # fp32) takes the exact check. Reading it is no sync: this is the CPU.
                if not write and bool(torch.isfinite(sumsq)):
                    continue
            factor = inv_scale if write else torch.ones((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, factor)
            continue
        bad, norms = _flags_and_norms(group, compute_sumsq)  # of the scaled values, pre-write
        found_inf.copy_(torch.maximum(found_inf, bad.any().to(torch.float32)))
        if per_tensor_flags is not None:
            index = host_to_device(torch.tensor(where, dtype=torch.int64), device)
            current = per_tensor_flags.index_select(0, index)
            per_tensor_flags.index_copy_(
                0, index, torch.maximum(current, bad.to(per_tensor_flags.dtype))
            )
        if total is not None and norms is not None:
            unscale = inv_scale.to(torch.float64).reshape(())
            total = total + norms.square().sum() * unscale.square()
        if write and amp_ok:
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        elif write:
            # A scalar of the list's own dtype keeps foreach's fast route; a float32 one on a
            # 16-bit list takes the per-tensor slow route (torch checks for equal dtypes): 2.5 ms
            # for 200M fp16 elements in 500 tensors on H100, ~9x one read-write pass. Rounding
            # inv_scale to the gradients' dtype is exact for power-of-two scales (GradScaler's).
            torch._foreach_mul_(group, inv_scale.to(dtype).reshape(()))
    return total


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
