"""16-bit weights (``weights=``) through DistAMPAccelerator and the Hugging Face Trainer, as the
tests of tests/test_accelerate_weights.py run them: real Accelerate and a real Trainer on CPU,
tiny models built from code (no hub), gloo ranks from :func:`distamp.cluster.spawn.run_ranks`.

Each rank builds its model from its own seed: DDP makes the weights rank 0's, and only if the
masters are made rank 0's as well do the ranks stay equal after the first step."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from torch import nn

import distamp

STEPS, ACCUM, BAD_STEP, SAVE_AT = 5, 2, 2, 1  # Accelerate's loop
HF_STEPS, HF_BAD_STEP, HF_SAVE_AT = 6, 3, 2  # the Trainer's


def small_model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))


def llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(cfg)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token rows, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self, n: int) -> None:
        self.rows = torch.randint(0, 32, (n, 6), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def unwrap(optimizer: Any) -> Any:
    """The optimizer under Accelerate's wrapper."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def digest(model: nn.Module, optimizer: Any) -> tuple[str, str]:
    """SHA-256 of the weights and of the fp32 masters (a parameter's own value where it has
    none), in parameter order."""
    opt = unwrap(optimizer)
    masters = dict(opt.master_tensors()) if hasattr(opt, "master_tensors") else {}
    weights, fp32 = hashlib.sha256(), hashlib.sha256()
    for p in model.parameters():
        weights.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
        master = masters.get(p, p.detach()).float().contiguous()
        fp32.update(master.view(torch.uint8).numpy().tobytes())
    return weights.hexdigest(), fp32.hexdigest()


# ---------------------------------------------------------------------------- Accelerate
def _accelerated(seed: int) -> tuple[Any, nn.Module, Any, Any]:
    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(
        mixed_precision="bf16",
        cpu=True,
        gradient_accumulation_steps=ACCUM,
        policy=distamp.AutocastPolicy("bf16"),  # LayerNorm: an fp32 module, fp32 weights
        weights=distamp.WeightPrecision(),
    )
    model = small_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched


def _train(
    rank: int, acc: Any, model: nn.Module, opt: Any, sched: Any, steps: range, out: dict[str, Any]
) -> None:
    for step in steps:
        for micro in range(ACCUM):
            gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            with acc.accumulate(model):
                loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
                acc.backward(loss)
                if acc.sync_gradients:
                    out["grad_dtypes"].update(str(p.grad.dtype) for p in model.parameters())
                    if step == BAD_STEP and rank == 1:  # after DDP's all-reduce: this rank only
                        next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                    before = digest(model, opt)
                opt.step()
                sched.step()
                opt.zero_grad()
        out["skipped"].append(opt.step_was_skipped)
        out["unchanged"].append(digest(model, opt) == before)
        out["lrs"].append(sched.get_last_lr()[0])


def accelerate_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """bf16 weights through DistAMPAccelerator on DDP: an inf in rank 1's gradient at
    :data:`BAD_STEP`, a ``save_state`` before :data:`SAVE_AT`, and a second accelerator (another
    model's weights) that loads it and trains the same steps."""
    acc, model, opt, sched = _accelerated(seed=rank)
    out: dict[str, Any] = {"grad_dtypes": set(), "skipped": [], "unchanged": [], "lrs": []}
    out["dtypes"] = {n: str(p.dtype) for n, p in model.module.named_parameters()}
    out["classes"] = [type(model).__name__, type(opt).__name__, type(unwrap(opt)).__name__]
    out["start"] = digest(model, opt)
    _train(rank, acc, model, opt, sched, range(SAVE_AT), out)
    acc.save_state(f"{root}/mid")
    _train(rank, acc, model, opt, sched, range(SAVE_AT, STEPS), out)
    out["end"] = digest(model, opt)
    out["grad_dtypes"] = sorted(out["grad_dtypes"])
    acc, model, opt, sched = _accelerated(seed=100 + rank)
    acc.load_state(f"{root}/mid")
    resumed: dict[str, Any] = {"grad_dtypes": set(), "skipped": [], "unchanged": [], "lrs": []}
    _train(rank, acc, model, opt, sched, range(SAVE_AT, STEPS), resumed)
    out["resumed"] = {"end": digest(model, opt), "skipped": resumed["skipped"]}
    acc.wait_for_everyone()
    return out


# ---------------------------------------------------------------------------- the Trainer
def _hf_trainer(rank: int, out_dir: str, seed: int) -> Any:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from distamp.integrations.transformers import with_distamp

    class InjectingTrainer(Trainer):
        """A user's Trainer subclass: an inf in rank 1's gradient after backward (and DDP's
        all-reduce) at one step."""

        def training_step(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().training_step(model, inputs, *args, **kw)
            self.grad_dtypes.update(str(p.grad.dtype) for p in model.parameters())
            if self.state.global_step == HF_BAD_STEP and rank == 1:
                next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
            return loss

    class Record(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trainer.before = digest(trainer.model, trainer.optimizer)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            trainer.skipped.append(bool(trainer.accelerator.optimizer_step_was_skipped))
            trainer.unchanged.append(digest(trainer.model, trainer.optimizer) == trainer.before)
            trainer.scheduler.append(trainer.lr_scheduler.last_epoch)

    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=HF_STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        report_to="none",
        disable_tqdm=True,
        save_strategy="steps",
        save_steps=HF_SAVE_AT,
        dataloader_num_workers=0,
        seed=0,
        fp16=True,
    )
    trainer = with_distamp(InjectingTrainer)(
        model=llama(seed),
        args=args,
        train_dataset=Tokens(48),
        callbacks=[Record()],
        # far from fp16 overflow for this model: the injected inf is the only skip
        scaler=distamp.DistributedGradScaler("cpu", init_scale=2.0**8),
        policy=distamp.AutocastPolicy("fp16", fp32_modules=["*RMSNorm"]),
        weights=distamp.WeightPrecision("fp16"),
    )
    trainer.grad_dtypes, trainer.skipped, trainer.unchanged, trainer.scheduler = set(), [], [], []
    return trainer


def trainer_run(rank: int, world: int, root: str) -> dict[str, Any]:
    """fp16 weights through the Trainer on DDP (its default fused AdamW, clipping, a linear
    schedule): an inf in rank 1's gradient at :data:`HF_BAD_STEP`, checkpoints every
    :data:`HF_SAVE_AT` steps; then a Trainer over another model's weights resumes from the
    first checkpoint."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    trainer = _hf_trainer(rank, root, seed=rank)
    trainer.train()
    opt = unwrap(trainer.optimizer)
    saved = torch.load(f"{root}/checkpoint-{HF_SAVE_AT}/optimizer.pt", weights_only=True)
    out = {
        "dtypes": {n: str(p.dtype) for n, p in trainer.model.named_parameters()},
        "grad_dtypes": sorted(trainer.grad_dtypes),
        "optimizer": [type(trainer.optimizer).__name__, type(opt).__name__],
        "fused": bool(opt.inner.defaults.get("fused")),
        "saved_masters": [str(e["master"].dtype) for e in saved["state"].values() if "master" in e],
        "skipped": trainer.skipped,
        "unchanged": trainer.unchanged,
        "scheduler": trainer.scheduler,
        "scale": trainer.scaler.get_scale(),
        "end": digest(trainer.model, trainer.optimizer),
    }
    resumed = _hf_trainer(rank, root, seed=100 + rank)
    resumed.train(resume_from_checkpoint=f"{root}/checkpoint-{HF_SAVE_AT}")
    out["resumed"] = {
        "end": digest(resumed.model, resumed.optimizer),
        "skipped": resumed.skipped,
        "scheduler": resumed.lr_scheduler.last_epoch,
        "scale": resumed.scaler.get_scale(),
    }
    return out
