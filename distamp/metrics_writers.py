"""Writers for metric dicts: JSON lines (default, no dependency) and TensorBoard (optional).

Both take the plain dicts that :meth:`distamp.metrics.AMPMetrics.compute` and
:meth:`distamp.metrics.WindowStats.as_dict` return, so one logging call serves the engine and the
integrations. Writers write on rank 0 only by default: every rank holds the same reduced figures,
and N ranks appending to one file would interleave lines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from distamp.cluster import is_distributed

__all__ = ["JSONLWriter", "MetricsWriter", "TensorBoardWriter", "make_writer"]


class MetricsWriter(Protocol):
    """What the integrations and examples call."""

    def write(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _is_writer_rank(rank_zero_only: bool) -> bool:
    if not rank_zero_only or not is_distributed():
        return True
    return dist.get_rank() == 0


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
    ``SummaryWriter`` (``pip install "distamp[tensorboard]"``). ``None`` and non-numeric values
    are left out: TensorBoard scalars must be numbers.

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
                "TensorBoardWriter needs the tensorboard package: pip install "
                "'distamp[tensorboard]' (or use the default JSONLWriter)"
            ) from e
        self._writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            self._writer.add_scalar(f"{self.prefix}/{name}", float(value), global_step=int(step))

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def make_writer(kind: str = "jsonl", path: str | Path = "metrics.jsonl") -> MetricsWriter:
    """Build a writer by name: ``"jsonl"`` (``path`` is the file) or ``"tensorboard"``
    (``path`` is the log folder).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind == "jsonl":
        return JSONLWriter(path)
    if kind == "tensorboard":
        return TensorBoardWriter(path)
    raise ValueError(f"kind={kind!r} is not a metrics writer: use 'jsonl' or 'tensorboard'")
