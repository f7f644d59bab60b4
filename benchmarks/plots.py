"""The documentation's plots, drawn from the benchmarks' JSON output.

    python benchmarks/plots.py            # run the benchmarks (a few minutes), then draw
    python benchmarks/plots.py --no-run   # draw again from the JSON already in docs/plots/data

Runs ``adaptive_precision.py --json`` and ``host_overhead.py --json`` at several tensor counts,
keeps their JSON in ``docs/plots/data/`` (committed: the plots can be redrawn without
re-measuring, and the figures behind a picture stay readable), and writes three PNGs to
``docs/plots/``:

- ``loss_scale.png``: the loss scale per step and the skipped steps of static fp16 and adaptive
  fp16 on the model whose ``hot`` module overflows (adaptive_precision.py, part 1);
- ``headroom.png``: the adaptive run's headroom per module at each report, and its promotions;
- ``host_time.png``: the scaler's host time per step, distamp vs torch's ``GradScaler``, by the
  number of parameter tensors (host_overhead.py).

matplotlib's Agg backend draws without a display, so this runs on a headless machine or in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display needed
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "plots"
DATA = OUT / "data"
SIZES = (50, 100, 250, 500, 1000)  # parameter tensors per model for host_overhead.py
DPI = 100  # with the sizes below, each PNG stays well under 150 KB


def run_benchmarks(rounds: int) -> None:
    """Run the benchmarks this script plots, each writing its JSON into ``DATA``."""
    DATA.mkdir(parents=True, exist_ok=True)
    bench = ROOT / "benchmarks"
    commands = [[str(bench / "adaptive_precision.py"), "--json", str(DATA / "adaptive.json")]]
    for n in SIZES:
        out = str(DATA / f"host_overhead_{n}.json")
        script = str(bench / "host_overhead.py")
        commands.append([script, "--tensors", str(n), "--rounds", str(rounds), "--json", out])
    for cmd in commands:
        print("+ python", " ".join(Path(c).relative_to(ROOT).as_posix() if "/" in c else c
                                   for c in cmd), flush=True)  # fmt: skip
        subprocess.run([sys.executable, *cmd], check=True, cwd=ROOT)


def _load(name: str) -> Any:
    return json.loads((DATA / name).read_text(encoding="utf-8"))


def plot_loss_scale(adaptive: dict[str, Any]) -> Path:
    """Loss scale (log2) per step, skipped steps marked, static vs adaptive fp16."""
    traces = adaptive["trajectories"]
    fig, (ax, ax_skips) = plt.subplots(
        2, 1, figsize=(7, 4.6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    styles = {"static fp16": ("tab:red", "--"), "adaptive fp16": ("tab:blue", "-")}
    for row, (name, (color, line)) in enumerate(styles.items()):
        trace = traces[name]
        steps = range(1, len(trace["loss_scale"]) + 1)
        ax.plot(steps, [math.log2(s) for s in trace["loss_scale"]], line, color=color, label=name)
        skipped = [s for s, skip in zip(steps, trace["skipped"], strict=True) if skip]
        ax_skips.plot(skipped, [row] * len(skipped), "|", color=color, markersize=9)
        for change in trace.get("promotions", []):
            ax.axvline(change["step"], color=color, linewidth=0.8, alpha=0.6)
            ax.annotate(
                f"{change['module']} -> {change['to']}",
                (change["step"], ax.get_ylim()[1]),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
    ax.axhline(-126, color="gray", linewidth=0.8, linestyle=":")
    ax.text(len(traces["static fp16"]["loss_scale"]), -121, "smallest normal float32", fontsize=8,
            ha="right", color="gray")  # fmt: skip
    ax.set_ylabel("log2(loss scale)")
    ax.set_title("Loss scale per step: a module overflows fp16 on 4 rows of every batch")
    ax.legend(loc="lower left", fontsize=8)
    ax_skips.set_yticks([0, 1], list(styles))
    ax_skips.set_ylim(-0.7, 1.7)
    ax_skips.set_xlabel("optimizer step")
    ax_skips.set_title("skipped steps", fontsize=9)
    return _save(fig, "loss_scale.png")


def plot_headroom(adaptive: dict[str, Any]) -> Path:
    """The adaptive run's headroom per module at each report; promotions as vertical lines."""
    trace = adaptive["trajectories"]["adaptive fp16"]
    reports = trace["headroom"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    modules = sorted({k for r in reports for k in r if k != "step"})
    top = 5.0  # where a non-finite output (an overflow) is drawn
    for module in modules:
        points = [(r["step"], r[module]) for r in reports if module in r]
        shown = [(s, h if math.isfinite(h) else top) for s, h in points]
        ax.plot(*zip(*shown, strict=True), "o-", markersize=3, label=module)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.text(reports[-1]["step"], 1.3, "fp16's maximum, 65504", fontsize=8, ha="right")
    ax.text(reports[-1]["step"], top * 1.3, "non-finite output", fontsize=8, ha="right")
    for change in trace.get("promotions", []):
        ax.axvline(change["step"], color="tab:gray", linewidth=0.8)
        ax.annotate(
            f"step {change['step']}: {change['module']} -> {change['to']}",
            (change["step"], 1e-2),
            xytext=(4, 0),
            textcoords="offset points",
            fontsize=8,
        )
    ax.set_yscale("log")
    ax.set_ylim(1e-6, top * 3)
    ax.set_xlabel("optimizer step (a report every 10 steps)")
    ax.set_ylabel("headroom: max |output| / 65504")
    ax.set_title("Numeric monitor, adaptive fp16: headroom per module at each report")
    ax.legend(fontsize=8, loc="center right")
    return _save(fig, "headroom.png")


def plot_host_time(runs: list[dict[str, Any]]) -> Path:
    """Scaler host time per step (CPU time, optimizer update excluded) by tensor count."""
    runs = sorted(runs, key=lambda r: r["tensors"])
    optimizers = list(dict.fromkeys(row["optimizer"] for row in runs[0]["rows"]))
    fig, axes = plt.subplots(1, len(optimizers), figsize=(9, 3.4), sharey=True)
    kinds = {
        "torch": ("torch GradScaler", "black", "o-"),
        "distamp": ("distamp, one-pass clip", "tab:blue", "s-"),
        "drop-in": ("distamp, torch's calls", "tab:orange", "^--"),
    }
    for ax, opt in zip(axes, optimizers, strict=True):
        for kind, (label, color, style) in kinds.items():
            xs, ys = [], []
            for run in runs:
                row = next(r for r in run["rows"] if r["optimizer"] == opt and r["path"] == "clip")
                xs.append(run["tensors"])
                ys.append(row[kind]["scaler_ms"])
            ax.plot(xs, ys, style, color=color, label=label, markersize=4)
        ax.set_title(f"{opt}, with clipping", fontsize=9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameter tensors")
    axes[0].set_ylabel("scaler ms per step (CPU time)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Host time of unscale + clip + step + update, optimizer excluded", fontsize=10)
    return _save(fig, "host_time.png")


def _save(fig: Any, name: str) -> Path:
    path = OUT / name
    fig.tight_layout()
    fig.savefig(path, dpi=DPI, metadata={"Software": None})  # no version: stable bytes
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="draw from the stored JSON only")
    parser.add_argument("--rounds", type=int, default=30, help="host_overhead.py --rounds")
    args = parser.parse_args(argv)
    if not args.no_run:
        run_benchmarks(args.rounds)
    adaptive = _load("adaptive.json")
    hosts = [_load(f"host_overhead_{n}.json") for n in SIZES]
    OUT.mkdir(parents=True, exist_ok=True)
    for path in (plot_loss_scale(adaptive), plot_headroom(adaptive), plot_host_time(hosts)):
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size // 1024} KB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
