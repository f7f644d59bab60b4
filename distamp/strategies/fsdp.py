"""Sharded data parallelism: FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``).

Both shard every repeated block of the model on its own and then the root, so at most one block's
parameters are gathered at a time. "Repeated block" means an entry of an ``nn.ModuleList`` — the
convention of transformer implementations — unless the caller names the classes to wrap.

Mixed precision: when :func:`distamp.policy.select_mp_owner` hands it to FSDP, parameters are
gathered in the compute dtype but gradients are always reduced (and kept) in fp32, so the loss
scaler sees fp32 gradients and fp16 reductions cannot overflow.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

__all__ = [
    "apply_fsdp1",
    "apply_fsdp2",
    "fsdp1_mixed_precision",
    "fsdp2_mixed_precision",
    "repeated_blocks",
]


def repeated_blocks(
    model: nn.Module, block_types: Iterable[type[nn.Module]] | None = None
) -> list[nn.Module]:
    """The submodules to shard on their own: instances of ``block_types``, or else every entry
    of every ``nn.ModuleList`` in ``model`` (outermost lists only), in module order."""
    if block_types is not None:
        types = tuple(block_types)
        return [m for m in model.modules() if m is not model and isinstance(m, types)]
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if isinstance(m, nn.ModuleList):
            blocks.extend(m)
            inside.update(id(sub) for sub in m.modules())
    return blocks


def fsdp1_mixed_precision(dtype: torch.dtype) -> torch.distributed.fsdp.MixedPrecision:
    """FSDP1 policy: compute in ``dtype``, reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)


def fsdp2_mixed_precision(dtype: torch.dtype) -> torch.distributed.fsdp.MixedPrecisionPolicy:
    """FSDP2 policy: compute in ``dtype``, reduce gradients in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp1(
    model: nn.Module,
    *,
    device: torch.device,
    mp_policy: torch.distributed.fsdp.MixedPrecision | None = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    block_types: Iterable[type[nn.Module]] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP1: each repeated block is its own FSDP unit, the root the last.

    ``use_orig_params=True`` keeps the original parameter names and shapes visible, which an
    optimizer factory with per-parameter groups and ``torch.distributed.checkpoint`` both need.

    Args:
        model: the module, on ``device`` (CPU with gloo works when ``device`` says so).
        device: this rank's device.
        mp_policy: FSDP1's ``MixedPrecision`` (see :func:`fsdp1_mixed_precision`) or ``None``.
        process_group: the sharding group; ``None`` is the default group.
        block_types: classes to wrap on their own (default: see :func:`repeated_blocks`).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    types = {type(b) for b in repeated_blocks(model, block_types)}
    return FullyShardedDataParallel(
        model,
        process_group=process_group,
        auto_wrap_policy=ModuleWrapPolicy(types) if types else None,
        mixed_precision=mp_policy,
        device_id=device,  # explicit even on CPU: FSDP1 otherwise looks for an accelerator
        use_orig_params=True,
    )


def apply_fsdp2(
    model: nn.Module,
    *,
    mesh: torch.distributed.device_mesh.DeviceMesh,
    mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    block_types: Iterable[type[nn.Module]] | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``fully_shard``): blocks first, then the root.

    The order matters: ``fully_shard`` on the root takes the parameters that no inner call
    claimed, so the blocks must be sharded before it.

    Args:
        model: the module, already on the mesh's device type.
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks. On CPU it must be explicit
            (``init_device_mesh("cpu", (world,))``): FSDP2's default mesh is built for CUDA.
        mp_policy: a ``MixedPrecisionPolicy`` (see :func:`fsdp2_mixed_precision`) or ``None``.
        reshard_after_forward: free gathered parameters after forward (re-gathered in backward);
            ``False`` trades memory for one all-gather per block and step.
        block_types: classes to shard on their own (default: see :func:`repeated_blocks`).

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are DTensors.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in repeated_blocks(model, block_types):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model
