"""The main job's GPT trained by a Lightning Fabric loop with distamp's precision plugin.

    python launch/lightning_example.py                                   # one process
    torchrun --standalone --nproc-per-node 2 launch/lightning_example.py # or srun, mpirun

Fabric's own loop (``setup``, ``backward``, ``no_backward_sync``, ``save``); the plugin brings the
rank-consistent fp16 scaler (CPU included) and fused-optimizer-safe clipping, the environment
adapter the launcher detection. Metrics go to ``--out/metrics.jsonl`` (or TensorBoard with
``--writer tensorboard``) every ``--log-interval`` steps; rank 0 prints the last record as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `launch.model` (and a checkout)
from lightning.fabric import Fabric

from distamp import make_writer, shutdown_distributed
from distamp.integrations.lightning import DistAMPEnvironment, DistAMPPrecision
from launch.model import GPT, GPTConfig, ShardedText, lm_loss, load_text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="16-mixed", choices=["16-mixed", "bf16-mixed"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--writer", default="jsonl", choices=["jsonl", "tensorboard"])
    p.add_argument("--out", type=Path, default=Path("runs/lightning"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = DistAMPEnvironment()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    amp = DistAMPPrecision(args.precision, device=device)
    fabric = Fabric(
        accelerator=device, devices=env.dist_env.local_world_size,
        num_nodes=env.dist_env.num_nodes or 1, strategy="ddp" if env.world_size() > 1 else "auto",
        plugins=[amp, env],
    )  # fmt: skip
    fabric.launch()
    fabric.seed_everything(args.seed)
    cfg = GPTConfig()
    data = ShardedText(
        load_text(), context=cfg.context, batch_size=args.batch_size,
        rank=fabric.global_rank, world_size=fabric.world_size, seed=args.seed,
        device=fabric.device,
    )  # fmt: skip
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.fused)
    model, opt = fabric.setup(model, opt)
    path = args.out / ("metrics.jsonl" if args.writer == "jsonl" else "tb")
    writer, record, micro = make_writer(args.writer, path), {}, 0
    for step in range(1, args.steps + 1):
        for k in range(args.accum):
            with fabric.no_backward_sync(model, enabled=k < args.accum - 1):
                loss = lm_loss(model, data.batch(micro))
                fabric.backward(loss / args.accum)
            amp.metrics.add_tokens(data.tokens_per_batch)
            micro += 1
        amp.clip_grad_norm_(opt, args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        if step % args.log_interval == 0 or step == args.steps:
            # every rank: one collective; loss read here only (host sync at logging steps)
            mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
            assert isinstance(mean_loss, torch.Tensor)
            record = {"loss": mean_loss.item(), **amp.metrics_dict()}
            writer.write(step, record)
    fabric.save(args.out / "state.ckpt", {"model": model, "optimizer": opt, "scaler": amp})
    writer.close()
    fabric.barrier()
    if fabric.global_rank == 0:
        print(json.dumps({**record, "steps": args.steps, "world_size": fabric.world_size}))
    del model, opt, fabric, amp  # the wrapped model holds the process group: release it first
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
