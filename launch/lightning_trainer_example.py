"""The main job's GPT trained by Lightning's Trainer with distamp's precision plugin.

    python launch/lightning_trainer_example.py                                   # one process
    torchrun --standalone --nproc-per-node 2 launch/lightning_trainer_example.py # or srun, mpirun

The Trainer runs the loop; ``DistAMPTrainerPrecision`` brings fp16 with ranks that agree on every
skip (CPU included), clipping through ``gradient_clip_val`` that works with ``--fused``, a warmup
scheduler that waits at skipped steps, and the scaler in the checkpoint; ``DistAMPEnvironment``
reads the launcher. ``--overflow-at N`` puts an inf into rank 1's gradient at step N (after DDP's
all-reduce) to show both ranks skip it. Metrics go to ``--out/metrics.jsonl`` every
``--log-interval`` steps; rank 0 prints a JSON summary last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `launch.model` (and a checkout)
import lightning.pytorch as pl

from distamp import make_writer, shutdown_distributed
from distamp.integrations.lightning import DistAMPEnvironment, DistAMPTrainerPrecision
from launch.model import GPT, GPTConfig, ShardedText, lm_loss, load_text


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", default="16-mixed", choices=["16-mixed", "bf16-mixed"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5, help="linear warmup steps (per real step)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True)")
    p.add_argument("--overflow-at", type=int, default=None, help="inf on rank 1 at this step")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("runs/lightning_trainer"))
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Batches(torch.utils.data.Dataset):
    """``steps`` batches of this rank's shard (ShardedText already splits by rank)."""

    def __init__(self, text: ShardedText, steps: int) -> None:
        self.text, self.steps = text, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.text.batch(index)


class LitGPT(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args, self.gpt = args, GPT(GPTConfig())

    def on_train_start(self) -> None:
        # Made here, once the process group is up: the writer writes on rank 0 only.
        self.writer = make_writer("jsonl", self.args.out / "metrics.jsonl")

    def on_train_end(self) -> None:
        self.writer.close()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _idx: int) -> torch.Tensor:
        self.trainer.precision_plugin.metrics.add_tokens(batch[0].numel())
        return lm_loss(self.gpt, batch)

    def on_after_backward(self) -> None:
        if self.global_step == self.args.overflow_at and self.global_rank == 1:
            next(self.gpt.parameters()).grad.view(-1)[0] = float("inf")

    def on_train_batch_end(self, outputs: Any, *_: Any) -> None:
        step = self.global_step
        if step % self.args.log_interval == 0 or step == self.args.steps:
            # every rank: one collective; the loss is read here only (host sync at logging steps)
            loss = self.trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
            record = {"loss": float(loss), **self.trainer.precision_plugin.metrics_dict()}
            self.writer.write(step, record)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.args.lr, fused=self.args.fused)
        warmup = max(self.args.warmup, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = DistAMPEnvironment()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plugin = DistAMPTrainerPrecision(args.precision, device=device)
    trainer = pl.Trainer(
        accelerator=device, devices=env.dist_env.local_world_size,
        num_nodes=env.dist_env.num_nodes or 1, strategy="ddp" if env.world_size() > 1 else "auto",
        plugins=[plugin, env], max_steps=args.steps, gradient_clip_val=args.max_grad_norm,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=args.out,
    )  # fmt: skip
    pl.seed_everything(args.seed, verbose=False)
    cfg = GPTConfig()
    text = ShardedText(
        load_text(), context=cfg.context, batch_size=args.batch_size, rank=env.global_rank(),
        world_size=env.world_size(), seed=args.seed,
    )  # fmt: skip
    model = LitGPT(args)
    loader = torch.utils.data.DataLoader(Batches(text, args.steps), batch_size=None)
    trainer.fit(model, loader)
    trainer.save_checkpoint(args.out / "last.ckpt")  # holds the scaler's state too
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    summary = {
        "steps": trainer.global_step,
        "skipped_steps": plugin.skipped_steps,
        "scheduler_steps": scheduler.last_epoch,
        "loss_scale": plugin.scaler.get_scale() if plugin.scaler is not None else 1.0,
        "world_size": trainer.world_size,
    }
    if trainer.global_rank == 0:
        print(json.dumps(summary))
    del model, trainer, plugin  # the wrapped model holds the process group: release it first
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
