"""What precision does each module actually run in? One forward pass, recorded.

Mixed precision is decided in three places that do not talk to each other: the dtype the
parameters are stored in, autocast's per-op (and per-device) rules, and FSDP's policy. The usual
surprises — a model that was ``.half()``-ed and then given a loss scaler ("Attempting to unscale
FP16 gradients"), a softmax that silently runs in bf16 on CPU — show up only as wrong numbers or
an error far from the cause. :func:`audit` runs one forward pass under the precision you train
with and reports, per module, the dtypes of its parameters, inputs and outputs and the ops that
produced low-precision results, plus the problems it recognizes and how to fix them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distamp.model_names import model_name, named_model_modules
from distamp.precision.casts import LOW_PRECISION
from distamp.precision.fp8_select import LinearChoice, plan_linears
from distamp.precision.policy import AutocastPolicy, PrecisionLike, parse_precision
from distamp.torch_compat import TorchDispatchMode

__all__ = ["AuditReport", "ModuleRecord", "audit"]

# Shape and copy ops: they move values, they do not compute with them.
_NOT_COMPUTE = frozenset(
    {
        "_to_copy", "to", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand",
        "detach", "alias", "clone", "split", "split_with_sizes", "slice", "select", "unsqueeze",
        "squeeze", "as_strided", "contiguous", "copy_", "empty_like", "lift_fresh",
    }
)  # fmt: skip
# Ops whose low-precision result costs accuracy (CPU autocast runs them in bf16/fp16).
_SENSITIVE = frozenset(
    {
        "native_layer_norm", "native_group_norm", "_softmax", "_log_softmax", "softmax",
        "log_softmax", "sum", "cumsum", "exp", "log", "nll_loss_forward", "mse_loss",
    }
)  # fmt: skip


@dataclass
class ModuleRecord:
    """What one module did during the audited forward.

    Attributes:
        name: qualified name in the model (``""`` is the root).
        kind: the module's class name.
        param_dtypes: dtypes of its own (non-recursive) parameters.
        input_dtypes / output_dtypes: dtypes of the floating tensors it received / returned.
        low_precision_ops: aten ops run directly in this module (not in a child) whose result
            was fp16/bf16, in first-seen order.
    """

    name: str
    kind: str
    param_dtypes: list[str] = field(default_factory=list)
    input_dtypes: list[str] = field(default_factory=list)
    output_dtypes: list[str] = field(default_factory=list)
    low_precision_ops: list[str] = field(default_factory=list)


@dataclass
class AuditReport:
    """The audit: one :class:`ModuleRecord` per module that ran, in call order, and the problems
    found (each names the cause and the fix). ``str(report)`` is the table.

    Under ``precision="fp8"``, ``fp8`` holds one
    :class:`~distamp.precision.fp8_select.LinearChoice` per
    Linear layer: whether it runs in float8 and, if not, why (fp32 island, ``fp8_exclude``,
    features not multiples of 16, below ``fp8_min_features``)."""

    records: list[ModuleRecord]
    issues: list[str]
    fp8: list[LinearChoice] = field(default_factory=list)
    adaptive: list[str] = field(default_factory=list)  # an adaptive policy's changes, in order

    def table(self) -> str:
        """A plain-text table, one row per module, then the issues."""
        head = ("module", "type", "params", "inputs", "outputs", "low-precision ops")
        rows = [
            (
                r.name or "(root)",
                r.kind,
                ",".join(r.param_dtypes) or "-",
                ",".join(r.input_dtypes) or "-",
                ",".join(r.output_dtypes) or "-",
                ",".join(r.low_precision_ops) or "-",
            )
            for r in self.records
        ]
        widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=False)]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in [head, *rows]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        if self.fp8:
            runs = sum(c.fp8 for c in self.fp8)
            lines.append(f"fp8: {runs} of {len(self.fp8)} Linear layers run in float8")
            lines += [f"  {c}" for c in self.fp8]
        if self.adaptive:
            lines.append(f"adaptive precision: {len(self.adaptive)} change(s)")
            lines += [f"  {c}" for c in self.adaptive]
        lines += [f"! {issue}" for issue in self.issues] or ["no precision issues found"]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def record(self, name: str) -> ModuleRecord:
        """The record of module ``name``. Raises ``KeyError`` if it did not run."""
        for r in self.records:
            if r.name == name:
                return r
        raise KeyError(f"module {name!r} did not run in the audited forward")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtypes(value: Any) -> list[str]:
    if isinstance(value, torch.Tensor):
        return [_short(value.dtype)] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [d for v in value for d in _dtypes(v)]
    if isinstance(value, dict):
        return [d for v in value.values() for d in _dtypes(v)]
    return []


def _unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


class _OpRecorder(TorchDispatchMode):
    """Attributes every low-precision aten result to the innermost running module."""

    def __init__(self, stack: list[ModuleRecord]) -> None:
        super().__init__()
        self.stack = stack

    @override
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.stack and name not in _NOT_COMPUTE:
            results = out if isinstance(out, (list, tuple)) else (out,)
            if any(isinstance(t, torch.Tensor) and t.dtype in LOW_PRECISION for t in results):
                ops = self.stack[-1].low_precision_ops
                if name not in ops:
                    ops.append(name)
        return out


@contextmanager
def _recording(model: nn.Module, records: list[ModuleRecord]) -> Iterator[None]:
    stack: list[ModuleRecord] = []
    handles = []
    for name, module in named_model_modules(model):  # model names, as the policy's

        def pre(mod: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            rec = ModuleRecord(
                name=name,
                kind=type(mod).__name__,
                param_dtypes=_unique([_short(p.dtype) for p in mod.parameters(recurse=False)]),
                input_dtypes=_unique(_dtypes(args) + _dtypes(kwargs)),
            )
            records.append(rec)
            stack.append(rec)

        def post(_mod: nn.Module, _args: Any, out: Any) -> None:
            if stack:
                stack.pop().output_dtypes = _unique(_dtypes(out))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        with _OpRecorder(stack):
            yield
    finally:
        for h in handles:
            h.remove()


def audit(
    model: nn.Module,
    *example_inputs: Any,
    precision: PrecisionLike = "bf16",
    device_type: str | None = None,
    policy: AutocastPolicy | None = None,
    scaler: Any = None,
) -> AuditReport:
    """Run ``model(*example_inputs)`` once under mixed precision and report the dtypes.

    Nothing is trained: the forward runs under ``torch.no_grad()`` and the model is left as it
    was (the recording hooks are removed). Syncs: it reads dtypes only, no tensor values.

    Args:
        model: the module to audit (unwrapped, or wrapped: records follow ``named_modules``).
        example_inputs: positional inputs for one forward pass.
        precision: the training precision (any :func:`~distamp.parse_precision` spelling).
            ``"fp8"`` also lists which Linear layers run in float8 and why the others do not
            (by :func:`distamp.precision.fp8_select.plan_linears`; the forward itself runs the
            model as it is,
            converted or not, under bf16 autocast).
        device_type: autocast's device type; default: the device of the first parameter.
        policy: audit under this :class:`~distamp.AutocastPolicy` instead of plain autocast
            (its hooks are applied to ``model`` if they were not already).
        scaler: the loss scaler training will use, if any (fp16 implies one).

    Returns:
        An :class:`AuditReport`; ``print(report)`` shows the table.
    """
    prec = policy.precision if policy is not None else parse_precision(precision)
    if device_type is None:
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
    if policy is not None:
        policy.apply(model)
        ctx: AbstractContextManager[Any] = policy.autocast(device_type)
    elif prec.compute_dtype is not None:
        ctx = torch.autocast(device_type, dtype=prec.compute_dtype)
    else:
        ctx = nullcontext()
    records: list[ModuleRecord] = []
    with torch.no_grad(), _recording(model, records), ctx:
        model(*example_inputs)
    fp8 = plan_linears(model, policy or AutocastPolicy(prec)) if prec.float8_linears else []
    changes = [] if policy is None or policy.adaptive is None else policy.adaptive.changes
    return AuditReport(
        records,
        _issues(model, records, prec.needs_scaler or _enabled(scaler)),
        fp8=fp8,
        adaptive=[str(c) for c in changes],
    )


def _enabled(scaler: Any) -> bool:
    return scaler is not None and bool(getattr(scaler, "is_enabled", lambda: True)())


def _issues(model: nn.Module, records: list[ModuleRecord], scaled: bool) -> list[str]:
    issues = []
    fp16_params = [
        model_name(n, model) for n, p in model.named_parameters() if p.dtype == torch.float16
    ]
    if fp16_params and scaled:
        shown = ", ".join(fp16_params[:3]) + (", ..." if len(fp16_params) > 3 else "")
        issues.append(
            f"{len(fp16_params)} parameter(s) are stored in float16 ({shown}) and a loss scaler "
            "is in use: the scaler refuses to step them ('16-bit parameter(s) with no "
            "master'): fp16 master weights lose small updates, fp16 gradients cannot be "
            "unscaled exactly. Fix: keep "
            "parameters in float32 (remove model.half() / .to(torch.float16)) and let autocast "
            "- or FSDP's param_dtype - cast per op."
        )
    sensitive = [
        f"{r.name or '(root)'}: {', '.join(op for op in r.low_precision_ops if op in _SENSITIVE)}"
        for r in records
        if any(op in _SENSITIVE for op in r.low_precision_ops)
    ]
    if sensitive:
        issues.append(
            "normalization/softmax/reduction ops ran in low precision ("
            + "; ".join(sensitive[:4])
            + ("; ..." if len(sensitive) > 4 else "")
            + "). CPU autocast keeps them in bf16/fp16 while CUDA runs them in fp32. Fix: train "
            "with distamp.AutocastPolicy (DistAMP(policy='default')), which runs them in fp32 "
            "on every device."
        )
    return issues
