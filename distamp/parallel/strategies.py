"""Parallelization strategies: wrapping and gradient-sync suppression, per wrapper.

Everything here that depends on the wrapper type (DDP, FSDP1, FSDP2) lives in this module, so
the engine never inspects a wrapper itself. The wrap functions are plain keyword-only functions
(:func:`apply_ddp`, :func:`apply_fsdp1`, :func:`apply_fsdp2`); :func:`apply_strategy` picks one;
:func:`wrap_replicas` wraps in torchft's DDP across replica groups (``ft_manager=``).
Loss-scale-aware DDP communication hooks live in :mod:`distamp.parallel.comm_hooks`.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.agreement.replicas import check_torchft_version
from distamp.agreement.topology import is_dtensor
from distamp.cluster import detect_environment, is_distributed
from distamp.model_names import model_name
from distamp.parallel.comm_hooks import COMM_HOOKS, register_comm_hook
from distamp.parallel.ddp import apply_ddp
from distamp.parallel.fsdp import (
    apply_fsdp1,
    apply_fsdp2,
    fsdp1_mixed_precision,
    fsdp2_mixed_precision,
    hsdp_mesh,
)
from distamp.precision.policy import AutocastPolicy

__all__ = [
    "COMM_HOOKS",
    "STRATEGIES",
    "apply_ddp",
    "apply_fsdp1",
    "apply_fsdp2",
    "apply_strategy",
    "gradient_sync_disabled",
    "hsdp_mesh",
    "is_parallelised",
    "rebuild_optimizer",
    "register_comm_hook",
    "resolve_strategy",
    "wrap_replicas",
]

STRATEGIES: tuple[str, ...] = ("auto", "none", "ddp", "fsdp", "fsdp2", "hsdp")
SHARDED: tuple[str, ...] = ("fsdp", "fsdp2", "hsdp")


def is_parallelised(model: nn.Module) -> bool:
    """Whether the user already parallelised ``model``: a DDP or FSDP1 wrapper, an FSDP2 module,
    or DTensor parameters (tensor, expert or data parallelism applied by hand)."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)):
        return True
    return any(is_dtensor(p) for p in model.parameters())


def resolve_strategy(strategy: str, world_size: int, *, parallelised: bool = False) -> str:
    """Turn ``"auto"`` into a concrete strategy: nothing for a model the user already
    parallelised (or for one rank), else DDP.

    Auto never picks FSDP: sharding changes what the optimizer and checkpoints hold, which is a
    choice the user should make knowingly. An explicit strategy on a parallelised model raises
    ``ValueError``: wrapping twice would reduce gradients twice.
    """
    if parallelised and strategy not in ("auto", "none"):
        raise ValueError(
            f"strategy={strategy!r}, but the model is already parallelised (DDP/FSDP wrapper or "
            "DTensor parameters): pass strategy='auto' or 'none' so it is not wrapped again"
        )
    if strategy == "auto":
        return "ddp" if world_size > 1 and not parallelised else "none"
    return strategy


def apply_strategy(
    model: nn.Module,
    *,
    strategy: str,
    device: torch.device,
    fsdp_dtype: torch.dtype | None = None,
    policy: AutocastPolicy | None = None,
    hsdp_shard_size: int | None = None,
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """Wrap ``model`` (already on ``device``) for a resolved ``strategy``.

    Args:
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"fsdp2"`` or ``"hsdp"`` (FSDP2 on a
            2-D replicate x shard mesh, see :func:`distamp.parallel.fsdp.hsdp_mesh`).
        fsdp_dtype: compute dtype for FSDP's own mixed-precision policy, when it owns mixed
            precision (see :func:`distamp.precision.policy.select_mp_owner`); ``None``: no FSDP
            policy.
            Ignored when ``policy`` is given.
        policy: a precision policy; FSDP then gathers each unit in the policy's dtypes, fp32
            modules in their own fp32 units (on every device: the policy owns the dtypes).
        hsdp_shard_size: ranks per shard group for ``"hsdp"``.
        ddp_kwargs: keyword arguments of :func:`apply_ddp` for ``"ddp"`` (checked by
            :func:`~distamp.parallel.ddp.ddp_options`); ignored by the other strategies.

    Raises:
        ValueError: unknown strategy, or a distributed strategy without a process group.
    """
    if strategy not in STRATEGIES or strategy == "auto":
        raise ValueError(
            f"strategy={strategy!r} is not one of {STRATEGIES[1:]} (resolve 'auto' first)"
        )
    if strategy == "none":
        return model
    if not is_distributed():
        raise ValueError(_no_group_message(strategy))
    if strategy == "ddp":
        return apply_ddp(model, device=device, **(ddp_kwargs or {}))
    if strategy == "fsdp":
        mp1 = fsdp1_mixed_precision(fsdp_dtype) if fsdp_dtype is not None else None
        return apply_fsdp1(model, device=device, mp_policy=mp1, precision_policy=policy)
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "hsdp":
        mesh = hsdp_mesh(device.type, dist.get_world_size(), hsdp_shard_size)
    else:
        # Explicit even on CPU: FSDP2's default mesh is built for CUDA.
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp2 = fsdp2_mixed_precision(fsdp_dtype) if fsdp_dtype is not None else None
    return apply_fsdp2(model, mesh=mesh, mp_policy=mp2, precision_policy=policy)


# How to start N ranks, in both messages below: the fix is the same whichever way this process
# came to train alone.
_LAUNCH = (
    "`distamp launch --nproc-per-node N script.py` (or torchrun --nproc-per-node N script.py; "
    "mpirun -np N and srun --ntasks N work too)"
)


def _no_group_message(strategy: str) -> str:
    """Why ``strategy`` cannot wrap when there is no process group at all.

    ``DistAMP.setup`` calls :func:`~distamp.init_distributed`, which makes a group whenever a
    launcher started the process; so under the engine, no group means no launcher, and the fix
    is the launch command, not another ``init_distributed()`` (which would make none either).
    Only a caller of :func:`apply_strategy` itself, under a launcher, still has to call it.
    """
    try:
        launcher = detect_environment().launcher
    except ValueError:  # a malformed launcher variable: init_distributed will name it
        launcher = "single"
    if launcher != "single":
        return (
            f"strategy={strategy!r} needs a torch.distributed process group: {launcher} started "
            "this process but no group was made; call distamp.init_distributed() before "
            "wrapping (DistAMP.setup() does), or use strategy='none' for one process"
        )
    return (
        f"strategy={strategy!r} needs a torch.distributed process group, and there is none: no "
        "launcher started this process (no torchrun, srun, mpirun or Ray variables in its "
        f"environment). Start N ranks with {_LAUNCH}; for one process, use strategy='none' "
        "(or 'auto')"
    )


def wrap_replicas(model: nn.Module, manager: Any, comm_hook: str | None = None) -> nn.Module:
    """``model`` in torchft's ``DistributedDataParallel``: its gradients averaged across the
    replicas of ``manager``'s quorum (the engine's wrapping for ``ft_manager=``); in 8-bit
    floats with ``comm_hook="fp8"`` or ``"fp8-ef"`` (:mod:`distamp.parallel.fp8_replicas`).
    torchft is imported here, when a model is wrapped, so ``import distamp`` works without it."""
    check_torchft_version()
    if comm_hook in ("fp8", "fp8-ef"):
        from distamp.parallel.fp8_replicas import replica_fp8_ddp

        return replica_fp8_ddp(manager, model, comm_hook)
    from torchft import DistributedDataParallel

    return DistributedDataParallel(manager, model)


@contextmanager
def _fsdp2_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def gradient_sync_disabled(
    model: nn.Module, *, first: bool = False
) -> AbstractContextManager[None]:
    """A context in which backward accumulates local gradients without communicating.

    DDP and FSDP1 have ``no_sync()``; FSDP2 has ``set_requires_gradient_sync(False)`` (restored on
    exit). Unwrapped modules need nothing. Forward and backward must both run inside it.

    ``first``: no backward has run on ``model`` yet. A DDP built with ``static_graph=True``
    records its graph in that backward, which must communicate (under ``no_sync`` torch 2.13
    fails an internal assert in its reducer), so that one micro-batch is all-reduced. The step's
    gradient is the same average: the next synced micro-batch averages what it adds.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return _fsdp2_no_sync(model)
    if first and getattr(model, "static_graph", False) is True:
        return nullcontext()
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else nullcontext()


def rebuild_optimizer(
    old: torch.optim.Optimizer, names: dict[int, str], wrapped: nn.Module, strategy: str
) -> torch.optim.Optimizer:
    """Rebuild ``old`` over the parameters of ``wrapped`` after FSDP replaced them.

    Parameter groups are matched by name (``names`` maps ``id`` of each original parameter to
    its model name before wrapping, :mod:`distamp.model_names`), so per-group settings such
    as "no weight decay on biases" survive. The class and its defaults are reused as they are.

    Raises:
        ValueError: ``old`` has already stepped: its state belongs to parameters that are gone.
    """
    if old.state:
        raise ValueError(
            f"optimizer: strategy={strategy!r} replaces the parameters, and this "
            f"{type(old).__name__} has already stepped (its state cannot follow); pass a factory "
            f"`lambda params: {type(old).__name__}(params, ...)` to setup() instead"
        )
    group_of = {
        names[id(p)]: i
        for i, g in enumerate(old.param_groups)
        for p in g["params"]
        if id(p) in names
    }
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in old.param_groups
    ]
    for name, p in wrapped.named_parameters():
        clean = model_name(name, wrapped)
        if clean in group_of:
            groups[group_of[clean]]["params"].append(p)
    if not any(g["params"] for g in groups):
        raise ValueError(
            f"optimizer: none of the {type(old).__name__}'s parameters belong to the model passed "
            "to setup(); build it over this model's parameters, or pass a factory"
        )
    warnings.warn(
        f"setup(): strategy={strategy!r} replaces the model's parameters, so the "
        f"{type(old).__name__} passed in was rebuilt over the sharded ones (same class, groups and "
        "hyper-parameters): use the optimizer setup() returns. Pass a factory "
        f"`lambda params: {type(old).__name__}(params, ...)` to build it only once.",
        stacklevel=3,
    )
    # Each group carries every hyper-parameter already; the constructor gets the defaults it
    # accepts (some classes store derived entries in `defaults`, e.g. AdamW's decoupled flag).
    accepted = inspect.signature(type(old).__init__).parameters
    defaults = {k: v for k, v in old.defaults.items() if k in accepted}
    return type(old)([g for g in groups if g["params"]], **defaults)
