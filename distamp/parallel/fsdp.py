"""Sharded data parallelism: FSDP1 (``FullyShardedDataParallel``) and FSDP2 (``fully_shard``).

Both shard every repeated block of the model on its own and then the root, so at most one block's
parameters are gathered at a time. "Repeated block" means an entry of an ``nn.ModuleList`` — the
convention of transformer implementations — unless the caller names the classes to wrap.

Mixed precision: when :func:`distamp.precision.policy.select_mp_owner` hands it to FSDP,
parameters are gathered in the compute dtype but gradients are always reduced (and kept) in
fp32, so the loss scaler sees fp32 gradients and fp16 reductions cannot overflow. With an
:class:`~distamp.precision.policy.AutocastPolicy`, the policy decides instead, on every device:
its fp32 modules become units of their own gathered, computed and reduced in fp32, every other
unit is gathered in the compute dtype and reduced in the policy's ``reduce_dtype``. Both come
from :func:`distamp.precision.fsdp_settings.fsdp_mixed_precision`.

HSDP is FSDP2 on a 2-D mesh (replicate x shard): parameters are sharded within a shard group and
replicated across groups; :func:`hsdp_mesh` builds the mesh.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from distamp.precision.fsdp_settings import fsdp_mixed_precision
from distamp.precision.policy import AutocastPolicy

__all__ = [
    "apply_fsdp1",
    "apply_fsdp2",
    "fsdp1_mixed_precision",
    "fsdp2_mixed_precision",
    "hsdp_mesh",
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
    """FSDP1 without a policy: compute in ``dtype``, reduce gradients in fp32, buffers fp32
    (:func:`~distamp.precision.fsdp_settings.fsdp_mixed_precision`)."""
    return fsdp_mixed_precision(1, dtype)


def fsdp2_mixed_precision(dtype: torch.dtype) -> torch.distributed.fsdp.MixedPrecisionPolicy:
    """FSDP2 without a policy: compute in ``dtype``, reduce gradients in fp32
    (:func:`~distamp.precision.fsdp_settings.fsdp_mixed_precision`)."""
    return fsdp_mixed_precision(2, dtype)


def apply_fsdp1(
    model: nn.Module,
    *,
    device: torch.device,
    mp_policy: torch.distributed.fsdp.MixedPrecision | None = None,
    process_group: torch.distributed.ProcessGroup | None = None,
    block_types: Iterable[type[nn.Module]] | None = None,
    precision_policy: AutocastPolicy | None = None,
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
        precision_policy: overrides ``mp_policy``: fp32 modules (with parameters) become their
            own units with an fp32 ``MixedPrecision``; the rest follows the policy's dtypes.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    types = {type(b) for b in repeated_blocks(model, block_types)}
    wrap: Any = ModuleWrapPolicy(types) if types else None
    if precision_policy is not None:
        fp32_ids = {id(m) for _, m in _fp32_units(model, precision_policy)}
        fp32_mp = precision_policy.fsdp1_policy(fp32=True)
        mp_policy = precision_policy.fsdp1_policy()

        def unit(module: nn.Module) -> bool | dict[str, Any]:
            if id(module) in fp32_ids:
                return {"mixed_precision": fp32_mp}
            return isinstance(module, tuple(types))

        wrap = CustomPolicy(unit)
    return FullyShardedDataParallel(
        model,
        process_group=process_group,
        auto_wrap_policy=wrap,
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
    precision_policy: AutocastPolicy | None = None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 (``fully_shard``): blocks first, then the root.

    The order matters: ``fully_shard`` on the root takes the parameters that no inner call
    claimed, so the blocks must be sharded before it.

    Args:
        model: the module, already on the mesh's device type.
        mesh: a 1-D ``DeviceMesh`` over the data-parallel ranks, or a 2-D one
            (replicate x shard, :func:`hsdp_mesh`) for HSDP. On CPU it must be explicit
            (``init_device_mesh("cpu", (world,))``): FSDP2's default mesh is built for CUDA.
        mp_policy: a ``MixedPrecisionPolicy`` (see :func:`fsdp2_mixed_precision`) or ``None``.
        reshard_after_forward: free gathered parameters after forward (re-gathered in backward);
            ``False`` trades memory for one all-gather per block and step.
        block_types: classes to shard on their own (default: see :func:`repeated_blocks`).
        precision_policy: overrides ``mp_policy``: each fp32 module (with parameters) is
            sharded first as its own unit with an fp32 ``MixedPrecisionPolicy``; blocks and the
            root follow the policy's compute and reduce dtypes.

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are DTensors.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if precision_policy is not None:
        policy = precision_policy.fsdp2_policy()
        fp32_policy = precision_policy.fsdp2_policy(fp32=True)
        # Innermost first: fully_shard on an outer module claims only parameters not yet taken.
        for _, module in _fp32_units(model, precision_policy):
            fully_shard(module, mesh=mesh, mp_policy=fp32_policy, reshard_after_forward=False)
    for block in repeated_blocks(model, block_types):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def _fp32_units(model: nn.Module, policy: AutocastPolicy) -> list[tuple[str, nn.Module]]:
    """The policy's fp32 modules that own parameters (a parameter-less module needs no unit)."""
    return [
        (name, m)
        for name, m in policy.fp32_modules_of(model)
        if m is not model and any(True for _ in m.parameters())
    ]


def hsdp_mesh(
    device_type: str, world_size: int, shard_size: int | None = None
) -> torch.distributed.device_mesh.DeviceMesh:
    """The 2-D ``DeviceMesh`` of HSDP: ``(world_size // shard_size, shard_size)``, dimensions
    named ``("replicate", "shard")``.

    Args:
        device_type: ``"cuda"`` or ``"cpu"`` (CPU needs the explicit mesh; gloo carries it).
        world_size: ranks in the job.
        shard_size: ranks per shard group. ``None``: the ranks of one node (``LOCAL_WORLD_SIZE``),
            the usual layout (sharding traffic stays on the fast intra-node links, only the
            replica all-reduce crosses nodes).

    Raises:
        ValueError: the shard size does not divide the world, or cannot be inferred.
    """
    import os

    from torch.distributed.device_mesh import init_device_mesh

    if shard_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if not local.isdigit() or int(local) in (0, world_size):
            raise ValueError(
                f"strategy='hsdp': cannot infer the shard size (LOCAL_WORLD_SIZE={local or None}, "
                f"world size {world_size}): one node is plain FSDP; pass hsdp_shard_size=N with "
                "N dividing the world size"
            )
        shard_size = int(local)
    if (
        isinstance(shard_size, bool)
        or not isinstance(shard_size, int)
        or shard_size < 1
        or world_size % shard_size
    ):
        raise ValueError(
            f"hsdp_shard_size={shard_size!r} must be a positive divisor of the world size "
            f"{world_size}"
        )
    return init_device_mesh(
        device_type,
        (world_size // shard_size, shard_size),
        mesh_dim_names=("replicate", "shard"),
    )
