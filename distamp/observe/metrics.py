"""Training metrics: ONE window reducer, fed by the engine and by every integration.

Why one: the overflow rate, the loss scale and the gradient norm should mean the same thing in
the engine's log and in an Accelerate or Lightning run, so exactly one class, :class:`Metrics`,
turns a window of optimizer steps into figures. Its feeders:

- :class:`distamp.DistAMP`: :meth:`Metrics.record` per micro-batch, :meth:`Metrics.end_step` per
  optimizer step, :meth:`Metrics.collect` at a logging step, which returns a :class:`WindowStats`;
- the Accelerate, Lightning Fabric and Lightning Trainer integrations, through
  :class:`AMPMetrics` (the same reducer under the method names they expose: ``step`` and
  ``compute``, which returns the plain dict their ``*metrics_dict()`` methods hand out).

Why on device: reading a loss with ``.item()`` every step stalls a GPU pipeline once per step.
Feeding the reducer only adds into device tensors and counts in Python; a logging step packs the
window into one tensor, reduces it across ranks with ONE collective and reads it back with ONE
host sync (the scaler's scale and skip counter cost one sync each on top, through its public
getters). Where the figures go (console, JSON lines, TensorBoard) is :mod:`distamp.observe.writers`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from distamp.agreement.scale_reads import current_loss_scale
from distamp.cluster import is_distributed
from distamp.observe.writers import ProgressPrinter  # re-exported: the name's old home

if TYPE_CHECKING:
    from distamp.agreement.traffic import Traffic

__all__ = ["AMPMetrics", "Metrics", "ProgressPrinter", "StepResult", "WindowStats"]


@dataclass(frozen=True)
class WindowStats:
    """What every rank learns at a logging step (identical on all ranks).

    Attributes:
        step: optimizer steps completed (the engine passes its own count; by default the steps
            this reducer was fed).
        loss: mean loss over all ranks' micro-batches since the previous logging step.
        last_loss: mean loss of the last step alone, over ranks and micro-batches.
        loss_scale: the scaler's current scale (1.0 without loss scaling).
        skipped_steps: steps skipped for non-finite gradients since the start.
        tokens_per_s: tokens of all ranks per second of wall time in the window; ``None``
            until some rank counts tokens (``backward(tokens=...)``, ``fit(tokens_per_batch=N)``
            or :meth:`Metrics.add_tokens`), where 0.0 would read as a stalled run.
        grad_norm: the window's last gradient norm before clipping, mean over ranks; ``None``
            when no step of the window clipped.
        stop: whether any rank asked to stop (see ``collect(stop=...)``).
        overflow: the one-line overflow report when the window skipped a step (the engine
            fills it in from ``scaler.overflow_report()``), else ``None``.
        overflow_rate: skipped steps / steps in the window (see :meth:`Metrics.collect`).
        grad_bytes: bytes this rank sent for gradients per step in the window (the payload:
            :mod:`distamp.agreement.traffic`); ``None`` where the path is not counted.
        grad_scale_bytes: the scales sent alongside (8-bit hooks), per step; ``None`` likewise.
        spike_skips: steps skipped by the spike guard since the start (``DistAMP(spike_guard=
            ...)``), counted apart from ``skipped_steps`` (non-finite gradients) because the
            two call for different fixes (the data or the learning rate vs the format).
        weights: how the weights are kept (``DistAMP(weights=...)``: "bf16 weights, exact
            master, fp32 states"; "fp32" without); ``None`` where not told.
        bytes_per_param: the bytes this rank keeps per parameter of the model between steps
            (weights, gradients, masters, optimizer states; counted by storage); ``None``
            where not counted.
    """

    step: int
    loss: float
    last_loss: float
    loss_scale: float
    skipped_steps: int
    tokens_per_s: float | None
    grad_norm: float | None
    stop: bool
    overflow: str | None = None
    overflow_rate: float = 0.0
    grad_bytes: float | None = None
    grad_scale_bytes: float | None = None
    spike_skips: int = 0
    weights: str | None = None
    bytes_per_param: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Every field by name, as the writers take it (no host sync: all are Python values)."""
        return asdict(self)


class StepResult:
    """The outcome of one optimizer step. Reading a property syncs with the device; building the
    result does not, so a loop that ignores it never waits."""

    __slots__ = ("_norm", "_scale", "_skipped", "_spike")

    def __init__(
        self,
        skipped: torch.Tensor | None,
        scale: torch.Tensor | None,
        norm: torch.Tensor | None,
        spike: bool = False,
    ) -> None:
        self._skipped, self._scale, self._norm, self._spike = skipped, scale, norm, spike

    @classmethod
    def capture(cls, scaler: Any, norm: torch.Tensor | None, spike: bool = False) -> StepResult:
        """Snapshot a scaler right after ``update()``, without a host sync. ``spike``: the
        spike guard skipped the step (a decision already on the host)."""
        if scaler is None or not scaler.is_enabled():
            return cls(None, None, norm, spike)
        skipped = getattr(scaler, "last_step_skipped", None)
        # The tensor, not get_scale() (a host sync); copied, since the next update() changes it.
        scale = current_loss_scale(scaler)
        scale = None if scale is None else scale.detach().clone()
        return cls(skipped if isinstance(skipped, torch.Tensor) else None, scale, norm, spike)

    @property
    def stepped(self) -> bool:
        """Whether the optimizer applied this step (False: skipped, see :attr:`skip_reason`)."""
        return self.skip_reason is None

    @property
    def skip_reason(self) -> str | None:
        """Why the step was skipped: ``"overflow"`` (inf/NaN gradients on some rank; the scale
        backed off), ``"spike"`` (the spike guard: finite, but the loss or the gradient norm far
        above the recent ones), or ``None`` (the optimizer stepped). An overflow wins when both
        happened. Host sync (the overflow flag), on request."""
        if self._skipped is not None and bool(self._skipped):  # host sync, on request
            return "overflow"
        return "spike" if self._spike else None

    @property
    def loss_scale(self) -> float:
        """The loss scale after this step's update (1.0 without loss scaling)."""
        return 1.0 if self._scale is None else float(self._scale)  # host sync, on request

    @property
    def grad_norm(self) -> float | None:
        """Total gradient norm before clipping; ``None`` when clipping is off."""
        return None if self._norm is None else float(self._norm)  # host sync, on request

    def __repr__(self) -> str:
        return (
            f"StepResult(stepped={self.stepped}, skip_reason={self.skip_reason!r}, "
            f"loss_scale={self.loss_scale}, grad_norm={self.grad_norm})"
        )


def _skip_count(scaler: Any) -> int:
    """The scaler's skip counter (host sync). One without a number there, torch's GradScaler or
    a test double standing in for one, counts as never skipping: the window's figures must not
    fail because a plug-in's scaler was replaced."""
    try:
        return int(getattr(scaler, "skipped_steps", 0))
    except (TypeError, ValueError):
        return 0


def _enabled(scaler: Any) -> bool:
    return scaler is not None and bool(scaler.is_enabled())


class Metrics:
    """The window reducer. Feeding it (:meth:`record`, :meth:`add_tokens`, :meth:`end_step`)
    never syncs with the device nor communicates; :meth:`collect` closes the window with one
    collective.

    Args:
        device: where the counters live (the device of the losses and of the scaler's flags).
        traffic: where this rank's gradient bytes are counted
            (:func:`distamp.agreement.traffic.grad_traffic`); ``None``: not reported.
        memory: ``() -> (bytes, parameters)`` this rank keeps between steps, read at each
            logging step (sizes only, no sync); ``None``: not reported.
        weights: how the weights are kept, as :attr:`WindowStats.weights` reports it.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        traffic: Traffic | None = None,
        *,
        memory: Callable[[], tuple[int, int]] | None = None,
        weights: str | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._traffic = traffic
        self._memory, self._weights = memory, weights
        self._traffic_base = (0, 0)  # payload and scale bytes at the window's start
        # fp32, not fp64: some backends (MPS) have no fp64, and window sums need no more.
        self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        self._step_loss = self._zero.clone()
        self._step_micro = 0
        self._last_step_loss = self._zero.clone()
        self._last_step_micro = 1
        self._steps_total = 0
        self._skips_base: int | None = None  # the scaler's skip counter at the window's start
        self._flags_fed = False  # whether steps came with their scaler (see _overflow_rate)
        self._tokens_seen = False  # whether any rank counted tokens in a collected window
        self.spike_skips = 0  # steps the spike guard skipped since the start (host count)
        self._reset_window()

    def _reset_window(self) -> None:
        self._loss = self._zero.clone()
        self._micro = 0
        self._tokens = 0
        self._steps = 0
        self._flagged = self._zero.clone()  # the window's steps the scaler flagged as skipped
        self._norm: torch.Tensor | None = None
        self._t0 = time.perf_counter()

    @property
    def window_steps(self) -> int:
        """Optimizer steps fed since the window opened (a Python count: no sync)."""
        return self._steps

    @property
    def step_loss(self) -> torch.Tensor | None:
        """This rank's mean loss over the micro-batches of the step in progress (a 0-dim device
        tensor: no sync), or ``None`` when none was recorded (a pipeline stage before the last).
        """
        return None if self._step_micro == 0 else self._step_loss / self._step_micro

    def record(self, loss: torch.Tensor, tokens: int = 0) -> None:
        """Add one micro-batch's (unscaled, undivided) loss and its token count. No host sync."""
        value = loss.detach().to(torch.float32).reshape(())  # a shape-[1] loss is one number
        self._loss += value
        self._step_loss += value
        self._micro += 1
        self._step_micro += 1
        self._tokens += int(tokens)

    def add_tokens(self, tokens: int) -> None:
        """Count tokens processed by this rank (any granularity: batch or micro-batch), for
        loops that do not :meth:`record` losses. No host sync."""
        self._tokens += int(tokens)

    def end_step(
        self,
        grad_norm: torch.Tensor | float | None = None,
        scaler: Any = None,
        spike: bool = False,
    ) -> None:
        """Close one optimizer step (call it after the scaler's ``update()``). No host sync.

        Args:
            grad_norm: the step's total gradient norm before clipping (unscaled), if it clipped;
                the window reports the last one.
            scaler: the loss scaler; its on-device ``last_step_skipped`` flag is added on device
                so the first window's overflow rate needs no extra sync (see :meth:`collect`).
                ``None`` or a disabled scaler: nothing is flagged.
            spike: the spike guard skipped the step (counted in ``spike_skips``).
        """
        # The step's mean micro-batch loss becomes the "last step" figure.
        self._last_step_loss, self._last_step_micro = self._step_loss, max(1, self._step_micro)
        self._step_loss, self._step_micro = self._zero.clone(), 0
        self._steps += 1
        self._steps_total += 1
        self.spike_skips += int(spike)
        if grad_norm is not None:
            self._norm = torch.as_tensor(grad_norm).detach().to(self.device, torch.float32)
        if _enabled(scaler):
            self._flags_fed = True
            flag = getattr(scaler, "last_step_skipped", None)  # torch's GradScaler has none
            if isinstance(flag, torch.Tensor):
                self._flagged += flag.to(self.device, torch.float32)

    def collect(
        self, *, step: int | None = None, scaler: Any = None, stop: bool = False
    ) -> WindowStats:
        """Reduce the window across ranks and start a new one. Collective when a process group
        is up: call it on every rank at the same step.

        One ``all_reduce`` (SUM over loss sums, counts, tokens, stop flags, last loss, norm) and
        one host sync (``.tolist()``) for all of them; the scaler's skip counter and scale cost
        one sync each (its public getters).

        The overflow rate is computed here and nowhere else: skipped steps in the window over
        steps in the window. Skips in the window are the growth of the scaler's skip counter,
        the very number ``skipped_steps`` reports, so the two never disagree. The counter at the
        window's start is the one read at the previous ``collect``; in the first window, the
        counter minus the skips flagged at this window's steps when :meth:`end_step` was given
        the scaler (so a count restored from a checkpoint is not charged to this window), else
        0 (a fresh scaler).

        Args:
            step: optimizer steps completed, for the record; ``None``: the steps fed so far.
            scaler: the loss scaler (or ``None``) to read the scale and skip count from.
            stop: this rank's wish to stop; the result's ``stop`` is true if any rank wished it,
                so every rank leaves its loop at the same step.
        """
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        last = self._last_step_loss / self._last_step_micro
        norm = self._norm if self._norm is not None else self._zero
        packed = torch.stack(
            [
                self._loss,
                self._zero + self._micro,
                self._zero + self._tokens,
                self._zero + float(stop),
                last,
                norm,
            ]
        )
        world = 1
        if is_distributed():
            world = dist.get_world_size()
            if world > 1:
                dist.all_reduce(packed)  # the window's one collective
        # The skip flags stay out of the sum (they are this rank's, like its scaler's counter)
        # but ride along in the same read.
        host = torch.cat([packed, self._flagged.reshape(1)]).tolist()  # host sync: logging
        grad_bytes, grad_scale_bytes = self._window_bytes()
        loss_sum, micro_sum, token_sum, stops, last_sum, norm_sum, flagged = host
        self._tokens_seen = self._tokens_seen or token_sum > 0  # summed: the same on every rank
        enabled = _enabled(scaler)
        # torch's GradScaler has no skip counter: it then counts as never skipping.
        skipped = _skip_count(scaler) if enabled else 0  # host sync
        stats = WindowStats(
            step=self._steps_total if step is None else step,
            loss=loss_sum / max(micro_sum, 1.0),
            last_loss=last_sum / world,
            loss_scale=float(scaler.get_scale()) if enabled else 1.0,  # host sync: logging
            skipped_steps=skipped,
            tokens_per_s=token_sum / elapsed if self._tokens_seen else None,
            grad_norm=norm_sum / world if self._norm is not None else None,
            stop=stops > 0,
            overflow_rate=self._overflow_rate(skipped, round(flagged)),
            grad_bytes=grad_bytes,
            grad_scale_bytes=grad_scale_bytes,
            spike_skips=self.spike_skips,
            weights=self._weights,
            bytes_per_param=self._bytes_per_param(),
        )
        self._reset_window()
        return stats

    def _bytes_per_param(self) -> float | None:
        """This rank's persistent bytes per parameter (``memory``'s count), or ``None``."""
        if self._memory is None:
            return None
        held, params = self._memory()
        return held / params if params else None

    def _window_bytes(self) -> tuple[float | None, float | None]:
        """This rank's gradient bytes per step in the closing window, payload and scales (host
        counts: no sync); ``None`` where the path is not counted."""
        if self._traffic is None:
            return None, None
        payload, scales = self._traffic.totals(self._steps_total)
        base, self._traffic_base = self._traffic_base, (payload, scales)
        steps = max(self._steps, 1)
        return (payload - base[0]) / steps, (scales - base[1]) / steps

    def _overflow_rate(self, skipped: int, flagged: int) -> float:
        """Skipped steps / steps in the closing window (the rule is in :meth:`collect`)."""
        if self._skips_base is None:
            self._skips_base = skipped - flagged if self._flags_fed else 0
        in_window, self._skips_base = skipped - self._skips_base, skipped
        return in_window / self._steps if self._steps else 0.0


class AMPMetrics(Metrics):
    """The reducer for loops distamp does not drive (Accelerate, Lightning), under the names
    those integrations expose: :meth:`step` after each optimizer step (after the scaler's
    ``update``), :meth:`add_tokens` per batch, and :meth:`compute` at the logging interval for a
    plain dict that a writer (:mod:`distamp.observe.writers`) or a framework's own logger takes.
    Only the names differ from :class:`Metrics`; the figures are computed by the same code.

    Args:
        device: where the counters live (the device the scaler's flags are on).
    """

    KEYS = (
        "loss_scale",
        "skipped_steps",
        "overflow_rate",
        "grad_norm",
        "tokens_per_s",
        "steps",
        "spike_skips",
    )

    def step(
        self,
        scaler: Any = None,
        grad_norm: torch.Tensor | float | None = None,
        spike: bool = False,
    ) -> None:
        """Record one optimizer step: :meth:`Metrics.end_step` (``spike``: the plug-in's spike
        guard skipped it). No host sync."""
        self.end_step(grad_norm, scaler, spike)

    def compute(self, scaler: Any = None) -> dict[str, float | int | None]:
        """Close the window and return its figures: :meth:`Metrics.collect`, as a dict.
        Collective when a process group is up: call it on every rank at the same step.

        Returns:
            ``loss_scale`` (1.0 without a scaler), ``skipped_steps`` (since the start),
            ``overflow_rate`` (skipped / steps in the window), ``grad_norm`` (last clipping norm
            in the window, mean over ranks; ``None`` without clipping), ``tokens_per_s`` (all
            ranks; ``None`` until :meth:`add_tokens` was called), ``steps`` (in the window) and
            ``spike_skips`` (steps the spike guard skipped since the start).
        """
        steps = self.window_steps  # before collect() opens the next window
        stats = self.collect(scaler=scaler)
        return {
            "loss_scale": stats.loss_scale,
            "skipped_steps": stats.skipped_steps,
            "overflow_rate": stats.overflow_rate,
            "grad_norm": stats.grad_norm,
            "tokens_per_s": stats.tokens_per_s,
            "steps": steps,
            "spike_skips": stats.spike_skips,
        }
