"""``distamp.export``: a trained model as a ``torch.export`` program in its trained precision.

The steps, in order:

1. a clean fp32 copy of the model (:func:`~distamp.deploy.casting.clean_copy`; the model itself
   is not touched), run once on the example inputs so that inputs which do not fit are refused
   here, with the model's own error, rather than deep inside tracing;
2. the :class:`~distamp.deploy.plan.PrecisionPlan`: the policy's fp32 islands, the adaptive
   promotions of training, float8 Linears as their bf16 fallback;
3. the low-precision copy with explicit casts (:mod:`distamp.deploy.casting`);
4. with ``check=``: the copy against the fp32 model on those inputs; past the tolerance either
   refused, naming the first diverging module, or (``auto_islands=True``) that module becomes
   an fp32 island and the check runs again, at most ``max_rounds`` times;
5. ``torch.export.export`` of the copy, and, with ``check=``, the same check on the exported
   program itself (the figures recorded are the program's).

The decisions and the figures travel with the program (:func:`precision_record`) and are
written next to it by :func:`~distamp.deploy.targets.save`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn

from distamp.arguments import as_bool, as_integer
from distamp.deploy.casting import clean_copy, low_precision_copy
from distamp.deploy.check import (
    CheckReport,
    Divergence,
    ExportCheckError,
    Tolerance,
    compare,
    first_divergence,
)
from distamp.deploy.plan import PrecisionPlan, adaptive_changes, as_policy
from distamp.precision.adaptive import PrecisionChange
from distamp.precision.policy import AutocastPolicy, Precision, PrecisionLike

__all__ = [
    "RECORD_FORMAT",
    "TrainedEngine",
    "annotate_record",
    "export",
    "export_engine",
    "precision_record",
]

RECORD_FORMAT = 1
_META_KEY = "distamp_precision"  # the record's key in the program's graph-module metadata
_SHARDED = ("fsdp", "fsdp2", "hsdp")


def _as_args(value: Any, what: str) -> tuple[Any, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(value)
    raise TypeError(
        f"{what}={type(value).__name__}: pass a tensor or a tuple of the forward's positional "
        "arguments, e.g. (tokens,)"
    )


def _batch_of(args: tuple[Any, ...], what: str) -> int:
    sizes = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1}
    if len(sizes) != 1:
        raise ValueError(
            f"dynamic_shapes='batch' needs every tensor of {what} to have the same first "
            f"(batch) dimension, got sizes {sorted(sizes)}; pass torch.export dynamic_shapes "
            "for another layout"
        )
    return sizes.pop()


def _dynamic(spec: Any, args: tuple[Any, ...], max_batch: int) -> tuple[Any, tuple[Any, ...]]:
    """torch.export's ``dynamic_shapes`` for ``spec``, and the inputs to trace with."""
    if not isinstance(spec, str):
        return spec, args
    if spec != "batch":
        raise ValueError(
            f"dynamic_shapes={spec!r}: pass 'batch' (the first dimension of every tensor "
            "input), None (static shapes) or torch.export's own dynamic_shapes"
        )
    batch = _batch_of(args, "example_inputs")
    dim = torch.export.Dim("batch", min=1, max=max_batch)
    shapes = tuple({0: dim} if isinstance(a, torch.Tensor) and a.dim() >= 1 else None for a in args)
    if batch == 1:  # torch.export specialises a size of 1: trace with 2, the graph is the same
        args = tuple(
            torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.dim() else a for a in args
        )
    return shapes, args


def _check_like(example: tuple[Any, ...], given: tuple[Any, ...], batch: bool) -> None:
    """Refuse check inputs that are not shaped like the example inputs (dtype, rank, sizes; the
    batch dimension may differ when it is dynamic)."""
    if len(given) != len(example):
        raise ValueError(
            f"check= has {len(given)} inputs, example_inputs {len(example)}: pass inputs the "
            "forward takes, like the example's"
        )
    for i, (want, got) in enumerate(zip(example, given, strict=True)):
        if not isinstance(want, torch.Tensor):
            continue
        if not isinstance(got, torch.Tensor):
            raise TypeError(f"check= input {i} is a {type(got).__name__}, expected a tensor")
        fixed = slice(1, None) if batch else slice(None)
        if (
            got.dtype != want.dtype
            or got.shape[fixed] != want.shape[fixed]
            or (got.dim() != want.dim())
        ):
            shape = ["B", *want.shape[1:]] if batch else list(want.shape)
            raise ValueError(
                f"check= input {i} has dtype {got.dtype} and shape {tuple(got.shape)}; the "
                f"example input is {want.dtype} of shape {tuple(want.shape)}: pass "
                f"{want.dtype} inputs of shape ({', '.join(map(str, shape))})"
            )


def _refusal(report: CheckReport, divergence: Divergence | None, plan: PrecisionPlan) -> str:
    where = (
        f"The first module whose output diverges from fp32 eager is {divergence}"
        if divergence is not None
        else "No single module diverges first (the model's own top-level ops do)"
    )
    fix = (
        f"export with auto_islands=True, or keep it in fp32: AutocastPolicy({plan.precision!r}, "
        f"fp32_modules=[..., {divergence.module!r}])"
        if divergence is not None
        else "export in another precision (policy='bf16' or 'fp32'), or loosen tolerance="
    )
    return (
        f"export check failed ({plan.precision}): {report}; tolerance max_rel="
        f"{report.max_rel:g}, min_top1={report.min_top1:g}. {where}. Fix: {fix}"
    )


def _version() -> str:
    try:
        return importlib.metadata.version("distamp")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _describe_inputs(args: tuple[Any, ...], batch: bool) -> list[dict[str, Any]]:
    described = []
    for a in args:
        if isinstance(a, torch.Tensor):
            shape: list[Any] = list(a.shape)
            if batch and shape:
                shape[0] = "batch"
            described.append({"shape": shape, "dtype": str(a.dtype).removeprefix("torch.")})
        else:
            described.append({"value": repr(a)})
    return described


def export(
    model: nn.Module | TrainedEngine,
    example_inputs: Any,
    *,
    policy: AutocastPolicy | PrecisionLike | None = None,
    promotions: Iterable[PrecisionChange] | None = None,
    dynamic_shapes: Any = None,
    max_batch: int = 1024,
    check: Any = None,
    auto_islands: bool = False,
    tolerance: Tolerance | None = None,
    max_rounds: int = 8,
) -> torch.export.ExportedProgram:
    """Export ``model`` for inference in the precision it was trained with.

    The program computes in the policy's compute dtype with explicit casts (no autocast at
    run time): fp32 islands (the policy's, the ``promotions`` of adaptive training, and those
    the check adds) hold fp32 parameters and get fp32 inputs; float8 Linears run as bf16
    linears. It takes and returns what the fp32 model does (floating outputs come back as
    fp32). Save it with :func:`distamp.deploy.save` (``.pt2``, AOTInductor, ONNX, ExecuTorch);
    the ``.pt2`` loads with ``torch.export.load`` alone.

    Args:
        model: the trained model (unwrapped), or the :class:`~distamp.DistAMP` that trained it
            (``distamp.export(amp, ...)``: its model, taken out of DDP, with its policy and
            promotions; :func:`export_engine`). Not changed: a copy is exported.
        example_inputs: the forward's positional arguments (a tensor or a tuple).
        policy: the training policy, or a precision (``"fp16"``: the default policy of that
            precision, normalization layers and the fp32 ops in fp32). ``None``: an engine's
            own (its policy, else its precision's default policy), ``"bf16"`` for a model.
        promotions: the adaptive rules' change log of training (``amp.adaptive`` or a
            checkpoint's). ``None``: an engine's own, none for a model.
        dynamic_shapes: ``None`` (the example's shapes), ``"batch"`` (the first dimension of
            every tensor input, 1 to ``max_batch``), or ``torch.export``'s own specification.
        max_batch: the largest batch of ``dynamic_shapes="batch"`` (ExecuTorch plans its
            memory for it).
        check: inputs shaped like ``example_inputs`` (the batch may differ) to compare the
            program with the fp32 eager model on; ``None``: no check.
        auto_islands: when the check fails, make the first diverging module an fp32 island and
            check again (at most ``max_rounds`` times); each promotion is recorded.
        tolerance: what the check accepts (:class:`~distamp.deploy.check.Tolerance`; default
            by dtype).
        max_rounds: the most promotions ``auto_islands`` makes.

    Returns:
        The ``torch.export.ExportedProgram``; :func:`precision_record` reads its decisions.

    Raises:
        ExportCheckError: (a ``ValueError``) the check failed; names the first diverging module
            and the fix.
        ValueError: inputs that do not fit the model, check inputs unlike the example, a bad
            option, a promotion of a module the model lacks, a sharded parameter, an engine
            whose strategy shards the model (FSDP, FSDP2, HSDP: export its checkpoint).
        TypeError: inputs that are not a tensor or a tuple.
    """
    if not isinstance(model, nn.Module):  # an engine after training
        model, policy, promotions = _trained(model, policy, promotions)
    policy = as_policy("bf16" if policy is None else policy)
    promotions = () if promotions is None else promotions
    auto_islands = as_bool("auto_islands", auto_islands)
    max_batch = as_integer("max_batch", max_batch)
    max_rounds = as_integer("max_rounds", max_rounds)
    if max_batch < 2 or max_rounds < 0:
        raise ValueError(f"max_batch={max_batch} (at least 2), max_rounds={max_rounds} (>= 0)")
    tolerance = Tolerance() if tolerance is None else tolerance
    args = _as_args(example_inputs, "example_inputs")
    check_args = None if check is None else _as_args(check, "check")
    batch = dynamic_shapes == "batch"
    if check_args is not None:
        _check_like(args, check_args, batch)
    fp32 = clean_copy(model)
    try:
        with torch.no_grad():
            fp32(*args)
    except Exception as exc:
        raise ValueError(
            f"example_inputs do not fit {type(model).__name__}: its forward raised "
            f"{type(exc).__name__}: {exc}. Pass the positional arguments the model takes "
            f"(dtypes and shapes as in training); got {_describe_inputs(args, False)}"
        ) from exc
    shapes, trace_args = _dynamic(dynamic_shapes, args, max_batch)
    plan = PrecisionPlan.from_training(fp32, policy, promotions)
    low = low_precision_copy(fp32, plan)
    dtype, rounds = plan.compute_dtype, 0
    while check_args is not None:
        report = compare(low, fp32, check_args, tolerance=tolerance, dtype=dtype)
        if report.passed:
            break
        rel = tolerance.rel_for(dtype)
        divergence = first_divergence(
            fp32, low, check_args, fixed=plan.fp32_modules, rel=rel, dtype=dtype
        )
        if not auto_islands or divergence is None or rounds >= max_rounds:
            message = _refusal(report, divergence, plan)
            if auto_islands:
                message += f" (auto_islands: {rounds} of max_rounds={max_rounds} rounds taken)"
            raise ExportCheckError(message, report, divergence)
        rounds += 1
        plan = plan.promote(divergence.module, f"export check, round {rounds}: {divergence.why}")
        low = low_precision_copy(fp32, plan)
    program = torch.export.export(low, trace_args, dynamic_shapes=shapes)
    final = None
    if check_args is not None:
        final = compare(program.module(), fp32, check_args, tolerance=tolerance, dtype=dtype)
        if not final.passed:
            raise ExportCheckError(_refusal(final, None, plan), final, None)
    program.graph_module.meta[_META_KEY] = {
        "format": RECORD_FORMAT,
        "distamp": _version(),
        "torch": str(torch.__version__),
        "model": type(model).__qualname__,
        **plan.to_dict(),
        "outputs_dtype": "float32",
        "inputs": _describe_inputs(args, batch),
        "dynamic_batch": {"min": 1, "max": max_batch} if batch else None,
        "check": None if final is None else {**final.to_dict(), "auto_island_rounds": rounds},
    }
    return program


def precision_record(program: torch.export.ExportedProgram) -> dict[str, Any] | None:
    """What :func:`export` decided and measured for ``program`` (JSON-ready), or ``None`` for
    a program it did not make: the precision, each module that is not in the compute dtype
    with its source and reason, the fp32 ops, the inputs, the check's figures."""
    record = program.graph_module.meta.get(_META_KEY)
    return dict(record) if isinstance(record, dict) else None


def annotate_record(program: torch.export.ExportedProgram, **fields: Any) -> None:
    """Add JSON-ready ``fields`` to ``program``'s precision record (where it came from: a
    checkpoint's path and step)."""
    record = program.graph_module.meta.get(_META_KEY)
    if isinstance(record, dict):
        record.update(fields)


class TrainedEngine(Protocol):
    """What :func:`export` reads of a :class:`~distamp.DistAMP` after training (structurally:
    deploy sits above the engine and reads it; the engine never imports deploy)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def precision(self) -> Precision: ...

    strategy: str
    config: Any
    adaptive: Any


def _trained(
    engine: TrainedEngine,
    policy: AutocastPolicy | PrecisionLike | None,
    promotions: Iterable[PrecisionChange] | None,
) -> tuple[nn.Module, AutocastPolicy | PrecisionLike, Iterable[PrecisionChange]]:
    """An engine's model (out of DDP), and the policy and promotions to export it with: those
    given, else the engine's own (see :func:`export`)."""
    if engine.strategy in _SHARDED:
        raise ValueError(
            f"distamp.export(amp) with strategy={engine.strategy!r}: the parameters are sharded, "
            "so no rank holds the whole model. Save a checkpoint (amp.save_state(DIR), on every "
            "rank) and export it in one process: distamp export DIR -o model.pt2"
        )
    model = engine.model
    inner = getattr(model, "module", None)  # DDP (torch's or torchft's) holds the model
    if isinstance(inner, nn.Module):
        model = inner
    if policy is None:
        policy = engine.config.policy or AutocastPolicy(engine.precision)
    if promotions is None:
        promotions = ()
        if engine.adaptive is not None:
            promotions = adaptive_changes({"adaptive": engine.adaptive.state_dict()})
    return model, policy, promotions


def export_engine(
    engine: TrainedEngine, example_inputs: Any, **options: Any
) -> torch.export.ExportedProgram:
    """:func:`export` for an engine's model after training, the same as
    ``distamp.export(amp, example_inputs, ...)``: its policy (or the default policy of its
    precision), the promotions its adaptive rules made, the model unwrapped from DDP.

    Raises:
        ValueError: a sharded strategy (FSDP, FSDP2, HSDP): no rank holds the whole model; the
            message says how to export from a checkpoint instead. And :func:`export`'s errors.
    """
    return export(engine, example_inputs, **options)
