"""The main job's model end to end on one device: tokens/s of distamp against a torch AMP loop.

One process trains three copies of ``launch/model.py``'s GPT (same weights, same batches, AdamW
as the main job, clipping at 1.0) per precision:

- ``torch``: the loop torch's documentation gives: ``torch.autocast`` and, for fp16,
  ``torch.amp.GradScaler`` with ``unscale_`` + ``clip_grad_norm_`` + ``step`` + ``update``;
- ``drop-in``: the same loop with ``distamp.DistributedGradScaler`` in place of torch's scaler
  (bf16: torch's loop needs no scaler; the drop-in row runs a check-only one, which skips a step
  whose gradients hold an inf/NaN);
- ``engine``: ``distamp.DistAMP(precision, strategy="none", max_grad_norm=1.0)`` with
  ``amp.autocast()`` and ``amp.backward_and_step(loss)``.

The three alternate step by step (the order flips every step) so that machine noise falls on all
alike; each row gives the median step time, tokens per second and the ratio to torch's (above
1.00: distamp is faster), and the last loss of each (the same data and weights: they agree to a
few digits). On CUDA the optimizer is fused AdamW (what a GPU run uses); each timed step ends
with a host read of the loss, so the time is the step's whole cost.

Every loop releases its gradients at the end of its own step (torch's loops call the
``zero_grad()`` of torch's example there instead of before the forward: the same call, the same
work), as the engine's ``step()`` does. The three models share one process and one allocator: a
loop whose gradients stay alive through the other loops' steps raises the heap's high-water mark
under them, so their gradients and optimizer temporaries land on fresh pages that the allocator
hands back to the system after each step. Measured with the medium GPT on a 2-core CPU (batch 1,
forward in fp32 so that the optimizer's share of the step is what a CPU with bf16 matrix units
sees), the old order put 36K page faults into every bf16 engine step against 14.5K into torch's
(fp16: 22K against 0.8K) and the engine at 0.84x torch's tokens/s; with one gradient lifetime
for all, every loop takes about 20K, as when it runs alone in a process.

    python benchmarks/end_to_end.py [--device cuda] [--size medium] [--precisions fp16,bf16]
        [--steps 30] [--warmup 5] [--batch-size 32] [--json PATH]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distamp import DistributedGradScaler
from distamp.engine import DistAMP
from launch.model import GPT, SIZES, ShardedText, lm_loss, load_text

LOOPS = ("torch", "drop-in", "engine")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _optimizer(params: Any, device: torch.device) -> torch.optim.Optimizer:
    fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, **fused)


def _loop(kind: str, precision: str, size: str, device: torch.device) -> Callable[[Any], float]:
    """One training step of ``kind`` (see the module doc): returns the loss (a host read)."""
    torch.manual_seed(0)
    model = GPT(SIZES[size])
    dtype = DTYPES[precision]
    if kind == "engine":
        amp = DistAMP(precision=precision, strategy="none", max_grad_norm=1.0, device=device)
        amp.setup(model, lambda p: _optimizer(p, device))

        def engine_step(batch: Any) -> float:
            with amp.autocast():
                loss = lm_loss(amp.model, batch)
            amp.backward_and_step(loss)
            return float(loss.detach())  # host sync: the step is timed to completion

        return engine_step
    model = model.to(device)
    opt = _optimizer(model.parameters(), device)
    scaler: Any = None
    if kind == "torch" and precision == "fp16":
        scaler = torch.amp.GradScaler(device.type)
    elif kind == "drop-in":
        scaler = DistributedGradScaler(device.type, check_only=precision != "fp16")

    def step(batch: Any) -> float:
        with torch.autocast(device.type, dtype=dtype):
            loss = lm_loss(model, batch)
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        opt.zero_grad()  # at the step's end, as the engine releases them (see the module doc)
        return float(loss.detach())  # host sync: the step is timed to completion

    return step


def measure(
    precision: str,
    *,
    size: str = "medium",
    steps: int = 30,
    warmup: int = 5,
    batch_size: int = 32,
    device: str | torch.device = "cuda",
) -> dict[str, Any]:
    """One precision's row: per loop the median step ms, tokens/s and last loss, and the ratio
    of each distamp loop's tokens/s to torch's."""
    device = torch.device(device)
    cfg = SIZES[size]
    data = ShardedText(load_text(), context=cfg.context, batch_size=batch_size, rank=0,
                       world_size=1, seed=0, device=device)  # fmt: skip
    loops = {kind: _loop(kind, precision, size, device) for kind in LOOPS}
    times: dict[str, list[float]] = {kind: [] for kind in LOOPS}
    losses: dict[str, float] = {}
    for k in range(warmup + steps):
        for kind in LOOPS if k % 2 == 0 else tuple(reversed(LOOPS)):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            losses[kind] = loops[kind](data.batch(k))
            if k >= warmup:
                times[kind].append(time.perf_counter() - t0)
    tokens = batch_size * cfg.context
    row: dict[str, Any] = {"precision": precision, "size": size, "tokens_per_step": tokens}
    for kind in LOOPS:
        ms = statistics.median(times[kind]) * 1e3
        row[kind] = {"ms": ms, "tokens_per_s": tokens / ms * 1e3, "loss": losses[kind]}
    for kind in LOOPS[1:]:
        row[kind]["vs_torch"] = row[kind]["tokens_per_s"] / row["torch"]["tokens_per_s"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", choices=SIZES, default="medium")
    p.add_argument("--precisions", default="fp16,bf16")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="CPU threads")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("benchmarks/end_to_end.py: --device cuda, but torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    rows = [
        measure(precision, size=args.size, steps=args.steps, warmup=args.warmup,
                batch_size=args.batch_size, device=args.device)
        for precision in args.precisions.split(",")
    ]  # fmt: skip
    print(f"GPT --size {args.size} on {args.device}, batch {args.batch_size}, median of "
          f"{args.steps} steps after {args.warmup}; torch {torch.__version__}")  # fmt: skip
    print(f"{'precision':9} {'loop':8} {'ms/step':>9} {'tokens/s':>10} {'vs torch':>9} {'loss':>8}")
    for row in rows:
        for kind in LOOPS:
            r = row[kind]
            ratio = f"{r['vs_torch']:.2f}" if "vs_torch" in r else ""
            print(f"{row['precision']:9} {kind:8} {r['ms']:9.2f} {r['tokens_per_s']:10.0f} "
                  f"{ratio:>9} {r['loss']:8.4f}")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": args.device, "torch": torch.__version__, "steps": args.steps}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()
