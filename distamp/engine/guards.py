"""Guards on the optimizer step beyond the overflow skip: :class:`SpikeGuard` skips a step whose
loss or gradient norm spikes, and a limit on consecutive skips stops a run that no longer trains.

Why a spike guard: one bad batch, or an update that lands in a sharp region, can send the loss or
the gradient norm far above where training has been; the gradients are finite, so the overflow
check lets the step through, and applying it can undo many steps of progress. OLMo-core skips
such steps against a rolling mean and standard deviation; :class:`SpikeGuard` does the same, with
the decision taken from numbers identical on every rank, so that every rank skips alike (a rank
that stepped alone would leave the replicas different for the rest of the run).

Why a limit: a run whose every step is skipped (the loss scale at its floor and the gradients
still overflowing, or a loss level that moved for good past the guard) spins without training
and without a word. After ``max_consecutive_skips`` skips in a row, of either kind, the engine
raises :class:`ConsecutiveSkipsError` on every rank, with the scaler's overflow report.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distamp.arguments import INT32_MAX, ArgumentTypeError, as_integer, as_real
from distamp.cluster import is_distributed
from distamp.scaler import DistributedGradScaler

__all__ = [
    "READ_EVERY",
    "ConsecutiveSkipsError",
    "SkipStreak",
    "SpikeGuard",
    "SpikeWatch",
    "StepGuards",
    "check_guards",
]

_log = logging.getLogger("distamp.engine")

READ_EVERY = 8
"""Steps between two reads of the skip streak when the step does not read anything on the host
otherwise (no scheduler, no spike guard): the limit is then noticed at most this many steps late,
and the step stays free of host syncs in between."""


class ConsecutiveSkipsError(RuntimeError):
    """Too many optimizer steps in a row were skipped (``DistAMP(max_consecutive_skips=...)``):
    the run no longer trains. Raised on every rank at the same step."""


def _number(field: str, value: Any, *, integer: bool) -> Any:
    """``value`` as an int or a finite float; ``ArgumentTypeError`` for a value that is no
    number, ``ValueError`` for an unusable one (both name ``SpikeGuard``'s field)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        kind = "an int" if integer else "a number"
        raise ArgumentTypeError(
            f"SpikeGuard({field}={value!r:.80}): expected {kind}, got {type(value).__name__}"
        )
    try:
        return as_integer(field, value) if integer else as_real(field, value)
    except ValueError as exc:
        raise ValueError(f"SpikeGuard({field}={value!r:.80}): {exc}") from None


def check_guards(spike_guard: Any, max_consecutive_skips: Any) -> int | None:
    """Check the two guard settings as ``DistAMP(...)`` does (its plug-ins take the same
    ones): ``spike_guard`` a :class:`SpikeGuard` or ``None``, ``max_consecutive_skips`` an int in
    [1, 2**31 - 1] or ``None``. Returns the limit as a plain int (or ``None``).

    Raises:
        ArgumentTypeError: ``spike_guard`` is no :class:`SpikeGuard`, or the limit no integer.
        ValueError: the limit is out of range; the message names the field.
    """
    if spike_guard is not None and not isinstance(spike_guard, SpikeGuard):
        raise ArgumentTypeError(
            f"spike_guard={spike_guard!r:.80} ({type(spike_guard).__name__}): pass "
            "distamp.SpikeGuard(window=..., sigmas=...) or None"
        )
    if max_consecutive_skips is None:
        return None
    try:
        limit = as_integer("max_consecutive_skips", max_consecutive_skips)
    except ValueError as exc:
        raise ValueError(f"max_consecutive_skips={max_consecutive_skips!r}: {exc}") from None
    if not 1 <= limit <= INT32_MAX:
        raise ValueError(
            f"max_consecutive_skips={limit!r}: the most optimizer steps skipped in a "
            f"row before the run stops; give an int in [1, {INT32_MAX}], or None (no "
            "limit)"
        )
    return limit


@dataclass(frozen=True, kw_only=True)
class SpikeGuard:
    """Skip an optimizer step whose loss or gradient norm lies more than ``sigmas`` standard
    deviations above the mean of the last ``window`` steps that were taken.

    Pass it as ``DistAMP(..., spike_guard=SpikeGuard(window=128, sigmas=6.0))``.

    What is watched: the step's loss, each rank's mean over its micro-batches and then the
    maximum over the ranks (one rank's spike is the job's: a bad batch on one rank reaches every
    replica through the gradient all-reduce); and, when ``max_grad_norm`` is set, the gradient
    norm the clipping computes (the whole job's, before clipping). Without ``max_grad_norm``
    there is no norm to read without an extra pass, and the guard watches the loss alone. A
    non-finite value is the overflow check's business: never a spike, never in the history.

    The history: only steps that were taken enter it (a skipped spike does not raise the bar
    for the next one), the ``window`` latest of them. Until ``min_history`` taken steps were
    seen the guard never skips (the deviation of a handful of values says little).

    Agreement and cost: the decision is taken on the host from numbers identical on every rank,
    so every rank skips the same steps and the parameters stay bitwise equal. It costs one
    ``all_reduce`` (MAX of one number) per step over the scaler's agreement group, next to the
    scaler's flag collective (that collective already carries the numeric monitor's statistics,
    and it runs inside the scaler's step, after the decision must be taken), and one host sync
    per step that reads the agreed loss and the norm together.

    A skip for a spike: no optimizer step, no scheduler step, the gradients released as after
    any step. The loss scale is not backed off: the scaler's ``update()`` runs as for any step
    with finite gradients (the gradients fitted the format at this scale), so the step also
    counts toward ``growth_interval``. An overflow in the same step wins: the step's
    ``skip_reason`` is ``"overflow"`` and the scale backs off.

    Attributes:
        window: taken steps the mean and the deviation are computed over; an int >= 2.
        sigmas: how many standard deviations above the mean a value must lie to be a spike; a
            finite number > 0.
        min_history: taken steps seen before the guard may skip, in [2, ``window``]; ``None``:
            half the window (at least 2), as OLMo-core waits for.

    Raises:
        ValueError: a value out of range, naming the field.
        ArgumentTypeError: a value that is no number (a ``TypeError`` and a ``ValueError``).
    """

    window: int = 128
    sigmas: float = 6.0
    min_history: int | None = None

    def __post_init__(self) -> None:
        window = _number("window", self.window, integer=True)
        if not 2 <= window <= INT32_MAX:
            raise ValueError(
                f"SpikeGuard(window={window!r}): the taken steps the deviation is computed "
                f"over; give an int in [2, {INT32_MAX}]"
            )
        sigmas = _number("sigmas", self.sigmas, integer=False)
        if sigmas <= 0:
            raise ValueError(
                f"SpikeGuard(sigmas={sigmas!r}): standard deviations above the mean that make a "
                "spike; give a finite number > 0 (e.g. 6.0)"
            )
        least = max(2, window // 2)
        if self.min_history is not None:
            least = _number("min_history", self.min_history, integer=True)
            if not 2 <= least <= window:
                raise ValueError(
                    f"SpikeGuard(min_history={least!r}): taken steps seen before the guard may "
                    f"skip; give an int in [2, window={window}], or None"
                )
        object.__setattr__(self, "window", window)
        object.__setattr__(self, "sigmas", sigmas)
        object.__setattr__(self, "min_history", least)


@dataclass(frozen=True)
class SpikeCheck:
    """One step's agreed values and the limits they were held against (``None``: not watched,
    or not enough history yet)."""

    loss: float | None
    grad_norm: float | None
    loss_limit: float | None
    norm_limit: float | None

    @property
    def spike(self) -> bool:
        return _above(self.loss, self.loss_limit) or _above(self.grad_norm, self.norm_limit)

    def describe(self) -> str:
        parts = []
        if _above(self.loss, self.loss_limit):
            parts.append(f"loss {self.loss:.6g} above {self.loss_limit:.6g}")
        if _above(self.grad_norm, self.norm_limit):
            parts.append(f"gradient norm {self.grad_norm:.6g} above {self.norm_limit:.6g}")
        return " and ".join(parts)


def _above(value: float | None, limit: float | None) -> bool:
    return value is not None and limit is not None and math.isfinite(value) and value > limit


def _limit(history: deque[float], guard: SpikeGuard) -> float | None:
    """mean + sigmas * std (the sample deviation) of ``history``, or ``None`` while it is
    shorter than ``min_history``. Sums with ``math.fsum``: the same bits on every rank."""
    n = len(history)
    if n < (guard.min_history or 2):
        return None
    mean = math.fsum(history) / n
    var = math.fsum((v - mean) ** 2 for v in history) / (n - 1)
    return mean + guard.sigmas * math.sqrt(var)


class SpikeWatch:
    """A :class:`SpikeGuard`'s history and its decision at each step (see there).

    The overflow flag of a taken step is known on the device only after the scaler's update; it
    is read with the next step's values, in the same host sync, and only then does the step
    enter the history (:meth:`settle` reads it on request, e.g. before saving).
    """

    def __init__(self, guard: SpikeGuard) -> None:
        self.guard = guard
        self.losses: deque[float] = deque(maxlen=guard.window)
        self.norms: deque[float] = deque(maxlen=guard.window)
        self.spike_skips = 0  # steps skipped for a spike since the start
        self.last: SpikeCheck | None = None
        # The last step's values and its overflow flag (a device tensor), not yet entered.
        self._pending: tuple[float | None, float | None, torch.Tensor] | None = None

    def check(
        self,
        loss: torch.Tensor | None,
        norm: torch.Tensor | None,
        scaler: DistributedGradScaler,
        also: torch.Tensor | None = None,
    ) -> tuple[SpikeCheck, float | None]:
        """This step's decision. One ``all_reduce`` (MAX of the loss) over the scaler's
        agreement group and one host sync, which also reads the last step's overflow flag and
        ``also`` (the skip streak's value, read at no extra cost; returned).

        Args:
            loss: this rank's mean loss of the step, or ``None`` (a pipeline stage before the
                last): it then takes no part in the maximum.
            norm: the step's agreed gradient norm (clipping), or ``None``.
            scaler: the engine's scaler: its agreement group, where its flags live.
            also: a 0-dim tensor to read in the same sync, or ``None``.
        """
        home = norm.device if norm is not None else (loss.device if loss is not None else None)
        home = scaler.agreement.device_for(home or torch.device("cpu"))  # NCCL: on the GPU
        local = torch.full((1,), -math.inf, dtype=torch.float32, device=home)
        if loss is not None:
            local.copy_(loss.detach().reshape(1).to(home, torch.float32))
        scaler.agreement.all_reduce_(local, dist.ReduceOp.MAX)
        nan = torch.full((1,), math.nan, dtype=torch.float32, device=home)
        parts = [
            local.reshape(1),
            nan if norm is None else norm.detach().reshape(1).to(home, torch.float32),
            nan if self._pending is None else self._pending[2].reshape(1).to(home, torch.float32),
            nan if also is None else also.reshape(1).to(home, torch.float32),
        ]
        agreed, agreed_norm, flag, extra = torch.cat(parts).tolist()  # host sync: the decision
        if self._pending is not None:
            self._enter(flag)
        value = agreed if math.isfinite(agreed) else None
        check = SpikeCheck(
            loss=value,
            grad_norm=None if norm is None else agreed_norm,
            loss_limit=_limit(self.losses, self.guard),
            norm_limit=None if norm is None else _limit(self.norms, self.guard),
        )
        self.last = check
        return check, None if also is None else extra

    def after_step(self, check: SpikeCheck, overflow: torch.Tensor, skipped: bool) -> None:
        """After the scaler's update. ``skipped``: the step was skipped for a spike (counted),
        or the spike came with an overflow (not a taken step either); otherwise the step waits,
        with its overflow flag (copied: the scaler replaces it), to enter the history."""
        if check.spike:
            self.spike_skips += int(skipped)
            self._pending = None
            return
        self._pending = (check.loss, check.grad_norm, overflow.detach().clone())

    def settle(self) -> None:
        """Enter the last step into the history now (reads its overflow flag: a host sync)."""
        if self._pending is not None:
            self._enter(float(self._pending[2].item()))  # host sync, on request only

    def _enter(self, overflow_flag: float) -> None:
        assert self._pending is not None
        loss, norm, _ = self._pending
        self._pending = None
        if overflow_flag != 0:  # an overflow skip: not a taken step
            return
        if loss is not None and math.isfinite(loss):
            self.losses.append(loss)
        if norm is not None and math.isfinite(norm):
            self.norms.append(norm)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The history and the count (plain Python numbers; identical on every rank). Host sync:
        the last step's overflow flag."""
        self.settle()
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.norms),
            "spike_skips": self.spike_skips,
        }

    def check_state_dict(self, state: Any) -> dict[str, Any]:
        """``state`` checked as :meth:`load_state_dict` needs it, without loading (``ValueError``
        naming the key); returned normalised (the latest ``window`` values kept)."""
        if not isinstance(state, dict) or set(state) != {"losses", "grad_norms", "spike_skips"}:
            raise ValueError(
                "a spike guard's state is a dict with the keys 'losses', 'grad_norms' and "
                f"'spike_skips', got {state!r:.200}"
            )
        out: dict[str, Any] = {}
        for key in ("losses", "grad_norms"):
            values = state[key]
            ok = isinstance(values, list) and all(
                isinstance(v, float) and math.isfinite(v) for v in values
            )
            if not ok:
                raise ValueError(
                    f"spike guard key {key!r}: a list of finite floats, got {values!r:.200}"
                )
            out[key] = values[-self.guard.window :]
        count = state["spike_skips"]
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count < 2**63:
            raise ValueError(f"spike guard key 'spike_skips': an int >= 0, got {count!r:.80}")
        out["spike_skips"] = count
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checked state (:meth:`check_state_dict`): the next decision is the one the
        saving run would have taken."""
        checked = self.check_state_dict(state)
        self.losses = deque(checked["losses"], maxlen=self.guard.window)
        self.norms = deque(checked["grad_norms"], maxlen=self.guard.window)
        self.spike_skips = checked["spike_skips"]
        self._pending = None


class SkipStreak:
    """Consecutive skipped steps (overflow and spike alike), counted on the device and read on
    the host only where the step reads something anyway: with the spike guard's read, after a
    scheduler's read of the decision, else every :data:`READ_EVERY` steps.

    Args:
        limit: the most skips in a row allowed; one more raises :class:`ConsecutiveSkipsError`.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.streak: torch.Tensor | None = None  # the current run of skips
        self.worst: torch.Tensor | None = None  # the longest run since the last read
        self.unread = 0  # steps counted since the last read

    def record(self, overflow: torch.Tensor, spike: bool) -> None:
        """Count one step. No host sync (device ops only)."""
        flag = overflow.detach().to(torch.int64)
        if self.streak is None or self.worst is None:
            self.streak = torch.zeros((), dtype=torch.int64, device=flag.device)
            self.worst = torch.zeros((), dtype=torch.int64, device=flag.device)
        if spike:
            flag = torch.ones_like(flag)
        self.streak.add_(1).mul_(flag)  # +1 on a skip, else 0
        torch.maximum(self.worst, self.streak, out=self.worst)
        self.unread += 1

    @property
    def due(self) -> bool:
        """Whether :data:`READ_EVERY` steps went unread."""
        return self.unread >= READ_EVERY

    def pending(self) -> torch.Tensor | None:
        """The longest run since the last read, for a read the step makes anyway."""
        return self.worst if self.unread else None

    def read(self, scaler: Any) -> None:
        """Read the longest run now (a host sync) and raise if it reached the limit."""
        if self.worst is not None and self.unread:
            self.settle(float(self.worst.item()), scaler)  # host sync: see the class doc

    def settle(self, worst: float, scaler: Any) -> None:
        """The longest run since the last read, read by the caller: raise
        :class:`ConsecutiveSkipsError` at the limit (every rank reads the same value at the same
        step, so every rank raises; the overflow report is gathered from all of them). ``scaler``:
        the step's, for the report and the scale; a plug-in's may be another ``GradScaler``."""
        assert self.worst is not None
        self.worst.zero_()
        self.unread = 0
        if worst < self.limit:
            return
        # A plug-in's replaced scaler that is not distamp's keeps no overflow report.
        ours = isinstance(scaler, DistributedGradScaler) and scaler.is_enabled()
        report = scaler.overflow_report() if ours else None
        where = "none of them overflowed" if report is None else report.one_line()
        scale = "none" if scaler is None else f"{scaler.get_scale():g}"
        raise ConsecutiveSkipsError(
            f"{int(worst)} optimizer steps in a row were skipped (max_consecutive_skips="
            f"{self.limit}): the run no longer trains. Last overflow report: {where}. "
            f"Loss scale {scale}. Likely causes: NaN/inf in the inputs or the "
            "loss (check the batch), a diverged model (lower the learning rate), fp16 overflow "
            "in activations (precision='bf16', or the module in fp32 with an AutocastPolicy), "
            "or a spike guard whose loss level moved for good (raise sigmas or the window). "
            "max_consecutive_skips=None turns this check off."
        )


class StepGuards:
    """The engine's guards on each step: the spike watch and the skip streak, either off.

    The plug-ins (:mod:`distamp.integrations.step_guards`) drive the same object from their
    framework's optimizer step; there the scaler may be one the user put in the framework's
    ``scaler`` slot (a ``torch.amp.GradScaler``, or ``None`` in bf16), so the methods take the
    step's overflow flag as an argument where such a scaler has no agreed one, and the loss is
    agreed over the whole job (a disabled distamp scaler's group) when the scaler is not
    distamp's.

    Args:
        spike_guard: the settings of the spike watch, or ``None``.
        limit: ``max_consecutive_skips``, or ``None``.
    """

    def __init__(self, spike_guard: SpikeGuard | None, limit: int | None) -> None:
        self.spike = None if spike_guard is None else SpikeWatch(spike_guard)
        self.streak = None if limit is None else SkipStreak(limit)
        self.check: SpikeCheck | None = None  # this step's, between before_step and after_step
        self.spike_skip = False  # this step was skipped for a spike (no overflow): confirm()
        self.step = 0  # the engine's step count at before_step, for the log line
        self._whole_job: DistributedGradScaler | None = None  # agrees for a foreign scaler

    def before_step(
        self,
        loss: torch.Tensor | None,
        norm: torch.Tensor | None,
        scaler: Any,
        step: int,
    ) -> bool:
        """Whether this step is a spike (always ``False`` without the guard). With the guard:
        one all_reduce and one host sync (:meth:`SpikeWatch.check`), which also reads the
        streak; may raise :class:`ConsecutiveSkipsError`. ``scaler``: the step's; one that is
        not distamp's agrees over the whole job."""
        if self.spike is None:
            return False
        agreeing = scaler
        if not isinstance(scaler, DistributedGradScaler):
            if self._whole_job is None:  # a disabled scaler allocates nothing: only its group
                self._whole_job = DistributedGradScaler("cpu", enabled=False)
            agreeing = self._whole_job
        also = None if self.streak is None else self.streak.pending()
        check, worst = self.spike.check(loss, norm, agreeing, also)
        if self.streak is not None and worst is not None:
            self.streak.settle(worst, scaler)
        self.check, self.step = check, step
        return check.spike

    def confirm(self, scaler: Any, overflow: torch.Tensor | None = None) -> bool:
        """After the update of a step :meth:`before_step` found a spike in: whether it is a
        spike skip, i.e. the gradients did not overflow as well (an overflow wins: the scale
        backed off and the step's reason is "overflow"). Reads the agreed overflow flag
        (``overflow``, else the scaler's ``last_step_skipped``): a host sync, on spike steps
        only."""
        flag = scaler.last_step_skipped if overflow is None else overflow
        self.spike_skip = not bool(flag)  # host sync, spike steps only
        if (
            self.spike_skip
            and self.check is not None
            and (not is_distributed() or dist.get_rank() == 0)
        ):
            _log.warning("step %d skipped by the spike guard: %s", self.step, self.check.describe())
        return self.spike_skip

    def after_step(
        self, scaler: Any, *, decided: bool, overflow: torch.Tensor | None = None
    ) -> None:
        """After the scaler's update. ``decided``: the step read its decision on the host
        already (a scheduler is attached), so the streak is read now at little cost.
        ``overflow``: the step's agreed overflow flag (0-dim), else the scaler's
        ``last_step_skipped``."""
        if overflow is None:
            overflow = scaler.last_step_skipped
        spike = self.spike_skip
        if self.spike is not None and self.check is not None:
            self.spike.after_step(self.check, overflow, spike)
        self.check, self.spike_skip = None, False
        if self.streak is None:
            return
        self.streak.record(overflow, spike)
        if self.spike is None and (decided or self.streak.due):
            self.streak.read(scaler)
