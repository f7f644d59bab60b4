"""One 2-rank run that telemetry and the run report both read (the ``telemetry_run`` fixture of
tests/conftest.py runs it once per test session).

Two gloo ranks under DDP, fp16 with an adaptive policy and clipping, where only rank 1's data
overflows inside ``hot.fc`` (tests/adaptive_scenarios.py): rank 1's own headroom there is
infinite while rank 0's is finite, the agreed one infinite, the skips are blamed on the module,
and its promotion to fp32 is an event of the record that made it. Rank 0 logs the windows to
``metrics.jsonl``, as the main job does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import adaptive_scenarios as sc
import torch
import torch.nn.functional as F

import distamp
from distamp import AutocastPolicy
from distamp.observe.telemetry import Telemetry
from distamp.observe.writers import ProgressPrinter, TensorBoardWriter, WandbWriter
from distamp.precision.adaptive import AdaptiveRules

STEPS, INTERVAL = 24, 4
HOT = "hot.fc"  # the module whose fp16 output overflows on rank 1's data
RULES = AdaptiveRules(interval=INTERVAL, skips=2, window=8, max_promoted_fraction=0.5)


def train(rank: int, world: int, out: str) -> dict[str, Any]:
    """Train the run into ``out``; returns what the ranks saw."""
    torch.manual_seed(0)
    writers: list[Any] = [TensorBoardWriter(Path(out) / "tb")]
    if rank == 0:
        writers.append(WandbWriter(Path(out), project="distamp-test"))
    telemetry = Telemetry(out, interval=INTERVAL, writers=writers)
    policy = AutocastPolicy("fp16", adaptive=RULES)
    amp = distamp.DistAMP(
        "fp16", strategy="ddp", policy=policy, telemetry=telemetry, max_grad_norm=1.0
    )
    amp.setup(sc.Net("small"), sc.optimizer)
    printer = ProgressPrinter(STEPS, jsonl=Path(out) / "metrics.jsonl") if rank == 0 else None

    def loss_fn(net: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(net(x).float(), y)

    amp.fit(
        lambda k: sc.batch(k, rank),
        loss_fn,
        steps=STEPS,
        log_interval=INTERVAL,
        on_log=printer.log if printer is not None else None,
    )
    skipped = amp.scaler.skipped_steps
    wandb_dir = str(writers[-1].run_dir) if rank == 0 else None
    amp.close()
    return {"records": telemetry.records, "skipped": skipped, "wandb": wandb_dir}
