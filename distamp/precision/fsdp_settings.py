"""FSDP's mixed-precision settings, built in one place for FSDP1 and FSDP2, with or without an
:class:`~distamp.precision.policy.AutocastPolicy`.

When FSDP owns mixed precision (:func:`distamp.precision.policy.select_mp_owner`), every unit
gathers its parameters in the compute dtype and reduces gradients in ``reduce_dtype`` (fp32 by
default, so that the loss scaler sees fp32 gradients and an fp16 reduction cannot overflow);
floating buffers (BatchNorm's running statistics) stay fp32, since they accumulate over steps.
An fp32 module of a policy is a unit of its own that gathers, computes and reduces in fp32; under
FSDP1 it may cast its forward inputs to fp32 itself (FSDP1 casts only at the root by default).
The strategies (:mod:`distamp.parallel.fsdp`), the policy and the Lightning FSDP plug-in all ask
:func:`fsdp_mixed_precision`, so the two FSDP versions and the plug-ins cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["fsdp_mixed_precision"]


def fsdp_mixed_precision(
    version: Literal[1, 2],
    compute_dtype: torch.dtype | None,
    *,
    reduce_dtype: torch.dtype = torch.float32,
    fp32: bool = False,
    cast_inputs: bool = False,
) -> Any:
    """FSDP1's ``MixedPrecision`` or FSDP2's ``MixedPrecisionPolicy`` for one unit.

    Args:
        version: 1 for ``FullyShardedDataParallel``, 2 for ``fully_shard``.
        compute_dtype: the dtype parameters are gathered (and matmuls run) in; ``None`` is fp32.
        reduce_dtype: the dtype gradients are reduced in (an fp32 unit reduces in fp32).
        fp32: the unit of a module the policy keeps in fp32: gathered, computed and reduced in
            fp32.
        cast_inputs: FSDP1, fp32 units only: cast the unit's floating forward inputs to fp32.
    """
    if fp32 or compute_dtype is None:
        compute_dtype = reduce_dtype = torch.float32
    else:
        cast_inputs = False
    if version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(
        param_dtype=compute_dtype,
        reduce_dtype=reduce_dtype,
        buffer_dtype=torch.float32,  # running statistics accumulate over steps
        cast_forward_inputs=cast_inputs,
    )
