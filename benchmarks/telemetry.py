"""What per-module telemetry costs: the main job's model on 2 ranks, DDP and FSDP2, side by side.

Each rank trains one copy of ``launch/model.py``'s GPT per configuration (same weights, same
batches, AdamW, clipping at 1.0, the engine ``distamp.DistAMP``):

- ``off``: no monitor, no telemetry (the default engine);
- ``every N``: ``DistAMP(telemetry=distamp.Telemetry(DIR, interval=N))``: the numeric monitor's
  forward hooks every step, and at every N-th step the agreed report, each rank's own numbers
  and one JSON line per rank (N = 10 is the default interval).

The copies alternate step by step (the order rotates every step), so the machine's noise falls
on all alike, and each row gives the median step time and the ratio to ``off`` (above 1.00:
telemetry costs that much). The per-step part (one ``amax`` per watched module's output and its
share of the flag collective) is what every interval pays; the sampling steps add the underflow
read and the host reads.

    python benchmarks/telemetry.py [--size medium] [--strategies ddp,fsdp2] [--intervals 1,10,100]
        [--steps 12] [--warmup 2] [--batch-size 2] [--precision bf16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distamp
from distamp.cluster.spawn import run_ranks
from launch.model import GPT, SIZES, ShardedText, lm_loss, load_text


def _engine(
    size: str, strategy: str, precision: str, interval: int | None, out: Path
) -> distamp.DistAMP:
    torch.manual_seed(0)
    telemetry = (
        None if interval is None else distamp.Telemetry(out / str(interval), interval=interval)
    )
    amp = distamp.DistAMP(precision, strategy=strategy, max_grad_norm=1.0, telemetry=telemetry)
    amp.setup(GPT(SIZES[size]), lambda p: torch.optim.AdamW(p, lr=3e-4))
    return amp


def _rank(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Every configuration of one strategy on this rank; the medians of rank 0 are reported."""
    out = Path(args["out"])
    configs: list[int | None] = [None, *args["intervals"]]
    engines = {
        c: _engine(args["size"], args["strategy"], args["precision"], c, out) for c in configs
    }
    cfg = SIZES[args["size"]]
    data = ShardedText(
        load_text(),
        context=cfg.context,
        batch_size=args["batch_size"],
        rank=rank,
        world_size=world,
        seed=0,
        device=torch.device("cpu"),
    )
    times: dict[int | None, list[float]] = {c: [] for c in configs}
    for step in range(args["warmup"] + args["steps"]):
        batch = data.batch(step)
        order = configs[step % len(configs) :] + configs[: step % len(configs)]
        for c in order:
            amp = engines[c]
            start = time.perf_counter()
            with amp.autocast():
                loss = lm_loss(amp.model, batch)
            amp.backward_and_step(loss)
            loss.item()  # the step's whole cost
            if step >= args["warmup"]:
                times[c].append(time.perf_counter() - start)
    for amp in engines.values():
        amp.close()
    return {str(c): statistics.median(t) for c, t in times.items()}


def measure(strategy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        settings = {
            "size": args.size,
            "strategy": strategy,
            "precision": args.precision,
            "intervals": args.intervals,
            "steps": args.steps,
            "warmup": args.warmup,
            "batch_size": args.batch_size,
            "out": out,
        }
        medians = run_ranks(_rank, 2, settings, timeout=3600)[0]
    base = medians["None"]
    rows = [{"strategy": strategy, "telemetry": "off", "step_s": base, "ratio": 1.0}]
    for n in args.intervals:
        t = medians[str(n)]
        rows.append(
            {"strategy": strategy, "telemetry": f"every {n}", "step_s": t, "ratio": t / base}
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, default="medium")
    p.add_argument("--strategies", default="ddp,fsdp2")
    p.add_argument("--intervals", default="1,10,100")
    p.add_argument("--precision", default="bf16", choices=("fp16", "bf16"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.intervals = [int(n) for n in args.intervals.split(",")]
    rows = [r for s in args.strategies.split(",") for r in measure(s, args)]
    print(
        f"GPT --size {args.size}, 2 ranks (gloo, CPU), {args.precision}, batch "
        f"{args.batch_size}, median of {args.steps} steps after {args.warmup}"
    )
    print("| strategy | telemetry | step (s) | vs off |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['telemetry']} | {r['step_s']:.3f} | {r['ratio']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
