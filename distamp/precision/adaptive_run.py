"""The numeric monitor and adaptive precision, driven by the scaler's step.

One :class:`AdaptiveRun` serves :class:`~distamp.DistAMP` and every framework plug-in
(Accelerate, Lightning Fabric and Trainer, the Hugging Face Trainer) alike: it watches the
scaler (:meth:`~distamp.DistributedGradScaler.attach_watcher`), so whoever drives the scaler
drives the rules, in the same order. Gradient underflow is read before the first gradient is
unscaled, the statistics ride the scaler's one flag collective, and the rules run on the agreed
report at the end of ``update()``, so every rank changes the same modules at the same step.
Per-block backward scales (``AutocastPolicy(backward_scales=...)``) ride along the same way:
their window joins the monitor's payload, their exponents change at the same reports and are
handed to the scaler, which unscales each gradient by its own factor. Every change is logged
(``logging`` logger ``"distamp.precision"``) and kept for the owner to hand to its framework's
own logger (:meth:`AdaptiveRun.take_changes`, :func:`change_metrics`). Pipeline stages (one
per rank) each decide for their own modules from their segment of the job-wide statistics
(:mod:`distamp.precision.pipeline_riders`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from distamp.agreement.scale_reads import current_loss_scale
from distamp.observe.numerics import NumericMonitor, NumericStats
from distamp.observe.telemetry import Telemetry
from distamp.precision.adaptive import AdaptivePrecision, PrecisionChange
from distamp.precision.backward_scales import BackwardScaleChange, BackwardScales
from distamp.precision.pipeline_riders import StageSegments, gather_stage_states
from distamp.precision.policy import AutocastPolicy, Precision, parse_precision
from distamp.scaler import DistributedGradScaler

__all__ = [
    "STATE_KEY",
    "AdaptiveRun",
    "Change",
    "change_metrics",
    "check_plugin_state",
    "load_plugin_state",
    "plugin_state",
    "refuse_under_pipeline",
]

STATE_KEY = "distamp_adaptive"  # the run's entry in a plug-in's checkpoint state

Change = PrecisionChange | BackwardScaleChange
_log = logging.getLogger("distamp.precision")
_BITS = {"fp32": 32.0, "bf16": 16.0, "fp16": 16.0, "fp8": 8.0}


def change_metrics(changes: Sequence[Change], prefix: str = "distamp/") -> dict[str, float]:
    """Numbers for a framework's metric logger (trackers take numbers, not text): for each
    precision change ``{prefix}precision_bits/<module>`` (the new format's width: 32, 16 or 8),
    for each backward-scale change ``{prefix}grad_exponent/<block>`` (the new exponent)."""
    out: dict[str, float] = {}
    for c in changes:
        if isinstance(c, PrecisionChange):
            out[f"{prefix}precision_bits/{c.module}"] = _BITS[c.after]
        else:
            out[f"{prefix}grad_exponent/{c.block}"] = float(c.after)
    return out


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

    It watches the scaler: nothing else is called per step. Build it once the model is set up
    (after the policy's fixed fp32 modules are applied), keep :meth:`state_dict` in the
    checkpoint, and :meth:`close` it when training ends.

    Args:
        model: the unwrapped model (names as the user knows them).
        precision: the training precision; the monitor needs fp16 or bf16.
        policy: the policy (its ``adaptive`` part, if set, decides).
        scaler: the scaler that drives the run; the statistics ride its step collective. It
            must be enabled (fp16's loss scaling or bf16's ``check_only=True``): a disabled
            scaler has no step to watch.
        interval: steps between reports when the policy does not set one.
        step: the owner's optimizer-step count now.
        stage: this rank's pipeline stage index (one stage per rank), or ``None``: the
            statistics then ride in the stage's segment of a job-wide vector
            (:mod:`distamp.precision.pipeline_riders`), each stage decides for its own
            modules, and :meth:`state_dict` holds every stage's part (collective).
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
        stage: int | None = None,
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
        if not scaler.is_enabled():
            raise ValueError(
                "adaptive precision and the numeric monitor are driven by the scaler's steps: "
                "this scaler is disabled; pass an enabled DistributedGradScaler (for bf16 one "
                "with check_only=True)"
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
        self.scaler, self.model = scaler, model
        # Where each report is kept, per rank (distamp.observe.telemetry); set by the owner.
        self.telemetry: Telemetry | None = None
        self.changes: list[Change] = []  # every change made or replayed, in order
        self._taken: dict[str, int] = {}  # reader -> how many take_changes() handed it
        self._riders: _StepRiders | None = None
        rider: Any = self.monitor
        if self.scales is not None:  # its hooks after the monitor's: the order they always ran
            self.scales.bind(model)
            scaler.set_grad_exponents(self.scales.grad_exponents())
            self._riders = rider = _StepRiders(self.monitor, self.scales)
        self.stage = stage
        if stage is not None:
            capacity = self.monitor.capacity + (0 if self.scales is None else self.scales.capacity)
            rider = StageSegments(rider, self.monitor, stage, capacity)
        scaler.attach_rider(rider)
        scaler.attach_watcher(self)

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
        stage: int | None = None,
    ) -> AdaptiveRun | None:
        """An :class:`AdaptiveRun` when the policy is adaptive, scales blocks' gradients, or
        ``interval`` is set."""
        adaptive = policy is not None and (
            policy.adaptive is not None or policy.backward_scales is not None
        )
        if not adaptive and interval is None:
            return None
        return cls(
            model,
            precision=precision,
            policy=policy,
            scaler=scaler,
            interval=interval,
            step=step,
            stage=stage,
        )

    @classmethod
    def for_plugin(
        cls,
        model: nn.Module,
        *,
        policy: Any,
        precision: Any,
        scaler: Any,
        owner: str,
    ) -> AdaptiveRun | None:
        """The run a framework plug-in owns, or ``None`` when ``policy`` neither adapts nor
        scales blocks' gradients. The same object, rules and order as in the engine.

        Args:
            precision: the plug-in's training precision, in any spelling
                :func:`~distamp.precision.policy.parse_precision` takes.

        Raises:
            ValueError: naming ``owner``: the policy's precision is not the plug-in's, it is
                fp8 (the engine converts the Linear layers and owns their float8 scales), or
                the plug-in has no enabled :class:`~distamp.DistributedGradScaler` to drive it.
        """
        adaptive = getattr(policy, "adaptive", None)
        scales = getattr(policy, "backward_scales", None)
        if adaptive is None and scales is None:
            return None
        what = "adaptive=..." if adaptive is not None else "backward_scales=..."
        try:
            precision = parse_precision(precision)
        except ValueError:
            precision = None
        if precision is None or precision.compute_dtype is None:
            raise ValueError(
                f"{owner}: AutocastPolicy(..., {what}) needs fp16 or bf16 mixed precision; "
                "the plug-in trains without it"
            )
        if precision.float8_linears:
            raise ValueError(
                f"{owner}: adaptive fp8 converts and promotes float8 Linear layers, which "
                "distamp.DistAMP owns (with their float8 weight scales); train fp8 through it, "
                "or use an fp16/bf16 policy here"
            )
        if policy.precision.name != precision.name:
            raise ValueError(
                f"{owner}: AutocastPolicy({policy.precision.name!r}, {what}) with "
                f"{precision.name!r} training: the rules watch the format the model computes "
                f"in; make the policy's precision {precision.name!r}"
            )
        if not isinstance(scaler, DistributedGradScaler) or not scaler.is_enabled():
            raise ValueError(
                f"{owner}: AutocastPolicy(..., {what}) is driven by distamp's scaler, and this "
                f"plug-in has {type(scaler).__name__ if scaler is not None else 'no scaler'}; "
                "pass a distamp.DistributedGradScaler (check_only=True for bf16)"
            )
        return cls(model, precision=precision, policy=policy, scaler=scaler, interval=None, step=0)

    def before_unscale(self) -> None:
        """The scaler's watcher protocol: before unscaling, the underflow read, at reporting
        steps (no host sync)."""
        self.monitor.before_step()

    def after_update(self, skipped: torch.Tensor) -> None:
        """The scaler's watcher protocol: after ``update()``, the skip's blame; at reporting
        steps the agreed report (one host sync) and the rules' decisions (see :meth:`decide`)."""
        self.decide(skipped)

    def decide(self, skipped: torch.Tensor) -> list[Change]:
        """End the step: the skip's blame; at reporting steps the agreed report (one host
        sync) and the rules' decisions, logged and returned (precision changes, then scale
        changes)."""
        due = self.monitor.due
        stats = self.monitor.end_step(skipped)
        made: list[Change] = []
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
        for change in made:
            _log.info("%s", change)
        self.changes.extend(made)
        if self.telemetry is not None:  # a reporting step: the report is on the host already
            scale = current_loss_scale(self.scaler)
            self.telemetry.record(
                stats,
                self.monitor.latest_local,
                loss_scale=1.0 if scale is None else float(scale),
                grad_exponents=self.grad_exponents,
                changes=made,
            )
        return made

    def take_changes(self, reader: str = "log") -> list[Change]:
        """The changes made since ``reader``'s previous call (replayed ones included), for the
        owner to log through its framework's logger; each reader (a console log, a metrics
        logger) gets every change once."""
        new = self.changes[self._taken.get(reader, 0) :]
        self._taken[reader] = len(self.changes)
        return new

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
        """The monitor's window, the change logs and the rules' counts (plain Python). For a
        pipeline stage every stage's, gathered (collective: call it on every rank)."""
        state = {
            "monitor": self.monitor.state_dict(),
            "adaptive": None if self.adaptive is None else self.adaptive.state_dict(),
            "backward_scales": None if self.scales is None else self.scales.state_dict(),
        }
        return state if self.stage is None else gather_stage_states(self.stage, state)

    def _own(self, state: Any) -> Any:
        """A pipeline stage's part of a gathered state (see :meth:`state_dict`)."""
        if self.stage is None:
            return state
        stages = state.get("stages") if isinstance(state, dict) else None
        if not isinstance(stages, dict) or str(self.stage) not in stages:
            raise ValueError(
                f"pipeline stage {self.stage}: the state holds no part for it (saved by another "
                f"pipeline layout?), got {state!r:.200}"
            )
        return stages[str(self.stage)]

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Check a :meth:`state_dict` against this run (``ValueError`` naming the part and the
        field); changes nothing: the monitor's window, the promotions (modules this model has)
        and the backward-scale exponents (blocks this model has, exponents in range)."""
        state = self._own(state)
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
        state = self._own(state)
        self.monitor.load_state_dict(state["monitor"])
        replayed: list[Change] = []
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])
            replayed.extend(self.adaptive.changes)
        if self.scales is not None and state.get("backward_scales") is not None:
            self.scales.load_state_dict(state["backward_scales"])
            self.scaler.set_grad_exponents(self.scales.grad_exponents())
            replayed.extend(self.scales.changes)
        self.changes, self._taken = sorted(replayed, key=lambda c: c.step), {}

    def close(self) -> None:
        """Detach from the scaler and take every hook off the model (the logs stay)."""
        self.scaler.attach_watcher(None)
        self.scaler.attach_rider(None)
        self.monitor.remove()
        if self.scales is not None:
            self.scales.remove()
            self.scaler.set_grad_exponents(None)


def plugin_state(scaler: Any, run: AdaptiveRun | None) -> dict[str, Any]:
    """A framework plug-in's checkpoint state: its scaler's (empty without one) and, under
    :data:`STATE_KEY`, the adaptive run's."""
    state = {} if scaler is None else dict(scaler.state_dict())
    if run is not None:
        state[STATE_KEY] = run.state_dict()
    return state


def check_plugin_state(state: Any, scaler: Any, run: AdaptiveRun | None) -> None:
    """Check what :func:`load_plugin_state` would load, changing nothing (``ValueError`` naming
    the part), so a checkpoint can be refused before a framework restores the model. A run not
    built yet (Lightning restores a DDP model before its precision plug-in sees it) gets its
    part checked for structure; the full check follows at :func:`load_plugin_state`."""
    if not isinstance(state, dict):
        raise ValueError(f"a plug-in state must be a dict, got {type(state).__name__}")
    state = dict(state)
    saved = state.pop(STATE_KEY, None)
    if saved is not None and run is not None:
        run.check_state_dict(saved)
    elif saved is not None and (not isinstance(saved, dict) or "monitor" not in saved):
        raise ValueError(f"{STATE_KEY!r} must be a dict with a 'monitor' entry, got {saved!r:.120}")
    if isinstance(scaler, DistributedGradScaler) and scaler.is_enabled():
        scaler.check_state_dict(state)


def load_plugin_state(state: dict[str, Any], scaler: Any, run: AdaptiveRun | None) -> None:
    """Load :func:`plugin_state`'s output: the run's part is checked before the scaler loads
    (a refused state changes nothing), then its changes are replayed. A state saved without a
    run (rules switched on at resume) starts the run with no changes."""
    state = dict(state)
    saved = state.pop(STATE_KEY, None)
    if run is not None and saved is not None:
        run.check_state_dict(saved)
    if scaler is not None:
        scaler.load_state_dict(state)
    if run is not None and saved is not None:
        run.load_state_dict(saved)


def refuse_under_pipeline(policy: AutocastPolicy | None, interval: int | None) -> None:
    """Refuse the monitor, adaptive rules and backward scales for a rank that holds several
    pipeline stages (interleaved and looped schedules), before any collective: one stage per
    rank is what the job-wide segments (:mod:`distamp.precision.pipeline_riders`) describe.

    Raises:
        ValueError: naming what was asked for and what to do instead.
    """
    asked = [] if interval is None else [f"numerics_interval={interval}"]
    if policy is not None and policy.adaptive is not None:
        asked.append("AutocastPolicy(adaptive=...)")
    if policy is not None and policy.backward_scales is not None:
        asked.append("AutocastPolicy(backward_scales=...)")
    if asked:
        raise ValueError(
            f"{' and '.join(asked)} with several pipeline stages on one rank: the numeric "
            "monitor and the rules it drives take one stage per rank (GPipe, 1F1B); use such a "
            "schedule, or train these stages with a static policy (fp32_modules=... for the "
            "modules that overflow)"
        )
