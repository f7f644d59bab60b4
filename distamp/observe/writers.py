"""Where the reduced figures go: pluggable writers behind one small interface.

Every writer has ``write(step, metrics)`` and ``close()`` (:class:`MetricsWriter`), and takes
the plain dicts that :meth:`distamp.observe.metrics.WindowStats.as_dict` and
:meth:`distamp.observe.metrics.AMPMetrics.compute` return, so one logging call serves the engine
and the
integrations. Writers hold no figures of their own: the numbers are computed once, by the reducer
in :mod:`distamp.observe.metrics`, and a writer only formats them.

- :class:`ConsoleWriter`: a progress line on stderr;
- :class:`JSONLWriter`: one JSON object per window in a file (default, no dependency);
- :class:`TensorBoardWriter`: one scalar per figure, histograms of per-module telemetry
  (optional dependency);
- :class:`WandbWriter`: the same for Weights & Biases, offline by default (optional dependency).

:class:`ProgressPrinter` bundles a console line and an optional JSONL file for the engine's
``on_log``/``on_step`` callbacks. Writers write on rank 0 only by default: every rank holds the
same reduced figures, and N ranks appending to one file would interleave lines.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

import torch.distributed as dist

from distamp.cluster import is_distributed

__all__ = [
    "ConsoleWriter",
    "JSONLWriter",
    "MetricsWriter",
    "ProgressPrinter",
    "TensorBoardWriter",
    "WandbWriter",
    "Window",
    "make_writer",
]


class Window(Protocol):
    """A collected window as :class:`ProgressPrinter` takes it: its step and its figures by name
    (:class:`distamp.observe.metrics.WindowStats` is one). Writers format; they never need the
    reducer that produced the figures, so this module does not import it."""

    @property
    def step(self) -> int: ...

    def as_dict(self) -> dict[str, Any]: ...


class MetricsWriter(Protocol):
    """What the integrations, the examples and :class:`ProgressPrinter` call."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record one window's figures at optimizer step ``step``. No device work: the figures
        are Python values already."""

    def close(self) -> None:
        """Release what the writer holds (files, event writers); later writes are dropped or
        reopen, as the writer documents."""


def _is_writer_rank(rank_zero_only: bool) -> bool:
    if not rank_zero_only or not is_distributed():
        return True
    return dist.get_rank() == 0


# (key, format) pairs of the console line, in display order; a key a dict lacks is left out.
_CONSOLE_FIELDS = (
    ("loss", "loss {:.4f}"),
    ("loss_scale", "scale {:g}"),
    ("skipped_steps", "skipped {}"),
    ("tokens_per_s", "{:,.0f} tok/s"),
)


class ConsoleWriter:
    """A progress line: a bar (given the run's length) and the window's loss, scale, skips and
    throughput, plus the overflow report when the window has one.

    On a terminal the line is redrawn in place (:meth:`step` every step); elsewhere (CI logs,
    SLURM output) one line is printed per written window, so logs stay readable.

    Args:
        total_steps: the step the run ends at, for the bar; ``None``: no bar, the step number.
        stream: where to print (stderr by default).
        rank_zero_only: print only on rank 0 of the default process group.
    """

    def __init__(
        self,
        total_steps: int | None = None,
        *,
        stream: TextIO | None = None,
        rank_zero_only: bool = True,
    ) -> None:
        self.total = None if total_steps is None else max(1, total_steps)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.active = _is_writer_rank(rank_zero_only)
        self._last = ""

    def _bar(self, step: int) -> str:
        if self.total is None:
            return f"step {step}"
        width = 24
        filled = int(width * min(step, self.total) / self.total)
        return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total}"

    def step(self, step: int) -> None:
        """Redraw the progress line (terminals only)."""
        if self.active and self.tty:
            self.stream.write(f"\r{self._bar(step)} {self._last}\x1b[K")
            self.stream.flush()

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show a window's loss, scale, skips and tokens/s (those of them ``metrics`` has) and
        its ``overflow`` report, if any."""
        if not self.active:
            return
        self._last = " | ".join(
            fmt.format(metrics[key]) for key, fmt in _CONSOLE_FIELDS if metrics.get(key) is not None
        )
        overflow = metrics.get("overflow")
        if self.tty:
            self.step(step)
            if overflow:
                self.stream.write(f"\n  {overflow}\n")
        else:
            self.stream.write(f"{self._bar(step)} {self._last}\n")
            if overflow:
                self.stream.write(f"  {overflow}\n")
            self.stream.flush()

    def close(self) -> None:
        """End the in-place line so that later output starts on a fresh line."""
        if self.active and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class JSONLWriter:
    """Append one JSON object per call, ``{"step": ..., **metrics}``, to a file.

    The file is opened per write (append mode) rather than held open, so that a killed job leaves
    every completed line on disk and a resumed job simply appends. Non-finite floats are written
    as ``null``: JSON has no inf/NaN and most readers reject Python's ``Infinity``.

    Args:
        path: the ``.jsonl`` file; its folder is created.
        rank_zero_only: write only on rank 0 of the default process group.
    """

    def __init__(self, path: str | Path, *, rank_zero_only: bool = True) -> None:
        self.path = Path(path)
        self.active = _is_writer_rank(rank_zero_only)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.active:
            return
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Nothing is held open; present for the :class:`MetricsWriter` protocol."""


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TensorBoardWriter:
    """One scalar per numeric metric, tagged ``{prefix}/{name}``, through TensorBoard's
    ``SummaryWriter`` (``pip install -e ".[tensorboard]"`` from a checkout). ``None`` and
    non-numeric values are left out: TensorBoard scalars must be numbers.

    Args:
        log_dir: the run folder TensorBoard reads.
        prefix: tag prefix, so that these curves group together.
        rank_zero_only: write only on rank 0 (other ranks do not even import TensorBoard).

    Raises:
        ImportError: TensorBoard is not installed; the message says which extra to install.
    """

    def __init__(
        self, log_dir: str | Path, *, prefix: str = "amp", rank_zero_only: bool = True
    ) -> None:
        self.prefix = prefix
        self._writer: Any = None
        if not _is_writer_rank(rank_zero_only):
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's module imports the tensorboard package itself
            raise ImportError(
                "TensorBoardWriter needs the tensorboard package: pip install -e "
                "'.[tensorboard]' from a distamp checkout (or use the default JSONLWriter)"
            ) from e
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(f"{self.prefix}/{name}", float(value), global_step=int(step))

    def write_histogram(self, step: int, name: str, values: Sequence[float]) -> None:
        """One histogram (e.g. every module's headroom at a telemetry sample)."""
        if self._writer is None or not values:
            return
        import numpy as np

        data = np.asarray(values, dtype=np.float64)
        self._writer.add_histogram(f"{self.prefix}/{name}", data, global_step=int(step))

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbWriter:
    """Numbers and telemetry histograms to a Weights & Biases run, offline by default.

    Offline (``mode="offline"``) writes the run under ``directory/wandb`` and needs no account
    nor network: a cluster's compute nodes rarely reach the internet, so the run is synced later
    from a login node with ``wandb sync DIR/wandb/offline-run-*``. ``None`` and non-numeric
    values are left out, as for TensorBoard.

    Args:
        directory: where W&B keeps the run.
        project: the W&B project name.
        mode: ``"offline"`` (default), ``"online"`` or ``"disabled"``.
        rank_zero_only: write only on rank 0 (other ranks do not even import wandb).
        **init: passed on to ``wandb.init`` (``name``, ``config``, ``tags``...).

    Raises:
        ImportError: wandb is not installed; the message gives the install command.
        ValueError: ``mode`` is not one of the three.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        project: str = "distamp",
        mode: Literal["offline", "online", "disabled"] = "offline",
        rank_zero_only: bool = True,
        **init: Any,
    ) -> None:
        if mode not in ("offline", "online", "disabled"):
            raise ValueError(f"WandbWriter(mode={mode!r}): use 'offline', 'online' or 'disabled'")
        self._run: Any = None
        if not _is_writer_rank(rank_zero_only):
            return
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "WandbWriter needs the wandb package: pip install -e '.[wandb]' from a distamp "
                "checkout (or use the default JSONLWriter)"
            ) from e
        self._wandb = wandb
        Path(directory).mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, x_disable_stats=True)
        self._run = wandb.init(
            project=project, dir=str(directory), mode=mode, settings=settings, **init
        )

    @property
    def run_dir(self) -> Path | None:
        """The folder of this rank's run (``None`` on ranks that do not write)."""
        return None if self._run is None else Path(self._run.dir).parent

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._run is None:
            return
        numbers = {
            k: float(v)
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self._run.log(numbers, step=int(step))

    def write_histogram(self, step: int, name: str, values: Sequence[float]) -> None:
        """One histogram (e.g. every module's headroom at a telemetry sample)."""
        if self._run is None or not values:
            return
        self._run.log({name: self._wandb.Histogram(list(values))}, step=int(step))

    def close(self) -> None:
        """Finish the run (flushes it to ``directory/wandb``)."""
        if self._run is not None:
            self._run.finish()
            self._run = None


def make_writer(kind: str = "jsonl", path: str | Path = "metrics.jsonl") -> MetricsWriter:
    """Build a writer by name: ``"jsonl"`` (``path`` is the file), ``"tensorboard"`` or
    ``"wandb"`` (``path`` is the log folder; W&B offline) or ``"console"`` (stderr; ``path`` is
    not used).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "jsonl":
        return JSONLWriter(path)
    if kind == "tensorboard":
        return TensorBoardWriter(path)
    if kind == "console":
        return ConsoleWriter()
    if kind == "wandb":
        return WandbWriter(path)
    raise ValueError(
        f"kind={kind!r} is not a metrics writer: use 'jsonl', 'tensorboard', 'wandb' or 'console'"
    )


class ProgressPrinter:
    """Rank 0's view of an engine run: a :class:`ConsoleWriter` progress line on stderr and,
    with ``jsonl``, each window appended to that file by a :class:`JSONLWriter`.

    Pass :meth:`log` as the engine's ``on_log`` and :meth:`step` as its ``on_step`` on rank 0
    only (as ``launch/train.py`` does): the writers it builds therefore do not check the rank
    again, so that a printer made before the process group exists still writes.

    Args:
        total_steps: the step the run ends at, for the bar.
        jsonl: the JSON-lines file, or ``None`` for none.
        stream: where the progress line goes (stderr by default).
        writers: more writers (e.g. a :class:`TensorBoardWriter`) that get every window too.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        jsonl: str | Path | None = None,
        stream: TextIO | None = None,
        writers: Sequence[MetricsWriter] = (),
    ) -> None:
        self.console = ConsoleWriter(total_steps, stream=stream, rank_zero_only=False)
        self.writers: list[MetricsWriter] = [self.console]
        if jsonl is not None:
            self.writers.append(JSONLWriter(jsonl, rank_zero_only=False))
        self.writers.extend(writers)

    def step(self, step: int) -> None:
        """Redraw the progress line (terminals only)."""
        self.console.step(step)

    def log(self, stats: Window) -> None:
        """Hand a collected window to every writer."""
        record = stats.as_dict()
        for writer in self.writers:
            writer.write(stats.step, record)

    def close(self) -> None:
        """Close every writer (the console's ends its in-place line)."""
        for writer in self.writers:
            writer.close()
