"""Per-module precision telemetry: what the numeric monitor measured, kept on every rank.

Why: the monitor (:mod:`distamp.observe.numerics`) already measures, per module, how close each
output came to its format's maximum, how much of each gradient underflowed, which module broke a
skipped step and how much of each float8 layer's input e4m3 flushed to zero; the adaptive rules
act on those numbers. Without telemetry a user sees none of it: a run that skipped steps or lost
its loss scale leaves only scalars behind. A :class:`Telemetry` turns each of the monitor's
reports into a :class:`TelemetryRecord` and keeps it:

- every rank appends its own record to ``DIR/telemetry/rank<r>.jsonl``: the agreed numbers (the
  ranks' maximum or mean, identical everywhere) *and* this rank's own, so a rank whose data runs
  hotter than its peers' can be told apart (:func:`read_telemetry` reads them back);
- the writers given to it (:class:`~distamp.observe.writers.TensorBoardWriter`,
  :class:`~distamp.observe.writers.WandbWriter`) get the agreed numbers as scalars and as
  histograms over modules, on rank 0.

Cost: nothing between reports. At a reporting step (every ``interval`` steps) the monitor reads
its agreed numbers anyway (one host sync); the record adds the read of this rank's own vector,
the loss scale, and one line of JSON. ``benchmarks/telemetry.py`` measures it.

Layering: this module formats what the precision layer hands it (a report, the loss scale, the
rules' changes and exponents); it imports nothing above :mod:`distamp.observe`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distamp.cluster import is_distributed
from distamp.observe.numerics import NumericStats
from distamp.observe.writers import MetricsWriter

__all__ = [
    "TELEMETRY_INTERVAL",
    "Telemetry",
    "TelemetryRecord",
    "read_telemetry",
    "telemetry_files",
]

TELEMETRY_INTERVAL = 10
"""Steps between samples by default: the monitor's own default reporting interval."""

FOLDER = "telemetry"
"""The folder of a run directory that holds one JSON-lines file per rank."""


@dataclass(frozen=True)
class TelemetryRecord:
    """One sample of a run's precision, as one rank saw it at a reporting step.

    Attributes:
        step: optimizer steps completed at the sample.
        rank, world_size: who wrote it.
        loss_scale: the scaler's scale after the step (1.0 without loss scaling).
        headroom, underflow, fp8_flush: the agreed numbers (identical on every rank): module ->
            max ``|output|`` over the format's maximum, parameter -> fraction of gradient
            elements zero or subnormal, float8 layer -> fraction of its input flushed to zero.
        local_headroom, local_underflow, local_fp8_flush: the same, this rank's own.
        skips: ``(step, module)`` of each step skipped since the previous sample; the module is
            the first whose forward output went non-finite (``None``: a gradient-only overflow).
        nonfinite: module -> how many of those skips it is blamed for.
        grad_exponents: block -> its backward-scale exponent (empty without backward scales).
        changes: precision promotions/demotions and backward-scale changes made since the
            previous sample, each a dict (``step``, ``module`` or ``block``, ``before``,
            ``after``, ``reason``).
        silent: watched modules that never ran as a module call (their numbers are "no
            data", not zero; see :attr:`~distamp.observe.numerics.NumericStats.silent`).
    """

    step: int
    rank: int
    world_size: int
    loss_scale: float
    headroom: dict[str, float] = field(default_factory=dict)
    underflow: dict[str, float] = field(default_factory=dict)
    fp8_flush: dict[str, float] = field(default_factory=dict)
    local_headroom: dict[str, float] = field(default_factory=dict)
    local_underflow: dict[str, float] = field(default_factory=dict)
    local_fp8_flush: dict[str, float] = field(default_factory=dict)
    skips: tuple[tuple[int, str | None], ...] = ()
    nonfinite: dict[str, int] = field(default_factory=dict)
    grad_exponents: dict[str, int] = field(default_factory=dict)
    changes: tuple[dict[str, Any], ...] = ()
    silent: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (non-finite numbers as ``None``: JSON has no inf)."""
        out = dataclasses.asdict(self)
        out["skips"] = [list(s) for s in self.skips]
        out["changes"] = list(self.changes)
        out["silent"] = list(self.silent)
        return _finite(out)

    def as_metrics(self, prefix: str = "telemetry/") -> dict[str, float]:
        """The agreed numbers as flat scalars for the metrics writers: ``headroom/<module>``,
        ``underflow/<parameter>``, ``fp8_flush/<layer>``, ``nonfinite/<module>``,
        ``grad_exponent/<block>``, ``skips`` and ``changes``."""
        out: dict[str, float] = {
            f"{prefix}skips": float(len(self.skips)),
            f"{prefix}changes": float(len(self.changes)),
        }
        groups: Sequence[tuple[str, Mapping[str, float]]] = (
            ("headroom", self.headroom),
            ("underflow", self.underflow),
            ("fp8_flush", self.fp8_flush),
            ("nonfinite", {k: float(v) for k, v in self.nonfinite.items()}),
            ("grad_exponent", {k: float(v) for k, v in self.grad_exponents.items()}),
        )
        for group, values in groups:
            out.update({f"{prefix}{group}/{name}": float(v) for name, v in values.items()})
        return out

    def histograms(self, prefix: str = "telemetry/") -> dict[str, list[float]]:
        """The agreed numbers as distributions over modules (finite values only), for writers
        that draw histograms: one module near the limit stands out among hundreds."""
        groups = {"headroom": self.headroom, "underflow": self.underflow}
        if self.fp8_flush:
            groups["fp8_flush"] = self.fp8_flush
        return {
            f"{prefix}{name}": [v for v in values.values() if math.isfinite(v)]
            for name, values in groups.items()
            if values
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> TelemetryRecord:
        """Read back what :meth:`as_dict` wrote (``None`` numbers come back as ``inf``: the only
        non-finite value a record holds is an overflowed module's headroom)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        for key in ("headroom", "local_headroom"):
            values[key] = {k: math.inf if v is None else v for k, v in values.get(key, {}).items()}
        values["skips"] = tuple((int(s), m) for s, m in values.get("skips", ()))
        values["changes"] = tuple(values.get("changes", ()))
        values["silent"] = tuple(str(n) for n in values.get("silent", ()))
        return cls(**values)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _change_dict(change: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(change) and not isinstance(change, type):
        return dataclasses.asdict(change)
    return {"change": str(change)}


class Telemetry:
    """Keep every report of the numeric monitor, per rank, and hand it to writers.

    Pass it to the engine (``DistAMP(..., telemetry=Telemetry(DIR))``, which then samples every
    ``interval`` steps even without ``numerics_interval``), or attach it to a plug-in's
    adaptive run (``run.telemetry = Telemetry(DIR)``); :meth:`record` is called at each report.

    Args:
        directory: the run folder; records go to ``directory/telemetry/rank<r>.jsonl``.
        interval: steps between samples (the monitor's reporting interval when the engine
            builds it; a ``numerics_interval`` or a policy's own interval wins).
        writers: more writers (TensorBoard, W&B) that get the agreed numbers as scalars and,
            where they have ``write_histogram``, as histograms; they decide which rank writes
            (rank 0 by default).

    Raises:
        ValueError: ``interval`` is not a whole number >= 1, or ``writers`` holds something
            without ``write``.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        interval: int = TELEMETRY_INTERVAL,
        writers: Iterable[MetricsWriter] = (),
    ) -> None:
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"Telemetry(interval={interval!r}): give a whole number of steps >= 1")
        if not isinstance(directory, (str, Path)):
            raise TypeError(f"Telemetry(directory={directory!r:.80}): expected a path")
        self.writers = list(writers)
        bad = [type(w).__name__ for w in self.writers if not callable(getattr(w, "write", None))]
        if bad:
            raise ValueError(f"Telemetry(writers=...): {', '.join(bad)} has no write(step, dict)")
        self.directory, self.interval = Path(directory), interval
        self.records = 0  # how many this rank wrote

    def path(self, rank: int) -> Path:
        """Rank ``rank``'s file."""
        return self.directory / FOLDER / f"rank{rank}.jsonl"

    def record(
        self,
        stats: NumericStats,
        local: NumericStats | None,
        *,
        loss_scale: float,
        grad_exponents: Mapping[str, int] | None = None,
        changes: Iterable[Any] = (),
    ) -> TelemetryRecord:
        """Keep one report: this rank's line in its file, the agreed numbers to the writers.
        No collective (every rank writes its own file); no device work (the report is read).

        Args:
            stats: the agreed report; ``local``: this rank's own numbers at the same step.
            loss_scale: the scale after the step.
            grad_exponents: each block's backward-scale exponent now.
            changes: the rules' changes made at this report.
        """
        rank, world = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
        own = local if local is not None else stats
        record = TelemetryRecord(
            step=stats.step,
            rank=rank,
            world_size=world,
            loss_scale=float(loss_scale),
            headroom=dict(stats.headroom),
            underflow=dict(stats.underflow),
            fp8_flush=dict(stats.fp8_flush),
            local_headroom=dict(own.headroom),
            local_underflow=dict(own.underflow),
            local_fp8_flush=dict(own.fp8_flush),
            skips=tuple(stats.skips),
            nonfinite=dict(Counter(m for _, m in stats.skips if m is not None)),
            grad_exponents=dict(grad_exponents or {}),
            changes=tuple(_change_dict(c) for c in changes),
            silent=tuple(stats.silent),
        )
        path = self.path(rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # opened per write: a killed run keeps every line
            f.write(json.dumps(record.as_dict()) + "\n")
        self.records += 1
        scalars = record.as_metrics()
        for writer in self.writers:
            writer.write(record.step, scalars)
            draw = getattr(writer, "write_histogram", None)
            if draw is not None:
                for name, values in record.histograms().items():
                    draw(record.step, name, values)
        return record

    def close(self) -> None:
        """Close the writers (the JSON-lines files are never held open)."""
        for writer in self.writers:
            writer.close()


def telemetry_files(directory: str | Path) -> dict[int, Path]:
    """Rank -> its telemetry file in run folder ``directory`` (empty when it has none)."""
    folder = Path(directory) / FOLDER
    out: dict[int, Path] = {}
    for path in sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []:
        suffix = path.stem[len("rank") :]
        if suffix.isdigit():
            out[int(suffix)] = path
    return out


def read_telemetry(directory: str | Path) -> dict[int, list[TelemetryRecord]]:
    """Every rank's records of run folder ``directory``, in step order. A line cut short by a
    killed run is skipped; a resumed run's repeated steps keep the later record."""
    out: dict[int, list[TelemetryRecord]] = {}
    for rank, path in telemetry_files(directory).items():
        by_step: dict[int, TelemetryRecord] = {}
        for line in path.read_text().splitlines():
            try:
                record = TelemetryRecord.from_dict(json.loads(line))
            except (ValueError, TypeError, KeyError):
                continue  # the last line of a killed run
            by_step[record.step] = record
        out[rank] = [by_step[s] for s in sorted(by_step)]
    return out
