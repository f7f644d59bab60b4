"""What ``DistAMP.setup`` checks of what it is given, before it wraps anything: the model, the
optimizer (or its factory) and the scheduler, the scaler against the device, the combinations
the strategy cannot take, torchft's setup, and the settings every rank must share (one
collective, :func:`distamp.cluster.agree_settings`).

The construction checks (``DistAMP(...)``'s own arguments) are :mod:`distamp.engine.config`'s;
these need the objects ``setup`` receives, or the process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distamp.agreement.replicas import is_ft_ddp
from distamp.cluster import agree_settings, is_distributed
from distamp.engine.config import AMPConfig
from distamp.parallel.ddp import check_sparse_gradients
from distamp.parallel.strategies import SHARDED
from distamp.precision.describe import describe_policy
from distamp.precision.requirements import check_parameter_dtypes

__all__ = [
    "OptimizerArg",
    "SchedulerArg",
    "built_optimizer",
    "check_ft_setup",
    "check_model",
    "check_optimizer",
    "check_scaler",
    "check_setup",
    "checked_scheduler",
    "engine_settings",
]

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerArg = Any  # an LRScheduler-like object (has .step), a factory `opt -> scheduler`, or None


def check_model(model: Any) -> None:
    """``TypeError`` unless ``model`` (a stage's module already taken out) is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"setup(model=...): expected a torch.nn.Module (or a torch.distributed.pipelining "
            f"stage, or a list of this rank's stages), got {type(model).__name__}: {model!r:.80}"
        )


def _check_optimizer_params(optimizer: torch.optim.Optimizer, params: Any, what: str) -> None:
    """``ValueError`` when ``optimizer`` updates a tensor that is not a parameter of the model:
    the model would silently never change."""
    mine = {id(p) for p in params}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(1 for p in held if id(p) not in mine)
    if not held or foreign:
        raise ValueError(
            f"setup(optimizer=...): {foreign or 'no'} of the {len(held)} tensors the "
            f"{type(optimizer).__name__} updates {'are' if foreign else 'is'} not a parameter "
            f"of {what}: build the optimizer over model.parameters() of the model you pass "
            "(or pass a factory `lambda params: ...`)"
        )


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    """``optimizer`` is an optimizer over ``model``'s parameters or a factory (``TypeError``,
    ``ValueError``), checked before anything is wrapped."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer_params(optimizer, model.parameters(), "this model")
    elif not callable(optimizer):
        raise TypeError(
            "setup(optimizer=...): expected a torch.optim.Optimizer or a factory "
            f"`lambda params: Optimizer(params, ...)`, got {type(optimizer).__name__}"
        )


def built_optimizer(optimizer: Any, wrapped: nn.Module) -> torch.optim.Optimizer:
    """What an optimizer factory returned, checked (``TypeError``/``ValueError``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "setup(optimizer=<factory>): the factory must return a torch.optim.Optimizer, "
            f"returned {type(optimizer).__name__}"
        )
    _check_optimizer_params(optimizer, wrapped.parameters(), "the wrapped model")
    return optimizer


def checked_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler (built from a factory if one was given), driving ``optimizer``."""
    if scheduler is not None and not hasattr(scheduler, "step"):
        if not callable(scheduler):
            raise TypeError(
                "setup(scheduler=...): expected an LR scheduler (with .step()), a factory "
                f"`lambda opt: ...` or None, got {type(scheduler).__name__}"
            )
        scheduler = scheduler(optimizer)
        if not hasattr(scheduler, "step"):
            raise TypeError(
                "setup(scheduler=<factory>): the factory must return a scheduler (with "
                f".step()), returned {type(scheduler).__name__}"
            )
    bound = getattr(scheduler, "optimizer", optimizer)
    if bound is not optimizer and bound is not getattr(optimizer, "inner", None):
        raise ValueError(
            f"setup(scheduler=...): this {type(scheduler).__name__} drives another optimizer "
            f"({type(bound).__name__} at {id(bound):#x}), not the one passed to setup(): its "
            "learning rates would never reach training; build it over that optimizer"
        )
    return scheduler


def engine_settings(cfg: AMPConfig, strategy: str, device: torch.device) -> dict[str, Any]:
    """Everything of ``cfg`` that must be identical on every rank (see
    :mod:`distamp.cluster.agreement`); the scaler's own settings when one was passed."""
    mesh = cfg.mesh
    settings: dict[str, Any] = {
        "precision": cfg.precision.name,
        "strategy": strategy,
        "device_type": device.type,
        "grad_accum_steps": cfg.grad_accum_steps,
        "max_grad_norm": cfg.max_grad_norm,
        "comm_hook": cfg.comm_hook,
        "hsdp_shard_size": cfg.hsdp_shard_size,
        "trust_ddp_sync": cfg.trust_ddp_sync,
        "trace_nonfinite": cfg.trace_nonfinite,
        "numerics_interval": cfg.numerics_interval,
        "ft_manager": cfg.ft_manager is not None,
        # Sorted: the text compared must not depend on the order the keys were written in.
        "ddp_kwargs": None if cfg.ddp_kwargs is None else sorted(cfg.ddp_kwargs.items()),
        "mesh": None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names),
        "scaler": "default" if cfg.scaler is None else type(cfg.scaler).__name__,
        "spike_guard": None if cfg.spike_guard is None else repr(cfg.spike_guard),
        "max_consecutive_skips": cfg.max_consecutive_skips,
        "weights": None if cfg.weights is None else cfg.weights.short(),
        **describe_policy(cfg.policy),
    }
    if cfg.scaler is not None:
        settings.update(cfg.scaler.settings())
    return settings


def check_scaler(cfg: AMPConfig, device: torch.device) -> None:
    """A scaler passed by the user is for the training device (``ValueError`` with the fix):
    torch disables a scaler built for a device that is not there with a mere warning, and an
    fp16 run would then train unscaled, with no inf check. (One disabled on purpose,
    ``enabled=False``, is the user's choice, as with torch.)"""
    scaler = cfg.scaler
    if scaler is None:
        return
    if scaler.device_type != device.type:
        raise ValueError(
            f"scaler: built for device {scaler.device_type!r}, but the engine trains on "
            f"{device.type!r}{' (not available here)' if not scaler.is_enabled() else ''}: build "
            f"it with DistributedGradScaler({device.type!r}, ...), or pass scaler=None"
        )


def check_setup(
    cfg: AMPConfig,
    strategy: str,
    device: torch.device,
    model: Any,
    optimizer: Any,
    scheduler: Any,
) -> dict[str, Any]:
    """What can only be checked at setup, once the strategy and device are resolved (the
    model's type is checked before, by :func:`check_model`): the optimizer, scheduler and scaler
    passed (``TypeError``/``ValueError``), a sparse gradient under a hook that cannot carry it
    (:func:`~distamp.parallel.ddp.check_sparse_gradients`), then, in one collective, that every
    rank has the same settings (:class:`~distamp.cluster.SettingsMismatchError` on every rank).

    Returns:
        The settings compared (:func:`engine_settings`), identical on every rank: what the run
        records of itself (``DistAMP.settings``, ``DIR/settings.json``)."""
    check_optimizer(optimizer, model)
    check_parameter_dtypes(model, cfg.precision, owner="DistAMP.setup(model=...)")
    check_scaler(cfg, device)
    _check_combinations(cfg, strategy, optimizer, scheduler)
    check_sparse_gradients(model, cfg.comm_hook)
    settings = engine_settings(cfg, strategy, device)
    agree_settings(settings, what="DistAMP")
    return settings


def _check_combinations(cfg: AMPConfig, strategy: str, optimizer: Any, scheduler: Any) -> None:
    built = isinstance(optimizer, torch.optim.Optimizer)
    if built and strategy in SHARDED and hasattr(scheduler, "step"):
        raise ValueError(
            f"scheduler: strategy={strategy!r} must rebuild the optimizer you passed, "
            "so a scheduler bound to it would drive a stale one; pass factories instead: "
            f"`lambda params: ...` and `lambda opt: {type(scheduler).__name__}(opt, ...)`"
        )
    fsdp2_ok = cfg.comm_hook in ("fp8", "fp8-ef") and strategy == "fsdp2"
    if cfg.comm_hook is not None and strategy != "ddp" and not fsdp2_ok:
        raise ValueError(
            f"comm_hook={cfg.comm_hook!r}: strategy resolved to {strategy!r}, which has "
            "no DDP comm hooks (one process resolves 'auto' to 'none'); use comm_hook=None"
        )
    several = is_distributed() and torch.distributed.get_world_size() > 1
    if cfg.ddp_kwargs is not None and strategy != "ddp" and several:  # one process: moot
        raise ValueError(
            f"ddp_kwargs={cfg.ddp_kwargs!r}: the model is already parallelised (a DDP or FSDP "
            "wrapper, DTensor parameters or pipeline stages), so the engine builds no DDP to "
            "pass them to; set them on your own wrapper, or pass the bare model"
        )


def check_ft_setup(cfg: AMPConfig, model: nn.Module, *, parallelised: bool, stages: bool) -> str:
    """With ``cfg.ft_manager``: the strategy inside the replica group, ``"ddp"`` when the engine
    wraps ``model`` in torchft's DDP across replicas, ``"none"`` when the user already did (or
    sharded it); ``ValueError`` for what cannot train across replicas."""
    from torch.nn.parallel import DistributedDataParallel

    if stages:
        raise ValueError(
            "ft_manager with pipeline stages: torchft replicates whole models; train the "
            "stages without ft_manager"
        )
    if isinstance(model, DistributedDataParallel) and not is_ft_ddp(model):
        raise ValueError(
            "ft_manager with a torch DistributedDataParallel model: its gradients stay inside "
            "the replica group; pass the bare model (the engine wraps it in torchft's DDP) or "
            "one wrapped with torchft.DistributedDataParallel"
        )
    if (parallelised or cfg.strategy == "none") and cfg.comm_hook is not None:
        raise ValueError(
            f"ft_manager with comm_hook={cfg.comm_hook!r} and a model wrapped or sharded by "
            "hand: the hook goes in the torchft DDP the engine builds; pass the bare model"
        )
    if parallelised or cfg.strategy == "none":
        return "none"
    if is_distributed() and torch.distributed.get_world_size() > 1:
        raise ValueError(
            f"ft_manager with {torch.distributed.get_world_size()} ranks in the replica group: "
            "torchft's DDP averages each rank with its peers in the other replica groups only; "
            "parallelise the model inside the group yourself (e.g. fully_shard over the group "
            "with torchft's HSDP mesh) and pass it with strategy='auto'"
        )
    return "ddp"
