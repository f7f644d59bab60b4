"""The numeric monitor's statistics under pipeline parallelism: one segment per stage.

Each pipeline stage watches its own modules, so the statistics of two stages differ in length
and meaning, yet the step's skip flag must be agreed over the whole job in one collective.
:class:`StageSegments` gives every stage a segment of one job-wide vector (its capacity read
once at setup from every rank): a rank writes its stage's statistics into its segment and zeros
elsewhere, so the one MAX (or SUM) reduction agrees each stage's numbers over the ranks that
run that stage (its data-parallel replicas) and hands every rank every stage's overflow flags.

With those a skip is blamed job-wide: the first stage (by stage index) whose watched modules
went non-finite holds the culprit; the stages after it, whose outputs merely inherited the
inf/NaN, blame nothing. Each stage then decides on its own agreed report (the same on its
replicas), so a stage promotes only what its modules caused.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from distamp.agreement.reduction import Rider
from distamp.observe.numerics import NumericMonitor

__all__ = ["StageSegments", "gather_stage_states"]


class StageSegments:
    """A :class:`~distamp.agreement.reduction.Rider` that puts ``inner``'s payload in this
    stage's segment of a job-wide vector (see the module doc).

    Args:
        inner: this rank's rider (the monitor, or the monitor and the backward scales).
        monitor: the monitor whose flags lead each segment; told when a skip is blamed on an
            earlier stage.
        stage: this rank's stage index.
        capacity: the most floats ``inner`` sends in a step.

    Collective at construction (one gather over the default group: each rank's stage, its
    capacity and its number of watched modules).
    """

    def __init__(self, inner: Rider, monitor: NumericMonitor, stage: int, capacity: int) -> None:
        self.inner, self.monitor, self.stage = inner, monitor, stage
        mine = (stage, capacity, len(monitor.names))
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        stages: dict[int, tuple[int, int]] = {}
        for s, cap, m in everyone:
            if stages.setdefault(s, (cap, m)) != (cap, m):
                raise ValueError(
                    f"pipeline stage {s}: its ranks watch different modules ({stages[s]} vs "
                    f"{(cap, m)} floats, modules): build every replica of a stage alike"
                )
        self.offsets: dict[int, int] = {}
        total = 0
        for s in sorted(stages):
            self.offsets[s] = total
            total += stages[s][0]
        self.flags = {s: stages[s][1] for s in stages}  # each segment's leading flag count
        self.replicas = sum(1 for s, _, _ in everyone if s == stage)
        self.total, self.capacity = total, capacity
        self._sent = 0
        self._device = torch.device("cpu")

    def payload(self) -> torch.Tensor | None:
        """Always a vector (every rank sends one, whatever its stage has this step)."""
        own = self.inner.payload()
        self._sent = 0 if own is None else own.numel()
        if own is not None:
            self._device = own.device
        if self._sent > self.capacity:
            raise AssertionError(f"stage {self.stage} sent {self._sent} > {self.capacity}")
        out = torch.zeros(self.total, device=self._device)
        if own is not None:
            start = self.offsets[self.stage]
            out[start : start + self._sent] = own
        return out

    def deliver(self, reduced: torch.Tensor, op: str, ranks: int) -> None:
        start = self.offsets[self.stage]
        upstream = [
            reduced[self.offsets[s] : self.offsets[s] + self.flags[s]]
            for s in self.offsets
            if s < self.stage
        ]
        if upstream:
            self.monitor.blamed_upstream = torch.cat(upstream).gt(0).any()
        if self._sent:  # a SUM adds this stage's replicas only: their mean divides by them
            del ranks
            self.inner.deliver(reduced[start : start + self._sent], op, self.replicas)


def gather_stage_states(stage: int, state: dict[str, Any]) -> dict[str, Any]:
    """Every stage's adaptive state, gathered onto every rank (collective over the default
    group): ``{"stages": {"<index>": state}}``, what a rank-0 checkpoint must hold."""
    everyone: list[Any] = [(stage, state)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (stage, state))
    return {"stages": {str(s): st for s, st in sorted(everyone, key=lambda e: e[0])}}
