"""Triton kernels of the 8-bit gradient exchange: one launch per step instead of a few dozen.

Imported lazily by :mod:`distamp.kernels.fp8_wire` (``import distamp`` never imports Triton),
which holds the torch reference these kernels reproduce bit for bit and documents the numbers;
the bounds and the target's bits come from :mod:`distamp.kernels.fp8_numbers`, and nothing from
the reference is imported here, so the dependency runs one way.

Layout. A bucket is ``rows`` chunks of ``chunk`` fp32 values (``chunk`` any size: a program
covers ``ROWS`` chunks of ``next_power_of_2(chunk)`` lanes, the tail masked). Each program
computes its chunks' scales from their amax on the spot, from the bits: no scale vector is
materialised and none is read twice.

Bit-exactness. Scales are powers of two built from integer exponents, so multiplying by a scale
or by its reciprocal is exact (or, into fp32's subnormals, rounded once as torch's division
rounds); the float8 cast and its inverse work on the integer bits (round to nearest even, e4m3fn
saturating at 448, e5m2 overflowing to inf, NaN kept), because Triton's own float8 conversion
rounds differently under the interpreter; the world's shards are summed in fp64, where the sum
of float8 values is exact in any order; the one non-power-of-two factor (``scale / divisor``)
is an IEEE division (``div_rn``), as torch's. Kernels compile with ``enable_fp_fusion=False``:
a fused multiply-add would round once where torch rounds twice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from distamp.kernels.fp8_numbers import LOG2_MAX, LOG2_MIN, target_parts

__all__ = ["chunk_amax", "dequantise", "quantise", "sum_shards"]

_ELEMENTS = 4096  # values per program: ROWS chunks of the padded chunk width
# Triton kernels read module globals only as constexprs.
_K_MIN = tl.constexpr(LOG2_MIN)
_K_MAX = tl.constexpr(LOG2_MAX)
# format -> (exponent bits, mantissa bits, bias, largest finite code, code of an overflow)
_FORMATS = {
    torch.float8_e4m3fn: (4, 3, 7, 0x7E, 0x7E),  # saturates: inf and 1000 become 448
    torch.float8_e5m2: (5, 2, 15, 0x7B, 0x7C),  # overflows to inf
}


@triton.jit
def _scale_exponent(amax, SIG_T: tl.constexpr, EXP_T: tl.constexpr):
    """Per chunk: ``(k, ok)``, the largest ``k`` in [LOG2_MIN, LOG2_MAX] with
    ``amax * 2**k <= SIG_T * 2**EXP_T``, and whether amax is positive and finite."""
    bits = amax.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # A subnormal amax is normalised through an exact int -> float conversion of its mantissa.
    sub = mant.to(tl.float32).to(tl.int32, bitcast=True)
    sig = tl.where(e > 0, mant, sub & 0x7FFFFF) | 0x800000
    p = tl.where(e > 0, e - 150, ((sub >> 23) & 0xFF) - 299)  # amax == sig * 2**p
    k = EXP_T - p - (sig > SIG_T).to(tl.int32)
    k = tl.minimum(tl.maximum(k, _K_MIN), _K_MAX)
    ok = (bits > 0) & (e < 255)
    return k, ok


@triton.jit
def _pow2(k):
    """``2**k`` for integer ``k`` in [-126, 127], built from its exponent bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to_fp8(
    y,
    EXP_BITS: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    OVER_CODE: tl.constexpr,
):
    """fp32 -> float8 code (int32 in [0, 255]), rounding to nearest even as torch does."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    nan = mag > 0x7F800000
    mag = tl.minimum(mag, 0x7F800000)  # inf stays in range of the rounding add below
    odd = (mag >> (23 - MANT)) & 1  # the last mantissa bit kept: ties go to even
    normal = ((mag + ((1 << (22 - MANT)) - 1) + odd) >> (23 - MANT)) - ((127 - BIAS) << MANT)
    # below the smallest normal: the value in units of the smallest subnormal, rounded to even
    e = mag >> 23
    sig = tl.where(e > 0, (mag & 0x7FFFFF) | 0x800000, mag & 0x7FFFFF)
    shift = tl.minimum(151 - BIAS - MANT - tl.maximum(e, 1), 25)
    q = sig >> shift
    rem = sig - (q << shift)
    half = (1 << shift) >> 1
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(e >= 128 - BIAS, normal, q)
    code = tl.where(code > MAX_CODE, OVER_CODE, code)
    code = tl.where(nan, 0x7F, code)
    return code | sign


@triton.jit
def _from_fp8(
    code,
    EXP_BITS: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NAN_MANT: tl.constexpr,
    SUB: tl.constexpr,
):
    """float8 code (int32) -> fp32, exactly. ``NAN_MANT``: the all-ones exponent's mantissa
    that means NaN in e4m3fn (7); e5m2 (-1) has inf there for mantissa 0, NaN otherwise.
    ``SUB``: the smallest subnormal, ``2**(1 - BIAS - MANT)``."""
    sign = (code & 0x80) << 24
    e = (code >> MANT) & ((1 << EXP_BITS) - 1)
    m = code & ((1 << MANT) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MANT))
    sub = (m.to(tl.float32) * SUB).to(tl.int32, bitcast=True)
    mag = tl.where(e == 0, sub, normal)
    top = e == (1 << EXP_BITS) - 1
    if NAN_MANT >= 0:
        mag = tl.where(top & (m == NAN_MANT), 0x7FC00000, mag)
    else:
        mag = tl.where(top, tl.where(m == 0, 0x7F800000, 0x7FC00000), mag)
    return (mag | sign).to(tl.float32, bitcast=True)


@triton.jit
def _amax_kernel(x_ptr, out_ptr, rows, chunk, ROWS: tl.constexpr, COLS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    mask = (r[:, None] < rows) & (c[None, :] < chunk)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * chunk + c[None, :], mask=mask, other=0.0)
    a = tl.where(x != x, float("inf"), tl.abs(x))  # NaN counts as inf, as in the reference
    tl.store(out_ptr + r, tl.max(a, axis=1), mask=r < rows)


@triton.jit
def _quantise_kernel(
    x_ptr,
    amax_ptr,
    nonfinite_ptr,
    q_ptr,
    lost_ptr,
    rows,
    chunk,
    SIG_T: tl.constexpr,
    EXP_T: tl.constexpr,
    RESIDUAL: tl.constexpr,
    EXP_BITS: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    OVER_CODE: tl.constexpr,
    NAN_MANT: tl.constexpr,
    SUB: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    mask = (r[:, None] < rows) & (c[None, :] < chunk)
    offsets = r[:, None].to(tl.int64) * chunk + c[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    k, ok = _scale_exponent(tl.load(amax_ptr + r, mask=r < rows, other=0.0), SIG_T, EXP_T)
    scale = tl.where(ok, _pow2(k), 1.0)
    code = _to_fp8(x * scale[:, None], EXP_BITS, MANT, BIAS, MAX_CODE, OVER_CODE)
    tl.store(q_ptr + offsets, code.to(tl.uint8), mask=mask)
    if RESIDUAL:
        inverse = tl.where(ok, _pow2(-k), 1.0)  # q / s, exactly
        lost = x - _from_fp8(code, EXP_BITS, MANT, BIAS, NAN_MANT, SUB) * inverse[:, None]
        lost = tl.where(tl.load(nonfinite_ptr) != 0, 0.0, lost)
        tl.store(lost_ptr + offsets, lost, mask=mask)


@triton.jit
def _sum_kernel(
    recv_ptr,
    amax_ptr,
    nonfinite_ptr,
    out_ptr,
    rows,
    chunk,
    world,
    divisor,
    SIG_T: tl.constexpr,
    EXP_T: tl.constexpr,
    REQUANT: tl.constexpr,
    SIG_T2: tl.constexpr,
    EXP_T2: tl.constexpr,
    EXP_BITS: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    OVER_CODE: tl.constexpr,
    NAN_MANT: tl.constexpr,
    SUB: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    mask = (r[:, None] < rows) & (c[None, :] < chunk)
    offsets = r[:, None].to(tl.int64) * chunk + c[None, :]
    shard = rows * chunk  # a bucket's elements: below 2**31
    acc = tl.zeros((ROWS, COLS), dtype=tl.float64)  # exact: see the module doc
    for w in range(world):
        code = tl.load(recv_ptr + w * shard + offsets, mask=mask, other=0).to(tl.int32)
        acc += _from_fp8(code, EXP_BITS, MANT, BIAS, NAN_MANT, SUB).to(tl.float64)
    amax = tl.load(amax_ptr + r, mask=r < rows, other=0.0)
    k, ok = _scale_exponent(amax, SIG_T, EXP_T)
    inverse = tl.where(ok, _pow2(-k), 1.0).to(tl.float64)
    total = (acc * inverse[:, None]).to(tl.float32)
    total = tl.where(tl.load(nonfinite_ptr) != 0, float("nan"), total)
    if REQUANT:
        k2, ok2 = _scale_exponent(amax, SIG_T2, EXP_T2)
        factor = tl.math.div_rn(tl.where(ok2, _pow2(k2), 1.0), divisor)
        code = _to_fp8(total * factor[:, None], EXP_BITS, MANT, BIAS, MAX_CODE, OVER_CODE)
        tl.store(out_ptr + offsets, code.to(tl.uint8), mask=mask)
    else:
        tl.store(out_ptr + offsets, total, mask=mask)


@triton.jit
def _dequantise_kernel(
    q_ptr,
    amax_ptr,
    out_ptr,
    rows,
    chunk,
    SIG_T: tl.constexpr,
    EXP_T: tl.constexpr,
    EXP_BITS: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    NAN_MANT: tl.constexpr,
    SUB: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    mask = (r[:, None] < rows) & (c[None, :] < chunk)
    offsets = r[:, None].to(tl.int64) * chunk + c[None, :]
    code = tl.load(q_ptr + offsets, mask=mask, other=0).to(tl.int32)
    k, ok = _scale_exponent(tl.load(amax_ptr + r, mask=r < rows, other=0.0), SIG_T, EXP_T)
    inverse = tl.where(ok, _pow2(-k), 1.0)
    tl.store(
        out_ptr + offsets,
        _from_fp8(code, EXP_BITS, MANT, BIAS, NAN_MANT, SUB) * inverse[:, None],
        mask=mask,
    )


def _shape(rows: int, chunk: int) -> tuple[tuple[int], dict[str, int]]:
    cols = triton.next_power_of_2(max(chunk, 1))
    per = max(1, _ELEMENTS // cols)
    return (triton.cdiv(rows, per),), {"ROWS": per, "COLS": cols}


def _format(dtype: torch.dtype) -> dict[str, int | float]:
    if dtype not in _FORMATS:
        raise ValueError(f"fp8 exchange kernels take {sorted(map(str, _FORMATS))}, got {dtype}")
    exp_bits, mant, bias, max_code, over = _FORMATS[dtype]
    return {
        "EXP_BITS": exp_bits,
        "MANT": mant,
        "BIAS": bias,
        "MAX_CODE": max_code,
        "OVER_CODE": over,
        "NAN_MANT": 7 if dtype == torch.float8_e4m3fn else -1,
        "SUB": 2.0 ** (1 - bias - mant),
    }


def _target(target: float, suffix: str = "") -> dict[str, int]:
    sig, exp = target_parts(target)
    return {f"SIG_T{suffix}": sig, f"EXP_T{suffix}": exp}


def _flag(nonfinite: torch.Tensor) -> torch.Tensor:
    return nonfinite.reshape(1).view(torch.uint8)


_OPTIONS = {"enable_fp_fusion": False}  # no fused multiply-add: torch rounds every op


def chunk_amax(chunks: torch.Tensor) -> torch.Tensor:
    """:func:`distamp.kernels.fp8_wire.chunk_amax` in one launch (``chunks``: contiguous
    ``[rows, chunk]`` fp32)."""
    rows, chunk = chunks.shape
    out = torch.empty(rows, dtype=torch.float32, device=chunks.device)
    grid, shape = _shape(rows, chunk)
    _amax_kernel[grid](chunks.contiguous(), out, rows, chunk, **shape)
    return out


def quantise(
    chunks: torch.Tensor,
    amax: torch.Tensor,
    target: float,
    dtype: torch.dtype,
    nonfinite: torch.Tensor,
    residual: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`distamp.kernels.fp8_wire.quantise` in one launch."""
    rows, chunk = chunks.shape
    q = torch.empty((rows, chunk), dtype=torch.uint8, device=chunks.device)
    lost = torch.empty(rows * chunk, dtype=torch.float32, device=chunks.device) if residual else q
    grid, shape = _shape(rows, chunk)
    _quantise_kernel[grid](
        chunks.contiguous(),
        amax.contiguous(),
        _flag(nonfinite),
        q,
        lost,
        rows,
        chunk,
        **_target(target),
        RESIDUAL=residual,
        **_format(dtype),
        **shape,
        **_OPTIONS,
    )
    return q, (lost if residual else None)


def sum_shards(
    received: torch.Tensor,
    amax: torch.Tensor,
    target: float,
    dtype: torch.dtype,
    nonfinite: torch.Tensor,
    world: int,
    requantise: tuple[float, float] | None,
) -> torch.Tensor:
    """:func:`distamp.kernels.fp8_wire.sum_shards` in one launch."""
    rows = amax.numel()
    chunk = received.numel() // (world * rows)
    requant = requantise is not None
    out = torch.empty(
        (rows, chunk), dtype=torch.uint8 if requant else torch.float32, device=received.device
    )
    target2, divisor = requantise if requantise is not None else (target, 1.0)
    grid, shape = _shape(rows, chunk)
    _sum_kernel[grid](
        received.contiguous(),
        amax.contiguous(),
        _flag(nonfinite),
        out,
        rows,
        chunk,
        world,
        float(divisor),
        **_target(target),
        REQUANT=requant,
        **_target(target2, "2"),
        **_format(dtype),
        **shape,
        **_OPTIONS,
    )
    return out


def dequantise(
    data: torch.Tensor, amax: torch.Tensor, target: float, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`distamp.kernels.fp8_wire.dequantise` in one launch."""
    rows = amax.numel()
    chunk = data.numel() // rows
    out = torch.empty(data.numel(), dtype=torch.float32, device=data.device)
    fmt = {k: v for k, v in _format(dtype).items() if k not in ("MAX_CODE", "OVER_CODE")}
    grid, shape = _shape(rows, chunk)
    _dequantise_kernel[grid](
        data.contiguous(),
        amax.contiguous(),
        out,
        rows,
        chunk,
        **_target(target),
        **fmt,
        **shape,
        **_OPTIONS,
    )
    return out
