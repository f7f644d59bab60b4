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
"""

from __future__ import annotations

import torch

__all__ = ["join_remainder", "round_nearest_bf16", "round_stochastic", "split_remainder"]

_HALF = 0x8000  # half a bf16 step, in fp32 bit units


def split_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight, remainder)``: the bf16 nearest to the fp32 ``master`` (ties away from zero)
    and the int16 that restores ``master`` exactly (:func:`join_remainder`).

    Non-finite masters are never split (a step that made one is skipped on every rank)."""
    if master.dtype != torch.float32:
        raise TypeError(f"split_remainder: the master must be float32, got {master.dtype}")
    bits = master.contiguous().view(torch.int32)
    # The sign is the top bit, so adding half a step to the bit pattern rounds the magnitude.
    high = torch.bitwise_right_shift(bits + _HALF, 16)
    # bits - (high << 16) has the low 16 bits of ``bits`` and lies in [-32768, 32767]: the
    # int16 those bits read as, which the wrapping cast gives in one pass.
    return high.to(torch.int16).view(torch.bfloat16), bits.to(torch.int16)


def join_remainder(weight: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The fp32 master that :func:`split_remainder` split into ``weight`` and ``remainder``: a
    new tensor (the weight's int16 bits, sign-extended, shifted up, plus the remainder)."""
    high = weight.contiguous().view(torch.int16).to(torch.int32)
    return (torch.bitwise_left_shift(high, 16) + remainder.to(torch.int32)).view(torch.float32)


def round_nearest_bf16(master: torch.Tensor) -> torch.Tensor:
    """The weight :func:`split_remainder` would store, without the remainder."""
    return split_remainder(master)[0]


def round_stochastic(master: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``master`` (fp32) rounded to bf16 up or down with probabilities in proportion to the
    distance, so that the expectation is ``master`` (torchao's ``bf16_stochastic_round``).

    A value that is already a bf16 comes back unchanged: its low 16 bits are zero, and no
    random number below 65,536 carries into the upper half. The random draw comes from
    ``generator`` (seeded alike on every rank, a replica's weights stay identical).
    """
    bits = master.contiguous().view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator
    )
    high = torch.bitwise_right_shift(bits + noise, 16)
    return high.to(torch.int16).view(torch.bfloat16)
