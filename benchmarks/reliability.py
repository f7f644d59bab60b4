"""Fault-injection campaign: inf/NaN in gradients at random steps, ranks and elements.

Runs the full cross product {DDP, FSDP1, FSDP2} x {fused, foreach} x {implicit, explicit
unscale_ + clip} x {1, 2 optimizers} x {hysteresis 1, 2} on 2 gloo ranks, several random
campaigns per configuration, and checks after every step that every rank took the same skip
decision, holds the same scale and holds bitwise-equal full parameters (FSDP: gathered), and
that exactly the injected steps were skipped. Prints one line per configuration and the totals:

    python benchmarks/reliability.py                 # 48 configurations x 3 seeds x 20 steps
    python benchmarks/reliability.py --seeds 10 --steps 40 --rate 0.25

Exits 1 if any divergence (or crash) was found, so it can gate a release.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The scenario runner lives with the tests (it is their fixture); children import it too.
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from _dist import run_ranks  # noqa: E402
from scaler_scenarios import (  # noqa: E402
    Scenario,
    campaign_configs,
    check_agreement,
    random_scenario,
    run_scenario,
)


def _campaign(rank: int, world: int, scenarios: list[Scenario]) -> list[dict[str, Any]]:
    """Run every scenario on this rank; a crash is recorded (it counts as a failure) and the
    campaign goes on, so that one bad configuration does not hide the others' figures."""
    out: list[dict[str, Any]] = []
    for sc in scenarios:
        t0 = time.perf_counter()
        try:
            record = run_scenario(rank, world, sc)
        except Exception:
            record = {"error": traceback.format_exc(limit=4)}
        record["seconds"] = time.perf_counter() - t0
        out.append(record)
    return out


def _label(config: dict[str, Any]) -> str:
    return (
        f"{config['strategy']:<6} {config['optimizer']:<8} "
        f"{'explicit' if config['explicit_unscale'] else 'implicit':<9}"
        f"{'2 opt' if config['two_optimizers'] else '1 opt':<6} hyst {config['hysteresis']}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3, help="random campaigns per configuration")
    p.add_argument("--steps", type=int, default=20, help="training steps per campaign")
    p.add_argument("--rate", type=float, default=0.3, help="probability a step is injected")
    p.add_argument("--timeout", type=float, default=1800.0, help="hard limit for the whole run")
    args = p.parse_args(argv)

    configs = campaign_configs()
    scenarios = [
        random_scenario(cfg, seed=1000 * i + s, steps=args.steps, world=2, rate=args.rate)
        for i, cfg in enumerate(configs)
        for s in range(args.seeds)
    ]
    t0 = time.perf_counter()
    per_rank = run_ranks(_campaign, 2, scenarios, timeout=args.timeout)
    wall = time.perf_counter() - t0

    totals = {"configs": len(configs), "campaigns": 0, "steps": 0, "injections": 0,
              "all_rank_injections": 0, "skips": 0, "divergences": 0, "crashes": 0}  # fmt: skip
    print(f"{'configuration':<38} {'steps':>6} {'inject':>6} {'skips':>6} {'diverge':>7} {'s':>6}")
    for i, cfg in enumerate(configs):
        row = {"steps": 0, "injections": 0, "skips": 0, "divergences": 0, "seconds": 0.0}
        for s in range(args.seeds):
            k = i * args.seeds + s
            sc, results = scenarios[k], [per_rank[0][k], per_rank[1][k]]
            totals["campaigns"] += 1
            row["seconds"] += max(r["seconds"] for r in results)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                totals["crashes"] += 1
                row["divergences"] += 1
                print(f"CRASH {sc}\n{errors[0]}", file=sys.stderr)
                continue
            problems = check_agreement(results, sc)
            for problem in problems:
                print(f"DIVERGENCE {sc}: {problem}", file=sys.stderr)
            row["steps"] += sc.steps
            row["injections"] += len(sc.injections)
            row["skips"] += sum(results[0]["skipped"])
            row["divergences"] += len(problems)
            totals["all_rank_injections"] += sum(r == -1 for r, _ in sc.injections.values())
        for key in ("steps", "injections", "skips", "divergences"):
            totals[key] += int(row[key])
        print(
            f"{_label(cfg):<38} {row['steps']:>6} {row['injections']:>6} {row['skips']:>6} "
            f"{row['divergences']:>7} {row['seconds']:>6.1f}"
        )
    print(
        f"\n{totals['configs']} configurations x {args.seeds} seeds = {totals['campaigns']} "
        f"campaigns on 2 gloo ranks in {wall:.0f} s: {totals['steps']} steps, "
        f"{totals['injections']} injections ({totals['all_rank_injections']} on every rank), "
        f"{totals['skips']} skips, {totals['divergences']} divergences, {totals['crashes']} crashes"
    )
    return 1 if totals["divergences"] or totals["crashes"] else 0


if __name__ == "__main__":
    sys.exit(main())
