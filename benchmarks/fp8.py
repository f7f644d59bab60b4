"""fp8 vs bf16: step time and loss after N steps, side by side, at several widths.

One process trains two copies of the same model from the same weights on the same batches:
``DistAMP(precision="bf16")`` and ``DistAMP(precision="fp8")`` with every block Linear in fp8
(``fp8_min_features=0``; the byte head stays bf16), so the table shows where fp8 starts to pay
and where distamp's default threshold (``fp8_min_features``, 2048) sits relative to that. The
model is a stack of pre-norm MLP blocks (LayerNorm, Linear d->4d, GELU, Linear 4d->d) on the
main job's byte-level text task. The two copies alternate step by step (the order flips every
step) so that machine noise falls on both alike; the table has each one's median step time,
the ratio fp8 / bf16 (below 1.00: fp8 is faster) and the first and last losses of both.

The learning rate shrinks with the width (``--lr`` at ``--lr-width``, times ``lr_width / d``:
muP's rule for Adam on hidden matrices), so that every width trains: one fixed rate that suits
width 64 stalls or diverges at 8192, and the two formats' losses would then compare nothing.

On CPU, distamp's float8 layers multiply their float8 operands in fp32 (``fp8_gemm="auto"``:
torch's ``_scaled_mm`` is a scalar reference kernel on CPUs without AMX-FP16), slower than the
bf16 GEMM at every size, so the CPU rows measure overhead, not a speed-up. With a CUDA
GPU (compute capability 8.9+) the default sizes are 1024-8192 wide, both models are compiled
with ``torch.compile`` (torchao's float8 casts need it to be fast), and the ratio falls below 1
for the large widths.

    python benchmarks/fp8.py [--device cpu|cuda] [--widths 64,256,512] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from distamp.engine import DistAMP  # noqa: E402
from distamp.precision.fp8 import DEFAULT_MIN_FEATURES  # noqa: E402
from distamp.precision.policy import AutocastPolicy  # noqa: E402
from launch.model import ShardedText, load_text  # noqa: E402


class MLPStack(nn.Module):
    """Byte embedding, ``depth`` residual MLP blocks of width ``d``, byte head."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
            for _ in range(depth)
        )
        self.head = nn.Linear(d, 256, bias=False)
        for block in self.blocks:
            nn.init.normal_(block[3].weight, std=0.02 / depth**0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())


def learning_rate(d: int, base: float = 2e-3, width: int = 256) -> float:
    """AdamW's rate at width ``d``: ``base`` at ``width``, scaled by ``width / d`` (muP for Adam:
    a hidden matrix's update grows with its fan-in, so the rate must shrink as 1 / width)."""
    return base * width / d


def _trainer(
    precision: str, d: int, args: argparse.Namespace, device: torch.device
) -> tuple[Callable[[Any], float], DistAMP]:
    policy = (
        AutocastPolicy("fp8", fp8_min_features=0, fp8_exclude=["head"])
        if precision == "fp8"
        else AutocastPolicy("bf16")
    )
    torch.manual_seed(0)
    amp = DistAMP(precision=precision, strategy="none", policy=policy, device=device)
    lr = learning_rate(d, args.lr, args.lr_width)
    model, _ = amp.setup(MLPStack(d, args.depth), lambda p: torch.optim.AdamW(p, lr=lr))
    run = torch.compile(model) if device.type == "cuda" else model

    def step(batch: Any) -> float:
        with amp.autocast():
            loss = _loss(run, batch)
        amp.backward_and_step(loss)
        return float(loss.detach())  # host sync: the step is timed to completion

    return step, amp


def _measure(d: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    data = ShardedText(
        load_text(),
        context=args.context,
        batch_size=args.batch_size,
        rank=0,
        world_size=1,
        seed=0,
        device=device,
    )
    steps = {p: _trainer(p, d, args, device) for p in ("bf16", "fp8")}
    times: dict[str, list[float]] = {p: [] for p in steps}
    losses: dict[str, float] = {}
    first: dict[str, float] = {}
    for k in range(args.warmup + args.steps):
        order = list(steps) if k % 2 == 0 else list(reversed(steps))
        for p in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses[p] = steps[p][0](data.batch(k))
            first.setdefault(p, losses[p])
            if k >= args.warmup:
                times[p].append(time.perf_counter() - t0)
    converted = steps["fp8"][1].fp8
    for _, amp in steps.values():
        amp.close()
    med = {p: statistics.median(ts) * 1e3 for p, ts in times.items()}
    return {
        "d": d,
        "bf16_ms": med["bf16"],
        "fp8_ms": med["fp8"],
        "ratio": med["fp8"] / med["bf16"],
        "lr": learning_rate(d, args.lr, args.lr_width),
        "bf16_first": first["bf16"],
        "fp8_first": first["fp8"],
        "bf16_loss": losses["bf16"],
        "fp8_loss": losses["fp8"],
        "fp8_layers": len(converted.converted) if converted is not None else 0,
        "default_on": d >= DEFAULT_MIN_FEATURES,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--widths", default=None, help="comma-separated model widths d")
    p.add_argument("--depth", type=int, default=2, help="MLP blocks")
    p.add_argument("--steps", type=int, default=None, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per model first")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--lr", type=float, default=2e-3, help="AdamW's rate at --lr-width")
    p.add_argument("--lr-width", type=int, default=256, help="the width --lr is set for")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("benchmarks/fp8.py: --device cuda, but torch sees no CUDA device")
    if cuda and torch.cuda.get_device_capability(device) < (8, 9):
        sys.exit("benchmarks/fp8.py: this GPU has no float8 GEMMs (compute capability < 8.9)")
    widths = args.widths or ("1024,2048,4096,8192" if cuda else "64,256,512")
    args.steps = args.steps or (50 if cuda else 20)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 2)
    args.batch_size = args.batch_size or (64 if cuda else 8)
    torch.set_num_threads(args.threads)
    rows = [_measure(int(d), args, device) for d in widths.split(",")]
    tokens = args.batch_size * args.context
    print(
        f"{device.type}{' + torch.compile' if cuda else ''}, {args.depth} MLP blocks (d -> 4d -> "
        f"d), {tokens} tokens per step, {args.steps} timed steps after {args.warmup} warm-up; "
        f"torch {torch.__version__}; distamp's default fp8_min_features={DEFAULT_MIN_FEATURES}"
    )
    head = (
        f"{'d':>6}{'lr':>9}{'fp8 layers':>12}{'bf16 ms':>10}{'fp8 ms':>10}{'fp8/bf16':>10}"
        f"{'bf16 loss':>17}{'fp8 loss':>17}{'fp8 by default':>16}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['d']:>6}{r['lr']:>9.1e}{r['fp8_layers']:>12}{r['bf16_ms']:>10.1f}"
            f"{r['fp8_ms']:>10.1f}{r['ratio']:>10.2f}"
            f"{r['bf16_first']:>8.4f} ->{r['bf16_loss']:>7.4f}"
            f"{r['fp8_first']:>8.4f} ->{r['fp8_loss']:>7.4f}"
            f"{'yes' if r['default_on'] else 'no':>16}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"device": device.type, "torch": torch.__version__, "steps": args.steps}
        args.json.write_text(json.dumps({**report, "rows": rows}, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()
