"""The trained precision as explicit casts: a copy of the model whose modules hold their
parameters in the dtype they compute in and cast their inputs to it.

Training computes in low precision through ``torch.autocast``, a context around the forward.
An exported program has no such context: whoever runs it (a ``.pt2`` loader, AOTInductor, ONNX
Runtime, ExecuTorch) runs exactly the ops in the graph. So the copy made here carries the
decisions in its own forwards:

- each module's floating parameters and buffers are cast once, to the dtype its
  :class:`~distamp.deploy.plan.PrecisionPlan` gives it (half the bytes for fp16/bf16);
- each module's forward (an instance ``forward``, never a hook pair) casts its floating inputs
  to that dtype, so an fp32 island gets fp32 inputs and the module after it gets the compute
  dtype again;
- the policy's fp32 ops (softmax, losses, reductions) run on fp32 operands wherever they are
  called (a ``TorchFunctionMode`` inside the model's own forward, traced into the graph);
- the model's outputs come back as fp32: the program takes and returns what the fp32 model
  does, whatever it computes in.

A float8 Linear (torchao) computes as a plain bf16 linear on its own weight, the fallback the
adaptive rules use in training.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from distamp.deploy.plan import PrecisionPlan
from distamp.model_names import named_model_modules
from distamp.precision.fp8_parallel import is_float8_linear
from distamp.precision.regions import AUTOCAST_LOW_OPS, Fp32Ops, strip_regions
from distamp.torch_compat import clear_module_hooks

__all__ = ["cast_floating", "clean_copy", "low_precision_copy"]

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every fp32/fp16/bf16 tensor in it (nested in tuples, named tuples, lists
    and dicts) cast to ``dtype``; everything else (integers, float64, other objects) untouched."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype in _CASTABLE and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    return value


def _plain(tensor: torch.Tensor, where: str) -> torch.Tensor:
    """A detached copy of a plain tensor; sharded (DTensor) or wrapped (float8 all-gather)
    tensors are refused: their full value is not on this rank."""
    data = tensor.detach()
    if type(data) is not torch.Tensor:
        raise ValueError(
            f"{where} is a {type(data).__name__}, not a plain tensor (a sharded or float8-wrapped "
            "parameter): its full value is not on this rank. Save a checkpoint "
            "(amp.save_state(DIR)) and export that: distamp export DIR -o model.pt2"
        )
    return data.clone()


def clean_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` for export: parameters and buffers detached (no gradient), no hooks
    (the live model's monitor and tracer stay with it), the classes' own forwards (the
    policy's and the promotions' are dropped: the plan says what they did), eval mode.
    ``model`` itself is not changed.

    Raises:
        ValueError: a parameter is sharded or float8-wrapped (see the message for the fix).
    """
    memo: dict[int, Any] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        memo[id(param)] = nn.Parameter(_plain(param, f"parameter {name!r}"), requires_grad=False)
    for name, buf in model.named_buffers(remove_duplicate=True):
        memo[id(buf)] = _plain(buf, f"buffer {name!r}")
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as exc:  # an attribute that cannot be copied (a lock, a process group)
        raise ValueError(
            f"{type(model).__name__} cannot be copied for export ({type(exc).__name__}: {exc}); "
            "export a model built afresh with the trained weights loaded "
            "(model.load_state_dict(...))"
        ) from exc
    strip_regions(twin)  # the policy's and the promotions' forwards: the plan says what they did
    for module in twin.modules():
        clear_module_hooks(module)
        module.__dict__.pop("forward", None)  # an instance forward of another wrapper
    return twin.eval()


def _cast_tensors(model: nn.Module, plan: PrecisionPlan) -> None:
    """Cast each module's own floating parameters and buffers to its dtype. A parameter two
    modules share (tied weights) stays shared when they compute in the same dtype; otherwise
    each dtype gets its own copy, cast from the same trained value."""
    copies: dict[tuple[int, torch.dtype], Any] = {}
    for name, module in named_model_modules(model):
        dtype = plan.dtype_of(name)
        for pname, param in list(module.named_parameters(recurse=False)):
            if param.dtype in _CASTABLE and param.dtype != dtype:
                key = (id(param), dtype)
                if key not in copies:
                    copies[key] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                setattr(module, pname, copies[key])
        for bname, buf in list(module.named_buffers(recurse=False)):
            if buf.dtype in _CASTABLE and buf.dtype != dtype:
                key = (id(buf), dtype)
                copies.setdefault(key, buf.to(dtype))
                setattr(module, bname, copies[key])


def _instance_forward(
    module: nn.Module, dtype: torch.dtype, inner: Callable[..., Any]
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return inner(module, *cast_floating(args, dtype), **cast_floating(kwargs, dtype))

    return forward


def _root_forward(
    module: nn.Module, dtype: torch.dtype, inner: Callable[..., Any], fp32_ops: frozenset[str]
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
        if fp32_ops or dtype != torch.float32:
            # Unconditional casts: an exported program has no autocast and computes as under
            # it (fp32 ops up; a matmul's mixed operands, an fp32 op's output among them, down).
            with Fp32Ops(fp32_ops, always=True, narrow=AUTOCAST_LOW_OPS):
                out = inner(module, *args, **kwargs)
        else:
            out = inner(module, *args, **kwargs)
        return cast_floating(out, torch.float32)

    return forward


def low_precision_copy(clean: nn.Module, plan: PrecisionPlan) -> nn.Module:
    """A copy of ``clean`` (a :func:`clean_copy`) computing as ``plan`` says, with explicit
    casts only: ready for ``torch.export`` and runnable eagerly (what the export check runs
    with forward hooks to find a diverging module). ``clean`` is not changed."""
    model = clean_copy(clean)
    if plan.compute_dtype == torch.float32 and not plan.decisions:
        return model  # fp32: nothing to cast
    _cast_tensors(model, plan)
    for name, module in named_model_modules(model):
        dtype = plan.dtype_of(name)
        # A float8 Linear computes as the plain linear it subclasses (its bf16 fallback).
        inner = nn.Linear.forward if is_float8_linear(module) else type(module).forward
        if name == "":
            wrapped = _root_forward(module, dtype, inner, plan.fp32_ops)
        else:
            wrapped = _instance_forward(module, dtype, inner)
        # torch.export binds the inputs (and dynamic_shapes) by the forward's signature.
        wrapped.__signature__ = inspect.signature(inner.__get__(module))  # type: ignore[attr-defined]
        setattr(module, "forward", wrapped)  # noqa: B010 (an instance attribute, on purpose)
    return model
