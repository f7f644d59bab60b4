"""fp32 values as a 16-bit weight plus what the 16 bits lost: the arithmetic of the master.

A bf16 number is the upper half of an fp32 number's bits. Rounding an fp32 master ``x`` to the
nearest bf16 ``h`` (ties away from zero) leaves a remainder ``r = bits(x) - bits(h) << 16`` in
``[-32768, 32767]``: an int16. ``h`` and ``r`` together ARE ``x``, bit for bit, at 2 bytes beside
the weight instead of 4 (the remainder scheme of TransformerEngine's FusedAdam
``store_param_remainders`` and Megatron-core's precision-aware optimizer).

Ties round away from zero rather than to even, so that every remainder fits an int16: with ties
to even, ``+32768`` (a tie rounded down to an even ``h``) and ``-32768`` (a tie rounded up to an
even ``h``) would both be needed. The weight then differs from torch's round-to-nearest-even cast
of the same master on exact ties only (one value in 65,536).

fp16 is not a truncation of fp32, so an fp16 weight keeps a full fp32 master instead
(:mod:`distamp.optim.master`). Stochastic rounding (:func:`round_stochastic`) keeps no master at
all: it rounds up with the probability of the dropped fraction, so updates smaller than a bf16
step survive in expectation.

Every operation here is integer arithmetic on bit patterns, exact whatever its formulation. The
optimizer's step calls the in-place forms (:func:`join_remainder` with ``out``,
:func:`split_remainder_`, :func:`round_nearest_bf16_`, :func:`round_stochastic_`): they write
into buffers the step reuses from chunk to chunk and into the weight and remainder themselves,
with no temporary (a join is two passes, a split four), where a tensor allocated per pass (as
the old eager formulation did) costs as much again in page faults on the CPU. A
``torch.compile``'d kernel doing each in one pass measured no faster than these in-place passes
on the CPU (torch 2.13) and costs 15 to 20 s at its first call, so there is none.
"""

from __future__ import annotations

import torch

from distamp.optim.draws import Draws

__all__ = [
    "join_remainder",
    "round_nearest_bf16",
    "round_nearest_bf16_",
    "round_stochastic",
    "round_stochastic_",
    "split_remainder",
    "split_remainder_",
]

_HALF = 0x8000  # half a bf16 step, in fp32 bit units


def _bits(master: torch.Tensor) -> torch.Tensor:
    if master.dtype != torch.float32:
        raise TypeError(f"the master must be float32, got {master.dtype}")
    if not master.is_contiguous():
        raise ValueError("the master must be contiguous (its bits are read as int32)")
    return master.view(torch.int32)


def _work(bits: torch.Tensor, work: torch.Tensor | None) -> torch.Tensor:
    """An int32 buffer shaped like ``bits`` that may be overwritten: ``work`` (any 4-byte
    dtype, read as int32, reshaped), or a new one."""
    if work is None:
        return torch.empty_like(bits)
    if work.numel() != bits.numel() or work.element_size() != 4:
        raise ValueError(
            f"the work buffer must hold {bits.numel()} 4-byte elements, got {work.numel()} "
            f"of {work.dtype}"
        )
    return work.view(torch.int32).view(bits.shape)


def _nearest_(bits: torch.Tensor, into: torch.Tensor, weight: torch.Tensor) -> None:
    """``weight``'s bits: ``(bits + half a step) >> 16``, computed in ``into`` (which may be
    ``bits`` itself). The sign is the top bit, so adding half a step to the bit pattern rounds
    the magnitude, ties away from zero."""
    torch.add(bits, _HALF, out=into).bitwise_right_shift_(16)
    weight.view(torch.int16).copy_(into.view(weight.shape))  # the wrapping int32 -> int16 cast


def split_remainder_(
    master: torch.Tensor,
    weight: torch.Tensor,
    remainder: torch.Tensor,
    work: torch.Tensor | None = None,
) -> None:
    """:func:`split_remainder` written into ``weight`` (bf16) and ``remainder`` (int16), both
    shaped like ``master`` (any strides; ``master`` contiguous). ``work``: a 4-byte buffer of
    ``master``'s size the split may overwrite (``master`` itself when its value is no longer
    needed); ``None``: one is allocated."""
    bits = _bits(master)
    # The low 16 bits of ``bits`` read as an int16 (the wrapping cast) are the remainder: it is
    # ``bits - (high << 16)``, which lies in [-32768, 32767]. Written before ``work`` (which
    # may be ``master``) is overwritten.
    remainder.copy_(bits.view(remainder.shape))
    _nearest_(bits, _work(bits, work), weight)


def split_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, remainder)``: the bf16 nearest to the fp32 ``master`` (ties away from zero)
    and the int16 that restores ``master`` exactly (:func:`join_remainder`).

    Non-finite masters are never split (a step that made one is skipped on every rank)."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_remainder: the master must be float32, got {master.dtype}")
    master = master.contiguous()
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    remainder = torch.empty(master.shape, dtype=torch.int16, device=master.device)
    split_remainder_(master, weight, remainder)
    return weight, remainder


def join_remainder(
    weight: torch.Tensor, remainder: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The fp32 master that :func:`split_remainder` split into ``weight`` and ``remainder``: the
    weight's int16 bits, sign-extended, shifted up, plus the remainder. Written into ``out``
    (fp32, contiguous, the weight's size: the step's reused buffer) and returned; ``None``: a
    new tensor."""
    if out is None:
        out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"join_remainder: the weight must be bfloat16, got {weight.dtype}")
    # Widening a bf16 to fp32 IS the shift of its 16 bits to the top of 32 (exact: every bf16
    # is an fp32), so one copy is the sign extension and the shift; the remainder adds to the
    # bit pattern.
    out = out.view(weight.shape).copy_(weight)
    _bits(out).add_(remainder.view(weight.shape))
    return out


def round_nearest_bf16_(
    master: torch.Tensor, weight: torch.Tensor, work: torch.Tensor | None = None
) -> None:
    """The weight :func:`split_remainder` would store, written into ``weight`` (bf16, shaped
    like ``master``); ``work`` as there."""
    bits = _bits(master)
    _nearest_(bits, _work(bits, work), weight)


def round_nearest_bf16(master: torch.Tensor) -> torch.Tensor:
    """The weight :func:`split_remainder` would store, without the remainder."""
    master = master.contiguous()
    weight = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device)
    round_nearest_bf16_(master, weight)
    return weight


def round_stochastic_(
    master: torch.Tensor,
    out: torch.Tensor,
    generator: torch.Generator | Draws | None,
    work: torch.Tensor | None = None,
) -> None:
    """:func:`round_stochastic` written into ``out`` (bf16, shaped like ``master``), with the
    same random numbers, drawn eagerly: from ``generator`` as :func:`round_stochastic` draws
    them, or from a :class:`~distamp.optim.draws.Draws` (the same stream, drawn faster). ``work``:
    a 4-byte buffer of ``master``'s size the draw may fill, not ``master`` itself (``None``:
    one is allocated where needed)."""
    bits = _bits(master)
    if work is not None and work.data_ptr() == bits.data_ptr():
        raise ValueError("round_stochastic_: the work buffer cannot be the master (it draws)")
    if isinstance(generator, Draws):
        noise = generator.int16_range(bits.shape, work)
    else:
        # One 32-bit draw per element, in order: the stream round_stochastic draws.
        noise = _work(bits, work).random_(0, 1 << 16, generator=generator)
    noise.add_(bits).bitwise_right_shift_(16)
    out.view(torch.int16).copy_(noise.view(out.shape))


def round_stochastic(master: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``master`` (fp32) rounded to bf16 up or down with probabilities in proportion to the
    distance, so that the expectation is ``master`` (torchao's ``bf16_stochastic_round``).

    A value that is already a bf16 comes back unchanged: its low 16 bits are zero, and no
    random number below 65,536 carries into the upper half. The random draw comes from
    ``generator`` (seeded alike on every rank, a replica's weights stay identical).
    """
    master = master.contiguous()
    bits = master.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator
    )
    high = torch.bitwise_right_shift(bits + noise, 16)
    return high.to(torch.int16).view(torch.bfloat16)
