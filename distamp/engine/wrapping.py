"""What ``DistAMP.setup`` does to the model and its optimizer, in setup's order.

1. How the model arrives (:func:`model_arrival`): a plain module the engine wraps for the
   strategy, a model already parallelised (a ``mesh`` given, DDP/FSDP modules, DTensor
   parameters: left as it is), one ``torch.distributed.pipelining`` stage or the list of this
   rank's stages (:func:`pipeline_stages`), or torchft replica groups; the strategy follows.
2. The precision that must be in place before wrapping (:func:`prepare_precision`): FSDP2 must
   see float8 weights, and the policy's hooks must sit on the modules FSDP turns into units.
3. The wrapper (:func:`wrap_model`), then the optimizer over the wrapped parameters
   (:func:`fit_optimizer`: FSDP replaces parameters) and the scaler told what holds them
   (:func:`connect_scaler`: names, copies, shards, stages; the comm hook reading its scale).

Kept apart from :mod:`distamp.engine.core`, which calls these in order and owns the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distamp.agreement.replicas import unwrap_ft_optimizer
from distamp.engine.config import AMPConfig
from distamp.engine.setup_checks import OptimizerArg, built_optimizer, check_ft_setup, check_model
from distamp.parallel.strategies import (
    SHARDED,
    apply_strategy,
    is_parallelised,
    rebuild_optimizer,
    register_comm_hook,
    resolve_strategy,
    wrap_replicas,
)
from distamp.precision.adaptive_run import refuse_under_pipeline
from distamp.precision.fp8 import Float8Training
from distamp.precision.patterns import job_modules
from distamp.precision.policy import AutocastPolicy, MPOwner
from distamp.scaler import DistributedGradScaler
from distamp.torch_compat import is_pipeline_stage

__all__ = [
    "Arrival",
    "connect_scaler",
    "fit_optimizer",
    "model_arrival",
    "pipeline_stages",
    "prepare_precision",
    "wrap_model",
]


def pipeline_stages(model: Any) -> tuple[list[Any], nn.Module]:
    """``(stages, module to train)`` for what :meth:`~distamp.DistAMP.setup` was given: no stage
    and the model itself, one ``torch.distributed.pipelining`` stage and its module, or a list
    of this rank's stages and a ``ModuleDict`` of their modules keyed by global stage index."""
    if is_pipeline_stage(model):
        return [model], model.submod
    if isinstance(model, (list, tuple)):
        if not model or not all(is_pipeline_stage(s) for s in model):
            kinds = sorted({type(s).__name__ for s in model}) or ["nothing"]
            raise ValueError(
                "setup(): a list must hold this rank's torch.distributed.pipelining stages "
                f"(several for interleaved schedules), got {', '.join(kinds)}"
            )
        indices = [s.stage_index for s in model]
        if len(set(indices)) != len(indices):
            raise ValueError(f"setup(): the stages' indices repeat: {indices}")
        return list(model), nn.ModuleDict({f"stage{s.stage_index}": s.submod for s in model})
    return [], model


@dataclass(frozen=True)
class Arrival:
    """How the model came to ``setup()``, and the strategy that follows (:func:`model_arrival`)."""

    model: nn.Module  # what is trained: the model, a stage's module, or the stages' ModuleDict
    stages: list[Any]  # this rank's pipeline stages (empty: none)
    parallelised: bool  # a mesh, a stage or a wrapper already there: the engine wraps nothing
    strategy: str  # "none", "ddp", "fsdp", "fsdp2" or "hsdp"


def model_arrival(model: Any, cfg: AMPConfig, world_size: int) -> Arrival:
    """Take the module out of a stage or stages, check it, and resolve the strategy: the one
    asked for (or "auto"'s) for a model the engine wraps, "none" for one already parallelised,
    torchft's replica setup with ``ft_manager`` (:func:`~.setup_checks.check_ft_setup`).

    Raises:
        TypeError: ``model`` is not a module, a stage or a list of stages.
        ValueError: a list of stages that repeats an index or holds something else; the
            monitor or adaptive rules on a rank with several stages; a strategy that cannot be.
    """
    stages, module = pipeline_stages(model)
    check_model(module)
    if len(stages) > 1:
        refuse_under_pipeline(cfg.policy, cfg.numerics_interval)
    parallelised = cfg.mesh is not None or bool(stages) or is_parallelised(module)
    strategy = (
        resolve_strategy(cfg.strategy, world_size, parallelised=parallelised)
        if cfg.ft_manager is None
        else check_ft_setup(cfg, module, parallelised=parallelised, stages=bool(stages))
    )
    return Arrival(module, stages, parallelised, strategy)


def prepare_precision(
    model: nn.Module,
    cfg: AMPConfig,
    *,
    arrival: Arrival,
    device: torch.device,
    job: tuple[Any, ...] | None,
) -> Float8Training | None:
    """Before wrapping: the float8 layers (converted here, or adopted when the user converted
    before parallelising) and the policy's hooks, which must stay on FSDP's units. ``job``: the
    modules of every stage of the job (:func:`~distamp.precision.patterns.gather_modules`), so
    that name patterns match across stages.

    Returns:
        The float8 training state for fp8, else ``None``.
    """
    fp8 = None
    with job_modules(job):
        if cfg.precision.float8_linears:  # before wrapping: FSDP2 must see float8 weights
            policy = cfg.policy or AutocastPolicy(cfg.precision)
            fp8 = (
                Float8Training.adopt(model, policy)  # converted before parallelising
                if arrival.parallelised
                else Float8Training.convert(model, policy, strategy=arrival.strategy, device=device)
            )
        if cfg.policy is not None:
            cfg.policy.apply(model)  # before wrapping: the hooks stay on FSDP's units
    return fp8


def wrap_model(
    model: nn.Module, cfg: AMPConfig, *, strategy: str, device: torch.device, mp_owner: MPOwner
) -> nn.Module:
    """The model wrapped for ``strategy``: torchft's DDP across replica groups with
    ``ft_manager`` (averaged across replicas), else :func:`~.parallel.strategies.apply_strategy`
    (FSDP casting with the compute dtype when FSDP's policy owns mixed precision)."""
    ft = cfg.ft_manager
    if ft is not None and strategy == "ddp":
        return wrap_replicas(model, ft, cfg.comm_hook)
    return apply_strategy(
        model,
        strategy=strategy,
        device=device,
        fsdp_dtype=cfg.precision.compute_dtype if mp_owner == "fsdp" else None,
        policy=cfg.policy if strategy in SHARDED else None,
        hsdp_shard_size=cfg.hsdp_shard_size,
        ddp_kwargs=cfg.ddp_kwargs,
    )


def fit_optimizer(
    optimizer: OptimizerArg,
    cfg: AMPConfig,
    *,
    names: dict[int, str],
    wrapped: nn.Module,
    strategy: str,
) -> torch.optim.Optimizer:
    """The optimizer over ``wrapped``'s parameters: a factory is called with them; a built one
    is rebuilt under FSDP (which replaced the parameters; ``names``: the unwrapped model's
    parameter names by ``id``); torchft's optimizer wrapper is taken off (the engine votes and
    starts quorums itself, as the wrapper would)."""
    if cfg.ft_manager is not None:
        optimizer = unwrap_ft_optimizer(optimizer, cfg.ft_manager)
    if not isinstance(optimizer, torch.optim.Optimizer):
        return built_optimizer(optimizer(list(wrapped.parameters())), wrapped)
    if strategy in SHARDED:
        return rebuild_optimizer(optimizer, names, wrapped, strategy)
    return optimizer


def connect_scaler(
    scaler: DistributedGradScaler, wrapped: nn.Module, stages: list[Any], cfg: AMPConfig
) -> Any:
    """Tell ``scaler`` what holds the parameters, then register the comm hook that reads its
    scale. Registration gives names for reports and, per wrapper: DDP's copies (trusted with
    ``trust_ddp_sync``: no collective), FSDP1's shards, how many ranks run the same pipeline
    stage. Call it on every rank, as the wrappers.

    Returns:
        The comm hook's state (DDP's hook, or FSDP2's reduce-scatter for "fp8"), or ``None``.
    """
    for part in stages or [wrapped]:
        scaler.register_module(part, trust_ddp_sync=cfg.trust_ddp_sync)
    if cfg.comm_hook is None:
        return None
    return register_comm_hook(wrapped, cfg.comm_hook, scaler=scaler)
