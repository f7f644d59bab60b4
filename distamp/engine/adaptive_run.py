"""The engine's numeric monitor and adaptive precision, wired into its step.

:class:`DistAMP` holds one :class:`AdaptiveRun` when its policy is adaptive or it was asked for
the monitor (``numerics_interval``). The run owns the order: gradient underflow is read before
unscaling, the statistics ride the scaler's one flag collective, and the rules run on the agreed
report after ``update()``, so every rank changes the same modules at the same step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distamp.observe.numerics import NumericMonitor, NumericStats
from distamp.precision.adaptive import AdaptivePrecision, PrecisionChange
from distamp.precision.policy import AutocastPolicy, Precision
from distamp.scaler import DistributedGradScaler

__all__ = ["AdaptiveRun"]


class AdaptiveRun:
    """A monitor attached to the scaler, and the policy's adaptive rules if any.

    Args:
        model: the unwrapped model (names as the user knows them).
        precision: the training precision; the monitor needs fp16 or bf16.
        policy: the engine's policy (its ``adaptive`` part, if set, decides).
        scaler: the engine's scaler; the statistics ride its step collective.
        interval: steps between reports when the policy does not set one.
        step: the engine's step count now.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        precision: Precision,
        policy: AutocastPolicy | None,
        scaler: DistributedGradScaler,
        interval: int | None,
        step: int,
    ) -> None:
        self.adaptive: AdaptivePrecision | None = policy.adaptive if policy is not None else None
        rules = self.adaptive.rules if self.adaptive is not None else None
        if precision.compute_dtype is None:
            raise ValueError(
                f"numerics_interval={interval!r} with precision={precision.name!r}: the monitor "
                "watches fp16/bf16 training; drop the argument for fp32"
            )
        self.monitor = NumericMonitor(
            model,
            compute_dtype=precision.compute_dtype,
            interval=interval if interval is not None else (rules.interval if rules else 10),
            watch=rules.watch if rules is not None else None,
            step=step,
        )
        if self.adaptive is not None:
            assert policy is not None
            fixed = tuple(name for name, _ in policy.fp32_modules_of(model))
            self.adaptive.bind(model, fixed)
        self.scaler = scaler
        scaler.attach_rider(self.monitor)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        *,
        precision: Precision,
        policy: AutocastPolicy | None,
        scaler: DistributedGradScaler,
        interval: int | None,
        step: int,
    ) -> AdaptiveRun | None:
        """An :class:`AdaptiveRun` when the policy is adaptive or ``interval`` is set."""
        adaptive = policy is not None and policy.adaptive is not None
        if not adaptive and interval is None:
            return None
        return cls(
            model, precision=precision, policy=policy, scaler=scaler, interval=interval, step=step
        )

    def before_step(self) -> None:
        """Before unscaling: the underflow read, at reporting steps (no host sync)."""
        self.monitor.before_step()

    def after_step(self, skipped: torch.Tensor) -> list[PrecisionChange]:
        """After ``update()``: the skip's blame; at reporting steps the agreed report (one host
        sync) and the rules' decisions, returned."""
        stats = self.monitor.end_step(skipped)
        if stats is None or self.adaptive is None:
            return []
        return self.adaptive.decide(stats)

    @property
    def latest(self) -> NumericStats | None:
        return self.monitor.latest

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor.state_dict(),
            "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the monitor's window and replay the saved precision changes."""
        self.monitor.load_state_dict(state["monitor"])
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])

    def close(self) -> None:
        self.scaler.attach_rider(None)
        self.monitor.remove()
