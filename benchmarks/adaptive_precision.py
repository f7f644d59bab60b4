"""Adaptive precision side by side with static fp16 and fp32, and the numeric monitor's cost.

Part 1, a model with one module whose fp16 output overflows for some inputs (4 rows of every
batch are scaled by 6e4 and clamped to fp16's range; the module scales its pre-activation by
16 and normalises it per row): fp32, static fp16 and ``AutocastPolicy("fp16",
adaptive=...)``, each through :class:`distamp.DistAMP`. Printed:
final (held-out) loss and its ratio to fp32, skipped steps, promotions, median step time.

Part 2, the main job's model (the byte-level GPT of ``launch/train.py``, fp16 autocast, AdamW,
clipping at 1.0) with and without the numeric monitor at its default interval (10), steps
interleaved so that drift hits both alike. Printed: median step, the monitor's cost per step
and its share of the step (target: under 2%).

Run: ``python benchmarks/adaptive_precision.py [--steps 150] [--gpt-steps 40] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distamp
from distamp import AutocastPolicy
from distamp.precision.adaptive import AdaptiveRules
from launch.model import DATA_FILE, GPT, GPTConfig, ShardedText, lm_loss, load_text

D = 16


class Hot(nn.Module):
    """Linear map normalised per row: a large row's fp16 pre-activation is inf, inf/inf NaN."""

    def __init__(self) -> None:
        super().__init__()
        fc = nn.Linear(D, 8)
        self.weight, self.bias = fc.weight, fc.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) * 16
        return y / (1 + y.abs().amax(-1, keepdim=True))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hot, self.mid, self.out = Hot(), nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.hot(x))))


_W = torch.randn(D, 1, generator=torch.Generator().manual_seed(1))


def batch(k: int, spiky: bool = True, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randn(n, D, generator=g)
    if spiky:
        x[:4] = (x[:4] * 6e4).clamp(-6e4, 6e4)  # fp16-representable inputs
    xn = x / (1 + x.abs().amax(-1, keepdim=True))
    return x, torch.tanh(4 * xn @ _W) + 0.3 * torch.randn(n, 1, generator=g)


def overflow_run(name: str, steps: int) -> tuple[float, int, int, float]:
    torch.manual_seed(0)
    net = Net()
    precision = "fp32" if name == "fp32" else "fp16"
    policy = None
    if name == "adaptive fp16":
        policy = AutocastPolicy("fp16", adaptive=AdaptiveRules(max_promoted_fraction=0.5))
    amp = distamp.DistAMP(precision, strategy="none", policy=policy)
    model, _ = amp.setup(net, lambda p: torch.optim.AdamW(p, lr=2e-2))
    times = []
    for k in range(steps):
        x, y = batch(k)
        t0 = time.perf_counter()
        with amp.autocast():
            loss = F.mse_loss(model(x).float(), y)
        amp.backward_and_step(loss)
        times.append(time.perf_counter() - t0)
    x, y = batch(99_999, spiky=False, n=4096)
    with torch.no_grad():
        final = F.mse_loss(net(x), y).item()
    skipped = amp.scaler.skipped_steps
    promotions = 0 if policy is None or policy.adaptive is None else len(policy.adaptive.changes)
    amp.close()
    return final, skipped, promotions, statistics.median(times)


def gpt_engine(monitor: bool) -> tuple[distamp.DistAMP, ShardedText]:
    torch.manual_seed(0)
    amp = distamp.DistAMP(
        "fp16", strategy="none", max_grad_norm=1.0, numerics_interval=10 if monitor else None
    )
    amp.setup(GPT(GPTConfig()), lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
    data = ShardedText(
        load_text(DATA_FILE),
        context=GPTConfig().context,
        batch_size=16,
        rank=0,
        world_size=1,
        seed=0,
        device=torch.device("cpu"),
    )
    return amp, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--gpt-steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, cpu, {args.threads} thread(s)")

    print(f"\n1. overflowing module, {args.steps} steps")
    print(f"{'run':15} {'final loss':>11} {'vs fp32':>8} {'skipped':>8} {'promoted':>9} {'ms':>7}")
    results = {n: overflow_run(n, args.steps) for n in ("fp32", "static fp16", "adaptive fp16")}
    ref = results["fp32"][0]
    for name, (final, skipped, promoted, step) in results.items():
        print(
            f"{name:15} {final:11.4f} {final / ref:8.3f} {skipped:8d} {promoted:9d} "
            f"{step * 1e3:7.2f}"
        )

    print(f"\n2. numeric monitor on the main job's GPT, {args.gpt_steps} steps, interval 10")
    engines = {m: gpt_engine(m) for m in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.gpt_steps + 3):
        for monitor, (amp, data) in engines.items():
            t0 = time.perf_counter()
            with amp.autocast():
                loss = lm_loss(amp.model, data.batch(i))
            amp.backward_and_step(loss)
            if i >= 3:
                times[monitor].append(time.perf_counter() - t0)
    base, mon = statistics.median(times[False]), statistics.median(times[True])
    print(f"{'configuration':16} {'median ms':>10}")
    print(f"{'no monitor':16} {base * 1e3:10.2f}")
    print(f"{'monitor':16} {mon * 1e3:10.2f}")
    print(f"monitor cost per step: {(mon - base) * 1e3:.2f} ms = {(mon - base) / base:.1%}")
    for amp, _ in engines.values():
        amp.close()


if __name__ == "__main__":
    main()
