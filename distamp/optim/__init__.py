"""The weights' and the optimizer's precision: the memory half of mixed precision.

Autocast halves the activations; this halves the rest. Parameters and gradients are kept in
16 bits, with a master that keeps every update (:class:`WeightPrecision` says which), and the
optimizer's moments in fp32 or bf16. The update itself is torch's own
(:mod:`distamp.optim.rules`), run on fp32 views (:mod:`distamp.optim.master`); the skip is the
scaler's agreed one. Sits above ``scaler`` and ``precision``, below ``parallel`` and ``engine``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distamp.optim.config import WeightPrecision, bytes_per_parameter
from distamp.optim.master import MasterWeightOptimizer
from distamp.optim.rules import rule_for
from distamp.optim.store import Master, cast_parameters_

__all__ = [
    "Master",
    "MasterWeightOptimizer",
    "WeightPrecision",
    "bytes_per_parameter",
    "cast_parameters_",
    "island_parameters",
    "master_weights",
]


def island_parameters(model: nn.Module, policy: Any) -> set[int]:
    """The ids of the parameters an :class:`~distamp.AutocastPolicy` keeps in fp32 (its fp32
    modules: the islands compute in fp32 from fp32 weights, so they keep them)."""
    if policy is None:
        return set()
    return {id(p) for _, module in policy.fp32_modules_of(model) for p in module.parameters()}


def master_weights(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    precision: WeightPrecision | None = None,
    *,
    policy: Any = None,
    process_group: Any = None,
) -> MasterWeightOptimizer:
    """Make ``model``'s weights 16-bit in place, keeping their exact masters, and return the
    optimizer that steps them. For a loop of your own; ``DistAMP(weights=...)`` does it itself.

    Call it on the fp32 model (weights loaded) before wrapping it in DDP, with an optimizer
    that has not stepped; then train as before, through the scaler::

        opt = distamp.optim.master_weights(model, torch.optim.AdamW(model.parameters()))
        model = DDP(model)
        ...
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()

    Args:
        model: the fp32 model (parameters on their device).
        optimizer: an ``AdamW``, ``Adam`` or ``SGD`` over ``model``'s parameters.
        precision: the weight precision; default ``WeightPrecision()`` (bf16 weights, exact
            master, fp32 states).
        policy: an :class:`~distamp.AutocastPolicy` whose fp32 modules keep fp32 weights.
        process_group: the data-parallel group for ``master="sharded"`` (default: all ranks).

    Raises:
        ValueError: an optimizer it cannot drive or that has stepped (nothing changed), or
            weights that are already 16-bit (cast them back to fp32 first: their masters are
            gone).
        TypeError: ``precision`` is not a :class:`WeightPrecision` (nothing changed).
    """
    precision = precision if precision is not None else WeightPrecision()
    if not isinstance(precision, WeightPrecision):
        raise TypeError(
            f"master_weights(precision={precision!r:.80}): pass a "
            "distamp.WeightPrecision(dtype=..., master=..., states=...) or None"
        )
    rule_for(optimizer)  # refuse before anything is cast
    if any(optimizer.state.values()):
        raise ValueError(
            f"{type(optimizer).__name__} has stepped already: build the weight precision "
            "before the first step"
        )
    sharded = [n for n, p in model.named_parameters() if hasattr(p, "device_mesh")]
    if sharded:
        raise ValueError(
            f"master_weights: {len(sharded)} parameters are DTensors ({', '.join(sharded[:3])}"
            f"{', ...' if len(sharded) > 3 else ''}): a model sharded by hand (fully_shard, "
            "tensor parallelism) is not covered; call it on the plain model before DDP, or let "
            "DistAMP(strategy='fsdp2', weights=...) cast and shard it"
        )
    keep = island_parameters(model, policy)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    refused = [n for n, p in model.named_parameters() if id(p) in held and p.dtype != torch.float32]
    if refused:
        raise ValueError(
            f"master_weights: {len(refused)} parameters are not fp32 ({', '.join(refused[:3])}"
            f"{', ...' if len(refused) > 3 else ''}): a master is made from the fp32 weights; "
            "build the model in fp32 (or load an fp32 checkpoint) and call it before .half()"
        )
    cast = [p for p in model.parameters() if id(p) in held and id(p) not in keep]
    low = cast_parameters_(cast, precision.torch_dtype)
    return MasterWeightOptimizer(optimizer, precision, low, process_group=process_group)
