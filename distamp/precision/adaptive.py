"""Adaptive precision: modules move to a wider format when the numbers say they must.

A static policy fixes its fp32 islands before training. Here the islands follow the agreed
statistics of :class:`distamp.observe.numerics.NumericMonitor`:

- a module blamed for ``skips`` of the last ``window`` skipped steps (its forward output was the
  first to go non-finite), or whose headroom (max ``|output|`` / format max) stays above
  ``headroom_limit`` for ``patience`` reports in a row, is **promoted**: fp16/bf16 -> fp32
  (autocast off inside it, inputs cast to fp32);
- with ``precision="fp8"``, a torchao float8 layer is promoted **fp8 -> bf16** (it then computes
  as a plain bf16 linear on its fp32 weight: a per-instance forward, the layer is not re-wrapped)
  when it is blamed for skips as above, or when more than ``fp8_flush_limit`` of its nonzero
  input elements flush to zero in e4m3 (the monitor's ``fp8_flush``) for ``patience`` reports in
  a row; the model's other modules run bf16 and are promoted bf16 -> fp32 as under "bf16".
  Models whose float8 weights FSDP2 all-gathers in float8 are refused (their weights are
  float8 tensors: no bf16 linear to run);
- optionally (``demote=True``) a promoted module whose headroom stays under ``demote_below`` for
  ``calm_reports`` reports with no skip blamed on it goes back, and so does a fallen-back float8
  layer whose flush fraction stays under ``fp8_demote_below``; a module promoted a second time
  stays promoted for good (hysteresis: it cannot oscillate);
- promotions stop at ``max_promoted_fraction`` of the model's parameters, with a warning,
  except where the run could not go on: when every step since the previous report skipped (at
  least ``min(window, interval)`` in a row, up to the report) and a module is blamed for them,
  the cap yields and that module is promoted anyway, with a warning naming it, the share of the
  parameters and how to avoid it. A cap that holds there would leave a run whose every step
  skips until the loss scale underflows: the cap bounds the cost, a dead run costs everything.

Decisions run only on reports, which are identical on every rank (their numbers rode the
step's one flag collective), so every rank changes the same modules at the same step. Every
change is a :class:`PrecisionChange` (step, module, from -> to, reason), kept in the engine's
checkpoint and replayed on resume.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from distamp.arguments import INT32_MAX, ArgumentTypeError
from distamp.model_names import named_model_modules
from distamp.observe.numerics import NumericStats
from distamp.precision.fp8_parallel import gathers_in_float8, is_float8_linear
from distamp.precision.patterns import check_module_patterns
from distamp.precision.promotion import Bf16Linear, Island
from distamp.precision.settings import Fields
from distamp.precision.state_checks import check_adaptive_state

__all__ = ["AdaptivePrecision", "AdaptiveRules", "PrecisionChange", "refuse_outside_engine"]

_ADAPTABLE = ("fp16", "bf16", "fp8")
_WIDER = {"fp8": "bf16", "fp16": "fp32", "bf16": "fp32"}


@dataclass(frozen=True, kw_only=True)
class AdaptiveRules:
    """Settings of adaptive precision (``AutocastPolicy(..., adaptive=AdaptiveRules(...))``).

    Every field is checked here, at construction (:mod:`distamp.precision.settings`): a wrong
    kind is an ``ArgumentTypeError`` (a ``TypeError`` and a ``ValueError``), a value out of range
    a ``ValueError``, both naming the field. Numbers are taken as torch takes them (numpy
    scalars, 0-d tensors; never ``bool``) and stored as plain Python numbers.

    Attributes:
        interval: steps between the monitor's reports, where the rules run; in
            ``[1, 2**31 - 1]`` (default 10).
        window: W, how many of the most recent skipped steps are considered; in
            ``[1, 2**31 - 1]`` (default 8).
        skips: K, promote a module blamed for this many of them; in ``[1, window]`` (default 2:
            a module cannot cause more skips than the window holds).
        headroom_limit: promote a module whose headroom (max ``|output|`` / format max)
            exceeds this, in ``(0, 1]`` (default 0.5: within 2x of the format's maximum; a
            finite low-precision output has headroom <= 1, so 1 switches the rule off) ...
        patience: ... on this many reports in a row; in ``[1, 2**31 - 1]`` (default 2).
        demote: allow demotion back to the low-precision format; a ``bool`` (default False).
        demote_below: headroom under which a promoted module is calm, in
            ``[0, headroom_limit)`` (default 0.05; the gap is the hysteresis).
        calm_reports: calm reports in a row before demotion; in ``[1, 2**31 - 1]`` (default 10).
        max_promoted_fraction: the most of the model's parameters that may be promoted, in
            ``(0, 1]`` (default 0.25).
        watch: module name patterns (``fnmatch`` on qualified names) to watch, a non-empty
            sequence of non-empty strings (stored as a tuple; one string is refused); each must
            match a module of the model it meets (:mod:`distamp.precision.patterns`).
            ``None`` (default): every module with parameters.
        fp8_flush_limit: precision "fp8" only: promote a float8 layer to bf16 when more than
            this fraction of its nonzero inputs flush to zero in e4m3, ``patience`` reports in
            a row; in ``(0, 1]`` (default 0.1; a well-scaled layer flushes about 1e-5; 1
            switches the rule off).
        fp8_demote_below: with ``demote=True``, a float8 layer that fell back to bf16 goes
            back to fp8 after ``calm_reports`` reports in a row with its flush fraction under
            this and no skip blamed on it; in ``[0, fp8_flush_limit)`` (default 0.01; the gap
            is the hysteresis, and a layer that falls back a second time stays in bf16).
    """

    interval: int = 10
    window: int = 8
    skips: int = 2
    headroom_limit: float = 0.5
    patience: int = 2
    demote: bool = False
    demote_below: float = 0.05
    calm_reports: int = 10
    max_promoted_fraction: float = 0.25
    watch: tuple[str, ...] | None = None
    fp8_flush_limit: float = 0.1
    fp8_demote_below: float = 0.01

    def __post_init__(self) -> None:
        f = Fields(self)
        f.whole("interval", 1, INT32_MAX)
        window = f.whole("window", 1, INT32_MAX)
        why = f" (window={window}: a module cannot cause more skips than the window holds)"
        f.whole("skips", 1, window, why)
        f.whole("patience", 1, INT32_MAX)
        f.whole("calm_reports", 1, INT32_MAX)
        limit = f.real("headroom_limit", 0.0, 1.0, low_open=True)
        why = f" (below headroom_limit={limit}, or a module could oscillate)"
        f.real("demote_below", 0.0, limit, high_open=True, why=why)
        f.real("max_promoted_fraction", 0.0, 1.0, low_open=True)
        flush = f.real("fp8_flush_limit", 0.0, 1.0, low_open=True)
        why = f" (below fp8_flush_limit={flush}, or a layer could oscillate)"
        f.real("fp8_demote_below", 0.0, flush, high_open=True, why=why)
        f.flag("demote")
        f.patterns("watch", "blocks.*.mlp", optional=True, empty=False)


@dataclass(frozen=True)
class PrecisionChange:
    """One decision: at optimizer ``step``, ``module`` went ``before`` -> ``after``."""

    step: int
    module: str
    before: str
    after: str
    reason: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.module} {self.before} -> {self.after} ({self.reason})"


class AdaptivePrecision:
    """The adaptive half of an :class:`~distamp.AutocastPolicy`: rules, decisions and the log.

    Args:
        rules: the settings.
        precision: the policy's precision name: "fp16", "bf16" or "fp8".

    Raises:
        ValueError: another precision (fp32 has nothing to promote).
    """

    def __init__(self, rules: AdaptiveRules, precision: str) -> None:
        if precision not in _ADAPTABLE:
            raise ValueError(
                f"adaptive=True with precision={precision!r}: adaptive precision promotes "
                "fp16/bf16 modules to fp32 and fp8 layers to bf16; use precision 'fp16', 'bf16' "
                "or 'fp8', or adaptive=False"
            )
        self.rules, self.precision = rules, precision
        self.low = "bf16" if precision == "fp8" else precision  # of the non-float8 modules
        self._fp8: set[str] = set()  # float8 layers (precision "fp8"): promoted to bf16
        self.changes: list[PrecisionChange] = []
        self._history: deque[str | None] = deque(maxlen=rules.window)
        self._hot: dict[str, int] = {}  # module -> reports in a row above the headroom limit
        self._calm: dict[str, int] = {}  # promoted module -> calm reports in a row
        self._pinned: set[str] = set()  # promoted twice: never demoted again
        self._refused: set[str] = set()  # over the cap: warned once
        self._handles: dict[str, list[Island | Bf16Linear]] = {}
        # 16-bit weights (distamp.optim): a parameter's exact fp32 master, for the islands.
        self.exact_weights: Callable[[torch.Tensor], torch.Tensor | None] | None = None
        self._modules: dict[str, nn.Module] = {}
        self._numel: dict[str, int] = {}
        self._total = 1
        self._fixed: set[str] = set()

    @classmethod
    def from_arg(cls, adaptive: bool | AdaptiveRules, precision: str) -> AdaptivePrecision | None:
        """``AutocastPolicy(adaptive=...)``: False -> None, True -> default rules."""
        if adaptive is False:
            return None
        if adaptive is True:
            return cls(AdaptiveRules(), precision)
        if isinstance(adaptive, AdaptiveRules):
            return cls(adaptive, precision)
        raise ArgumentTypeError(
            f"adaptive={adaptive!r}: pass True, False or an AdaptiveRules(...) instance"
        )

    @property
    def promoted(self) -> tuple[str, ...]:
        """The modules running wider now because of a decision (fp32; bf16 for float8
        layers), in promotion order."""
        return tuple(self._handles)

    def bind(self, model: nn.Module, fixed: tuple[str, ...] = ()) -> None:
        """Know ``model``'s modules by their model names (:mod:`distamp.model_names`: the same
        with or without activation checkpointing, ``torch.compile``, DDP or FSDP, so a change log
        saved under one wrapping replays under another); ``fixed`` are the policy's own fp32
        modules, never changed. A refused model changes nothing.

        Raises:
            ValueError: a ``watch`` pattern that matches no module of ``model``; or precision
                "fp8" and a float8 layer whose weight FSDP2 all-gathers in float8 (no bf16
                weight to fall back on).
        """
        check_module_patterns(model, watch=self.rules.watch)
        modules = dict(named_model_modules(model))
        fp8: set[str] = set()
        if self.precision == "fp8":
            fp8 = {n for n, m in modules.items() if is_float8_linear(m)}
            gathered = [n for n in sorted(fp8) if gathers_in_float8(modules[n])]
            if gathered:
                raise ValueError(
                    f"adaptive=True with precision='fp8': {gathered[0]!r} has its weight "
                    "all-gathered in float8 by FSDP2, so it cannot fall back to bf16; pass "
                    "AutocastPolicy('fp8', fp8_all_gather=False, adaptive=...) or adaptive=False"
                )
        self._modules, self._fp8 = modules, fp8
        self._numel = {n: sum(p.numel() for p in m.parameters()) for n, m in modules.items()}
        self._total = max(1, sum(p.numel() for p in model.parameters()))
        self._fixed = set(fixed)

    # ------------------------------------------------------------------ decisions
    def decide(self, stats: NumericStats) -> list[PrecisionChange]:
        """Apply the rules to one agreed report; returns (and logs) the changes made."""
        made: list[PrecisionChange] = []
        blamed_now = set()
        stalled = self._stalled(stats)
        over_cap: dict[str, str] = {}  # stalled: modules the cap holds back, decided below
        for step, module in stats.skips:
            del step
            self._history.append(module)
            if module is None or module in self._handles:
                continue
            blamed_now.add(module)
            count = sum(1 for m in self._history if m == module)
            if count >= self.rules.skips:
                reason = f"caused {count} of the last {len(self._history)} skipped steps"
                if stalled and self._over_cap(module):
                    over_cap[module] = reason
                elif self._promote(stats.step, module, reason, made):
                    self._forget(module)
        # The cap yields only where nothing else was promoted for the skips: then the module
        # blamed for the most of them (the first such) goes up, the others stay held back.
        ranked = sorted(over_cap, key=lambda m: -sum(1 for h in self._history if h == m))
        for k, module in enumerate(ranked):
            yields = k == 0 and not made
            if self._promote(stats.step, module, over_cap[module], made, stalled=yields):
                self._forget(module)
        for module, flush in stats.fp8_flush.items():
            if module not in self._fp8:
                continue
            if module in self._handles:  # fallen back to bf16: calm enough for fp8 again?
                limit = self.rules.fp8_demote_below
                self._calm_check(stats.step, module, flush, module in blamed_now, made, limit)
                continue
            hot = flush > self.rules.fp8_flush_limit
            streak = self._hot.get(module, 0) + 1 if hot else 0
            self._hot[module] = streak
            if streak >= self.rules.patience:
                reason = (
                    f"{flush:.3g} of its input flushes to zero in e4m3 "
                    f"(> {self.rules.fp8_flush_limit}) for {streak} reports"
                )
                if self._promote(stats.step, module, reason, made):
                    self._hot[module] = 0
        for module, headroom in stats.headroom.items():
            if module in self._fp8:
                continue  # dynamic scaling fits any finite amax: the flush rule above decides
            if module in self._handles:
                self._calm_check(stats.step, module, headroom, module in blamed_now, made)
                continue
            # a non-finite output is the skip rule's business (downstream modules inherit it)
            hot = math.isfinite(headroom) and headroom > self.rules.headroom_limit
            streak = self._hot.get(module, 0) + 1 if hot else 0
            self._hot[module] = streak
            if streak >= self.rules.patience:
                reason = (
                    f"headroom {headroom:.3g} > {self.rules.headroom_limit} for {streak} reports"
                )
                if self._promote(stats.step, module, reason, made):
                    self._hot[module] = 0
        return made

    def _calm_check(
        self,
        step: int,
        module: str,
        value: float,
        blamed: bool,
        made: list[PrecisionChange],
        below: float | None = None,
    ) -> None:
        """Demotion: ``value`` (headroom; for a fallen-back float8 layer its flush fraction,
        under ``below``) calm for ``calm_reports`` reports with no skip blamed on it."""
        if not self.rules.demote or module in self._pinned:
            return
        fp8 = below is not None
        limit = self.rules.demote_below if below is None else below
        calm = self._calm.get(module, 0) + 1 if value < limit else 0
        self._calm[module] = 0 if blamed else calm
        if self._calm[module] >= self.rules.calm_reports:
            what = "e4m3 flush" if fp8 else "headroom"
            reason = f"{what} < {limit} for {calm} reports"
            before, after = ("bf16", "fp8") if fp8 else ("fp32", self.low)
            self._change(PrecisionChange(step, module, before, after, reason), made)

    def _stalled(self, stats: NumericStats) -> bool:
        """Whether no step was taken since the previous report: its last ``min(window,
        interval)`` steps, up to the report's own (skips are numbered from 1), all skipped.
        Read from the report alone (identical on every rank, nothing to checkpoint)."""
        need = min(self.rules.window, self.rules.interval)
        steps = [s for s, _ in stats.skips[-need:]]
        return len(steps) == need and steps == list(range(stats.step - need + 1, stats.step + 1))

    def _forget(self, module: str) -> None:
        """Drop a promoted module's skips from the window (they are dealt with)."""
        self._history = deque((m for m in self._history if m != module), maxlen=self.rules.window)

    def _over_cap(self, module: str) -> bool:
        """Whether promoting ``module`` would put more than the cap in the wider format."""
        if module in self._fixed or module not in self._modules:
            return False
        share = sum(self._numel[m] for m in self._handles) + self._numel.get(module, 0)
        return share / self._total > self.rules.max_promoted_fraction

    def _promote(
        self,
        step: int,
        module: str,
        reason: str,
        made: list[PrecisionChange],
        *,
        stalled: bool = False,
    ) -> bool:
        if module in self._fixed or module not in self._modules:
            return False
        share = sum(self._numel[m] for m in self._handles) + self._numel.get(module, 0)
        wider = _WIDER[self._low_of(module)]
        if share / self._total > self.rules.max_promoted_fraction and stalled:
            warnings.warn(
                f"adaptive precision: promoting {module!r} ({reason}) over the cap: it puts "
                f"{share / self._total:.1%} of the parameters in {wider}, more than "
                f"max_promoted_fraction={self.rules.max_promoted_fraction}, but every step since "
                "the last report skipped and the run cannot go on without it. To start it "
                f"there, add {module!r} to the policy's fp32_modules (or raise the cap)",
                RuntimeWarning,
                stacklevel=3,
            )
            reason += "; over max_promoted_fraction, as no step could be taken"
        elif share / self._total > self.rules.max_promoted_fraction:
            if module not in self._refused:
                self._refused.add(module)
                warnings.warn(
                    f"adaptive precision: not promoting {module!r} ({reason}): it would put "
                    f"{share / self._total:.1%} of the parameters in {wider}, over "
                    f"max_promoted_fraction={self.rules.max_promoted_fraction}; raise the cap "
                    "or add the module to fp32_modules",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return False
        low = self._low_of(module)
        if any(c.module == module and c.after == low for c in self.changes):
            self._pinned.add(module)  # promoted again after a demotion: stays
        self._change(PrecisionChange(step, module, low, wider, reason), made)
        return True

    def _low_of(self, module: str) -> str:
        return "fp8" if module in self._fp8 else self.low

    def _change(self, change: PrecisionChange, made: list[PrecisionChange]) -> None:
        module = self._modules[change.module]
        if change.before == "fp8":
            assert isinstance(module, nn.Linear)  # a torchao Float8Linear
            self._handles[change.module] = [Bf16Linear(module)]
        elif change.after == "fp32":
            self._handles[change.module] = [Island(module, self.exact_weights)]
        else:  # a demotion: fp32 -> the low format, or a fallen-back layer bf16 -> fp8
            for h in self._handles.pop(change.module, []):
                h.remove()
        if change.module in self._handles:
            self._calm[change.module] = 0  # promoted: calm counted from now
        self.changes.append(change)
        made.append(change)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The change log and the rules' running counts (plain Python: rank-identical)."""
        return {
            "changes": [asdict(c) for c in self.changes],
            "history": list(self._history),
            "hot": dict(self._hot),
            "calm": dict(self._calm),
            "pinned": sorted(self._pinned),
            "refused": sorted(self._refused),
        }

    def validate_state_dict(self, state: Any) -> None:
        """Check a :meth:`state_dict` against this bound model and these rules; changes
        nothing (see :func:`~distamp.precision.state_checks.check_adaptive_state`: kinds,
        ranges, module names this model has, a log that replays).

        Raises:
            RuntimeError: called before :meth:`bind`.
            ValueError: naming the entry (``ArgumentTypeError`` for a wrong kind).
        """
        self._checked(state)

    def _checked(self, state: Any) -> dict[str, Any]:
        if not self._modules:
            raise RuntimeError("adaptive precision: bind(model) before loading its state")
        return check_adaptive_state(state, modules=list(self._modules), fp8=self._fp8, low=self.low)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replay the saved changes on the bound model (promotions re-applied in order) and
        restore the counts, so a resumed run decides exactly as an uninterrupted one. The
        whole state is checked first (:meth:`validate_state_dict`): a refused one changes
        nothing."""
        state = self._checked(state)
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles, self.changes = {}, []
        for entry in state["changes"]:
            self._change(PrecisionChange(**entry), [])
        self._history = deque(state["history"], maxlen=self.rules.window)
        self._hot, self._calm = dict(state["hot"]), dict(state["calm"])
        self._pinned, self._refused = set(state["pinned"]), set(state["refused"])

    def remove(self) -> None:
        """Take every promotion's hooks off (the log stays)."""
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles = {}


def refuse_outside_engine(policy: Any, owner: str) -> None:
    """Refuse a policy whose adaptive rules or backward scales nothing would drive.

    Their decisions are taken at :class:`~distamp.DistAMP`'s steps (the numeric monitor's agreed
    reports); a framework plug-in applies a policy's fixed fp32 islands only, so it would train
    as if the rules were not there, without a word.

    Raises:
        ValueError: ``policy.adaptive`` or ``policy.backward_scales`` is set.
    """
    adaptive = getattr(policy, "adaptive", None) is not None
    if adaptive or getattr(policy, "backward_scales", None) is not None:
        what = "adaptive=..." if adaptive else "backward_scales=..."
        raise ValueError(
            f"{owner}(policy=AutocastPolicy(..., {what})): adaptive precision and backward "
            "scales are decided at distamp.DistAMP's steps; this plug-in applies a policy's "
            "fixed fp32 modules only. Train through distamp.DistAMP, or pass a policy without them"
        )
