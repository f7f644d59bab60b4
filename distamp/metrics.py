"""Training metrics kept on device and synced only at a logging interval.

Reading a loss with ``.item()`` every step stalls a GPU pipeline once per step. :class:`Metrics`
instead adds each micro-batch's loss into a device tensor and counts tokens in Python; at a
logging step :meth:`Metrics.collect` packs everything into one tensor, reduces it across ranks
with ONE collective and reads it with ONE host sync. :class:`ProgressPrinter` is the rank-0 side:
a progress line on stderr and a JSON-lines file of the collected windows.

:class:`AMPMetrics` is the same idea for loops the engine does not run (the Accelerate and
Lightning integrations): after each optimizer step it adds the scaler's on-device skip flag and
the clipping norm to device counters, and :meth:`AMPMetrics.compute` turns them into a plain dict
at the logging interval. Writers for such dicts live in :mod:`distamp.metrics_writers`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from distamp.cluster import is_distributed

__all__ = ["AMPMetrics", "Metrics", "ProgressPrinter", "StepResult", "WindowStats"]


@dataclass(frozen=True)
class WindowStats:
    """What every rank learns at a logging step (identical on all ranks).

    Attributes:
        step: optimizer steps completed.
        loss: mean loss over all ranks' micro-batches since the previous logging step.
        last_loss: mean loss of the last step alone, over ranks and micro-batches.
        loss_scale: the scaler's current scale (1.0 without loss scaling).
        skipped_steps: steps skipped for non-finite gradients since the start.
        tokens_per_s: tokens of all ranks per second of wall time in the window.
        grad_norm: the last step's gradient norm before clipping, if clipping is on.
        stop: whether any rank asked to stop (see ``collect(stop=...)``).
        overflow: the one-line overflow report when the window skipped a step (the engine
            fills it in from ``scaler.overflow_report()``), else ``None``.
        overflow_rate: skipped steps / steps in the window. The first window of a process
            divides all skips so far by all steps so far (after a resume both include the
            restored counts), since no earlier window is known.
    """

    step: int
    loss: float
    last_loss: float
    loss_scale: float
    skipped_steps: int
    tokens_per_s: float
    grad_norm: float | None
    stop: bool
    overflow: str | None = None
    overflow_rate: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class StepResult:
    """The outcome of one optimizer step. Reading a property syncs with the device; building the
    result does not, so a loop that ignores it never waits."""

    __slots__ = ("_norm", "_scale", "_skipped")

    def __init__(
        self, skipped: torch.Tensor | None, scale: torch.Tensor | None, norm: torch.Tensor | None
    ) -> None:
        self._skipped, self._scale, self._norm = skipped, scale, norm

    @classmethod
    def capture(cls, scaler: Any, norm: torch.Tensor | None) -> StepResult:
        """Snapshot a scaler right after ``update()``, without a host sync."""
        if scaler is None or not scaler.is_enabled():
            return cls(None, None, norm)
        skipped = getattr(scaler, "last_step_skipped", None)
        # torch's GradScaler has no public accessor for the scale that avoids a host sync
        # (get_scale() calls .item()); its `_scale` tensor is only read (checked on torch 2.13).
        scale = getattr(scaler, "_scale", None)
        scale = scale.detach().clone() if isinstance(scale, torch.Tensor) else None
        return cls(skipped if isinstance(skipped, torch.Tensor) else None, scale, norm)

    @property
    def stepped(self) -> bool:
        """Whether the optimizer applied this step (False: skipped for inf/NaN gradients)."""
        return self._skipped is None or not bool(self._skipped)  # host sync, on request

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
            f"StepResult(stepped={self.stepped}, loss_scale={self.loss_scale}, "
            f"grad_norm={self.grad_norm})"
        )


class Metrics:
    """Per-window counters; ``record`` never syncs, ``collect`` syncs once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # fp32, not fp64: some backends (MPS) have no fp64, and window sums need no more.
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._reset_window()
        self._step_loss = self._zero.clone()
        self._step_micro = 0
        self._last_step_loss = self._zero.clone()
        self._last_step_micro = 1
        self._grad_norm: torch.Tensor | None = None
        self._skips_seen: int | None = None  # skipped_steps at the previous collect
        self._steps_seen = 0

    def _reset_window(self) -> None:
        self._loss = self._zero.clone()
        self._micro = 0
        self._tokens = 0
        self._t0 = time.perf_counter()

    def record(self, loss: torch.Tensor, tokens: int = 0) -> None:
        """Add one micro-batch's (unscaled, undivided) loss and its token count."""
        value = loss.detach().to(torch.float32)
        self._loss += value
        self._step_loss += value
        self._micro += 1
        self._step_micro += 1
        self._tokens += int(tokens)

    def end_step(self, grad_norm: torch.Tensor | None) -> None:
        """Close a step: its loss becomes the "last step" figure."""
        self._last_step_loss, self._last_step_micro = self._step_loss, max(1, self._step_micro)
        self._step_loss, self._step_micro = self._zero.clone(), 0
        self._grad_norm = grad_norm

    def collect(self, *, step: int, scaler: Any = None, stop: bool = False) -> WindowStats:
        """Reduce the window across ranks and start a new one. Collective on every rank.

        One ``all_reduce`` (SUM over loss sums, counts, tokens, stop flags) and one host sync
        (``.tolist()``) for all of them; the scaler's scale and skip counter cost one sync each.

        Args:
            step: optimizer steps completed, for the record.
            scaler: the loss scaler (or ``None``) to read the scale and skip count from.
            stop: this rank's wish to stop; the result's ``stop`` is true if any rank wished it,
                so every rank leaves its loop at the same step.
        """
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        last = self._last_step_loss / self._last_step_micro
        norm = (
            self._grad_norm.to(self.device, torch.float32)
            if self._grad_norm is not None
            else self._zero
        )
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
                dist.all_reduce(packed)
        loss_sum, micro, tokens, stops, last_sum, norm_sum = packed.tolist()  # host sync: logging
        enabled = scaler is not None and scaler.is_enabled()
        skipped = int(scaler.skipped_steps) if enabled else 0  # host sync: logging
        if self._skips_seen is None:  # first window: everything so far (see WindowStats)
            window_skips, window_steps = skipped, step
        else:
            window_skips, window_steps = skipped - self._skips_seen, step - self._steps_seen
        self._skips_seen, self._steps_seen = skipped, step
        stats = WindowStats(
            step=step,
            loss=loss_sum / max(micro, 1.0),
            last_loss=last_sum / world,
            loss_scale=float(scaler.get_scale()) if enabled else 1.0,  # host sync: logging
            skipped_steps=skipped,
            tokens_per_s=tokens / elapsed,
            grad_norm=norm_sum / world if self._grad_norm is not None else None,
            stop=stops > 0,
            overflow_rate=window_skips / window_steps if window_steps > 0 else 0.0,
        )
        self._reset_window()
        return stats


class ProgressPrinter:
    """Rank 0's view: a progress line on stderr, and each window appended to a JSONL file.

    On a terminal the line is redrawn in place every step; elsewhere (CI logs, SLURM output) one
    line is printed per logging step, so logs stay readable.
    """

    def __init__(
        self, total_steps: int, *, jsonl: str | Path | None = None, stream: TextIO | None = None
    ) -> None:
        self.total = max(1, total_steps)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.jsonl = Path(jsonl) if jsonl is not None else None
        self._last = ""

    def _bar(self, step: int) -> str:
        width = 24
        filled = int(width * min(step, self.total) / self.total)
        return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total}"

    def step(self, step: int) -> None:
        """Redraw the progress line (terminals only)."""
        if self.tty:
            self.stream.write(f"\r{self._bar(step)} {self._last}\x1b[K")
            self.stream.flush()

    def log(self, stats: WindowStats) -> None:
        """Show a collected window and append it to the JSONL file."""
        self._last = (
            f"loss {stats.loss:.4f} | scale {stats.loss_scale:g} | skipped {stats.skipped_steps}"
            f" | {stats.tokens_per_s:,.0f} tok/s"
        )
        if self.tty:
            self.step(stats.step)
            if stats.overflow:
                self.stream.write(f"\n  {stats.overflow}\n")
        else:
            self.stream.write(f"{self._bar(stats.step)} {self._last}\n")
            if stats.overflow:
                self.stream.write(f"  {stats.overflow}\n")
            self.stream.flush()
        if self.jsonl is not None:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(stats.as_dict()) + "\n")

    def close(self) -> None:
        """End the in-place line so that later output starts on a fresh line."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class AMPMetrics:
    """Mixed-precision health of a loop distamp does not drive (Accelerate, Lightning).

    Call :meth:`step` after each optimizer step (after the scaler's ``update``) and
    :meth:`add_tokens` per micro-batch; neither syncs with the device nor communicates, so they
    cost nothing at every step. :meth:`compute` at the logging interval packs the window into one
    tensor, reduces it with ONE collective and reads it with ONE host sync (plus one each for the
    scaler's scale and skip counter), and returns a plain dict for a writer
    (:mod:`distamp.metrics_writers`) or a framework's own logger.

    Args:
        device: where the counters live (the device the scaler's flags are on).
    """

    KEYS = ("loss_scale", "skipped_steps", "overflow_rate", "grad_norm", "tokens_per_s", "steps")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._zero = torch.zeros((), dtype=torch.float32, device=self.device)
        self._reset()

    def _reset(self) -> None:
        self._skips = self._zero.clone()
        self._steps = 0
        self._tokens = 0
        self._norm: torch.Tensor | None = None
        self._t0 = time.perf_counter()

    def add_tokens(self, tokens: int) -> None:
        """Count tokens processed by this rank (any granularity: batch or micro-batch)."""
        self._tokens += int(tokens)

    def step(self, scaler: Any = None, grad_norm: torch.Tensor | float | None = None) -> None:
        """Record one optimizer step. No host sync.

        Args:
            scaler: the loss scaler after ``update()``; its ``last_step_skipped`` tensor (if it
                has one) is added on device. ``None`` or a disabled scaler: never skipped.
            grad_norm: the total gradient norm of the step before clipping (unscaled), if
                clipping ran; the window reports the last one.
        """
        self._steps += 1
        if scaler is not None and scaler.is_enabled():
            flag = getattr(scaler, "last_step_skipped", None)
            if isinstance(flag, torch.Tensor):
                self._skips += flag.to(self.device, torch.float32)
        if grad_norm is not None:
            self._norm = torch.as_tensor(grad_norm).detach().to(self.device, torch.float32)

    def compute(self, scaler: Any = None) -> dict[str, float | int | None]:
        """Close the window and return its figures. Collective when a process group is up: call
        it on every rank at the same step.

        Returns:
            ``loss_scale`` (1.0 without a scaler), ``skipped_steps`` (since the start),
            ``overflow_rate`` (skipped / steps in the window), ``grad_norm`` (last clipping norm
            in the window, mean over ranks; ``None`` without clipping), ``tokens_per_s`` (all
            ranks) and ``steps`` (in the window).
        """
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        norm = self._norm if self._norm is not None else self._zero
        packed = torch.stack([self._skips, norm, self._zero + self._tokens])
        world = 1
        if is_distributed():
            world = dist.get_world_size()
            if world > 1:
                dist.all_reduce(packed)  # the one collective of the window
        skips, norm_sum, tokens = packed.tolist()  # host sync: logging only
        enabled = scaler is not None and scaler.is_enabled()
        steps = self._steps
        out: dict[str, float | int | None] = {
            "loss_scale": float(scaler.get_scale()) if enabled else 1.0,  # host sync: logging
            "skipped_steps": int(getattr(scaler, "skipped_steps", 0)) if enabled else 0,
            # every rank took the same skip decision: the sum over ranks counts each skip world
            # times (a rank-local scaler would show up here as a non-integer rate).
            "overflow_rate": (skips / world) / steps if steps else 0.0,
            "grad_norm": norm_sum / world if self._norm is not None else None,
            "tokens_per_s": tokens / elapsed,
            "steps": steps,
        }
        self._reset()
        return out
