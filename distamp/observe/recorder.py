"""``metrics.jsonl`` from a loop of one's own: :class:`MetricsRecorder`.

Why: ``distamp report`` draws the loss, the loss scale, the skips and the gradient norm from
``DIR/metrics.jsonl``, which :meth:`distamp.DistAMP.fit` writes through its ``on_log``. A loop
that drives :class:`~distamp.DistributedGradScaler` itself (``autocast`` + ``scale`` /
``step`` / ``update``), or the engine's :meth:`~distamp.DistAMP.backward_and_step` by hand,
has no ``fit`` to log for it. The recorder is that logging step, and nothing more: the figures
come from the one window reducer (:class:`~distamp.observe.metrics.Metrics`) and go out through
the one JSON-lines writer (:class:`~distamp.observe.writers.JSONLWriter`), so a hand loop's lines
are the engine's lines, key for key.

Cost: feeding it adds the loss and the scaler's skip flag into device tensors (no host sync);
every ``log_interval`` steps one all-reduce and the reducer's host reads close the window, as in
``fit``. Call it on every rank alike: the logging step is a collective; rank 0 writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from distamp.observe.metrics import Metrics, WindowStats
from distamp.observe.run_settings import write_settings
from distamp.observe.writers import JSONLWriter, MetricsWriter

__all__ = ["METRICS_FILE", "MetricsRecorder"]

METRICS_FILE = "metrics.jsonl"
"""The file of a run folder that holds one line per logging window (what the report reads)."""


class MetricsRecorder:
    """Keep a hand loop's metrics in ``directory/metrics.jsonl``, as ``fit`` keeps the engine's.

    With the drop-in scaler, call ``recorder.step(scaler, loss=loss, grad_norm=norm)`` after
    each ``scaler.update()``, and ``recorder.close(scaler)`` after the last step. With the
    engine in a hand loop, whose ``backward`` and ``step`` feed its own reducer, call
    ``recorder.log(amp.collect_metrics())`` at each logging step.

    Args:
        directory: the run folder (the one ``distamp report`` is given).
        log_interval: optimizer steps between lines (:meth:`step` collects at every multiple).
        settings: what the run was set up with, written to ``directory/settings.json`` so that
            the report states them rather than guesses: at least ``max_grad_norm`` (``None``
            when the loop does not clip); the engine's :attr:`~distamp.DistAMP.settings`
            whole. ``None``: nothing recorded (the report then says it does not know).
        device: where the window's counters live; ``None``: the device of the first loss.
        writers: more writers that get every window (e.g. a
            :class:`~distamp.observe.writers.ConsoleWriter`).

    Raises:
        ValueError: ``log_interval`` is not a whole number >= 1.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        log_interval: int = 10,
        settings: Mapping[str, Any] | None = None,
        device: torch.device | str | None = None,
        writers: Sequence[MetricsWriter] = (),
    ) -> None:
        if not isinstance(log_interval, int) or isinstance(log_interval, bool) or log_interval < 1:
            raise ValueError(
                f"MetricsRecorder(log_interval={log_interval!r}): give a whole number of "
                "optimizer steps >= 1"
            )
        self.directory = Path(directory)
        self.log_interval = log_interval
        self.path = self.directory / METRICS_FILE
        self.writers: list[MetricsWriter] = [JSONLWriter(self.path), *writers]  # rank 0 writes
        self.steps = 0  # optimizer steps fed
        self.last: WindowStats | None = None  # the last window collected
        self._device = None if device is None else torch.device(device)
        self._metrics: Metrics | None = None
        self._reported = 0  # skipped steps whose overflow report a line already carries
        if settings is not None:
            write_settings(self.directory, settings)

    def _reducer(self, like: torch.Tensor | None = None) -> Metrics:
        if self._metrics is None:
            device = self._device or (like.device if like is not None else torch.device("cpu"))
            self._metrics = Metrics(device)
        return self._metrics

    def record(self, loss: torch.Tensor, tokens: int = 0) -> None:
        """Add one micro-batch's loss (unscaled, undivided) and its token count. No host sync.
        A step of one micro-batch can pass its loss to :meth:`step` instead."""
        self._reducer(loss).record(loss, tokens)

    def step(
        self,
        scaler: Any,
        *,
        loss: torch.Tensor | None = None,
        grad_norm: torch.Tensor | float | None = None,
        tokens: int = 0,
    ) -> WindowStats | None:
        """Close one optimizer step, after ``scaler.update()``; at every ``log_interval``-th
        step, also collect the window and write its line.

        No host sync between logging steps (the loss, the norm and the scaler's skip flag stay
        on device). A logging step is a collective (one all-reduce, and the overflow report's
        gather when the window skipped): call :meth:`step` on every rank at every step.

        Args:
            scaler: the loss scaler (a :class:`~distamp.DistributedGradScaler`, torch's
                ``GradScaler``, or ``None`` without loss scaling).
            loss: the step's loss, when it has one micro-batch (else :meth:`record` each).
            grad_norm: the total norm before clipping (what ``scaler.clip_grad_norm_`` or
                ``torch.nn.utils.clip_grad_norm_`` returned), when the loop clips.
            tokens: tokens this rank processed in the step, for the throughput figure.

        Returns:
            The window collected at a logging step (identical on every rank), else ``None``.
        """
        if loss is not None:
            self.record(loss, tokens)
        elif tokens:
            self._reducer().add_tokens(tokens)
        self._reducer().end_step(grad_norm, scaler)
        self.steps += 1
        return self.flush(scaler) if self.steps % self.log_interval == 0 else None

    def flush(self, scaler: Any) -> WindowStats | None:
        """Collect the window in progress and write its line (collective: every rank); nothing
        when no step was fed since the last line. Call it after the last step, so that a run
        whose length is not a multiple of ``log_interval`` keeps its end."""
        metrics = self._metrics
        if metrics is None or metrics.window_steps == 0:
            return None
        stats = metrics.collect(step=self.steps, scaler=scaler)
        return self.log(self._with_overflow(stats, scaler))

    def log(self, stats: WindowStats) -> WindowStats:
        """Write a window collected elsewhere (the engine's :meth:`~distamp.DistAMP.
        collect_metrics`) to every writer; rank 0 writes the file. No collective."""
        record = stats.as_dict()
        for writer in self.writers:
            writer.write(stats.step, record)
        self.last = stats
        return stats

    def close(self, scaler: Any = None) -> None:
        """:meth:`flush` the last window when ``scaler`` is given (collective), then close the
        writers."""
        if scaler is not None:
            self.flush(scaler)
        for writer in self.writers:
            writer.close()

    def _with_overflow(self, stats: WindowStats, scaler: Any) -> WindowStats:
        """``stats`` with the scaler's one-line overflow report when the window skipped, as the
        engine's lines carry it. The report gathers from every rank: the window's skip count is
        the same everywhere, so every rank takes this branch alike. torch's GradScaler has no
        report (the line then has none)."""
        if stats.skipped_steps <= self._reported:
            return stats
        self._reported = stats.skipped_steps
        report_of = getattr(scaler, "overflow_report", None)
        report = report_of() if callable(report_of) else None
        if report is None:
            return stats
        return replace(stats, overflow=report.one_line())
