"""Data parallelism with ``DistributedDataParallel``.

A plain keyword-only function, as for every strategy: the engine chooses, this module only wraps.
It also says which of DDP's options users may pass through the engine (:data:`DDP_KWARGS`,
checked by :func:`ddp_options`) and which hooks cannot carry a sparse gradient
(:func:`check_sparse_gradients`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distamp.arguments import INT32_MAX, ArgumentTypeError, as_bool, as_real
from distamp.model_names import named_model_modules

__all__ = ["DDP_KWARGS", "DENSE_BUCKET_HOOKS", "apply_ddp", "check_sparse_gradients", "ddp_options"]

DDP_KWARGS: tuple[str, ...] = (
    "bucket_cap_mb",
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "broadcast_buffers",
)
"""The ``DistributedDataParallel`` options that ``DistAMP(ddp_kwargs=...)`` passes on: a real
``bucket_cap_mb`` in (0, 2**31 - 1] (DDP counts the cap in int64 bytes), the rest ``bool``. The
others the engine sets itself, or has not checked against its scaler and hooks."""

# Why the engine keeps a DDP option to itself: a second value would contradict its own choice.
_ENGINE_OWNED = {
    "module": "the engine wraps the model passed to setup()",
    "device_ids": "the engine places the model on its device (DistAMP(device=...))",
    "output_device": "the engine places the model on its device (DistAMP(device=...))",
    "process_group": "the engine averages over the job's default group",
    "device_mesh": "the engine averages over the job's default group",
    "mixed_precision": "the engine owns the precision (DistAMP(precision=..., policy=...))",
}

DENSE_BUCKET_HOOKS: tuple[str, ...] = ("fp16", "fp8", "fp8-ef", "powersgd")
"""The engine's comm hooks that read a bucket as one dense buffer (see
:func:`check_sparse_gradients`)."""


def ddp_options(given: Any) -> dict[str, Any]:
    """``given`` (``DistAMP(ddp_kwargs=...)``) as a new plain dict of checked values, so that
    later edits of the caller's mapping cannot reach DDP.

    Raises:
        TypeError: ``given`` is not a mapping, or a flag is not a ``bool``.
        ValueError: a key outside :data:`DDP_KWARGS` (why, and the keys allowed), or a
            ``bucket_cap_mb`` that is not a real number in (0, 2**31 - 1].
    """
    if not isinstance(given, Mapping):
        raise ArgumentTypeError(
            f"ddp_kwargs={given!r} ({type(given).__name__}) must be a mapping such as "
            "{'find_unused_parameters': True}, or None"
        )
    options: dict[str, Any] = {}
    for key, value in given.items():
        name = f"ddp_kwargs[{key!r}]"
        if key not in DDP_KWARGS:
            reason = _ENGINE_OWNED.get(key, "the engine does not pass it on")
            raise ValueError(f"{name}: {reason}; the keys it takes are {DDP_KWARGS}")
        if key != "bucket_cap_mb":
            options[key] = as_bool(name, value)
            continue
        try:
            mb = as_real(name, value)
        except ValueError as exc:
            raise ValueError(f"{name}={value!r}: {exc}") from None
        if not 0 < mb <= INT32_MAX:  # DDP keeps the cap as an int64 count of bytes
            raise ValueError(f"{name}={mb!r} must be a number of megabytes in (0, {INT32_MAX}]")
        options[key] = mb
    return options


def check_sparse_gradients(model: nn.Module, comm_hook: str | None) -> None:
    """``ValueError`` when ``comm_hook`` is one of :data:`DENSE_BUCKET_HOOKS` and ``model`` has
    a module that makes sparse gradients (``Embedding``/``EmbeddingBag`` with ``sparse=True``).

    DDP gives each sparse gradient a bucket of its own and hands the hook the sparse tensor.
    The fp16, fp8 and PowerSGD hooks treat it as a dense buffer (a max over it, chunks of it, a
    matrix of it) and fail inside backward (PowerSGD once it starts compressing), after setup.
    The fp32 and bf16 hooks only cast, divide and all-reduce, which sparse tensors support: on
    2 gloo ranks (torch 2.13) they trained to the parameters of DDP without a hook (bf16 within
    its rounding). Checked before wrapping, so nothing is built.
    """
    if comm_hook not in DENSE_BUCKET_HOOKS:
        return
    for name, module in named_model_modules(model):
        sparse = isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse
        if sparse and module.weight.requires_grad:
            raise ValueError(
                f"comm_hook={comm_hook!r} with a sparse gradient: module {name or '<root>'!r} "
                f"({type(module).__name__}(sparse=True)) gives parameter "
                f"{(name + '.' if name else '') + 'weight'!r} a sparse gradient, and the "
                f"{comm_hook!r} hook compresses dense buckets only; build the module with "
                "sparse=False, or use comm_hook='fp32', 'bf16' or None"
            )


def apply_ddp(
    model: nn.Module,
    *,
    device: torch.device,
    process_group: torch.distributed.ProcessGroup | None = None,
    bucket_cap_mb: float | None = None,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = True,
    static_graph: bool = False,
    broadcast_buffers: bool | None = None,
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
        static_graph: DDP's promise that the same parameters are used in every iteration,
            which lets it skip the unused-parameter search after the first one.
        broadcast_buffers: whether to copy rank 0's buffers (e.g. batch-norm statistics) to
            every rank at each forward; ``None``: DDP's default (yes).

    Returns:
        The ``DistributedDataParallel`` module. Its ``no_sync()`` is what the engine's
        ``accumulate()`` uses on micro-batches that must not all-reduce.
    """
    device_ids = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else None
    )
    # Passed only when set: torch 2.13 warns that the name is deprecated, whatever its value.
    buffers: dict[str, Any] = (
        {} if broadcast_buffers is None else {"broadcast_buffers": broadcast_buffers}
    )
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        **buffers,
    )
