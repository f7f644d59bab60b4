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

Part 3, per-block backward scales (``AutocastPolicy("fp16", backward_scales=True)``) on a deep
model whose blocks' gradients are further apart than fp16's range (RMS-normalised blocks with
weight scales 2**15, 1 and 2**-14, learning rates proportional to them; block 0 feeds a 2-wide
bottleneck): fp32, static fp16 and backward scales. Printed: final loss and its ratio to fp32,
block 0's gradient underflow fraction (mean of the last 5 reports), its exponent, median step.
Then the GPT of part 2 with the monitor alone vs backward scales (the blocks: tok, pos,
blocks.0, blocks.1, ln_f, head), interleaved: the step-time ratio.

Run: ``python benchmarks/adaptive_precision.py [--steps 150] [--gpt-steps 40] [--threads 1]
[--deep-steps 200] [--json PATH]``. ``--json`` also writes every printed figure and, for part 1,
each run's per-step loss scale and skips and the adaptive run's headroom per report and its
promotions (``benchmarks/plots.py`` draws them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

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


def overflow_run(
    name: str, steps: int, record: dict[str, Any] | None = None
) -> tuple[float, int, int, float]:
    """One run of part 1; ``record`` (if given) receives its per-step trajectory, read after
    each step's timing so that the reads cost no measured time."""
    torch.manual_seed(0)
    net = Net()
    precision = "fp32" if name == "fp32" else "fp16"
    policy = None
    if name == "adaptive fp16":
        policy = AutocastPolicy("fp16", adaptive=AdaptiveRules(max_promoted_fraction=0.5))
    amp = distamp.DistAMP(precision, strategy="none", policy=policy)
    model, _ = amp.setup(net, lambda p: torch.optim.AdamW(p, lr=2e-2))
    times = []
    trace: dict[str, list[Any]] = {"loss_scale": [], "skipped": [], "headroom": []}
    for k in range(steps):
        x, y = batch(k)
        t0 = time.perf_counter()
        with amp.autocast():
            loss = F.mse_loss(model(x).float(), y)
        result = amp.backward_and_step(loss)
        times.append(time.perf_counter() - t0)
        if record is not None and result is not None:
            trace["loss_scale"].append(result.loss_scale)  # host reads, outside the timing
            trace["skipped"].append(not result.stepped)
            stats = amp.numerics()
            if stats is not None and stats.step == k + 1:
                trace["headroom"].append({"step": k + 1, **stats.headroom})
    x, y = batch(99_999, spiky=False, n=4096)
    with torch.no_grad():
        final = F.mse_loss(net(x), y).item()
    skipped = amp.scaler.skipped_steps
    changes = [] if policy is None or policy.adaptive is None else policy.adaptive.changes
    promotions = len(changes)
    if record is not None:
        trace["promotions"] = [{"step": c.step, "module": c.module, "to": c.after} for c in changes]
        record[name] = trace
    amp.close()
    return final, skipped, promotions, statistics.median(times)


def gpt_engine(
    numerics_interval: int | None, policy: AutocastPolicy | None = None
) -> tuple[distamp.DistAMP, ShardedText]:
    """The main job's GPT on one process (fp16, clipping), with the monitor at
    ``numerics_interval`` (None: off) and an optional policy."""
    torch.manual_seed(0)
    amp = distamp.DistAMP(
        "fp16",
        strategy="none",
        max_grad_norm=1.0,
        numerics_interval=numerics_interval,
        policy=policy,
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


class Block(nn.Module):
    """``tanh(rms_normalise(W x))``, ``W`` at scale ``w``: its gradient scales as ``1 / w``."""

    def __init__(self, d_in: int, d_out: int, w: float) -> None:
        super().__init__()
        self.w = w
        self.fc = nn.Linear(d_in, d_out, bias=False)
        with torch.no_grad():
            self.fc.weight.normal_(0, w / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).float()
        return torch.tanh(h / (h.pow(2).mean(-1, keepdim=True).sqrt() + 1e-30))


_W2 = torch.randn(D, 2, generator=torch.Generator().manual_seed(1))


def deep_batch(k: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, D, generator=torch.Generator().manual_seed(100 + k))
    return x * 2.0**-6, torch.tanh(x @ _W2).sum(-1, keepdim=True)


def deep_run(name: str, steps: int, lr: float = 3e-3) -> tuple[float, float, int, float]:
    torch.manual_seed(0)
    net = nn.Sequential(
        Block(D, 2, 2.0**15), Block(2, 32, 1.0), Block(32, 32, 2.0**-14), nn.Linear(32, 1)
    )
    groups = [{"params": b.parameters(), "lr": lr * b.w} for b in net[:3]]  # type: ignore[union-attr]
    groups.append({"params": net[3].parameters(), "lr": lr})
    precision = "fp32" if name == "fp32" else "fp16"
    policy = None  # the same policy (fp32 ops, norms) for both fp16 runs: only the scales differ
    if name != "fp32":
        policy = AutocastPolicy("fp16", backward_scales=name == "backward scales")
    interval = None if name == "fp32" else 10
    amp = distamp.DistAMP(precision, strategy="none", policy=policy, numerics_interval=interval)
    model, _ = amp.setup(net, lambda _p: torch.optim.Adam(groups))
    times, under = [], []
    for k in range(steps):
        x, y = deep_batch(k)
        t0 = time.perf_counter()
        with amp.autocast():
            loss = F.mse_loss(model(x).float(), y)
        amp.backward_and_step(loss)
        times.append(time.perf_counter() - t0)
        stats = amp.numerics()
        if stats is not None and stats.step == k + 1:
            under.append(stats.underflow["0.fc.weight"])
    x, y = deep_batch(10**6, n=4096)
    with torch.no_grad():
        final = F.mse_loss(net(x), y).item()
    exponent = amp.adaptive.grad_exponents.get("0", 0) if amp.adaptive is not None else 0
    amp.close()
    late = under[-5:]
    mean_late = sum(late) / len(late) if late else float("nan")
    return final, mean_late, exponent, statistics.median(times)


def interleaved(engines: dict[bool, tuple[distamp.DistAMP, ShardedText]], steps: int) -> Any:
    times: dict[bool, list[float]] = {k: [] for k in engines}
    for i in range(steps + 3):
        for key, (amp, data) in engines.items():
            t0 = time.perf_counter()
            with amp.autocast():
                loss = lm_loss(amp.model, data.batch(i))
            amp.backward_and_step(loss)
            if i >= 3:
                times[key].append(time.perf_counter() - t0)
    for amp, _ in engines.values():
        amp.close()
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--gpt-steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--deep-steps", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    out: dict[str, Any] = {"torch": torch.__version__, "args": settings}
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, cpu, {args.threads} thread(s)")

    print(f"\n1. overflowing module, {args.steps} steps")
    print(f"{'run':15} {'final loss':>11} {'vs fp32':>8} {'skipped':>8} {'promoted':>9} {'ms':>7}")
    traces: dict[str, Any] = {}
    results = {
        n: overflow_run(n, args.steps, traces) for n in ("fp32", "static fp16", "adaptive fp16")
    }
    out["overflow"] = {
        n: {"final_loss": r[0], "skipped": r[1], "promoted": r[2], "step_ms": r[3] * 1e3}
        for n, r in results.items()
    }
    out["trajectories"] = traces
    ref = results["fp32"][0]
    for name, (final, skipped, promoted, step) in results.items():
        print(
            f"{name:15} {final:11.4f} {final / ref:8.3f} {skipped:8d} {promoted:9d} "
            f"{step * 1e3:7.2f}"
        )

    print(f"\n2. numeric monitor on the main job's GPT, {args.gpt_steps} steps, interval 10")
    base, mon = interleaved(
        {m: gpt_engine(10 if m else None) for m in (False, True)}, args.gpt_steps
    )
    print(f"{'configuration':16} {'median ms':>10}")
    print(f"{'no monitor':16} {base * 1e3:10.2f}")
    print(f"{'monitor':16} {mon * 1e3:10.2f}")
    print(f"monitor cost per step: {(mon - base) * 1e3:.2f} ms = {(mon - base) / base:.1%}")
    out["monitor"] = {"base_ms": base * 1e3, "monitor_ms": mon * 1e3}

    print(f"\n3. backward scales on a deep model, {args.deep_steps} steps")
    print(f"{'run':16} {'final loss':>11} {'vs fp32':>8} {'underflow':>10} {'2**k':>5} {'ms':>7}")
    deep_run("static fp16", 20)  # warm-up: the first run pays lazy initialisation
    deep = {n: deep_run(n, args.deep_steps) for n in ("fp32", "static fp16", "backward scales")}
    out["backward_scales"] = {
        n: {"final_loss": r[0], "underflow": r[1], "exponent": r[2], "step_ms": r[3] * 1e3}
        for n, r in deep.items()
    }
    ref = deep["fp32"][0]
    for name, (final, under, exponent, step) in deep.items():
        print(
            f"{name:16} {final:11.4f} {final / ref:8.3f} {under:10.3f} {exponent:5d} "
            f"{step * 1e3:7.2f}"
        )
    static_under, scaled_under = deep["static fp16"][1], deep["backward scales"][1]
    ratio = static_under / scaled_under if scaled_under > 0 else float("inf")
    print(f"underflow, static / backward scales: {ratio:.1f}x")
    step_ratio = deep["backward scales"][3] / deep["static fp16"][3]
    print(f"step time, backward scales / static fp16 (deep model): {step_ratio:.3f}")
    base, scaled = interleaved(
        {
            s: gpt_engine(10, AutocastPolicy("fp16", backward_scales=True) if s else None)
            for s in (False, True)
        },
        args.gpt_steps,
    )  # the monitor alone (interval 10) vs the monitor plus backward scales
    print(f"GPT step, monitor alone {base * 1e3:.2f} ms, with backward scales "
          f"{scaled * 1e3:.2f} ms: ratio {scaled / base:.3f}")  # fmt: skip
    out["backward_scales_gpt"] = {"monitor_ms": base * 1e3, "backward_scales_ms": scaled * 1e3}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
