"""The cost of adaptive precision through each way of training, side by side.

The main job's GPT (``launch/model.py``, fp16 autocast, AdamW) trained through the engine,
``DistAMPAccelerator``, Lightning Fabric's ``DistAMPPrecision``, the Lightning Trainer's
``DistAMPTrainerPrecision`` and the Hugging Face ``DistAMPTrainer``, each with
``AutocastPolicy("fp16")`` (a static policy) and with ``AutocastPolicy("fp16", adaptive=True)``
(the numeric monitor and the rules, default interval 10). Loops we write (the engine,
Accelerate, Fabric) interleave the two configurations step by step, so that drift hits both
alike; the Trainers' own loops cannot be interleaved, so their runs alternate (static, adaptive,
static, adaptive) and every step is timed by a callback. Printed per way: median step time of
each and their ratio (the monitor's cost).

Run: ``python benchmarks/adaptive_plugins.py [--steps 30] [--threads 1] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distamp
from distamp import AutocastPolicy
from launch.model import DATA_FILE, GPT, GPTConfig, ShardedText, lm_loss, load_text

WARMUP = 3
WAYS = ("engine", "accelerate", "fabric", "lightning", "hf")


def policy(adaptive: bool) -> AutocastPolicy:
    return AutocastPolicy("fp16", adaptive=adaptive)


def text() -> ShardedText:
    cfg = GPTConfig()
    return ShardedText(
        load_text(DATA_FILE), context=cfg.context, batch_size=16, rank=0, world_size=1,
        seed=0, device=torch.device("cpu"),
    )  # fmt: skip


class LM(nn.Module):
    """The GPT and its data: ``forward()`` returns the loss of the next batch (a framework's
    own batch is only a step token), so every way trains on the same batches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt, self.data, self.calls = GPT(GPTConfig()), text(), 0

    def forward(self, *_: Any, **__: Any) -> torch.Tensor:
        batch = self.data.batch(self.calls)
        self.calls += 1
        return lm_loss(self.gpt, batch)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def interleave(steps: dict[bool, Callable[[], None]], n: int) -> dict[bool, float]:
    """Median seconds of each configuration's step, run alternately."""
    times: dict[bool, list[float]] = {k: [] for k in steps}
    for i in range(n + WARMUP):
        for key, step in steps.items():
            t0 = time.perf_counter()
            step()
            if i >= WARMUP:
                times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def alternate(fit: Callable[[bool], list[float]]) -> dict[bool, float]:
    """Median step of whole runs done in turn (static, adaptive, static, adaptive)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(2):
        for key in (False, True):
            times[key] += fit(key)[WARMUP:]
    return {k: statistics.median(v) for k, v in times.items()}


def engine(n: int) -> dict[bool, float]:
    def build(adaptive: bool) -> Callable[[], None]:
        model = LM()
        amp = distamp.DistAMP("fp16", strategy="none", policy=policy(adaptive))
        amp.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))

        def step() -> None:
            with amp.autocast():
                loss = amp.model()
            amp.backward_and_step(loss)

        return step

    return interleave({k: build(k) for k in (False, True)}, n)


def accelerate(n: int) -> dict[bool, float]:
    from distamp.integrations.accelerate import DistAMPAccelerator

    def build(adaptive: bool) -> Callable[[], None]:
        acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True, policy=policy(adaptive))
        model = LM()
        prepared, opt = acc.prepare(model, adamw(model))

        def step() -> None:
            acc.backward(prepared())
            opt.step()
            opt.zero_grad()

        return step

    return interleave({k: build(k) for k in (False, True)}, n)


def fabric(n: int) -> dict[bool, float]:
    from lightning.fabric import Fabric

    from distamp.integrations.lightning import DistAMPPrecision

    def build(adaptive: bool) -> Callable[[], None]:
        plugin = DistAMPPrecision("16-mixed", device="cpu", policy=policy(adaptive))
        fab = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        model = LM()
        wrapped, opt = fab.setup(model, adamw(model))

        def step() -> None:
            fab.backward(wrapped())
            opt.step()
            opt.zero_grad()

        return step

    return interleave({k: build(k) for k in (False, True)}, n)


def lightning(n: int) -> dict[bool, float]:
    import lightning.pytorch as pl

    from distamp.integrations.lightning import DistAMPTrainerPrecision

    class Lit(LM, pl.LightningModule):
        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            return self()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return adamw(self)

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)

    def fit(adaptive: bool) -> list[float]:
        clock = Clock()
        plugin = DistAMPTrainerPrecision("16-mixed", device="cpu", policy=policy(adaptive))
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=n + WARMUP, plugins=[plugin],
            callbacks=[clock], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Lit(), torch.utils.data.DataLoader(list(range(n + WARMUP)), batch_size=None))
        return clock.times

    return alternate(fit)


def hf(n: int) -> dict[bool, float]:
    from transformers import TrainerCallback, TrainingArguments

    from distamp.integrations.transformers import DistAMPTrainer

    class HFLM(LM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return {"loss": super().forward()}

    class Clock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.times.append(time.perf_counter() - self.t0)

    def fit(adaptive: bool) -> list[float]:
        clock = Clock()
        args = TrainingArguments(
            output_dir=os.path.join("runs", "adaptive_plugins_hf"), use_cpu=True, fp16=True,
            max_steps=n + WARMUP, per_device_train_batch_size=1, learning_rate=1e-3,
            optim="adamw_torch", max_grad_norm=0.0, report_to="none", save_strategy="no",
            disable_tqdm=True, remove_unused_columns=False, logging_strategy="no",
        )  # fmt: skip
        data = [{"step": k} for k in range(n + WARMUP)]
        trainer = DistAMPTrainer(
            model=HFLM(), args=args, train_dataset=data, callbacks=[clock],
            policy=policy(adaptive),
        )  # fmt: skip
        trainer.train()
        return clock.times

    return alternate(fit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", nargs="*", choices=WAYS, default=list(WAYS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.simplefilter("ignore")  # frameworks' deprecation notes; the table is the output
    print(f"torch {torch.__version__}, cpu, {args.threads} thread(s), GPT fp16, {args.steps} steps")
    print(f"{'way':12} {'static ms':>10} {'adaptive ms':>12} {'ratio':>7}")
    runs = {"engine": engine, "accelerate": accelerate, "fabric": fabric}
    runs.update(lightning=lightning, hf=hf)
    for name in args.only:
        times = runs[name](args.steps)
        base, adaptive = times[False], times[True]
        print(f"{name:12} {base * 1e3:10.2f} {adaptive * 1e3:12.2f} {adaptive / base:7.3f}")


if __name__ == "__main__":
    main()
