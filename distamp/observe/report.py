"""``distamp report DIR``: one self-contained HTML page of a run's precision, and PNG files.

What it reads from the run folder ``DIR``:

- ``metrics.jsonl``: one line per logging window (the main job's ``--out DIR``, ``fit`` logging
  through :class:`~distamp.ProgressPrinter`, a loop of one's own through
  :class:`~distamp.MetricsRecorder`), for the loss, the loss scale, the skips, the gradient
  norm and the bytes on the wire; a folder without it is said to lack it;
- ``settings.json``: the settings the run recorded (:mod:`distamp.observe.run_settings`), so
  that the report says whether the run clipped rather than guessing it from a missing norm;
- ``telemetry/rank<r>.jsonl``: every rank's per-module records (:class:`~distamp.Telemetry`),
  for the headroom and underflow heatmaps, the precision changes, the fp8 layers, the skips'
  blame and each rank's own numbers.

Why one file with everything inline: a run's report is looked at where the run was, on a login
node, from a CI artifact or mailed to a colleague, often with no network; the page has no
script, no stylesheet link and no image link, only inline SVG drawn by matplotlib (an optional
dependency: ``pip install -e ".[report]"``).
"""

from __future__ import annotations

import html
import io
import json
import math
from pathlib import Path
from typing import Any

from distamp.observe.report_plots import FIGURES, RunData
from distamp.observe.run_settings import read_settings
from distamp.observe.telemetry import read_telemetry

__all__ = ["ReportError", "draw_report", "load_run", "summary", "write_report"]

METRICS = "metrics.jsonl"


class ReportError(ValueError):
    """The folder is not a run this report can draw (the message says what it lacks)."""


def load_run(directory: str | Path) -> RunData:
    """Read a run folder (see the module doc). A line cut short by a killed run is skipped.

    Raises:
        ReportError: ``directory`` does not exist, or holds neither ``metrics.jsonl`` nor
            ``telemetry/``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise ReportError(f"{root}: no such directory (give the run's folder, e.g. --out DIR)")
    windows: list[dict[str, Any]] = []
    metrics = root / METRICS
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                windows.append(record)
    run = RunData(
        windows=windows,
        telemetry=read_telemetry(root),
        metrics_file=metrics.is_file(),
        settings=read_settings(root),
    )
    if not run.windows and not run.telemetry:
        raise ReportError(
            f"{root} holds neither {METRICS} nor telemetry/rank<r>.jsonl: train with --out "
            f"{root} (the main job), or log windows with ProgressPrinter(jsonl=DIR/{METRICS}) "
            "(fit) or distamp.MetricsRecorder(DIR) (a loop of one's own), and pass "
            "DistAMP(telemetry=distamp.Telemetry(DIR))"
        )
    return run


def summary(run: RunData) -> dict[str, Any]:
    """The page's headline figures (plain values, also printed by the CLI)."""
    last = run.windows[-1] if run.windows else {}
    skips = run.skips()
    records = run.records
    return {
        "steps": last.get("step", records[-1].step if records else 0),
        "final_loss": last.get("loss"),
        "loss_scale": last.get("loss_scale", records[-1].loss_scale if records else None),
        "overflow_skips": sum(1 for s in skips if s.reason == "overflow"),
        "spike_skips": sum(1 for s in skips if s.reason == "spike"),
        "ranks": len(run.telemetry) or None,
        "modules_watched": len(records[-1].headroom) if records else 0,
        "precision_changes": sum(len(r.changes) for r in records),
        "weights": last.get("weights"),
        "bytes_per_param": last.get("bytes_per_param"),
    }


def _svg(fig: Any) -> str:
    """The figure as inline SVG, without the XML prolog and DOCTYPE (a DTD address the
    browser would not fetch, but that a page with no network references must not carry)."""
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "n/a" if not math.isfinite(value) else f"{value:.6g}"
    return "n/a" if value is None else str(value)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 60em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.1em; margin-top: 2em; }
table { border-collapse: collapse; } td, th { padding: 0.2em 0.8em; text-align: left; }
th { color: #555; font-weight: normal; } figure { margin: 1em 0; }
figcaption { color: #444; font-size: 0.9em; max-width: 55em; }
svg { max-width: 100%; height: auto; }
"""


def write_report(
    directory: str | Path, output: str | Path | None = None, *, png: str | Path | None = None
) -> Path:
    """Draw the report of run folder ``directory``.

    Args:
        output: the HTML file (default ``directory/report.html``).
        png: a folder to also write each figure to as ``<name>.png``.

    Returns:
        The HTML file written.

    Raises:
        ReportError: the folder is not a run (:func:`load_run`).
        ImportError: matplotlib is missing; the message gives the install command.
    """
    return draw_report(load_run(directory), directory, output, png=png)


def draw_report(
    run: RunData,
    directory: str | Path,
    output: str | Path | None = None,
    *,
    png: str | Path | None = None,
) -> Path:
    """:func:`write_report` for a run already loaded (:func:`load_run`), so that a caller that
    also prints its :func:`summary` reads the folder once."""
    try:
        import matplotlib  # noqa: F401  (the figures import its parts)
    except ImportError as e:
        raise ImportError(
            "distamp report draws with matplotlib: pip install -e '.[report]' from a distamp "
            "checkout"
        ) from e
    out = Path(output) if output is not None else Path(directory) / "report.html"
    png_dir = Path(png) if png is not None else None
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for name, draw in FIGURES:
        fig, caption = draw(run)
        if png_dir is not None:
            fig.savefig(png_dir / f"{name}.png", dpi=110)
        sections.append(
            f'<figure id="{name}">{_svg(fig)}<figcaption>{html.escape(caption)}</figcaption>'
            "</figure>"
        )
    rows = "".join(
        f"<tr><th>{html.escape(k.replace('_', ' '))}</th><td>{html.escape(_cell(v))}</td></tr>"
        for k, v in summary(run).items()
    )
    title = f"distamp run report: {html.escape(Path(directory).resolve().name)}"
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title><style>{_STYLE}</style></head><body>"
        f"<h1>{title}</h1><table>{rows}</table>{''.join(sections)}</body></html>\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
