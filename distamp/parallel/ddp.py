"""Data parallelism with ``DistributedDataParallel``.

A plain keyword-only function, as for every strategy: the engine chooses, this module only wraps.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["apply_ddp"]


def apply_ddp(
    model: nn.Module,
    *,
    device: torch.device,
    process_group: torch.distributed.ProcessGroup | None = None,
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = True,
) -> DistributedDataParallel:
    """Wrap ``model`` (already on ``device``) for data-parallel training.

    Args:
        model: the module to replicate; its parameters must already live on ``device``.
        device: this rank's device. CUDA gets ``device_ids=[index]`` (one device per process);
            CPU gets ``None``, as DDP requires for CPU modules.
        process_group: the replicas' group; ``None`` is the default group.
        bucket_cap_mb: DDP's bucket size (``None``: torch's default, 25 MB).
        find_unused_parameters: set for models whose forward skips parameters; it costs a graph
            traversal every step, so it is off by default.
        gradient_as_bucket_view: gradients alias DDP's communication buckets, which saves one
            gradient-sized copy per step and the memory of a second gradient set. The scaler
            unscales in place, so the alias is harmless.

    Returns:
        The ``DistributedDataParallel`` module. Its ``no_sync()`` is what the engine's
        ``accumulate()`` uses on micro-batches that must not all-reduce.
    """
    device_ids = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else None
    )
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
