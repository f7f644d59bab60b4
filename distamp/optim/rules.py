"""The update rules the weight precision can drive, each as torch's own functional step.

The master-weight optimizer (:mod:`distamp.optim.master`) never re-implements an update: it
hands fp32 views (the master, the gradient, the moments) to the very function torch's optimizer
class runs (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``), with the user's group settings
(``foreach``/``fused`` included), so an exact master follows torch's fp32 trajectory bit for bit.
A rule knows its state's names, how to create it, and how to call the function.

Supported: :class:`torch.optim.Adam`, :class:`torch.optim.AdamW` and :class:`torch.optim.SGD`
(momentum, Nesterov, weight decay), and subclasses that do not override ``step``. Anything else
keeps its own state layout, which the weight precision cannot hold in 16 bits:
:func:`rule_for` refuses it by name.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SUPPORTED", "Rule", "rule_for"]


@dataclass(frozen=True)
class Rule:
    """One optimizer family: its moment buffers and its functional step."""

    name: str
    moments: tuple[str, ...]  # tensor states shaped like the parameter
    has_step: bool  # a per-parameter step count ("step")
    run: Callable[
        [dict[str, Any], list[torch.Tensor], list[torch.Tensor], dict[str, list[Any]]], None
    ]

    def moment_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The moments this group keeps (Adam's ``max_exp_avg_sq`` only with ``amsgrad``; SGD's
        buffer only with momentum)."""
        if self.name == "adam":
            return self.moments if group["amsgrad"] else self.moments[:2]
        return self.moments if group["momentum"] != 0 else ()


def _adam(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: dict[str, list[Any]],
) -> None:
    adam = importlib.import_module("torch.optim.adam").adam
    beta1, beta2 = group["betas"]
    adam(
        params,
        grads,
        states["exp_avg"],
        states["exp_avg_sq"],
        states.get("max_exp_avg_sq", []),
        states["step"],
        foreach=group.get("foreach"),
        capturable=group.get("capturable", False),
        differentiable=False,
        fused=group.get("fused"),
        decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        amsgrad=group["amsgrad"],
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group.get("maximize", False),
    )


def _sgd(
    group: dict[str, Any],
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: dict[str, list[Any]],
) -> None:
    sgd = importlib.import_module("torch.optim.sgd").sgd
    sgd(
        params,
        grads,
        states.get("momentum_buffer", []),  # none without momentum (torch passes [] then)
        foreach=group.get("foreach"),
        fused=group.get("fused"),
        weight_decay=group["weight_decay"],
        momentum=group["momentum"],
        lr=group["lr"],
        dampening=group["dampening"],
        nesterov=group["nesterov"],
        maximize=group.get("maximize", False),
    )


ADAM = Rule("adam", ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), True, _adam)
SGD = Rule("sgd", ("momentum_buffer",), False, _sgd)
SUPPORTED: dict[type[torch.optim.Optimizer], Rule] = {
    torch.optim.Adam: ADAM,
    torch.optim.AdamW: ADAM,
    torch.optim.SGD: SGD,
}


def rule_for(optimizer: torch.optim.Optimizer) -> Rule:
    """The rule of ``optimizer``'s class.

    Raises:
        ValueError: an optimizer the weight precision cannot drive (its class named, the
            supported ones listed, and the way out: fp32 weights, i.e. no weight precision).
    """
    for cls in type(optimizer).__mro__:
        if cls in SUPPORTED:
            # torch wraps ``step`` in a profiling hook on the class of the first instance built
            # (functools.wraps), so an inherited step may be another wrapper of the same function.
            if inspect.unwrap(type(optimizer).step) is not inspect.unwrap(cls.step):
                break  # a subclass with an update of its own
            return SUPPORTED[cls]
    names = ", ".join(c.__name__ for c in SUPPORTED)
    raise ValueError(
        f"the weight precision cannot drive {type(optimizer).__name__}: its update and state "
        f"layout are its own, and 16-bit weights need the master kept beside them. Supported: "
        f"{names} (torch.optim). Use one of them, or keep fp32 weights (no weight precision)."
    )
