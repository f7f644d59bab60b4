"""What a training precision requires of the policy and the model it is given: one rule each,
for the engine and every plug-in, checked before anything trains.

- The policy's precision is the trainer's (:func:`check_policy_precision`). A policy's
  ``autocast`` casts to its own compute dtype, whatever the trainer was told: an fp16 policy
  inside a bf16 (or fp32) trainer computes in fp16 under a check-only scaler (or none), so no
  loss is scaled and small gradients flush to zero without a word; a bf16 policy inside an fp16
  trainer scales a loss that never needed it, and the checkpoints say fp16.
- The parameters stay fp32 master weights (:func:`check_parameter_dtypes`); autocast casts them
  per op. fp16 parameters (``model.half()``) have fp16 gradients; the scaler refuses to step
  them (:mod:`distamp.scaler.master_dtypes`), at the first step, after a forward and a backward
  ran; the check-only scaler of bf16/fp32 refuses them alike, and a parameter cast to 16 bits
  after setup at any step. bf16 parameters train
  under bf16 (a choice some make), but under fp16 loss scaling they undo what the scaling is
  for: an update smaller than bf16's 8-bit mantissa resolves is lost in the weight itself.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distamp.precision.policy import Precision

__all__ = ["check_parameter_dtypes", "check_policy_precision"]


def check_policy_precision(policy: Any, precision: Precision, *, given: str) -> None:
    """Refuse a policy whose precision is not the trainer's (see the module doc).

    Args:
        policy: an :class:`~distamp.AutocastPolicy`, or any object; only one whose
            ``precision`` is a :class:`~distamp.precision.policy.Precision` is checked (a
            plug-in also takes objects of its own with ``apply`` and ``autocast``).
        precision: the precision the trainer was given.
        given: how the caller was given it, for the message (``"precision='bf16'"``,
            ``"mixed_precision='bf16'"``...).

    Raises:
        ValueError: naming both and the fix.
    """
    own = getattr(policy, "precision", None)
    if not isinstance(own, Precision) or own == precision:
        return
    if own.needs_scaler and not precision.needs_scaler:
        effect = "fp16 compute with no loss scaling: small gradients would flush to zero unseen"
    else:
        effect = f"{own.name} compute, while the scaler and the checkpoints are set for {precision}"
    short = policy.short() if hasattr(policy, "short") else type(policy).__name__
    raise ValueError(
        f"the policy is for {own.name}, but {given} trains in {precision.name}: pass the same "
        f"precision to both (its autocast would give {effect}; policy: {short})"
    )


def check_parameter_dtypes(model: nn.Module, precision: Precision, *, owner: str) -> None:
    """Refuse trainable parameters in fp16 (any precision), or in bf16 under fp16 loss scaling
    (see the module doc). Reads dtypes only: no sync.

    Raises:
        ValueError: naming ``owner``, how many parameters, a few of their names, and the fix.
    """
    refused = (torch.float16, torch.bfloat16) if precision.needs_scaler else (torch.float16,)
    found = [
        (name, p.dtype)
        for name, p in model.named_parameters()
        if p.requires_grad and p.dtype in refused
    ]
    if not found:
        return
    dtype = found[0][1]
    names = ", ".join(repr(n) for n, _ in found[:3]) + (", ..." if len(found) > 3 else "")
    why = (
        "their gradients would be fp16 too, which no scaler unscales (torch fails at the first "
        "step: 'Attempting to unscale FP16 gradients')"
        if dtype == torch.float16
        else "a bf16 weight drops the small updates that the loss scaling is there to keep"
    )
    raise ValueError(
        f"{owner}: {len(found)} trainable parameters are {dtype} ({names}) with "
        f"precision={precision.name!r}: {why}. Keep the master weights in fp32 (drop "
        f"model.half() / .to({dtype})): autocast casts them per op to the compute dtype; for "
        "16-bit weights (half the memory) keep them with an exact master: "
        "weights=distamp.WeightPrecision(...) (DistAMP) or distamp.master_weights"
    )
