"""Overflow diagnostics: which parameters, modules and ranks produced the inf/NaN of a skipped step.

A loss scaler normally reports one bit per step (found_inf). The unscale pass already looks at
every gradient, so it can as well raise one flag per gradient tensor (the kernels'
``per_tensor_flags``). :class:`OverflowRecorder` keeps those flags on the device: at every
``update()`` the flags of a skipped step replace the kept ones (a ``torch.where`` on the agreed
found_inf, no host sync), so after any number of good steps the last skipped step's flags are still
there. Only :meth:`DistributedGradScaler.overflow_report` reads them (and gathers them from every
rank), on request. The recorder lives in :mod:`distamp.observe.overflow_flags`.

:class:`NonFiniteTracer` answers the question the gradients cannot: where did the inf/NaN first
appear in the forward pass? Forward hooks reduce each module's output to one on-device "all
finite" bit and remember the first module (in execution order) whose output was not; the loss is
checked before scaling. Opt-in, because every hook reads its module's output once more.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.agreement.topology import local_grad
from distamp.cluster import is_distributed
from distamp.model_names import named_model_modules
from distamp.observe.overflow_flags import OverflowRecorder
from distamp.torch_compat import foreach_norm, in_recomputation

__all__ = [
    "NonFiniteTracer",
    "OverflowEntry",
    "OverflowRecorder",
    "OverflowReport",
    "ScaleHealth",
    "build_report",
    "trace_nonfinite",
]


@dataclass(frozen=True)
class OverflowEntry:
    """One parameter whose gradient was non-finite at the reported step."""

    parameter: str
    module: str
    ranks: tuple[int, ...]
    kind: str  # "inf", "nan", "inf+nan", or "non-finite" when the gradient is no longer there

    def __str__(self) -> str:
        where = ",".join(map(str, self.ranks))
        return f"{self.parameter} ({self.kind}, rank {where})"


@dataclass(frozen=True)
class OverflowReport:
    """What went non-finite at the last skipped step (identical on every rank).

    Attributes:
        step: the scaler iteration (number of ``update()`` calls before it) of the skip.
        entries: the parameters with a non-finite gradient, in optimizer order.
        largest_grad_norms: ``(parameter, norm)`` of the largest finite local gradient norms at
            report time (the usual suspects when an inf is near), when gradients are still held.
        forward: the first module whose forward output was non-finite, when a
            :class:`NonFiniteTracer` was active; ``None`` otherwise or when all were finite.
        loss_nonfinite: whether the loss itself was non-finite before scaling (tracer only).
        extra: more findings by name; ``"fp8_saturated"``: the fp8 layers whose float8 GEMMs
            went non-finite (see :meth:`distamp.precision.fp8.Float8Training.saturation`).
    """

    step: int
    entries: tuple[OverflowEntry, ...]
    largest_grad_norms: tuple[tuple[str, float], ...] = ()
    forward: str | None = None
    loss_nonfinite: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def modules(self) -> tuple[str, ...]:
        """The modules owning the flagged parameters, in order, without repeats."""
        return tuple(dict.fromkeys(e.module for e in self.entries))

    def one_line(self) -> str:
        """A log line: the step, the first few parameters, and the forward origin if known."""
        head = ", ".join(str(e) for e in self.entries[:3])
        more = f" +{len(self.entries) - 3} more" if len(self.entries) > 3 else ""
        parts = [f"overflow at iteration {self.step}: {head or 'no gradient flagged'}{more}"]
        if self.forward is not None:
            parts.append(f"first non-finite forward output: {self.forward}")
        if self.loss_nonfinite:
            parts.append("the loss itself was non-finite before scaling")
        saturated = self.extra.get("fp8_saturated")
        if saturated:  # set by distamp.precision.fp8 under precision="fp8"
            parts.append(f"fp8 amax saturated: {', '.join(saturated[:3])}")
        return "; ".join(parts)


def module_of(name: str) -> str:
    """``"blocks.0.attn.qkv.weight"`` -> ``"blocks.0.attn.qkv"`` (the root for a bare name)."""
    return name.rsplit(".", 1)[0] if "." in name else "<root>"


def _kind(param: torch.Tensor) -> str:
    grad = param.grad
    if grad is None:
        return "non-finite"
    local = local_grad(grad)
    if local.is_sparse:
        local = local.coalesce().values()
    has_nan = bool(torch.isnan(local).any())
    has_inf = bool(torch.isinf(local).any())
    if has_nan and has_inf:
        return "inf+nan"
    return "nan" if has_nan else "inf" if has_inf else "non-finite"


def build_report(
    recorder: OverflowRecorder,
    names: Mapping[int, str],
    all_params: Sequence[torch.Tensor],
    group: Any = None,
    tracer: NonFiniteTracer | None = None,
) -> OverflowReport | None:
    """Assemble the report from this rank's kept flags and every rank's (collective if grouped).

    Returns ``None`` when no step has been skipped yet (on every rank: the skip is agreed).
    """
    step, flagged = recorder.flagged()
    latest = step >= 0 and step == recorder.iterations - 1  # the gradients are still that step's
    local = [
        (names.get(id(p), f"param[{i}]"), _kind(p) if latest else "non-finite")
        for i, p in enumerate(flagged)
    ]
    largest = _largest_norms(all_params, names)
    forward = tracer.first_nonfinite(kept=True) if tracer is not None else None
    loss_bad = tracer.loss_was_nonfinite(kept=True) if tracer is not None else None
    rank = 0
    gathered: list[Any] = [(rank, local, forward, loss_bad)]
    if is_distributed():
        rank = dist.get_rank()
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (rank, local, forward, loss_bad), group=group)
    if step < 0:
        return None
    ranks: dict[str, list[int]] = {}
    kinds: dict[str, set[str]] = {}
    for r, entries, _, _ in gathered:
        for name, kind in entries:
            ranks.setdefault(name, []).append(r)
            kinds.setdefault(name, set()).add(kind)
    entries = tuple(
        OverflowEntry(name, module_of(name), tuple(sorted(rs)), _merge_kinds(kinds[name]))
        for name, rs in ranks.items()
    )
    first_forward = next((f"{f} (rank {r})" for r, _, f, _ in gathered if f is not None), None)
    losses = [lb for _, _, _, lb in gathered if lb is not None]
    return OverflowReport(
        step=step,
        entries=entries,
        largest_grad_norms=largest,
        forward=first_forward,
        loss_nonfinite=any(losses) if losses else None,
    )


def _merge_kinds(kinds: set[str]) -> str:
    known = {k for k in kinds if k != "non-finite"}
    if not known:
        return "non-finite"
    return "inf+nan" if "inf+nan" in known or known == {"inf", "nan"} else known.pop()


def _largest_norms(
    params: Sequence[torch.Tensor], names: Mapping[int, str], top: int = 3
) -> tuple[tuple[str, float], ...]:
    grads = []
    for i, p in enumerate(params):
        if p.grad is None or p.grad.is_sparse:
            continue
        local = local_grad(p.grad)
        if local.numel():
            grads.append((names.get(id(p), f"param[{i}]"), local))
    if not grads:
        return ()
    norms = torch.stack(foreach_norm([g for _, g in grads])).float().cpu().tolist()
    finite = [(n, v) for (n, _), v in zip(grads, norms, strict=True) if math.isfinite(v)]
    return tuple(sorted(finite, key=lambda nv: -nv[1])[:top])


class NonFiniteTracer:
    """Forward hooks that find the first module whose output is not finite, on device.

    Each hook costs one reduction and two tiny in-place updates: the fp32 sum of its module's
    output (non-finite exactly when an element is, short of an fp32 overflow of the sum itself)
    decides whether the module's slot takes the current value of a clock that every hook call
    advances, so the slots hold, per module, when its output first went non-finite, in the order
    modules *finish*: an inner module that produced the first inf finishes before the parents
    that merely passed it on. The earliest slot is only examined once per iteration, at the
    scaler's ``update()`` (:meth:`commit`, a few kernels, no host sync) or on request. Attached
    to a scaler (``scaler.attach_tracer``), the record is kept for a skipped step and cleared
    after a good one, like the gradient flags.

    Tensors only, no Python state per call: a compiled block traces the hooks into its graph
    (no graph break per module, no recompilation per step), each module's slot an index tensor.
    """

    _NONE = 2**62

    def __init__(self, model: nn.Module) -> None:
        modules = list(named_model_modules(model))  # model names: the same under any wrapper
        self.names = [name or "<root>" for name, _ in modules]
        first = next(iter(model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        # per module: the clock value at which its output first went non-finite (or _NONE)
        self._when = torch.full((len(modules),), self._NONE, dtype=torch.int64, device=device)
        self._clock = torch.zeros(1, dtype=torch.int64, device=device)
        self._slots = [torch.tensor([i], device=device) for i in range(len(modules))]
        self._loss_bad: torch.Tensor | None = None
        self._kept_first: torch.Tensor | None = None
        self._kept_loss: torch.Tensor | None = None
        self._handles = [
            module.register_forward_hook(self._hook(index))
            for index, (_, module) in enumerate(modules)
        ]

    def _hook(self, index: int) -> Any:
        slot = self._slots[index]

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if in_recomputation():  # activation checkpointing: this forward was recorded
                return
            for t in _flatten(output):
                if t.is_floating_point() and t.numel():
                    self._record(slot, torch.sum(t.detach(), dtype=torch.float32))

        return hook

    def _record(self, slot: torch.Tensor, total: torch.Tensor) -> None:
        bad = ~torch.isfinite(total.to(self._when.device)).reshape(1)
        when = torch.minimum(
            self._when.index_select(0, slot), torch.where(bad, self._clock, self._NONE)
        )
        self._when.index_copy_(0, slot, when)
        self._clock.add_(1)

    def _first(self) -> torch.Tensor:
        """On device: the module index of the first non-finite output, or ``_NONE``."""
        if not self.names:
            return torch.full((), self._NONE, dtype=torch.int64, device=self._when.device)
        earliest = self._when.min()
        return torch.where(earliest < self._NONE, self._when.argmin(), self._NONE)

    def record_loss(self, loss: torch.Tensor) -> None:
        """Remember whether ``loss`` (before scaling) is non-finite; no host sync."""
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def commit(self, found: torch.Tensor) -> None:
        """At the scaler's ``update()``: keep this iteration's record if it skipped, then reset."""
        first = self._first()
        if self._kept_first is None:
            self._kept_first = torch.full_like(first, self._NONE)
        flag = found.to(first.device)
        self._kept_first.copy_(torch.where(flag, first, self._kept_first))
        self._when.fill_(self._NONE)
        self._clock.zero_()
        if self._loss_bad is not None:
            if self._kept_loss is None:
                self._kept_loss = torch.zeros_like(self._loss_bad)
            flag = found.to(self._loss_bad.device)
            self._kept_loss.copy_(torch.where(flag, self._loss_bad, self._kept_loss))
            self._loss_bad = None

    def first_nonfinite(self, kept: bool = False) -> str | None:
        """The first module whose output was non-finite: since the last commit, or (``kept``)
        at the last skipped step. Host sync, on request."""
        value = self._kept_first if kept else self._first()
        if value is None:
            return None
        index = int(value.item())
        return None if index == self._NONE else self.names[index]

    def loss_was_nonfinite(self, kept: bool = False) -> bool | None:
        """Whether the loss was non-finite before scaling (current, or at the last skip)."""
        value = self._kept_loss if kept else self._loss_bad
        return None if value is None else bool(value.item())

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _flatten(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)


@contextmanager
def trace_nonfinite(model: nn.Module) -> Iterator[NonFiniteTracer]:
    """``with trace_nonfinite(model) as tracer: ...`` — hooks on for the block, off after it."""
    tracer = NonFiniteTracer(model)
    try:
        yield tracer
    finally:
        tracer.remove()


class ScaleHealth:
    """Warns (once per episode) when the loss scale keeps dropping or sits at its floor.

    Fed at logging steps with host values the metrics already synced, so it costs no extra sync.
    An episode ends when a window has no skipped step.
    """

    def __init__(self, consecutive: int = 5, min_scale: float | None = None) -> None:
        self.consecutive = consecutive
        self.min_scale = min_scale
        self._warned = False

    def check(
        self, *, skipped_in_a_row: int, scale: float, report: OverflowReport | None
    ) -> str | None:
        """The warning text to emit now, or ``None``."""
        at_floor = self.min_scale is not None and scale <= self.min_scale
        if skipped_in_a_row == 0 and not at_floor:
            self._warned = False
            return None
        if self._warned or (skipped_in_a_row < self.consecutive and not at_floor):
            return None
        self._warned = True
        where = ""
        if report is not None and report.entries:
            where = f" Last overflow: {report.one_line()}."
        cause = (
            f"the loss scale sits at min_scale={self.min_scale}"
            if at_floor
            else f"{skipped_in_a_row} optimizer steps in a row were skipped (scale now {scale:g})"
        )
        return (
            f"distamp: {cause}.{where} Likely causes: fp16 overflow in one module's activations, "
            "a learning rate too high, or a bad batch. Usual fixes: train in bf16; keep the "
            "overflowing module in fp32 with an AutocastPolicy; lower the learning rate or "
            "init_scale; check the data of the failing step."
        )
