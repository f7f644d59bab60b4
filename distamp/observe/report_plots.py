"""The run report's figures, one function each, from a loaded run (:class:`RunData`).

Why matplotlib, drawn here rather than in the browser: the page must open offline, on a login
node or from a CI artifact, with no script and no network, and the same figures must come out as
PNG files for terminals and CI logs. Every figure is a ``matplotlib.figure.Figure`` built
without pyplot (no global state, no display), so the report can run inside a training process.

Each function returns ``(figure, caption)``: the caption says how to read it, and is what the
guide (docs/guides/seeing-a-run.md) repeats.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from distamp.observe.telemetry import TelemetryRecord

__all__ = ["FIGURES", "RunData", "Skip"]

_RANK = re.compile(r"rank ([\d,]+)")
MAX_ROWS = 40  # heatmap rows: the hottest modules when a model has more


@dataclass(frozen=True)
class Skip:
    """One skipped step, as the report marks it."""

    step: int
    reason: str  # "overflow" or "spike"
    module: str | None = None  # the first module whose forward output went non-finite
    ranks: str | None = None  # the ranks whose gradients held the inf/NaN ("0,1")

    @property
    def label(self) -> str:
        if self.reason == "spike":
            return "spike"
        who = self.module or "gradients"
        return f"{who} (rank {self.ranks})" if self.ranks else who


@dataclass
class RunData:
    """What a run folder holds: the metrics windows (``metrics.jsonl``) and every rank's
    telemetry records (``telemetry/rank<r>.jsonl``)."""

    windows: list[dict[str, Any]] = field(default_factory=list)
    telemetry: dict[int, list[TelemetryRecord]] = field(default_factory=dict)
    metrics_file: bool = True  # whether the folder has a metrics.jsonl at all
    settings: dict[str, Any] = field(default_factory=dict)  # settings.json: what the run recorded

    def clipping(self) -> tuple[bool, float | None]:
        """``(known, max_grad_norm)``: whether the run recorded its clipping setting, and that
        setting (``None``: it did not clip). Never guessed from a missing norm: a loop may clip
        without logging the norm."""
        if "max_grad_norm" not in self.settings:
            return False, None
        value = self.settings["max_grad_norm"]
        return True, float(value) if isinstance(value, (int, float)) else None

    def silent(self) -> set[str]:
        """Watched modules that never ran as a module call at some sample (no data there)."""
        return {n for r in self.records for n in r.silent}

    @property
    def records(self) -> list[TelemetryRecord]:
        """The agreed records (the lowest rank's copy: they are the same on every rank)."""
        return self.telemetry[min(self.telemetry)] if self.telemetry else []

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of a window figure, where it is a finite number."""
        points = [
            (int(w["step"]), float(w[key]))
            for w in self.windows
            if isinstance(w.get(key), (int, float)) and math.isfinite(float(w[key]))
        ]
        return [s for s, _ in points], [v for _, v in points]

    def skips(self) -> list[Skip]:
        """Every skipped step the run recorded: from telemetry (the step and the module blamed)
        when it has it, else one per window whose skip count grew (at the window's step); the
        rank comes from the window's overflow report. Spike skips (``spike_skips``) likewise."""
        out: list[Skip] = []
        blamed = [(s, m) for r in self.records for s, m in r.skips]
        previous, low = {"skipped_steps": 0, "spike_skips": 0}, 0  # counts and step so far
        for w in self.windows:
            ranks = _RANK.search(str(w.get("overflow") or ""))
            grew = {k: int(w.get(k) or 0) - v for k, v in previous.items()}
            previous = {k: int(w.get(k) or 0) for k in previous}
            if not blamed and grew["skipped_steps"] > 0:
                out.append(Skip(int(w["step"]), "overflow", ranks=ranks and ranks.group(1)))
            for s, module in blamed:
                if low < s <= int(w["step"]):
                    out.append(Skip(s, "overflow", module, ranks and ranks.group(1)))
            if grew["spike_skips"] > 0:
                out.append(Skip(int(w["step"]), "spike"))
            low = int(w["step"])
        if not self.windows:
            out = [Skip(s, "overflow", m) for s, m in blamed]
        return out


def _figure(height: float = 3.2) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, height), layout="constrained")
    return fig, fig.add_subplot()


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _mark_skips(ax: Any, skips: Sequence[Skip]) -> None:
    """A vertical line per skip, labelled with what it is blamed on (the first of each label
    only, so a run of skips stays readable)."""
    seen: set[str] = set()
    for skip in skips:
        color = "tab:purple" if skip.reason == "spike" else "tab:red"
        ax.axvline(skip.step, color=color, alpha=0.5, linewidth=1.0)
        if skip.label not in seen:
            seen.add(skip.label)
            ax.annotate(
                skip.label,
                (skip.step, 1.0),
                xycoords=("data", "axes fraction"),
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=color,
            )


MISSING = (
    "no metrics.jsonl in the run folder: fit writes it through ProgressPrinter(jsonl=...),\n"
    "a loop of one's own through distamp.MetricsRecorder(DIR)"
)
"""What a figure drawn from the windows says when the folder has no ``metrics.jsonl``."""


def loss_and_scale(run: RunData) -> tuple[Any, str]:
    fig, ax = _figure()
    steps, loss = run.series("loss")
    if not run.metrics_file:
        _empty(ax, MISSING)
        return fig, "Loss and loss scale: metrics.jsonl is missing, so nothing is drawn."
    if not steps:
        _empty(ax, "no loss was logged (metrics.jsonl holds no 'loss')")
        return fig, "Loss and loss scale: nothing logged."
    ax.plot(steps, loss, color="tab:blue", marker=".", label="loss (window mean)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss", color="tab:blue")
    s_steps, scale = run.series("loss_scale")
    if s_steps:
        right = ax.twinx()
        # "pre": a window's value holds over the steps that led to it (a skip inside lowers it)
        right.step(s_steps, scale, where="pre", color="tab:orange", label="loss scale")
        right.set_yscale("log", base=2)
        right.set_ylabel("loss scale", color="tab:orange")
    _mark_skips(ax, run.skips())
    ax.set_title("Loss and loss scale, skipped steps marked")
    caption = (
        "The mean loss of each logging window (blue) and the loss scale after it (orange, "
        "log2 axis). A red line is a step skipped for a non-finite gradient, labelled with the "
        "first module whose forward output went inf/NaN and the ranks whose gradients held it; "
        "a purple line is a step the spike guard skipped. A scale that keeps falling while red "
        "lines cluster is a module that overflows its format, not bad luck."
    )
    return fig, caption


def grad_norm(run: RunData) -> tuple[Any, str]:
    fig, ax = _figure(2.6)
    steps, norms = run.series("grad_norm")
    if not steps:
        _empty(ax, _no_norm(run))
    else:
        ax.plot(steps, norms, color="tab:green", marker=".")
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("total norm")
        _mark_skips(ax, run.skips())
    ax.set_title("Gradient norm before clipping")
    return fig, (
        "The total gradient norm (unscaled, before clipping) of the last step of each window, "
        "the mean over ranks. A norm that jumps by orders of magnitude before a skip is the "
        "overflow building up; one that decays to nothing is underflow."
    )


NO_DATA = "0.82"  # the colour of a cell nothing was measured for: a grey in neither colour map


def _colour_map(name: str) -> Any:
    """matplotlib's colour map ``name`` with the "no data" grey for cells without a number."""
    from matplotlib import colormaps

    return colormaps[name].with_extremes(bad=NO_DATA)


def _no_norm(run: RunData) -> str:
    """Why the gradient-norm figure is empty, from what the run recorded only: a missing file
    is said to be missing, and "did not clip" only when the run recorded that it did not."""
    known, max_norm = run.clipping()
    if not run.metrics_file:
        if not known:
            return MISSING
        clip = "did not clip" if max_norm is None else f"clipped at max_grad_norm={max_norm:g}"
        return f"{MISSING}\n(the run {clip})"
    if not known:
        return "no gradient norm in metrics.jsonl (the run recorded no clipping setting)"
    if max_norm is None:
        return "no gradient norm: the run did not clip (max_grad_norm=None)"
    return (
        f"no gradient norm in metrics.jsonl, although the run clipped (max_grad_norm={max_norm:g})"
    )


def _mark_no_data(ax: Any, grid: Any) -> None:
    """Hatch every run of cells without a number, so that "no data" can never be read as the
    scale's coolest colour, which means "safe"."""
    from matplotlib.patches import Rectangle

    for row, values in enumerate(grid):
        col = 0
        while col < len(values):
            if not math.isnan(values[col]):
                col += 1
                continue
            end = col
            while end < len(values) and math.isnan(values[end]):
                end += 1
            box = Rectangle((col - 0.5, row - 0.5), end - col, 1.0, hatch="///", fill=False)
            box.set_edgecolor("0.45")
            box.set_linewidth(0.0)
            ax.add_patch(box)
            col = end


def _heatmap(
    ax: Any,
    records: Sequence[TelemetryRecord],
    key: str,
    *,
    log: bool,
    label: str,
    silent: AbstractSet[str] = frozenset(),
) -> None:
    import numpy as np

    names = list(dict.fromkeys(n for r in records for n in getattr(r, key)))  # model order

    def value(r: TelemetryRecord, n: str) -> float:
        if n in r.silent:  # never called as a module: its 0 is "nothing measured"
            return math.nan
        v = getattr(r, key).get(n, math.nan)
        return 1.0 if log and math.isinf(v) else v

    grid = np.array([[value(r, n) for r in records] for n in names], dtype=float)
    if len(names) > MAX_ROWS:  # the hottest rows (a row without data counts as the coolest)
        order = np.argsort(-np.where(np.isnan(grid), -1.0, grid).max(axis=1))[:MAX_ROWS]
        names, grid = [names[i] for i in sorted(order)], grid[sorted(order)]
    if log:
        grid = np.log10(np.clip(grid, 1e-8, None))  # NaN stays NaN: no data
    cmap = _colour_map("magma" if log else "viridis")
    limits = (-8, 0) if log else (0, 1)
    image = ax.imshow(
        np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=limits[0], vmax=limits[1]
    )
    _mark_no_data(ax, grid)
    ax.figure.colorbar(image, ax=ax, label=f"log10 {label.split(' (')[0]}" if log else label)
    labels = [f"{n} (no data)" if n in silent else n for n in names]
    ax.set_yticks(range(len(names)), labels, fontsize=7)
    steps = [r.step for r in records]
    ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("optimizer step (telemetry sample)")


def _heatmap_figure(
    records: Sequence[TelemetryRecord],
    key: str,
    *,
    log: bool,
    label: str,
    title: str,
    empty: str,
    silent: AbstractSet[str] = frozenset(),
) -> Any:
    """A figure holding one heatmap of ``key`` (rows: names, columns: samples), sized to its
    rows; ``empty`` is said instead when no record has any. ``silent``: rows of modules never
    called as a module, labelled "no data"."""
    rows = len({n for r in records for n in getattr(r, key)})
    fig, ax = _figure(1.6 + 0.18 * min(max(rows, 1), MAX_ROWS) if rows else 2.0)
    if rows:
        _heatmap(ax, records, key, log=log, label=label, silent=silent)
    else:
        _empty(ax, empty)
    ax.set_title(title)
    return fig


def _no_data_line(silent: AbstractSet[str]) -> str:
    """The caption's line on the rows drawn as "no data", naming them."""
    if not silent:
        return ""
    names = ", ".join(sorted(silent)[:6]) + (", ..." if len(silent) > 6 else "")
    return (
        f" No data (grey, hatched): {names} never ran as a module call, so nothing was "
        "measured there (its parent uses its weights directly, as nn.MultiheadAttention does "
        "with out_proj); that is not the same as safe."
    )


def headroom_heatmap(run: RunData) -> tuple[Any, str]:
    silent = run.silent()
    fig = _heatmap_figure(
        run.records,
        "headroom",
        log=True,
        label="headroom (|output| / format max)",
        title="Activation headroom per module",
        empty="no headroom was sampled",
        silent=silent,
    )
    return fig, (
        "Each module's largest |output| since the previous sample over its format's maximum "
        "(fp16 65504, bf16 3.4e38, e4m3 448), agreed over ranks, on a log10 colour scale: 0 "
        "(white) is the limit itself, an overflow is drawn at 0. A row creeping towards white is "
        "the next module to overflow; the adaptive rules promote such modules."
        + _no_data_line(silent)
    )


def underflow_heatmap(run: RunData) -> tuple[Any, str]:
    fig = _heatmap_figure(
        run.records,
        "underflow",
        log=False,
        label="underflow fraction",
        title="Gradient underflow per parameter",
        empty="no underflow was sampled",
    )
    return fig, (
        "The fraction of each parameter's scaled gradient elements that are zero or subnormal in "
        "the compute format, agreed over ranks. Bright rows are gradients the format loses: a "
        "higher loss scale, a per-block backward scale, or bf16 keeps them."
    )


def precision_events(run: RunData) -> tuple[Any, str]:
    fig, ax = _figure(2.6)
    changes = [c for r in run.records for c in r.changes]
    if not changes:
        _empty(ax, "no promotion, demotion or backward-scale change")
    else:
        names = list(dict.fromkeys(str(c.get("module", c.get("block"))) for c in changes))
        for c in changes:
            row = names.index(str(c.get("module", c.get("block"))))
            up = str(c.get("after")) in ("fp32", "bf16") or "2**" not in str(c)
            ax.scatter(c.get("step", 0), row, marker="^" if up else "v", color="tab:red")
            ax.annotate(
                f"{c.get('before')} -> {c.get('after')}",
                (c.get("step", 0), row),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(-0.5, len(names) - 0.5)
    ax.set_title("Precision changes")
    return fig, (
        "Each decision of the adaptive rules at the step it was made, the same on every rank: a "
        "module promoted to a wider format (fp16 -> fp32, fp8 -> bf16) or demoted back, and each "
        "block's backward-scale exponent change."
    )


def fp8_status(run: RunData) -> tuple[Any, str]:
    fig = _heatmap_figure(
        run.records,
        "fp8_flush",
        log=False,
        label="fraction flushed to zero",
        title="fp8 layers: input flushed to zero in e4m3",
        empty="no float8 layers in this run",
        silent=run.silent(),
    )
    return fig, (
        "For each float8 layer, the fraction of its nonzero input that e4m3 under dynamic "
        "tensorwise scaling rounds to zero. Near 0 the layer is safe in fp8; a bright row is an "
        "input whose range e4m3 cannot hold (the adaptive rules send such layers to bf16)."
    )


def rank_headroom(run: RunData) -> tuple[Any, str]:
    fig, ax = _figure(2.6)
    if not run.telemetry:
        _empty(ax, "no telemetry (DistAMP(telemetry=distamp.Telemetry(DIR)))")
    for rank, records in sorted(run.telemetry.items()):
        steps = [r.step for r in records]
        hottest = [max(r.local_headroom.values(), default=0.0) for r in records]
        ax.plot(steps, [min(h, 1.0) for h in hottest], marker=".", label=f"rank {rank}")
    if run.telemetry:
        ax.set_yscale("log")
        ax.axhline(1.0, color="0.3", linestyle="--", linewidth=0.8)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("max headroom")
        ax.legend(fontsize=7, ncol=min(len(run.telemetry), 8))
    ax.set_title("Each rank's own hottest module")
    return fig, (
        "Per rank, the largest headroom over all modules in its own data (before the ranks "
        "agree), capped at the limit (dashed). One rank well above the others is that rank's "
        "data, not the model: look at its batches."
    )


def wire_bytes(run: RunData) -> tuple[Any, str]:
    fig, ax = _figure(2.4)
    steps, payload = run.series("grad_bytes")
    if not run.metrics_file:
        _empty(ax, MISSING)
    elif not steps:
        _empty(ax, "gradient bytes were not counted on this path")
    else:
        ax.plot(steps, [b / 2**20 for b in payload], color="tab:brown", marker=".")
        s_steps, scales = run.series("grad_scale_bytes")
        if s_steps and any(scales):
            ax.plot(s_steps, [b / 2**20 for b in scales], color="tab:gray", label="scales")
            ax.legend(fontsize=7)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("MiB per step")
    ax.set_title("Gradient bytes on the wire (this rank)")
    return fig, (
        "The gradient bytes rank 0 sent per optimizer step, and the scales sent alongside with "
        "the 8-bit hooks: a compressed exchange shows as a flat line at a quarter of fp32's."
    )


FIGURES = (
    ("loss", loss_and_scale),
    ("grad_norm", grad_norm),
    ("headroom", headroom_heatmap),
    ("underflow", underflow_heatmap),
    ("precision_changes", precision_events),
    ("fp8", fp8_status),
    ("ranks", rank_headroom),
    ("wire_bytes", wire_bytes),
)
"""``(name, function)`` of each figure, in the page's order; ``--png`` names files after them."""
