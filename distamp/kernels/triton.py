"""Triton multi-tensor kernel: unscale + non-finite check + sum of squares in one read pass.

Imported lazily by :mod:`distamp.kernels.dispatch` (``import distamp`` never imports Triton).

Layout. The gradients of one call are split into fixed-size chunks (``_CONFIG``: elements per
program, by dtype and by write or read-only); one program handles one chunk of one tensor, so a
1-D grid covers thousands of tensors in one launch per (dtype, alignment) group — usually a single
launch per dtype. Each group owns one int64 table on the device::

    [ address (T) | numel (T) | flag slot (T) | chunk's tensor (C) | chunk's index in it (C) ]

Tables depend only on the gradients' addresses, sizes and dtypes, so they are cached under that
key: gradients that persist between steps (or are re-allocated at the same addresses) reuse the
table and a cache hit launches kernels only. Gradients re-allocated elsewhere with the same sizes
(``zero_grad(set_to_none=True)``, every step) keep everything but the addresses: the table is
then re-addressed (one small upload) instead of rebuilt, the rebuild's per-tensor Python work
being most of a step's host time with hundreds of tensors.

Sum of squares without spurious overflow. Squares of finite fp32 values overflow fp32 (1e30² is
not representable). Each program therefore scales its chunk by an exact power of two chosen from
the chunk's max-abs (every scaled element then lies below 4 in magnitude), sums squares in fp32,
and writes the chunk's partial, rescaled and multiplied by inv_scale², in fp64; the partials are
summed in fp64. Power-of-two scaling is exact, so tiny values lose nothing either, and the fp32 sum
is finite exactly when every element is — which is the non-finite check for free.

Alignment. Full chunks load without a mask, and 16-byte-aligned tensors get a divisibility hint:
with both, the sm_90 PTX uses 128-bit ``ld.global.v4``/``st.global.v4`` (checked by compiling
for ``GPUTarget("cuda", 90, 32)``); unaligned tensors get a separate launch with scalar loads.

Measured on H100 (torch 2.11, Triton 3.6; 200M elements in 500 tensors, CUDA-graph replay, in
units of one flat read of the same bytes): check + sum of squares 1.03 (fp32), 1.10 (bf16/fp16),
i.e. 2.6-2.9 TB/s; unscale (read + write) 2.02-2.03, at 91-97% of a flat copy's bandwidth; torch's
unscale + clip_grad_norm_ takes 5.98 (fp32) and 8.38 (fp16).
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from distamp.kernels.reference import device_mismatch, host_to_device, reference_subset_

__all__ = [
    "auto_failed",
    "is_interpreted",
    "plan_cache_clear",
    "plan_cache_info",
    "unscale_check_sumsq_triton_",
]

# (dtype, write) -> (elements per program, warps). From `benchmarks/unscale_bandwidth.py --blocks`
# on H100, 200M elements in 500 tensors, CUDA-graph timings, in read-pass equivalents: read-only
# check+sumsq is best with 8192/4 (fp32 0.97, 16-bit 1.04; 2048/8 gives 1.17 and 1.68), the
# read-write unscale with smaller blocks (16-bit: 2048/4 2.04 vs 8192/4 2.43; fp32 4096/4 1.95).
_CONFIG = {
    (torch.float32, False): (8192, 4),
    (torch.float32, True): (4096, 4),
    (torch.float16, False): (8192, 4),
    (torch.float16, True): (2048, 4),
    (torch.bfloat16, False): (8192, 4),
    (torch.bfloat16, True): (2048, 4),
}
_DTYPES = frozenset(dtype for dtype, _ in _CONFIG)
_ALIGN_BYTES = 16  # the widest vector load; unaligned tensors run in a launch without the hint
_CACHE_SIZE = 16


@triton.jit
def _unscale_chunks_kernel(
    meta_ptr,
    like_ptr,
    inv_scale_ptr,
    found_inf_ptr,
    flags_ptr,
    partial_ptr,
    num_tensors,
    num_chunks,
    BLOCK: tl.constexpr,
    ALIGNED: tl.constexpr,
    WRITE: tl.constexpr,
    SUMSQ: tl.constexpr,
    FLAGS: tl.constexpr,
):
    chunk = tl.program_id(0)
    tensor = tl.load(meta_ptr + 3 * num_tensors + chunk)
    start = tl.load(meta_ptr + 3 * num_tensors + num_chunks + chunk) * BLOCK
    remaining = tl.load(meta_ptr + num_tensors + tensor) - start
    base = tl.load(meta_ptr + tensor).to(like_ptr.dtype, bitcast=True)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    ptrs = base + start + tl.arange(0, BLOCK)
    # Full chunks load without a mask: a mask from a runtime size defeats vectorized loads.
    if remaining >= BLOCK:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=tl.arange(0, BLOCK) < remaining, other=0.0)
    x = x.to(tl.float32)  # also the only bf16 math the interpreter offers: load, convert, compute
    inv_scale = tl.load(inv_scale_ptr)

    if SUMSQ:
        # r = 2^-p for the chunk's max-abs m in [2^p, 2^(p+1)), p clamped to [-126, 126] so r is a
        # normal number: x * r is exact, below 4 in magnitude, and its squares cannot overflow.
        # So the fp32 sum s is finite exactly when every x is, which doubles as the check.
        m = tl.max(tl.abs(x), axis=0)
        p = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        p = tl.minimum(tl.maximum(p, -126), 126)
        r = ((127 - p) << 23).to(tl.float32, bitcast=True)
        z = x * r
        s = tl.sum(z * z, axis=0)
        nonfinite = not (s <= 3.4028234663852886e38)
        # inv_scale is applied in fp64, after the sum: exact, and no fp32 rounding of x * inv.
        ratio = inv_scale.to(tl.float64) / r.to(tl.float64)
        tl.store(partial_ptr + chunk, s.to(tl.float64) * ratio * ratio)
    else:
        # |x| <= FLT_MAX is false for both infinities and NaN: one compare per element.
        finite = tl.abs(x) <= 3.4028234663852886e38
        nonfinite = tl.min(finite.to(tl.int32), axis=0) == 0
    if nonfinite:
        # Every writer stores the same 1: the race is benign and needs no atomics.
        tl.store(found_inf_ptr, 1.0)
        if FLAGS:
            tl.store(flags_ptr + tl.load(meta_ptr + 2 * num_tensors + tensor), 1.0)

    if WRITE:
        # Rounded once from fp32, like torch's unscale: bit-identical results.
        y = (x * inv_scale).to(like_ptr.dtype.element_ty)
        if remaining >= BLOCK:
            tl.store(ptrs, y)
        else:
            tl.store(ptrs, y, mask=tl.arange(0, BLOCK) < remaining)


_INTERPRETED = type(_unscale_chunks_kernel).__name__ == "InterpretedFunction"


def is_interpreted() -> bool:
    """Whether the kernel runs under Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETED


@dataclass(frozen=True)
class _Launch:
    """One kernel launch: a group of same-dtype, same-alignment dense tensors."""

    meta: torch.Tensor
    indices: tuple[int, ...]  # positions in the call's gradient list (also their flag slots)
    num_chunks: int
    block: int
    warps: int
    aligned: bool
    partial_offset: int


@dataclass(frozen=True)
class _Plan:
    launches: tuple[_Launch, ...]
    fallback: tuple[int, ...]  # positions the reference handles: non-dense or unsupported dtype
    total_chunks: int


_plans: dict[tuple[object, ...], _Plan] = {}  # insertion order: oldest first
# The same plans keyed without the addresses (only their alignment), for re-addressing.
_layouts: dict[tuple[object, ...], _Plan] = {}
_stats = {"hits": 0, "misses": 0, "readdressed": 0}
_auto_failed = False  # a launch failed under the automatic backend: stop trying


def auto_failed() -> bool:
    """Whether a launch failed under the automatic backend (which then stays on the reference)."""
    return _auto_failed


def plan_cache_info() -> dict[str, int]:
    """Hits, misses (of which ``readdressed``: a known layout at new addresses) and size of the
    pointer-table cache (for tests and benchmarks)."""
    return {**_stats, "size": len(_plans)}


def plan_cache_clear(*, keep_layouts: bool = False) -> None:
    """Drop every cached pointer table (they hold device memory). ``keep_layouts``: keep what
    re-addressing needs, as after a step that re-allocated every gradient (benchmarks)."""
    _plans.clear()
    if not keep_layouts:
        _layouts.clear()
    _stats.update(hits=0, misses=0, readdressed=0)


_dtype_of = operator.attrgetter("dtype")


def _is_dense(g: torch.Tensor) -> bool:
    """Non-overlapping and dense in some dimension order: the kernel sees ``numel`` elements
    starting at ``data_ptr``, whatever the order (channels_last, transposes)."""
    if g.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(zip(g.shape, g.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _build_launch(
    grads: Sequence[torch.Tensor],
    indices: list[int],
    write: bool,
    device: torch.device,
    offset: int,
) -> _Launch:
    block, warps = _CONFIG[grads[indices[0]].dtype, write]
    numels = torch.tensor([grads[i].numel() for i in indices], dtype=torch.int64)
    chunks = (numels + block - 1) // block
    owner = torch.repeat_interleave(torch.arange(len(indices)), chunks)
    first = torch.cumsum(chunks, 0) - chunks
    local = torch.arange(owner.numel()) - first[owner]
    addresses = torch.tensor([grads[i].data_ptr() for i in indices], dtype=torch.int64)
    slots = torch.tensor(indices, dtype=torch.int64)
    meta = torch.cat([addresses, numels, slots, owner, local])
    aligned = all(grads[i].data_ptr() % _ALIGN_BYTES == 0 for i in indices)
    return _Launch(
        host_to_device(meta, device), tuple(indices), owner.numel(), block, warps, aligned, offset
    )


def _build_plan(grads: Sequence[torch.Tensor], write: bool, device: torch.device) -> _Plan:
    groups: dict[tuple[torch.dtype, bool], list[int]] = {}
    fallback: list[int] = []
    for i, g in enumerate(grads):
        if g.device != device:  # checked on a miss only: a hit has the same (unified) addresses
            raise device_mismatch(i, g, device)
        if not g.numel():
            continue
        if g.dtype in _DTYPES and g.layout == torch.strided and _is_dense(g):
            key = (g.dtype, g.data_ptr() % _ALIGN_BYTES == 0)
            groups.setdefault(key, []).append(i)
        else:
            fallback.append(i)
    launches: list[_Launch] = []
    offset = 0
    for indices in groups.values():
        launch = _build_launch(grads, indices, write, device, offset)
        launches.append(launch)
        offset += launch.num_chunks
    return _Plan(tuple(launches), tuple(fallback), offset)


def _readdress(like: _Plan, grads: Sequence[torch.Tensor], device: torch.device) -> _Plan:
    """``like``'s launches with this call's addresses: the sizes, slots and chunk maps are the
    same (the layout key pins them), so only the addresses are uploaded, next to a device copy of
    the rest. A new table, not an update in place: ``like`` stays valid for its own addresses."""
    for i, g in enumerate(grads):  # the addresses are new: so may be the devices
        if g.device != device:
            raise device_mismatch(i, g, device)
    launches = []
    for launch in like.launches:
        addresses = torch.tensor([grads[i].data_ptr() for i in launch.indices], dtype=torch.int64)
        meta = torch.cat([host_to_device(addresses, device), launch.meta[len(launch.indices) :]])
        launches.append(replace(launch, meta=meta))
    return replace(like, launches=tuple(launches))


def _remember(cache: dict[tuple[object, ...], _Plan], key: tuple[object, ...], plan: _Plan) -> None:
    cache[key] = plan
    if len(cache) > _CACHE_SIZE:  # evict the oldest entry
        del cache[next(iter(cache))]


def _plan_for(
    grads: Sequence[torch.Tensor],
    write: bool,
    device: torch.device,
    build: bool = True,
    grouped: bool = False,
) -> _Plan | None:
    # The key pins everything a table encodes. Host time of a whole call (H100 machine, Python
    # 3.12): 500 tensors 0.25-0.4 ms on a hit, 1.5-2.4 ms on a miss (table build + H2D copy);
    # 2000 tensors 1.2 ms on a hit, 0.74 ms of it in these attribute maps
    # (`unscale_bandwidth.py --profile`). Nothing waits for the GPU, so it overlaps with queued
    # work, and a cache hit is CUDA-graph capturable, which removes it.
    # Device addresses are unique across devices (unified addressing), so a hit needs no per-tensor
    # device check: the miss that built the entry did it.
    contiguous = tuple(map(torch.Tensor.is_contiguous, grads))
    layouts = (
        ()
        if all(contiguous)
        else tuple((i, g.shape, g.stride()) for i, g in enumerate(grads) if not contiguous[i])
    )
    addresses = tuple(map(torch.Tensor.data_ptr, grads))
    # One dtype for all when the caller grouped them (the scaler does): a quarter of a hit's key.
    dtypes = (grads[0].dtype,) if grouped and grads else tuple(map(_dtype_of, grads))
    shapes = (device, write, tuple(map(torch.Tensor.numel, grads)), dtypes)
    key = (*shapes, layouts, addresses)
    plan = _plans.get(key)
    if plan is not None:
        _stats["hits"] += 1
        return plan
    _stats["misses"] += 1
    if not build:
        return None
    # What the launches are made of, but the addresses: sizes, dtypes, layouts and alignment.
    layout_key = (*shapes, layouts, tuple(a % _ALIGN_BYTES == 0 for a in addresses))
    like = _layouts.get(layout_key)
    if like is None:
        plan = _build_plan(grads, write, device)
        _remember(_layouts, layout_key, plan)
    else:
        plan = _readdress(like, grads, device)
        _stats["readdressed"] += 1
    _remember(_plans, key, plan)
    return plan


def unscale_check_sumsq_triton_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
    compute_sumsq: bool = False,
    per_tensor_flags: torch.Tensor | None = None,
    sumsq_dtype: torch.dtype = torch.float32,
    strict: bool = True,
    grouped: bool = False,
) -> torch.Tensor | None:
    """The "triton" backend of :func:`distamp.kernels.unscale_check_sumsq_` (same arguments).

    Tensors the kernel does not take (non-dense layouts, dtypes other than fp32/fp16/bf16) go to
    the reference in the same call. With ``strict=False`` (the automatic backend) a launch that
    fails to compile is handed to the reference as well, with a one-time warning; nothing of that
    launch has run, so no gradient is unscaled twice. No host sync.
    """
    global _auto_failed
    device = found_inf.device
    if device.type != "cuda" and not is_interpreted():
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got tensors on {device}; use backend='torch' "
            "(or set TRITON_INTERPRET=1 before Triton is imported to run the kernel on CPU)"
        )
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    plan = _plan_for(grads, write, device, build=not capturing, grouped=grouped)
    if plan is None:
        # A new table needs a host-to-device copy, which must not be baked into a CUDA graph
        # being captured; the reference ops capture cleanly. A warm-up step with the same
        # gradient tensors (zero_grad(set_to_none=False)) caches the table and gets the kernel.
        total = reference_subset_(
            grads,
            range(len(grads)),
            found_inf,
            inv_scale,
            write=write,
            compute_sumsq=compute_sumsq,
            per_tensor_flags=per_tensor_flags,
        )
        return None if total is None else total.to(sumsq_dtype)
    partials = (
        torch.empty(plan.total_chunks, dtype=torch.float64, device=device)
        if compute_sumsq
        else found_inf
    )
    flags = found_inf if per_tensor_flags is None else per_tensor_flags
    leftover = list(plan.fallback)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for launch in plan.launches:
            try:
                _unscale_chunks_kernel[(launch.num_chunks,)](
                    launch.meta,
                    grads[launch.indices[0]],
                    inv_scale,
                    found_inf,
                    flags,
                    partials[launch.partial_offset :] if compute_sumsq else partials,
                    len(launch.indices),
                    launch.num_chunks,
                    BLOCK=launch.block,
                    ALIGNED=launch.aligned,
                    WRITE=write,
                    SUMSQ=compute_sumsq,
                    FLAGS=per_tensor_flags is not None,
                    num_warps=launch.warps,
                    enable_fp_fusion=False,  # bit-exact x * inv_scale, as torch computes it
                )
            except Exception as exc:
                if strict:
                    raise
                if not _auto_failed:
                    warnings.warn(
                        f"distamp: the Triton unscale kernel failed ({exc!r}); using the torch "
                        "reference instead. Set DISTAMP_KERNEL_BACKEND=torch to silence this.",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    _auto_failed = True
                leftover.extend(launch.indices)
                if compute_sumsq:
                    partials[launch.partial_offset : launch.partial_offset + launch.num_chunks] = 0
    rest = None
    if leftover:
        rest = reference_subset_(
            [grads[i] for i in leftover],
            leftover,
            found_inf,
            inv_scale,
            write=write,
            compute_sumsq=compute_sumsq,
            per_tensor_flags=per_tensor_flags,
        )
    if not compute_sumsq:
        return None
    total = partials.sum()
    if rest is not None:
        total = total + rest
    return total.to(sumsq_dtype)
