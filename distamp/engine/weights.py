"""The weight precision in the engine's setup: the cast before wrapping, the optimizer after.

``DistAMP(weights=...)`` (:class:`~distamp.optim.WeightPrecision`) makes the parameters 16-bit
before the wrapper sees them, so DDP all-reduces 16-bit gradients (half the bytes, no fp32
bucket) and FSDP2 shards, gathers and reduce-scatters 16-bit parameters; the policy's fp32
modules keep fp32 weights. The optimizer the wrapper leaves (rebuilt over FSDP2's sharded
parameters) is then wrapped in a :class:`~distamp.optim.MasterWeightOptimizer` whose masters
come from the exact values the cast kept, cut to each parameter's local shard.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from distamp.model_names import model_name
from distamp.optim import MasterWeightOptimizer, WeightPrecision, island_parameters
from distamp.optim.bits import join_remainder
from distamp.optim.rules import rule_for
from distamp.optim.sharding import broadcast_bytes_
from distamp.optim.store import cast_parameters_, local_tensor
from distamp.precision.policy import Precision

__all__ = ["WEIGHT_STRATEGIES", "cast_weights", "check_weights", "master_optimizer"]

WEIGHT_STRATEGIES = ("auto", "none", "ddp", "fsdp2")


def check_weights(
    weights: Any,
    precision: Precision,
    *,
    strategy: str,
    comm_hook: str | None,
    mesh: Any,
    ft_manager: Any,
) -> WeightPrecision | None:
    """``weights`` as a :class:`WeightPrecision` fitted to the engine's settings: a string is a
    master kind (``"exact"``, ``"sharded"``, ``"stochastic"``, ``"kahan"``) with the precision's
    dtype and fp32 states.

    Raises:
        ValueError: a precision without 16-bit compute (fp32, fp8), a dtype other than the
            precision's, a strategy, comm hook, mesh or torchft setup it does not cover yet.
        TypeError: neither a WeightPrecision, a string nor None.
    """
    if weights is None:
        return None
    dtype = precision.compute_dtype
    if precision.float8_linears or dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"weights= with precision={precision.name!r}: 16-bit weights go with 'bf16' or "
            "'fp16' training; use one of them, or drop weights"
        )
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if isinstance(weights, str):
        weights = WeightPrecision(name, master=weights)  # type: ignore[arg-type]
    if not isinstance(weights, WeightPrecision):
        raise TypeError(
            f"weights={weights!r:.80}: pass a distamp.WeightPrecision, a master kind "
            "('exact', 'sharded', 'stochastic', 'kahan') or None"
        )
    if weights.torch_dtype != dtype:
        raise ValueError(
            f"weights={weights!r} with precision={precision.name!r}: the weights are the "
            f"compute dtype; pass WeightPrecision({name!r}, ...)"
        )
    if strategy not in WEIGHT_STRATEGIES:
        raise ValueError(
            f"weights= with strategy={strategy!r}: 16-bit weights train under "
            f"{', '.join(WEIGHT_STRATEGIES)}; use strategy='fsdp2' for sharding"
        )
    if comm_hook is not None:
        raise ValueError(
            f"weights= with comm_hook={comm_hook!r}: the gradients are 16-bit already, and "
            "DDP sends them as they are; drop comm_hook"
        )
    if mesh is not None or ft_manager is not None:
        what = "mesh" if mesh is not None else "ft_manager"
        raise ValueError(
            f"weights= with {what}=: a model you parallelised yourself (or torchft replicas) "
            "keeps fp32 weights for now; pass the plain model with strategy='ddp' or 'fsdp2', "
            "or drop weights"
        )
    return weights


def cast_weights(
    model: nn.Module,
    weights: WeightPrecision,
    policy: Any,
    *,
    parallelised: bool,
    optimizer: Any = None,
) -> dict[str, torch.Tensor]:
    """Cast ``model``'s trainable fp32 parameters (not the policy's fp32 modules) to the weight
    dtype in place; return what restores each exact master, by parameter name.

    Raises:
        ValueError: an optimizer the weight precision cannot drive, a model already
            parallelised or a pipeline stage (its parameters may be
            sharded already, their masters gone), or 16-bit parameters (the same: cast from
            fp32).
    """
    if isinstance(optimizer, torch.optim.Optimizer):  # refused before any weight changes
        rule_for(optimizer)  # (a factory's optimizer is checked when it is built)
    if parallelised:
        raise ValueError(
            "weights= with a model that arrives parallelised (DDP, FSDP, DTensor parameters, "
            "pipeline stages): pass the plain fp32 model and a strategy ('ddp' or 'fsdp2'), "
            "or, for DDP in a loop of your own, distamp.master_weights before wrapping"
        )
    keep = island_parameters(model, policy)
    named = [(model_name(n, model), p) for n, p in model.named_parameters() if p.requires_grad]
    low16 = [n for n, p in named if p.dtype in (torch.float16, torch.bfloat16)]
    if low16:
        raise ValueError(
            f"weights=: {len(low16)} parameters are 16-bit already ({', '.join(low16[:3])}): "
            "the masters are made from fp32 weights; build or load the model in fp32"
        )
    cast = [(n, p) for n, p in named if id(p) not in keep]
    low = cast_parameters_([p for _, p in cast], weights.torch_dtype)
    return {n: low[p] for n, p in cast if p in low}


def master_optimizer(
    optimizer: torch.optim.Optimizer,
    weights: WeightPrecision,
    low: Mapping[str, torch.Tensor],
    wrapped: nn.Module,
    strategy: str,
) -> MasterWeightOptimizer:
    """The optimizer over ``wrapped``'s (possibly sharded) parameters, keeping masters: each
    parameter's exact low bits cut to its local shard (FSDP2: the DTensor's placements);
    under DDP rank 0's, as the weights are.

    Raises:
        ValueError: an optimizer (a factory's) the weight precision cannot drive; the weights
            are fp32 again (unless FSDP2 sharded them).
    """
    by_name = {}
    for name, p in wrapped.named_parameters():
        clean = model_name(name, wrapped)
        if clean in low:
            by_name[id(p)] = _local_like(low[clean], p)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = {p: by_name[id(p)] for p in params if id(p) in by_name}
    if weights.master == "sharded" and any(hasattr(p, "device_mesh") for p in params):
        # FSDP2 shards every master with its parameter already: the exact one is the cheapest.
        weights = replace(weights, master="exact")
    if strategy == "ddp" and dist.is_initialized() and dist.get_world_size() > 1:
        # DDP made every replica's weights rank 0's; the masters follow (ranks seeded apart)
        broadcast_bytes_([low[n] for n in sorted(low)])
    try:
        return MasterWeightOptimizer(optimizer, weights, mine)
    except ValueError:  # a factory's optimizer it cannot drive: the weights back to fp32
        _uncast_(mine)
        raise


def _uncast_(low: Mapping[nn.Parameter, torch.Tensor]) -> None:
    """Undo :func:`cast_weights` for parameters that were not sharded since (their exact fp32
    values back from the kept low bits)."""
    for p, bits in low.items():
        if hasattr(p, "device_mesh"):
            continue
        with torch.no_grad():
            p.data = join_remainder(p.detach(), bits) if bits.dtype == torch.int16 else bits


def _local_like(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``full`` (the whole parameter's shape) cut as ``p``'s local shard is (no communication:
    every rank holds the whole tensor)."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    shard = distribute_tensor(
        full.to(local_tensor(p).device), mesh, cast(Any, p).placements, src_data_rank=None
    )
    return shard.to_local()
