"""Cost of overflow diagnostics on the main job's model, side by side with torch's own tools.

One process, the byte-level GPT of ``launch/train.py`` in fp16 autocast with AdamW, clipping
through ``scaler.clip_grad_norm_``. Per configuration it times the median training step:

- ``torch GradScaler``: torch's scaler with ``unscale_`` + ``clip_grad_norm_`` (the baseline).
- ``distamp, no report``: ``DistributedGradScaler(report_overflow=False)``.
- ``distamp, report``: the default — per-gradient flags from the unscale pass, kept on device.
- ``distamp, report + tracer``: plus :class:`distamp.observe.diagnostics.NonFiniteTracer` forward
hooks.
- ``torch anomaly mode``: ``torch.autograd.set_detect_anomaly(True)`` with torch's scaler, what
  users are told to try when they hunt an inf today.

Run: ``python benchmarks/overflow_diagnostics.py [--steps 20] [--device cuda]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from distamp import DistributedGradScaler
from distamp.observe.diagnostics import NonFiniteTracer
from launch.model import DATA_FILE, GPT, GPTConfig, ShardedText, lm_loss, load_text


def make_step(config: str, device: str) -> Callable[[int], None]:
    torch.manual_seed(0)
    model = GPT(GPTConfig()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = ShardedText(
        load_text(DATA_FILE),
        context=GPTConfig().context,
        batch_size=16,
        rank=0,
        world_size=1,
        seed=0,
        device=torch.device(device),
    )
    torch_scaler = config in ("torch GradScaler", "torch anomaly mode")
    scaler: torch.amp.GradScaler = (
        torch.amp.GradScaler(device)
        if torch_scaler
        else DistributedGradScaler(device, report_overflow=config != "distamp, no report")
    )
    if config.endswith("tracer"):
        tracer = NonFiniteTracer(model)
        assert isinstance(scaler, DistributedGradScaler)
        scaler.attach_tracer(tracer)
    anomaly = config == "torch anomaly mode"

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autograd.set_detect_anomaly(True) if anomaly else nullcontext():
            with torch.autocast(device, dtype=torch.float16):
                loss = lm_loss(model, data.batch(i))
            scaler.scale(loss).backward()
        if isinstance(scaler, DistributedGradScaler):
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs = [
        "torch GradScaler",
        "distamp, no report",
        "distamp, report",
        "distamp, report + tracer",
        "torch anomaly mode",
    ]
    steps = {name: make_step(name, args.device) for name in configs}
    times: dict[str, list[float]] = {name: [] for name in configs}
    for i in range(args.steps + 3):  # interleaved, so drift hits every configuration alike
        for name, step in steps.items():
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            if args.device == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["torch GradScaler"])
    print(f"torch {torch.__version__}, {args.device}, {args.threads} thread(s), {args.steps} steps")
    print(f"{'configuration':28} {'median ms':>10} {'vs torch':>9}")
    for name in configs:
        med = statistics.median(times[name])
        print(f"{name:28} {med * 1e3:10.2f} {med / base:9.2f}")


if __name__ == "__main__":
    main()
