"""The engine's numeric monitor and adaptive precision, wired into its step.

:class:`DistAMP` holds one :class:`AdaptiveRun` when its policy is adaptive or it was asked for
the monitor (``numerics_interval``). The run owns the order: gradient underflow is read before
unscaling, the statistics ride the scaler's one flag collective, and the rules run on the agreed
report after ``update()``, so every rank changes the same modules at the same step. Per-block
backward scales (``AutocastPolicy(backward_scales=...)``) ride along the same way: their window
joins the monitor's payload, their exponents change at the same reports and are handed to the
scaler, which unscales each gradient by its own factor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distamp.observe.numerics import NumericMonitor, NumericStats
from distamp.precision.adaptive import AdaptivePrecision, PrecisionChange
from distamp.precision.backward_scales import BackwardScaleChange, BackwardScales
from distamp.precision.policy import AutocastPolicy, Precision
from distamp.scaler import DistributedGradScaler

__all__ = ["AdaptiveRun"]


class _StepRiders:
    """The monitor's and the backward scales' statistics as one rider of the step's collective
    (each payload at most once a step; the reduced tensor split back by length)."""

    def __init__(self, monitor: NumericMonitor, scales: BackwardScales) -> None:
        self.monitor, self.scales = monitor, scales
        self.sent = False
        self._lengths: list[int] = []

    def payload(self) -> torch.Tensor | None:
        if self.sent:
            return None
        self.sent = True
        parts = [self.monitor.payload(), self.scales.payload(self.monitor.due)]
        self._lengths = [0 if p is None else p.numel() for p in parts]
        present = [p for p in parts if p is not None]
        if not present:
            return None
        return torch.cat([p.to(present[0].device) for p in present])

    def deliver(self, reduced: torch.Tensor, op: str, ranks: int) -> None:
        first, second = self._lengths
        if first:
            self.monitor.deliver(reduced[:first], op, ranks)
        if second:
            self.scales.deliver(reduced[first : first + second], op, ranks)


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
        self.scales: BackwardScales | None = policy.backward_scales if policy is not None else None
        rules = self.adaptive.rules if self.adaptive is not None else None
        if precision.compute_dtype is None:
            raise ValueError(
                f"numerics_interval={interval!r} with precision={precision.name!r}: the monitor "
                "watches fp16/bf16 training; drop the argument for fp32"
            )
        if self.scales is not None and (not scaler.is_enabled() or scaler.check_only):
            raise ValueError(
                "backward_scales=True needs the fp16 loss scaler: the engine's scaler is "
                "disabled or check-only; pass an enabled DistributedGradScaler or drop "
                "backward_scales"
            )
        # What can refuse the model runs before the monitor's hooks go on it.
        if self.adaptive is not None:
            assert policy is not None
            fixed = tuple(name for name, _ in policy.fp32_modules_of(model))
            self.adaptive.bind(model, fixed)
        self.monitor = NumericMonitor(
            model,
            compute_dtype=precision.compute_dtype,
            interval=interval if interval is not None else (rules.interval if rules else 10),
            watch=rules.watch if rules is not None else None,
            step=step,
        )
        self.scaler = scaler
        self._riders: _StepRiders | None = None
        if self.scales is not None:  # its hooks after the monitor's: the order they always ran
            self.scales.bind(model)
            scaler.set_grad_exponents(self.scales.grad_exponents())
            self._riders = _StepRiders(self.monitor, self.scales)
            scaler.attach_rider(self._riders)
        else:
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
        """An :class:`AdaptiveRun` when the policy is adaptive, scales blocks' gradients, or
        ``interval`` is set."""
        adaptive = policy is not None and (
            policy.adaptive is not None or policy.backward_scales is not None
        )
        if not adaptive and interval is None:
            return None
        return cls(
            model, precision=precision, policy=policy, scaler=scaler, interval=interval, step=step
        )

    def before_step(self) -> None:
        """Before unscaling: the underflow read, at reporting steps (no host sync)."""
        self.monitor.before_step()

    def after_step(self, skipped: torch.Tensor) -> list[PrecisionChange | BackwardScaleChange]:
        """After ``update()``: the skip's blame; at reporting steps the agreed report (one host
        sync) and the rules' decisions, returned (precision changes, then scale changes)."""
        due = self.monitor.due
        stats = self.monitor.end_step(skipped)
        made: list[PrecisionChange | BackwardScaleChange] = []
        if self.scales is not None:
            assert self._riders is not None
            self._riders.sent = False
            self.scales.end_step(due, skipped)
        if stats is None:
            return made
        if self.adaptive is not None:
            made.extend(self.adaptive.decide(stats))
        if self.scales is not None:
            changed = self.scales.decide(stats)
            if changed:  # the same exponents on every rank, from the agreed report
                self.scaler.set_grad_exponents(self.scales.grad_exponents())
            made.extend(changed)
        return made

    @property
    def grad_exponents(self) -> dict[str, int]:
        """Each block's backward-scale exponent now (empty without backward scales)."""
        if self.scales is None:
            return {}
        return dict(zip(self.scales.names, self.scales.exponents, strict=True))

    @property
    def latest(self) -> NumericStats | None:
        return self.monitor.latest

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor.state_dict(),
            "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
            "backward_scales": None if self.scales is None else self.scales.state_dict(),
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Check a :meth:`state_dict` against this run (``ValueError`` naming the part and the
        field); changes nothing: the monitor's window, the promotions (modules this model has)
        and the backward-scale exponents (blocks this model has, exponents in range)."""
        if not isinstance(state, dict) or "monitor" not in state:
            raise ValueError(f"must be a dict with a 'monitor' entry, got {state!r:.200}")
        self.monitor.check_state_dict(state["monitor"])
        for key, part in (("adaptive", self.adaptive), ("backward_scales", self.scales)):
            saved = state.get(key)
            if part is not None and saved is not None:
                try:
                    part.validate_state_dict(saved)
                except (ValueError, TypeError) as exc:
                    raise ValueError(f"{key!r}: {exc}") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the monitor's window and replay the saved precision changes (checked first:
        a refused state changes nothing)."""
        self.check_state_dict(state)
        self.monitor.load_state_dict(state["monitor"])
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        if self.scales is not None and state.get("backward_scales") is not None:
            self.scales.load_state_dict(state["backward_scales"])
            self.scaler.set_grad_exponents(self.scales.grad_exponents())

    def close(self) -> None:
        self.scaler.attach_rider(None)
        self.monitor.remove()
        if self.scales is not None:
            self.scales.remove()
            self.scaler.set_grad_exponents(None)
