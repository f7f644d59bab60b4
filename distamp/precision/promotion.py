"""How a module is promoted to a wider format, in place, so that training carries on.

Adaptive precision (:mod:`distamp.precision.adaptive`) decides *which* module changes format;
this module holds *how*: an fp16/bf16 module made an fp32 island (:class:`Island`: autocast off
inside it, every low-precision operand cast to fp32) and a torchao float8 layer made a bf16
linear (:class:`Bf16Linear`). Both are decisions held by the module's own instance ``forward``
(:mod:`distamp.precision.regions`), not new modules, so the parameters, their optimizer state and
every hook (FSDP2's among them) stay, a recomputed forward computes as the first one, and
``remove()`` hands the class's forward back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distamp.precision.regions import ExactUpcast, region_of, release_region

__all__ = ["Bf16Linear", "Island", "is_float8"]


class Island:
    """The promotion of one module: its forward (:class:`~distamp.precision.regions.RegionForward`)
    runs with autocast off and every low-precision operand cast to fp32. A flag on the module's
    own forward, not a pre/post hook pair holding a context open between them: what
    ``torch.compile`` traces (one guard, one recompilation), and what a forward recomputed by
    activation checkpointing carries along. The module's own hooks (FSDP2's unshard among them)
    still run around it. :meth:`remove` takes the promotion back."""

    def __init__(
        self, module: nn.Module, exact: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    ) -> None:
        self.module = module
        region = region_of(module)
        region.promoted = True
        # 16-bit weights with an exact master: the island computes from the master.
        region.exact = None if exact is None else ExactUpcast(exact)

    def remove(self) -> None:
        region = region_of(self.module)
        region.promoted = False
        region.exact = None
        release_region(self.module)


def is_float8(t: Any) -> bool:
    """Whether ``t`` is a torchao float8 tensor (or a DTensor of one): its values are already
    quantised, so whatever flushed to zero is gone."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return any(c.__name__.startswith("Float8") for c in type(local).__mro__)


class Bf16Linear:
    """The fp8 -> bf16 promotion of one torchao float8 layer: an instance ``forward`` that runs
    ``F.linear`` in bf16 on the layer's own (fp32) weight and bias, so the same parameters, hooks
    and optimizer state carry on; :meth:`remove` hands the class's float8 forward back.

    Under tensor parallelism torchao's float8 styles cast the layer's input to float8 in a
    pre-hook, before the layer runs: the flushed values would be lost before the bf16 linear
    sees them. So a pre-hook of its own, ahead of every other, keeps the input as it came, and
    the bf16 linear runs on it (a DTensor in the layout the style's hook gave, when it made one).
    """

    def __init__(self, module: nn.Linear) -> None:
        self.module = module
        self._raw: Any = None

        def keep(_module: nn.Module, args: tuple[Any, ...]) -> None:
            self._raw = args[0] if args else None

        self._hook = module.register_forward_pre_hook(keep, prepend=True)

        def bf16_forward(x: torch.Tensor) -> torch.Tensor:
            raw, self._raw = self._raw, None
            if is_float8(x) and raw is not None:
                x = _as_received(raw, x)
            bias = module.bias
            out = torch.nn.functional.linear(
                x.to(torch.bfloat16),
                module.weight.to(torch.bfloat16),
                None if bias is None else bias.to(torch.bfloat16),
            )
            return _PlainGrad.apply(out)  # type: ignore[no-any-return]

        region_of(module).replacement = bf16_forward

    def remove(self) -> None:
        self._hook.remove()
        region_of(self.module).replacement = None
        release_region(self.module)


def _as_received(raw: torch.Tensor, received: Any) -> torch.Tensor:
    """The high-precision input ``raw`` in the form the style handed the layer ``received``
    (the same DTensor layout, when it made one)."""
    if not hasattr(received, "to_local"):
        return raw
    from torch.distributed.tensor import DTensor

    local = raw.to_local() if isinstance(raw, DTensor) else raw
    if tuple(local.shape) != tuple(received.to_local().shape):
        raise RuntimeError(
            "adaptive fp8: a fallen-back layer's tensor-parallel style redistributes its input "
            "(sequence parallel); the bf16 fallback cannot follow it: exclude the layer from "
            "fp8 (fp8_exclude=...) or use the plain column/row styles"
        )
    return DTensor.from_local(local, received.device_mesh, received.placements, run_check=False)


class _PlainGrad(torch.autograd.Function):
    """Identity forward; in backward a float8 gradient (torchao's tensor-parallel styles cast
    the layer's output gradient to float8 in their output hook) is handed on in high precision,
    which the bf16 linear's own backward needs."""

    @staticmethod
    @override
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    @override
    def backward(ctx: Any, grad: Any) -> Any:
        if not is_float8(grad):
            return grad
        if hasattr(grad, "to_local"):
            from torch.distributed.tensor import DTensor

            local = grad.to_local().to_original_precision()
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return grad.to_original_precision()
