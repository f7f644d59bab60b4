"""Scenarios for ``tests/test_lightning_weights.py``: a real ``lightning.pytorch.Trainer`` with
``DistAMPTrainerPrecision("bf16-true")`` / ``("16-true")`` on the CPU, run in the test's
process or on each of 2 gloo ranks (``strategy="ddp"``).

The LightningModule draws its batch from the global step and its rank (the dataloader only
counts steps), so a run resumed from a checkpoint sees the batches the uninterrupted run saw
whatever Lightning does with a dataloader interrupted mid-epoch. Rank 1 may write an inf into
one gradient element in ``on_after_backward`` (after DDP's all-reduce) at chosen global steps;
each rank records whether its own gradients were finite there, so a test that counts skips also
proves the inf was one-sided. The ranks build their modules from different seeds: DDP makes the
weights rank 0's, and the masters must follow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from distamp import AutocastPolicy, DistributedGradScaler, WeightPrecision
from distamp.integrations.lightning import DistAMPEnvironment, DistAMPTrainerPrecision

FEATURES, BATCH = 8, 16


class Net(pl.LightningModule):
    """Linear, LayerNorm (the default policy's fp32 module), Linear; AdamW with a per-step
    StepLR. Records, per step, the loss, the plug-in's skip, whether this rank's gradients
    were finite after the injection, and the gradients' dtypes."""

    def __init__(self, seed: int = 0, bad_steps: tuple[int, ...] = (), lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 1)
        )
        self.bad_steps = bad_steps
        self.lr = lr
        self.losses: list[float] = []
        self.skipped: list[bool] = []
        self.nonfinite: list[bool] = []
        self.grad_dtypes: set[str] = set()

    def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
        rank = dist.get_rank() if dist.is_initialized() else 0
        gen = torch.Generator().manual_seed(1000 * self.global_step + rank)
        x = torch.randn(BATCH, FEATURES, generator=gen)
        y = x[:, :1] - 2 * x[:, 1:2]
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, _idx: int) -> None:
        return None

    def on_after_backward(self) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.global_step in self.bad_steps and rank == 1:
            grads[0].view(-1)[0] = float("inf")  # one element, one rank, after the all-reduce
        self.nonfinite.append(not all(bool(torch.isfinite(g).all()) for g in grads))
        self.grad_dtypes.update(str(g.dtype) for g in grads)

    def on_train_batch_end(self, *_: Any) -> None:
        # (Lightning's own plug-ins, which a comparison runs, say nothing of skips)
        self.skipped.append(getattr(self.trainer.precision_plugin, "step_was_skipped", False))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def steps_loader(steps: int) -> DataLoader[Any]:
    """A loader of ``steps`` placeholder batches (the module draws its own)."""
    return DataLoader(TensorDataset(torch.zeros(steps, 1)), batch_size=1)


def trainer(root: str | Path, steps: int, plugin: Any, devices: int = 1, **kw: Any) -> Any:
    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps=steps, plugins=[plugin, DistAMPEnvironment()], default_root_dir=str(root),
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, **kw,
    )  # fmt: skip


def plugin(precision: str, weights: WeightPrecision | None = None) -> DistAMPTrainerPrecision:
    """The plug-in under test; fp16 starts at a loss scale of 2**10, far from overflow for
    this model, so the injected infs are the only skips."""
    scaler = DistributedGradScaler("cpu", init_scale=2.0**10) if precision == "16-true" else None
    return DistAMPTrainerPrecision(
        precision, "cpu", scaler, AutocastPolicy(precision.split("-")[0]), weights=weights
    )


def fit(
    root: str | Path,
    precision: str,
    steps: int,
    *,
    seed: int = 0,
    bad: tuple[int, ...] = (),
    weights: WeightPrecision | None = None,
    ckpt_path: str | None = None,
    devices: int = 1,
    **kw: Any,
) -> tuple[Any, Net]:
    module = Net(seed, bad)
    run = trainer(root, steps, plugin(precision, weights), devices, **kw)
    run.fit(module, steps_loader(steps), ckpt_path=ckpt_path)
    return run, module


def outcome(run: Any, module: Net) -> dict[str, Any]:
    """What a run ended with, as plain (picklable, bitwise) values: the weights (16-bit, as
    fp32), the masters this rank holds, the optimizer's first moments, and the records."""
    opt = run.optimizers[0]
    names = {id(p): n for n, p in module.named_parameters()}
    return {
        "optimizer": type(opt).__name__,
        "dtypes": {n: str(p.dtype) for n, p in module.named_parameters()},
        "weights": {n: p.detach().float().flatten().tolist() for n, p in module.named_parameters()},
        "masters": {names[id(p)]: m.flatten().tolist() for p, m in opt.master_tensors()},
        "exp_avg": {
            names[id(p)]: s["exp_avg"].float().flatten().tolist()
            for p, s in opt.state.items()
            if "exp_avg" in s
        },
        "losses": module.losses,
        "skipped": module.skipped,
        "nonfinite": module.nonfinite,
        "grad_dtypes": sorted(module.grad_dtypes),
        "lr": run.optimizers[0].param_groups[0]["lr"],
        "skipped_steps": run.precision_plugin.skipped_steps,
    }


# ---------------------------------------------------------------------------- 2 gloo ranks
STEPS, MIDDLE = 6, 3  # the uninterrupted run's max_steps, the checkpoint's step
BAD = (1, 4)  # rank 1's gradient holds an inf at these global steps: once before the checkpoint


def ddp_runs(rank: int, world: int, root: str) -> dict[str, Any]:
    """On each rank: bf16-true uninterrupted, and the same run stopped at ``MIDDLE``, saved
    and resumed with ``ckpt_path=``, for an exact and a sharded master; 16-true uninterrupted.
    The ranks' modules start from different weights (seed = rank)."""
    out: dict[str, Any] = {}
    kw: dict[str, Any] = {"seed": rank, "bad": BAD, "devices": world}
    for name, weights in (("exact", None), ("sharded", WeightPrecision(master="sharded"))):
        if name == "exact":
            run, module = fit(root, "bf16-true", STEPS, **kw)
            out["exact"] = outcome(run, module)
            run.save_checkpoint(f"{root}/exact_end.ckpt")
        run, _ = fit(root, "bf16-true", MIDDLE, weights=weights, **kw)
        run.save_checkpoint(f"{root}/{name}_middle.ckpt")
        run, module = fit(
            root, "bf16-true", STEPS, weights=weights, ckpt_path=f"{root}/{name}_middle.ckpt", **kw
        )
        out[f"{name}_resumed"] = outcome(run, module)
        run.save_checkpoint(f"{root}/{name}_resumed_end.ckpt")
    run, module = fit(root, "16-true", STEPS, **kw)
    out["fp16"] = outcome(run, module)
    out["fp16_scale"] = run.precision_plugin.scaler.get_scale()
    return out
