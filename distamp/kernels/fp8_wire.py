"""The 8-bit gradient exchange's arithmetic: per-chunk amax and scales, quantise, sum, dequantise.

:mod:`distamp.parallel.fp8_comm` moves the bytes (the collectives); this module computes what
travels. Every step has two implementations with bitwise equal results:

- ``"torch"``: eager torch ops, the reference, and the path on CPU (and wherever Triton is
  missing). A bucket takes a few dozen small kernels, each with its launch's host cost (about
  1.2 ms per 25 MB bucket on an H200, 2026-11-26).
- ``"triton"``: :mod:`distamp.kernels.fp8_exchange`, one kernel per step (amax; quantise plus the
  error-feedback residual; dequantise-sum-requantise; dequantise). CUDA tensors, or CPU tensors
  under ``TRITON_INTERPRET=1``.

The choice follows :func:`distamp.kernels.get_default_backend` (``DISTAMP_KERNEL_BACKEND``):
``"auto"`` takes Triton for CUDA tensors when it imports and falls back to the reference, with a
one-time warning, when a launch fails (each step is local: no collective runs inside one, so a
fallback never changes what the ranks exchange); ``"triton"`` raises instead.

Numbers, shared by both paths (the kernels reproduce them bit for bit):

- **amax**: each chunk's largest magnitude, ``inf`` when the chunk holds an inf, -inf or NaN.
- **scale**: the largest power of two ``s = 2**k`` with ``amax * s <= target`` exactly,
  ``k`` clamped to [-126, 126]; 1 for a chunk whose amax is 0 or not finite. The exponent comes
  from the bits of amax and target (``frexp``), not from ``floor(log2(target / amax))``, whose
  rounding can put ``amax * s`` a hair above the target and which no kernel reproduces exactly.
  The bounds and the target's bits are :mod:`distamp.kernels.fp8_numbers`', read by both paths.
- **cast**: torch's ``.to(float8_e4m3fn)`` / ``.to(float8_e5m2)`` (round to nearest even; e4m3fn
  saturates at 448, inf included; e5m2 overflows to inf), done in the kernels on the integer bits:
  Triton's own float8 conversion rounds differently under the interpreter (measured: 126.58 became
  104 where torch gives 112).
- **sum**: the world's dequantised shards summed in fp64, where every order gives the exact sum
  (float8 values are multiples of 2**-16 below 2**16), then rounded once to fp32.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

from distamp.kernels.dispatch import get_default_backend
from distamp.kernels.fp8_numbers import LOG2_MAX, LOG2_MIN, target_parts

__all__ = [
    "LOG2_MAX",
    "LOG2_MIN",
    "backend_for",
    "chunk_amax",
    "chunk_scales",
    "dequantise",
    "overflows",
    "quantise",
    "sum_shards",
    "target_parts",
]

_kernels: ModuleType | None = None
_kernels_error: BaseException | None = None
_auto_failed = False


def _load() -> ModuleType | None:
    """Import the Triton kernels once; ``None`` (error remembered) when Triton is unusable."""
    global _kernels, _kernels_error
    if _kernels is None and _kernels_error is None:
        try:
            from distamp.kernels import fp8_exchange  # Triton: imported on first use only

            _kernels = fp8_exchange
        except Exception as exc:  # ImportError, or a Triton build that fails on import
            _kernels_error = exc
    return _kernels


def backend_for(device: torch.device, backend: str | None = None) -> str:
    """Which implementation runs the exchange's steps for tensors on ``device``: ``"triton"``
    or ``"torch"`` (see the module doc). ``backend``: ``None`` reads the default.

    Raises:
        ImportError: ``"triton"`` asked for explicitly without a usable Triton.
    """
    resolved = get_default_backend() if backend is None else backend
    if resolved == "triton":
        if _load() is None:
            raise ImportError(
                f"backend='triton' was requested but Triton cannot be used ({_kernels_error!r})"
            ) from _kernels_error
        return "triton"
    if resolved == "auto" and device.type == "cuda" and not _auto_failed:
        return "triton" if _load() is not None else "torch"
    return "torch"


def _run_kernel(name: str, backend: str | None, *args: object) -> object:
    """The kernel ``name`` of :mod:`~distamp.kernels.fp8_exchange`, or ``None`` when the
    automatic backend saw it fail (then the reference runs, here and from now on)."""
    global _auto_failed
    mod = _load()
    assert mod is not None
    try:
        return getattr(mod, name)(*args)
    except Exception as exc:
        if (get_default_backend() if backend is None else backend) != "auto":
            raise
        warnings.warn(
            f"distamp: the Triton fp8 exchange kernel {name} failed ({exc!r}); using the torch "
            "reference instead. Set DISTAMP_KERNEL_BACKEND=torch to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        _auto_failed = True
        return None


def chunk_amax(chunks: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Each row's largest magnitude, ``inf`` for a row holding an inf, -inf or NaN: the vector
    whose MAX over the ranks is both the scales' input and the bucket's overflow flag.
    (``nan_to_num`` maps ``inf`` to the largest finite float unless told otherwise, which would
    let the cast saturate an overflow into a finite value.)"""
    if backend_for(chunks.device, backend) == "triton":
        out = _run_kernel("chunk_amax", backend, chunks)
        if isinstance(out, torch.Tensor):
            return out
    return torch.nan_to_num(chunks.abs().amax(1), nan=float("inf"), posinf=float("inf"))


def overflows(amax: torch.Tensor, target: float) -> torch.Tensor:
    """Whether any chunk is non-finite or beyond what its clamped scale can bring under
    ``target`` (a 0-dim bool on ``amax``'s device: a saturating cast must never see either)."""
    return (amax > target * 2.0**-LOG2_MIN).any() | torch.isinf(amax).any()


def chunk_scales(amax: torch.Tensor, target: float) -> torch.Tensor:
    """Per chunk: the largest power of two ``s`` with ``amax * s <= target``, the exponent
    clamped to [-126, 126]; 1 for 0 or non-finite (see the module doc). The reference."""
    sig_t, exp_t = target_parts(target)
    ok = torch.isfinite(amax) & (amax > 0)
    mantissa, exponent = torch.frexp(torch.where(ok, amax, torch.ones_like(amax)))
    # amax = m * 2**e with m in [0.5, 1): amax * 2**k <= target exactly when
    # k <= (exp_t + 24) - e, one less when m's significand exceeds the target's
    above = (mantissa * 2.0**24 > sig_t).to(torch.int32)
    k = (exp_t + 24 - exponent.to(torch.int32) - above).clamp(LOG2_MIN, LOG2_MAX)
    scale = (k + 127).bitwise_left_shift(23).view(torch.float32)  # 2**k, built exactly
    return torch.where(ok, scale, torch.ones_like(amax))


def quantise(
    chunks: torch.Tensor,
    amax: torch.Tensor,
    target: float,
    dtype: torch.dtype,
    nonfinite: torch.Tensor,
    *,
    residual: bool,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``chunks`` (rows of fp32) times their scales for ``target``, cast to ``dtype``.

    Returns:
        The float8 bytes (uint8, ``chunks``' shape) and, with ``residual``, what each value lost
        (``x - q / s``, flat fp32; zeros when ``nonfinite``, the bucket's agreed overflow flag).
    """
    if backend_for(chunks.device, backend) == "triton":
        out = _run_kernel("quantise", backend, chunks, amax, target, dtype, nonfinite, residual)
        if out is not None:
            return out  # type: ignore[return-value]
    scale = chunk_scales(amax, target)
    q = (chunks * scale[:, None]).to(dtype)
    lost = None
    if residual:
        lost = torch.where(nonfinite, 0.0, chunks - q.float() / scale[:, None]).reshape(-1)
    return q.view(torch.uint8), lost


def sum_shards(
    received: torch.Tensor,
    amax: torch.Tensor,
    target: float,
    dtype: torch.dtype,
    nonfinite: torch.Tensor,
    world: int,
    *,
    requantise: tuple[float, float] | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """This rank's shard of every rank's quantised bucket, dequantised and summed.

    Args:
        received: what the all-to-all delivered: ``world`` shards of ``len(amax)`` chunks
            (uint8, flat), rank ``r``'s shard ``r``-th.
        amax: the shard's chunks' agreed amax (the scales of ``target`` and of the requantising).
        target, dtype: what the shards were quantised with (:func:`quantise`).
        nonfinite: the bucket's agreed overflow flag: the sum is NaN everywhere when set.
        requantise: ``(target2, divisor)``: return the sum divided by ``divisor`` and quantised
            with the scales of ``target2`` (the bytes to all-gather) instead of the fp32 sum.

    Returns:
        ``[len(amax), chunk]``: the fp32 sum, or with ``requantise`` the float8 bytes (uint8).
    """
    k = amax.numel()
    if backend_for(received.device, backend) == "triton":
        out = _run_kernel(
            "sum_shards", backend, received, amax, target, dtype, nonfinite, world, requantise
        )
        if isinstance(out, torch.Tensor):
            return out
    nan = torch.full_like(amax, float("nan"))
    mine = torch.where(nonfinite, nan, chunk_scales(amax, target))
    parts = received.view(world, k, -1).view(dtype).to(torch.float64)
    total = parts.sum(0).div(mine[:, None]).float()  # exact in fp64, then rounded once
    if requantise is None:
        return total
    target2, divisor = requantise
    factor = chunk_scales(amax, target2) / divisor
    return (total * factor[:, None]).to(dtype).view(torch.uint8)


def dequantise(
    data: torch.Tensor,
    amax: torch.Tensor,
    target: float,
    dtype: torch.dtype,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Float8 bytes (uint8, flat, ``len(amax)`` chunks) divided by the scales of ``target``:
    flat fp32."""
    if backend_for(data.device, backend) == "triton":
        out = _run_kernel("dequantise", backend, data, amax, target, dtype)
        if isinstance(out, torch.Tensor):
            return out
    rows = data.view(dtype).float().view(amax.numel(), -1)
    return (rows / chunk_scales(amax, target)[:, None]).reshape(-1)
