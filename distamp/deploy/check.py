"""The export check: the exported program against the fp32 eager model, and which module diverges.

:func:`compare` runs both on the same inputs and measures each floating output: the largest
absolute error, the largest error relative to the output's own scale (``max |low - fp32| /
max |fp32|``: a per-element ratio explodes where the reference crosses zero), how many values
are inf/NaN where fp32 is finite, and, for classifier-like outputs (last dimension > 1), how
often the top-1 class agrees. Past the :class:`Tolerance` the export is refused; the error
names the module to blame, found by :func:`first_divergence`: forward hooks record every
module's output in the fp32 model and in the low-precision copy, and the first module (in the
order their forwards finish) whose output overflows, or drifts past the tolerance, is the one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from distamp.model_names import named_model_modules
from distamp.precision.settings import Fields

__all__ = [
    "CheckReport",
    "Divergence",
    "ExportCheckError",
    "OutputCheck",
    "Tolerance",
    "compare",
    "first_divergence",
]

# The default relative error by compute dtype: fp16 keeps 11 significant bits, bf16 8. Measured
# on the main job's models (benchmarks/inference.py, trained 60 steps): 4e-4 to 6e-4 of the
# logits' scale in fp16, 3.5e-3 to 4.2e-3 in bf16; the defaults leave room for deeper models.
_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_DEFAULT_REL = {torch.float16: 0.02, torch.bfloat16: 0.08, torch.float32: 1e-5}


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """How far the exported program may be from the fp32 eager model.

    Attributes:
        max_rel: the largest ``max |low - fp32| / max |fp32|`` accepted per output; ``None``
            (default): by compute dtype, 0.02 for fp16, 0.08 for bf16.
        min_top1: the smallest top-1 agreement accepted for a classifier-like output (last
            dimension > 1), a fraction in ``[0, 1]`` (default 0.9).
    """

    max_rel: float | None = None
    min_top1: float = 0.9

    def __post_init__(self) -> None:
        f = Fields(self)
        if self.max_rel is not None:
            f.real("max_rel", 0.0, math.inf, low_open=True, high_open=True)
        f.real("min_top1", 0.0, 1.0)

    def rel_for(self, dtype: torch.dtype) -> float:
        """The relative error accepted for a program computing in ``dtype``."""
        return self.max_rel if self.max_rel is not None else _DEFAULT_REL[dtype]


@dataclass(frozen=True)
class OutputCheck:
    """The figures of one floating output."""

    output: str  # its place in the output structure, e.g. "output[0]"
    max_abs: float
    max_rel: float
    nonfinite: int  # values inf/NaN in the program where fp32 is finite
    top1: float | None  # top-1 agreement (last dim > 1), else None
    passed: bool

    def __str__(self) -> str:
        top1 = "" if self.top1 is None else f", top-1 agreement {self.top1:.4f}"
        bad = f", {self.nonfinite} non-finite" if self.nonfinite else ""
        return f"{self.output}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}{top1}{bad}"


@dataclass(frozen=True)
class Divergence:
    """The first module whose low-precision output left the fp32 model's."""

    module: str
    kind: str  # the module's class name
    why: str

    def __str__(self) -> str:
        return f"{self.module!r} ({self.kind}): {self.why}"


@dataclass(frozen=True)
class CheckReport:
    """The export check's result: every output's figures, the tolerance, the rounds taken."""

    outputs: tuple[OutputCheck, ...]
    max_rel: float
    min_top1: float
    samples: int

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "samples": self.samples,
            "tolerance": {"max_rel": self.max_rel, "min_top1": self.min_top1},
            "outputs": [asdict(o) for o in self.outputs],
        }

    def __str__(self) -> str:
        return "; ".join(str(o) for o in self.outputs)


class ExportCheckError(ValueError):
    """The exported program is farther from the fp32 model than the tolerance allows.

    Attributes:
        report: the figures (:class:`CheckReport`).
        divergence: the first module whose output diverges, or ``None`` when none could be
            told apart (the error then comes from the model's own top-level ops).
    """

    def __init__(self, message: str, report: CheckReport, divergence: Divergence | None) -> None:
        super().__init__(message)
        self.report, self.divergence = report, divergence


def _leaves(value: Any, where: str) -> list[tuple[str, Any]]:
    if isinstance(value, (list, tuple)):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{where}[{k!r}]")]
    return [(where, value)]


def _measure(
    where: str, low: torch.Tensor, ref: torch.Tensor, rel: float, top1_min: float
) -> OutputCheck:
    low, ref = low.detach().double(), ref.detach().double()
    finite = torch.isfinite(ref)
    nonfinite = int((~torch.isfinite(low) & finite).sum())
    diff = (low - ref).abs()[finite & torch.isfinite(low)]
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref[finite].abs().max()) if finite.any() else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
    top1 = None
    if ref.dim() >= 1 and ref.shape[-1] > 1 and ref.numel():
        agree = low.nan_to_num(nan=-math.inf).argmax(-1) == ref.argmax(-1)
        top1 = float(agree.double().mean())
    passed = nonfinite == 0 and max_rel <= rel and (top1 is None or top1 >= top1_min)
    return OutputCheck(where, max_abs, max_rel, nonfinite, top1, passed)


def compare(
    program: Callable[..., Any],
    reference: Callable[..., Any],
    inputs: tuple[Any, ...],
    *,
    tolerance: Tolerance,
    dtype: torch.dtype,
) -> CheckReport:
    """Run ``program`` and the fp32 ``reference`` on ``inputs`` and measure every floating
    output (see the module docstring). One host sync per output (the figures are Python
    numbers)."""
    with torch.no_grad():
        got, want = program(*inputs), reference(*inputs)
    rel = tolerance.rel_for(dtype)
    checks = []
    for (where, low), (_, ref) in zip(_leaves(got, "output"), _leaves(want, "output"), strict=True):
        if isinstance(ref, torch.Tensor) and ref.is_floating_point():
            checks.append(_measure(where, low, ref, rel, tolerance.min_top1))
    first = inputs[0] if inputs and isinstance(inputs[0], torch.Tensor) else None
    samples = int(first.shape[0]) if first is not None and first.dim() else 1
    return CheckReport(tuple(checks), rel, tolerance.min_top1, samples)


def _record(model: nn.Module, skip: set[str]) -> tuple[dict[str, Any], list[str], list[Any]]:
    """Forward hooks on every module of ``model`` (except ``skip``): the first output each
    produces, in the order their forwards finish."""
    outputs: dict[str, Any] = {}
    order: list[str] = []
    handles = []
    for name, module in named_model_modules(model):
        if name in skip:
            continue

        def hook(_m: nn.Module, _args: Any, out: Any, name: str = name) -> None:
            if name not in outputs:
                outputs[name] = out
                order.append(name)

        handles.append(module.register_forward_hook(hook))
    return outputs, order, handles


def _tensors(value: Any) -> list[torch.Tensor]:
    return [
        v for _, v in _leaves(value, "") if isinstance(v, torch.Tensor) and v.is_floating_point()
    ]


def _diverges(low: Any, ref: Any, rel: float, dtype: torch.dtype) -> str | None:
    for a, b in zip(_tensors(low), _tensors(ref), strict=False):
        if a.shape != b.shape:
            continue
        a, b = a.detach().double(), b.detach().double()
        finite = torch.isfinite(b)
        bad = int((~torch.isfinite(a) & finite).sum())
        if bad:
            top = float(b[finite].abs().max()) if finite.any() else math.inf
            name = _NAMES.get(dtype, str(dtype))
            return (
                f"{bad} of {a.numel()} output values are inf/NaN in {name} where fp32 is finite "
                f"(fp32 max |x| = {top:.3g}; {name} holds up to {torch.finfo(dtype).max:.6g})"
            )
        scale = float(b[finite].abs().max()) if finite.any() else 0.0
        err = float((a - b)[finite].abs().max()) if finite.any() else 0.0
        if scale > 0 and err / scale > rel:
            return f"its output is {err / scale:.3g} of its scale away from fp32 (> {rel:g})"
    return None


def first_divergence(
    reference: nn.Module,
    low: nn.Module,
    inputs: tuple[Any, ...],
    *,
    fixed: Sequence[str],
    rel: float,
    dtype: torch.dtype,
) -> Divergence | None:
    """The first module (in the order forwards finish: a child before its parent) whose output
    in ``low`` overflows or drifts past ``rel`` from the same module's in ``reference``.
    Modules already fp32 (``fixed``: their names; everything inside them) and the model itself
    are not candidates: promoting those changes nothing, or everything.

    Both models must have the same module names (``low`` is a copy of ``reference``)."""

    def frozen(name: str) -> bool:
        return name == "" or any(name == f or name.startswith(f + ".") for f in fixed if f)

    skip = {n for n, _ in named_model_modules(reference) if frozen(n)}
    ref_out, _, ref_handles = _record(reference, skip)
    low_out, order, low_handles = _record(low, skip)
    try:
        with torch.no_grad():
            reference(*inputs)
            low(*inputs)
    finally:
        for h in (*ref_handles, *low_handles):
            h.remove()
    kinds = dict(named_model_modules(reference))
    for name in order:
        if name not in ref_out:
            continue
        why = _diverges(low_out[name], ref_out[name], rel, dtype)
        if why is not None:
            return Divergence(name, type(kinds[name]).__name__, why)
    return None
