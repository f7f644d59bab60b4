"""The main job's GPT trained by an ordinary Accelerate loop, with distamp's scaler underneath.

    python launch/accelerate_example.py                                   # one process
    torchrun --standalone --nproc-per-node 2 launch/accelerate_example.py # or accelerate launch

The loop is Accelerate's own (``prepare``, ``accumulate``, ``backward``, ``clip_grad_norm_``,
``save_state``); only the ``Accelerator`` class differs. fp16 works on CPU too. Metrics go to
``--out/metrics.jsonl`` (or TensorBoard with ``--writer tensorboard``) every ``--log-interval``
steps; rank 0 prints the last record as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `launch.model` (and a checkout)
from distamp import make_writer, shutdown_distributed
from distamp.integrations.accelerate import DistAMPAccelerator
from launch.model import GPT, GPTConfig, ShardedText, lm_loss, load_text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "no"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--writer", default="jsonl", choices=["jsonl", "tensorboard"])
    p.add_argument("--out", type=Path, default=Path("runs/accelerate"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.manual_seed(args.seed)
    acc = DistAMPAccelerator(
        mixed_precision=args.precision, cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=args.accum,
    )  # fmt: skip
    cfg = GPTConfig()
    data = ShardedText(
        load_text(), context=cfg.context, batch_size=args.batch_size,
        rank=acc.process_index, world_size=acc.num_processes, seed=args.seed, device=acc.device,
    )  # fmt: skip
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=args.fused)
    model, opt = acc.prepare(model, opt)
    path = args.out / ("metrics.jsonl" if args.writer == "jsonl" else "tb")
    writer, record, micro = make_writer(args.writer, path), {}, 0
    for step in range(1, args.steps + 1):
        for _ in range(args.accum):
            with acc.accumulate(model):
                loss = lm_loss(model, data.batch(micro))
                acc.backward(loss)
                acc.amp_metrics.add_tokens(data.tokens_per_batch)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                opt.step()
                opt.zero_grad()
            micro += 1
        if step % args.log_interval == 0 or step == args.steps:
            # every rank: one collective; loss read here only (host sync at logging steps)
            record = {"loss": acc.reduce(loss.detach(), "mean").item(), **acc.amp_metrics_dict()}
            writer.write(step, record)
    acc.save_state(str(args.out / "state"))
    writer.close()
    acc.wait_for_everyone()
    if acc.is_main_process:
        print(json.dumps({**record, "steps": args.steps, "world_size": acc.num_processes}))
    acc.end_training()
    del model, opt, acc  # the wrapped model holds the process group: release it first
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
