"""Host overhead of one training step's scaler work: dispatched ops and time, vs torch's scaler.

One process, one thread, a model with ``--tensors`` small parameter tensors (launch overhead,
not bandwidth, decides here). Each measured step is everything after backward: (clip,) step,
update, for

- torch: ``torch.amp.GradScaler`` with ``step``/``update`` and, when clipping,
  ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``;
- distamp: ``DistributedGradScaler`` through ``scaler.clip_grad_norm_`` (one pass);
- distamp drop-in: ``DistributedGradScaler`` through the same calls as torch.

for foreach AdamW, fused AdamW and SGD with momentum. The two scalers alternate step by step on
identical models (the order flips every round), so machine noise falls on both alike; the table
gives the median of the process CPU time per step, which other processes disturb far less than
wall time, the ratio to torch (target <= 1.00), and the aten ops dispatched per step (counted by a
``TorchDispatchMode`` in a separate pass, so counting costs no measured time).

    python benchmarks/host_overhead.py [--tensors 500] [--rounds 60] [--device cpu] [--json PATH]

``--json PATH`` also writes the table's figures (per optimizer and path: each scaler's step and
scaler-only milliseconds and op counts), for ``benchmarks/plots.py``.
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
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distamp import DistributedGradScaler

OPTIMIZERS = ("foreach AdamW", "fused AdamW", "SGD momentum")
PATHS = ("no clip", "clip")


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _model(tensors: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(max(1, tensors // 4)):
        layers += [nn.Linear(32, 32), nn.LayerNorm(32)]  # 4 parameter tensors per pair
    return nn.Sequential(*layers)


def _optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "foreach AdamW":
        return torch.optim.AdamW(params, lr=1e-4, foreach=True)
    if name == "fused AdamW":
        return torch.optim.AdamW(params, lr=1e-4, fused=True)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True)


class _Runner:
    """One model + optimizer + scaler; ``after_backward`` is the measured part. ``kind``:
    "torch", "distamp" (its one-pass clip) or "drop-in" (distamp's scaler, torch's calls)."""

    def __init__(self, kind: str, opt_name: str, path: str, tensors: int, device: str) -> None:
        self.model = _model(tensors).to(device)
        self.opt = _optimizer(opt_name, self.model.parameters())
        self.kind, self.clip = kind, path == "clip"
        self.scaler: Any = (
            torch.amp.GradScaler(device) if kind == "torch" else DistributedGradScaler(device)
        )
        self.x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(device)
        # The optimizer's own update is the same whatever the scaler: timed apart, so that the
        # scaler's share is not lost in its noise.
        self.opt_time = 0.0
        inner = self.opt.step

        def timed_step(*a: Any, **k: Any) -> Any:
            t = time.process_time()
            try:
                return inner(*a, **k)
            finally:
                self.opt_time += time.process_time() - t

        self.opt.step = timed_step  # type: ignore[method-assign]

    def backward(self) -> None:
        self.opt.zero_grad()
        self.scaler.scale(self.model(self.x).square().mean()).backward()

    def after_backward(self) -> None:
        s, opt = self.scaler, self.opt
        if self.clip:
            if self.kind == "distamp":
                s.clip_grad_norm_(opt, 1.0)
            else:
                s.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        s.step(opt)
        s.update()


def _cpu_time(fn: Callable[[], None]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def _measure(
    opt_name: str, path: str, tensors: int, rounds: int, device: str
) -> dict[str, dict[str, float]]:
    kinds = ("torch", "distamp", "drop-in")
    runners = {k: _Runner(k, opt_name, path, tensors, device) for k in kinds}
    for _ in range(3):  # warm-up: optimizer state, caches
        for r in runners.values():
            r.backward()
            r.after_backward()
    times: dict[str, list[float]] = {k: [] for k in kinds}
    own: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(rounds):
        order = kinds if i % 2 == 0 else tuple(reversed(kinds))
        for k in order:
            r = runners[k]
            r.backward()
            r.opt_time = 0.0
            total = _cpu_time(r.after_backward)
            times[k].append(total)
            own[k].append(total - r.opt_time)
    out: dict[str, dict[str, float]] = {}
    for k in kinds:
        runners[k].backward()
        counter = _OpCounter()
        with counter:
            runners[k].after_backward()
        out[k] = {
            "ms": statistics.median(times[k]) * 1e3,
            "scaler_ms": statistics.median(own[k]) * 1e3,
            "ops": counter.ops,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tensors", type=int, default=500)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu or cuda; on CUDA the CPU time is the host's share, kernels run asynchronously",
    )
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("benchmarks/host_overhead.py: --device cuda, but torch sees no CUDA device")
    rows: list[dict[str, Any]] = []
    torch.set_num_threads(1)
    print(
        f"{args.tensors} parameter tensors on {args.device}, 1 thread, "
        f"median CPU time of {args.rounds} steps"
    )
    print("step = clip + step + update (optimizer included); scaler = the same without the")
    print("optimizer's own update; ratios are distamp / torch")
    header = (
        f"{'optimizer':14} {'path':8} | {'torch step':>10} {'scaler':>7} {'ops':>5} | "
        f"{'distamp step':>12} {'scaler':>7} {'ops':>5} {'ratio':>11} | "
        f"{'drop-in step':>12} {'scaler':>7} {'ops':>5} {'ratio':>11}"
    )
    print(header)
    print("-" * len(header))
    for opt_name in OPTIMIZERS:
        for path in PATHS:
            m = _measure(opt_name, path, args.tensors, args.rounds, args.device)
            rows.append({"optimizer": opt_name, "path": path, **m})
            t = m["torch"]
            cells = [
                f"{opt_name:14} {path:8} | {t['ms']:10.3f} {t['scaler_ms']:7.3f} {t['ops']:5.0f}"
            ]
            for k in ("distamp", "drop-in"):
                d = m[k]
                ratio = f"{d['ms'] / t['ms']:.2f}/{d['scaler_ms'] / t['scaler_ms']:.2f}"
                cells.append(f"{d['ms']:12.3f} {d['scaler_ms']:7.3f} {d['ops']:5.0f} {ratio:>11}")
            print(" | ".join(cells))
    if args.json is not None:
        report = {
            "torch": torch.__version__,
            "device": args.device,
            "tensors": args.tensors,
            "rounds": args.rounds,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**report, "rows": rows}, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()
