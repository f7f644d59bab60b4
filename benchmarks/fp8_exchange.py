"""The 8-bit gradient exchange's cost on one device: eager torch ops against the fused kernels.

Part 1, one bucket's arithmetic (``distamp.kernels.fp8_wire``: amax, overflow flag, quantise
with error feedback, the shards' sum requantised, the final dequantise), the collectives left
out: each rank's shards are simulated by the bucket's own bytes. Per backend: the host time of
the calls (what the Python side costs: the figure that decides a small-batch step) and the
device time (CUDA events), medians of ``--repeats``.

Part 2, whole steps: the main job's GPT (``--size``) under ``DistAMP(strategy="ddp",
comm_hook=...)`` on one device (a process group of one rank: NCCL on CUDA, gloo on CPU, so the
exchange runs in full and nothing crosses a link), bf16 compute, median ms per step for the
fp32 hook (DDP's own all-reduce), ``"fp8"`` and ``"fp8-ef"``, each with the eager path and with
the kernels (CUDA only). ``--bucket-mb`` is DDP's bucket cap, the exchange's knob
(``DistAMP(ddp_kwargs={"bucket_cap_mb": ...})``): fewer, larger buckets pay the per-bucket host
cost fewer times.

    python benchmarks/fp8_exchange.py [--device cuda] [--bucket-mb 25] [--world 8]
        [--size medium] [--batch-size 16] [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import distamp
from distamp.kernels import dispatch, fp8_wire
from launch.model import GPT, SIZES, ShardedText, lm_loss, load_text


def backends(device: torch.device) -> list[str]:
    """The backends that run on ``device``: the kernels need CUDA (or the interpreter)."""
    return ["torch", "triton"] if device.type == "cuda" else ["torch"]


def bucket_costs(
    mb: float, world: int, device: torch.device, backend: str, repeats: int, chunk: int = 256
) -> dict[str, float]:
    """Host and device ms of one bucket's exchange arithmetic with ``backend``."""
    rows = -(-int(mb * 2**20 / 4) // (world * chunk)) * world
    x = torch.randn(rows, chunk, device=device) * 1e-3
    dtype, fmax = torch.float8_e4m3fn, float(torch.finfo(torch.float8_e4m3fn).max)
    k = rows // world
    gathered = torch.zeros(rows * chunk, dtype=torch.uint8, device=device)

    def exchange() -> None:
        amax = fp8_wire.chunk_amax(x, backend=backend)
        nonfinite = fp8_wire.overflows(amax, fmax / world)
        q, _ = fp8_wire.quantise(x, amax, fmax / world, dtype, nonfinite, residual=True,
                                 backend=backend)  # fmt: skip
        fp8_wire.sum_shards(q.reshape(-1), amax[:k], fmax / world, dtype, nonfinite, world,
                            requantise=(fmax, world), backend=backend)  # fmt: skip
        fp8_wire.dequantise(gathered, amax, fmax, dtype, backend=backend)

    cuda = device.type == "cuda"
    host, dev = [], []
    for i in range(repeats + 3):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        exchange()
        t1 = time.perf_counter()
        if cuda:
            end.record()
            torch.cuda.synchronize()
        if i >= 3:  # warm-up: compiles, caches
            host.append((t1 - t0) * 1e3)
            dev.append(start.elapsed_time(end) if cuda else (t1 - t0) * 1e3)
    return {"host_ms": statistics.median(host), "device_ms": statistics.median(dev)}


def step_times(
    size: str, device: torch.device, hook: str, backend: str, args: argparse.Namespace
) -> float:
    """Median ms per step of the GPT under DDP with ``hook`` (one-rank group)."""
    dispatch.set_default_backend(backend)
    try:
        torch.manual_seed(0)
        cfg = SIZES[size]
        amp = distamp.DistAMP(
            "bf16", strategy="ddp", comm_hook=hook, max_grad_norm=1.0, device=device,
            ddp_kwargs={"bucket_cap_mb": args.bucket_mb},
        )  # fmt: skip
        amp.setup(GPT(cfg), lambda p: torch.optim.AdamW(p, lr=3e-4))
        data = ShardedText(load_text(), context=cfg.context, batch_size=args.batch_size, rank=0,
                           world_size=1, seed=0, device=device)  # fmt: skip
        times = []
        for k in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with amp.autocast():
                loss = lm_loss(amp.model, data.batch(k))
            amp.backward_and_step(loss)
            float(loss.detach())  # host sync: the step is timed to completion
            if k >= args.warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        amp.close()
        return statistics.median(times)
    finally:
        dispatch.set_default_backend(None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket size (DDP's cap)")
    p.add_argument("--world", type=int, default=8, help="simulated ranks of part 1")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--size", choices=SIZES, default="medium", help="part 2: the GPT's size")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("benchmarks/fp8_exchange.py: --device cuda, but torch sees no CUDA device")
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {"device": args.device, "torch": torch.__version__, "buckets": {}}
    print(f"part 1: one {args.bucket_mb:g} MB bucket, {args.world} simulated ranks, "
          f"medians of {args.repeats}")  # fmt: skip
    print(f"{'backend':8} {'host ms':>9} {'device ms':>10}")
    for backend in backends(device):
        r = bucket_costs(args.bucket_mb, args.world, device, backend, args.repeats)
        out["buckets"][backend] = r
        print(f"{backend:8} {r['host_ms']:9.3f} {r['device_ms']:10.3f}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    pg = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(pg, store=dist.HashStore(), rank=0, world_size=1)
    steps: dict[str, dict[str, float]] = {}
    try:
        for hook in ("fp32", "fp8", "fp8-ef"):
            for backend in backends(device) if hook != "fp32" else ["torch"]:
                steps.setdefault(hook, {})[backend] = step_times(
                    args.size, device, hook, backend, args
                )
    finally:
        dist.destroy_process_group()
    out["steps"] = steps
    base = steps["fp32"]["torch"]
    what = f"DDP on one rank ({pg}), bf16, batch {args.batch_size}"
    print(f"\npart 2: GPT --size {args.size}, {what}, bucket cap {args.bucket_mb:g} MB, "
          f"median of {args.steps}")  # fmt: skip
    for hook, by in steps.items():
        cells = ", ".join(f"{b} {ms:.2f} ({ms / base:.2f}x fp32)" for b, ms in by.items())
        print(f"{hook:7} {cells}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()
