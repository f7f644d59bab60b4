"""Step time of the distamp engine vs a hand-written torch loop, same model, same run.

Two gloo ranks train the main job's GPT (``launch/model.py``) under DDP. The torch loop is the
textbook one: ``torch.autocast`` + ``torch.amp.GradScaler`` + ``DistributedDataParallel``, with
``unscale_`` and ``clip_grad_norm_`` before ``step``. The engine runs
``DistAMP(strategy="ddp", max_grad_norm=...)`` with ``backward_and_step``. Both start from the same
weights and see the same batches. They alternate in blocks of ``--block`` steps (the order flips
every round) so that machine noise — other processes, frequency changes — falls on both alike;
the table reports rank 0's median step time and the ratio engine / torch (target <= 1.00), and
the same for the process's CPU time per step, which other processes on a shared machine disturb
far less than wall time.

    python benchmarks/step_time.py [--precision fp16] [--rounds 40] [--block 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from distamp.cluster.spawn import run_ranks  # noqa: E402
from distamp.engine import DistAMP  # noqa: E402
from distamp.precision.policy import parse_precision  # noqa: E402
from launch.model import GPT, GPTConfig, ShardedText, lm_loss, load_text  # noqa: E402

MAX_NORM = 1.0


def _torch_loop(precision: str, seed: int) -> Callable[[Any], None]:
    from torch.nn.parallel import DistributedDataParallel

    dtype = parse_precision(precision).compute_dtype
    torch.manual_seed(seed)
    model = DistributedDataParallel(GPT(GPTConfig()))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype is torch.float16)

    def step(batch: Any) -> None:
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = lm_loss(model, batch)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def _engine_loop(precision: str, seed: int) -> Callable[[Any], None]:
    torch.manual_seed(seed)
    amp = DistAMP(precision=precision, strategy="ddp", max_grad_norm=MAX_NORM)
    model, _ = amp.setup(
        GPT(GPTConfig()),
        lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
    )

    def step(batch: Any) -> None:
        with amp.autocast():
            loss = lm_loss(model, batch)
        amp.backward_and_step(loss)

    return step


def _worker(rank: int, world: int, args: argparse.Namespace) -> Any:
    data = ShardedText(
        load_text(), context=64, batch_size=args.batch_size, rank=rank, world_size=world, seed=0
    )
    loops = {
        "torch": _torch_loop(args.precision, 0),
        "distamp": _engine_loop(args.precision, 0),
    }
    times: dict[str, list[float]] = {name: [] for name in loops}
    cpu: dict[str, list[float]] = {name: [] for name in loops}
    for step in loops.values():  # warm-up: first steps allocate optimizer state
        for k in range(args.warmup):
            step(data.batch(k))
    k = args.warmup
    for r in range(args.rounds):
        order = list(loops) if r % 2 == 0 else list(reversed(loops))
        for name in order:
            dist.barrier()  # both ranks start the block together
            for _ in range(args.block):
                batch = data.batch(k)
                t0, c0 = time.perf_counter(), time.process_time()
                loops[name](batch)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                k += 1
    return times, cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="fp16", help="fp16 | bf16 | fp32")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=40, help="alternations of the two loops")
    p.add_argument("--block", type=int, default=1, help="steps per loop per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per loop first")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.ranks)  # the host's cores, shared
    times, cpu = run_ranks(_worker, args.ranks, args, timeout=1800, threads=threads)[0]
    med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    cpu_med = {name: statistics.median(ts) * 1e3 for name, ts in cpu.items()}
    n = len(times["torch"])
    print(
        f"{args.ranks} ranks gloo, DDP, {args.precision}, GPT {GPTConfig()}, batch "
        f"{args.batch_size}x64 per rank; {n} steps per loop in {args.rounds} alternating rounds"
    )
    header = f"{'loop':<10}{'median ms':>12}{'min ms':>10}{'max ms':>10}{'CPU ms':>10}"
    print(header)
    print("-" * len(header))
    for name in ("torch", "distamp"):
        ts = times[name]
        print(
            f"{name:<10}{med[name]:>12.2f}{min(ts) * 1e3:>10.2f}{max(ts) * 1e3:>10.2f}"
            f"{cpu_med[name]:>10.2f}"
        )
    print(f"ratio distamp / torch (median step time): {med['distamp'] / med['torch']:.3f}")
    # CPU time of the process (all its threads) is far less disturbed by other processes on a
    # shared machine than wall time: a cross-check when the wall-time ratio looks noisy.
    print(f"ratio distamp / torch (median CPU time):  {cpu_med['distamp'] / cpu_med['torch']:.3f}")


if __name__ == "__main__":
    main()
