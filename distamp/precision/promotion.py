"""How a module is promoted to a wider format, in place, so that training carries on.

Adaptive precision (:mod:`distamp.precision.adaptive`) decides *which* module changes format;
this module holds *how*: an fp16/bf16 module made an fp32 island (:class:`Island`: autocast off
inside it, every low-precision operand cast to fp32) and a torchao float8 layer made a bf16
linear (:class:`Bf16Linear`). Both are instance ``forward`` attributes, not new modules, so the
parameters, their optimizer state and every hook (FSDP2's among them) stay, and ``remove()``
hands the class's forward back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from distamp.precision.casts import to_fp32

__all__ = ["Bf16Linear", "Island", "Upcast", "autocast_on", "is_float8"]

# Read once, outside any compiled frame: torch 2.11's dynamo cannot trace the availability check
# (a builtin), and breaks the promoted forward's graph on it.
_AUTOCAST_KINDS = tuple(k for k in ("cpu", "cuda") if torch.amp.is_autocast_available(k))


def autocast_on() -> list[str]:
    """The device types whose autocast is on here (a plain list: no generator to trace)."""
    return [kind for kind in _AUTOCAST_KINDS if torch.is_autocast_enabled(kind)]


class Upcast(TorchFunctionMode):
    """Inside a promoted module: every op's low-precision floating arguments cast to fp32.

    Casting the module's inputs is not enough where its parameters themselves arrive in the
    compute dtype (FSDP2 gathers them so): ``F.linear(fp32, fp16)`` refuses mixed dtypes once
    autocast is off. The cast is differentiable, so gradients still reach the parameters."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*to_fp32(args), **to_fp32(kwargs or {}))


class Island:
    """The promotion of one module: an instance ``forward`` that runs the class's with autocast
    off and every low-precision operand cast to fp32. A ``with`` block inside one call (not a
    pre/post hook pair holding a context open between them) is what ``torch.compile`` can trace;
    the module's own hooks (FSDP2's unshard among them) still run around it. :meth:`remove`
    hands the class's forward back."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        inner = type(module).forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            kinds = autocast_on()
            if not kinds:
                return inner(module, *args, **kwargs)
            args, kwargs = to_fp32(args), to_fp32(kwargs)
            # Plain nested ``with`` blocks (no ExitStack): what torch.compile traces whole.
            if len(kinds) == 2:
                with (
                    torch.autocast("cpu", enabled=False),
                    torch.autocast("cuda", enabled=False),
                    Upcast(),
                ):
                    return inner(module, *args, **kwargs)
            with torch.autocast(kinds[0], enabled=False), Upcast():
                return inner(module, *args, **kwargs)

        setattr(module, "forward", forward)  # noqa: B010 (an instance attribute, on purpose)

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


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

        def forward(x: torch.Tensor) -> torch.Tensor:
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

        setattr(module, "forward", forward)  # noqa: B010 (an instance attribute, on purpose)

    def remove(self) -> None:
        self._hook.remove()
        self.module.__dict__.pop("forward", None)


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
    def forward(ctx: Any, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if not is_float8(grad):
            return grad
        if hasattr(grad, "to_local"):
            from torch.distributed.tensor import DTensor

            local = grad.to_local().to_original_precision()
            return DTensor.from_local(local, grad.device_mesh, grad.placements, run_check=False)
        return grad.to_original_precision()
