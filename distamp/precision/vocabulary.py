"""The precision vocabulary: parsing every spelling of a training precision, and the one place
that decides who owns mixed precision.

Frameworks spell the same training precisions a dozen ways ("16-mixed", "fp16",
``torch.float16``, Accelerate's "no"). :func:`parse_precision` folds every spelling into one small
:class:`Precision` value so that nothing downstream compares strings. :func:`select_mp_owner` is
the only function that branches on (precision, strategy, device) to choose between autocast and
FSDP's own mixed-precision policy; the engine and the strategies ask it instead of re-deriving it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from distamp.arguments import integer_or_none

__all__ = [
    "VALID_PRECISIONS",
    "MPOwner",
    "Precision",
    "PrecisionLike",
    "parse_precision",
    "select_mp_owner",
]

MPOwner = Literal["none", "autocast", "fsdp"]
"""Who casts to the compute dtype: nobody (fp32), ``torch.autocast``, or FSDP's policy."""


@dataclass(frozen=True)
class Precision:
    """A parsed training precision.

    Attributes:
        name: the canonical name: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        compute_dtype: the dtype matmuls run in, or ``None`` for full fp32 (no casting at all).
        needs_scaler: whether gradients need loss scaling. Only fp16 does: its 5-bit exponent
            underflows small gradients, while bf16 shares fp32's exponent range (fp8 keeps its
            gradients in bf16/fp32 and scales each float8 operand itself, per tensor or row).
        float8_linears: the Linear layers the policy selects run in float8 (torchao, see
            :mod:`distamp.precision.fp8`); everything else computes in ``compute_dtype`` (bf16).
    """

    name: str
    compute_dtype: torch.dtype | None
    needs_scaler: bool
    float8_linears: bool = False

    def __str__(self) -> str:
        return self.name


_FP32 = Precision("fp32", None, False)
_FP16 = Precision("fp16", torch.float16, True)
_BF16 = Precision("bf16", torch.bfloat16, False)
_FP8 = Precision("fp8", torch.bfloat16, False, float8_linears=True)

# Lower-case spelling -> precision. Lightning's names ("16-mixed", "bf16-mixed", "32-true", and the
# legacy integers), Accelerate's ("no", "fp16", "bf16"), and torch's dtype names.
_SPELLINGS: dict[str, Precision] = {
    **dict.fromkeys(("fp32", "32", "32-true", "no", "float32", "float", "full"), _FP32),
    **dict.fromkeys(("fp16", "16", "16-mixed", "fp16-mixed", "float16", "half"), _FP16),
    **dict.fromkeys(("bf16", "bf16-mixed", "bfloat16", "bfloat16-mixed"), _BF16),
    **dict.fromkeys(("fp8", "float8", "fp8-mixed"), _FP8),
}
_DTYPES: dict[torch.dtype, Precision] = {
    torch.float32: _FP32,
    torch.float16: _FP16,
    torch.bfloat16: _BF16,
}
VALID_PRECISIONS: tuple[str, ...] = tuple(_SPELLINGS)

PrecisionLike = Precision | str | int | torch.dtype
"""What :func:`parse_precision` accepts."""


def parse_precision(value: PrecisionLike | Any) -> Precision:
    """Turn any accepted spelling of a training precision into a :class:`Precision`.

    Args:
        value: a :class:`Precision`, a string (case-insensitive: ``"fp16"``, ``"16-mixed"``,
            ``"bf16-mixed"``, ``"32-true"``, ``"no"``, ``"fp8"``, ...), the integers
            ``16``/``32``, or one of ``torch.float16``, ``torch.bfloat16``, ``torch.float32``.
            A float8 dtype is not a training precision (parameters and most ops stay
            fp32/bf16): spell it ``"fp8"``.

    Raises:
        ValueError: the value is not a precision; the message echoes it and lists the valid ones.
            "bf16-true"/"16-true" (parameters themselves in low precision, no master) are refused
            on purpose, naming ``weights=WeightPrecision(...)``, which keeps an exact master:
            distamp keeps parameters in fp32 and casts per op.
    """
    if isinstance(value, Precision):
        return value
    if isinstance(value, torch.dtype):
        if value in _DTYPES:
            return _DTYPES[value]
    elif integer_or_none(value) is not None and str(integer_or_none(value)) in _SPELLINGS:
        return _SPELLINGS[str(integer_or_none(value))]
    elif isinstance(value, str) and value.strip().lower() in _SPELLINGS:
        return _SPELLINGS[value.strip().lower()]
    if isinstance(value, str) and value.strip().lower() in ("bf16-true", "16-true"):
        dtype = "bf16" if value.strip().lower().startswith("bf16") else "fp16"
        raise ValueError(
            f"precision={value!r}: 16-bit weights alone drop every update smaller than their "
            f"mantissa resolves. Keep them with an exact master instead: precision={dtype!r} "
            f"with weights=distamp.WeightPrecision({dtype!r}) (DistAMP), or "
            "distamp.master_weights(model, optimizer) in a loop of your own. Valid values: "
            f"{', '.join(repr(s) for s in VALID_PRECISIONS)}."
        )
    raise ValueError(
        f"precision={value!r} is not a training precision distamp knows. Valid values: "
        f"{', '.join(repr(s) for s in VALID_PRECISIONS)}, or torch.float32/float16/bfloat16."
    )


def select_mp_owner(precision: Precision, strategy: str, device_type: str) -> MPOwner:
    """Decide who casts to the compute dtype: autocast, FSDP's policy, or nobody.

    The order of the checks is the decision:

    1. fp32 has nothing to cast: ``"none"``.
    2. FSDP (1 or 2) on CUDA: ``"fsdp"``. FSDP's policy casts the *sharded* parameters once before
       the all-gather, so the gather moves half the bytes and every forward reuses the cast copy;
       autocast would gather fp32 and re-cast each weight at every op. Gradients are still
       reduced in fp32 (the strategies set ``reduce_dtype``), so the scaler sees fp32 grads.
    3. Everything else, CPU FSDP included: ``"autocast"``. On CPU the gather is a memcpy and
       autocast's per-op rules (fp32 for losses and reductions) are the better numerics.

    Args:
        precision: a parsed precision.
        strategy: the resolved strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"fsdp2"`` or
            ``"hsdp"`` (FSDP2 on a 2-D mesh).
        device_type: the model's device type (``"cpu"``, ``"cuda"``...).
    """
    if precision.compute_dtype is None:
        return "none"
    if strategy in ("fsdp", "fsdp2", "hsdp") and device_type == "cuda":
        return "fsdp"
    return "autocast"
