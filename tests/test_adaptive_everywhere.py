"""Adaptive precision through every way of training: the engine, Accelerate, Lightning Fabric,
the Lightning Trainer and the Hugging Face Trainer (2 gloo ranks each, CPU).

The scenario (tests/adaptive_scenarios.py): ``net.hot`` overflows fp16 on rank 1's data only,
once as 10% of the parameters and once as 67% (over the default ``max_promoted_fraction`` of
25%), with the default rules. Each way must take >= 100 of 120 steps, promote ``net.hot`` at the
same step on both ranks, keep the ranks' parameters bitwise equal and end within 5% of fp32.
Accelerate, Fabric, the Lightning Trainer and the Hugging Face Trainer also save in the middle
and resume, bitwise equal to the uninterrupted run (the engine's resume is in test_adaptive.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from adaptive_scenarios import (
    LR,
    SHARES,
    STEPS,
    Scenario,
    check,
    fp32_reference,
    optimizer,
    outcome,
)
from adaptive_scenarios import schedule as make_schedule

HALF = STEPS // 2


def _needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


@functools.cache
def reference(share: str) -> float:
    return fp32_reference(share)


def _policy() -> Any:
    from distamp import AutocastPolicy

    return AutocastPolicy("fp16", adaptive=True)  # the default rules


def _check_all(results: list[dict[str, dict[str, Any]]]) -> None:
    for share in SHARES:
        check([r[share] for r in results], share, reference(share))


# ---------------------------------------------------------------------------- the engine


def _engine(rank: int, world: int) -> dict[str, Any]:
    import distamp

    out = {}
    for share in SHARES:
        model, policy = Scenario(share, rank), _policy()
        amp = distamp.DistAMP("fp16", strategy="ddp", policy=policy)
        amp.setup(model, optimizer, make_schedule)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "promoting ... over the cap"
            for _ in range(STEPS):
                with amp.autocast():
                    loss = amp.model()
                amp.backward_and_step(loss)
        out[share] = outcome(model, policy.adaptive.changes, amp.scaler.skipped_steps)
        amp.close()
    return out


def test_engine() -> None:
    _check_all(run_ranks(_engine, 2, timeout=240))


# ---------------------------------------------------------------------------- Accelerate


def _accelerate_run(
    rank: int, share: str, stop: int, *, save: str | None = None, load: str | None = None
) -> tuple[Any, Any]:
    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(
        mixed_precision="fp16", cpu=True, policy=_policy(), step_scheduler_with_optimizer=False
    )
    model = Scenario(share, rank)
    opt = optimizer(model)
    prepared, opt, sched = acc.prepare(model, opt, make_schedule(opt))
    start = 0
    if load is not None:
        acc.load_state(load)
        model.calls = start = HALF
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for k in range(start, stop):
            if save is not None and k == HALF:
                acc.save_state(save)
            loss = prepared()
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
    return acc, model


def _accelerate(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for share in SHARES:
        ckpt = os.path.join(root, share) if share == "small" else None
        acc, model = _accelerate_run(rank, share, STEPS, save=ckpt)
        assert acc.adaptive is not None
        out[share] = outcome(model, acc.adaptive.changes, acc.scaler.skipped_steps)
        acc.adaptive.close()
        if ckpt is not None:  # resume from the middle, in a fresh accelerator and model
            acc, model = _accelerate_run(rank, share, STEPS, load=ckpt)
            assert acc.adaptive is not None
            out["resumed"] = outcome(model, acc.adaptive.changes, acc.scaler.skipped_steps)
            acc.adaptive.close()
    return out


@_needs("accelerate")
def test_accelerate(tmp_path: Path) -> None:
    results = run_ranks(_accelerate, 2, str(tmp_path), timeout=300)
    _check_all(results)
    for r in results:  # the resumed run replays the promotion and ends bitwise equal
        whole, resumed = r["small"], r["resumed"]
        assert resumed["changes"] == whole["changes"]
        assert resumed["params"] == whole["params"]


# ---------------------------------------------------------------------------- Lightning Fabric


def _fabric_run(
    rank: int, world: int, share: str, *, save: str | None = None, load: str | None = None
) -> tuple[Any, Any]:
    from lightning.fabric import Fabric

    from distamp.integrations.lightning import DistAMPEnvironment, DistAMPPrecision

    plugin = DistAMPPrecision("16-mixed", device="cpu", policy=_policy())
    fabric = Fabric(
        accelerator="cpu", devices=world, strategy="ddp", plugins=[plugin, DistAMPEnvironment()]
    )
    fabric.launch()
    model = Scenario(share, rank)
    opt = optimizer(model)
    sched = make_schedule(opt)
    wrapped, opt = fabric.setup(model, opt)
    state = {"model": wrapped, "optimizer": opt, "scheduler": sched, "amp": plugin}
    start = 0
    if load is not None:  # the plugin's state: the scaler's and the adaptive run's
        fabric.load(load, state)
        model.calls = start = HALF
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for k in range(start, STEPS):
            if save is not None and k == HALF:
                fabric.save(save, state)
            fabric.backward(wrapped())
            opt.step()
            if not plugin.step_was_skipped:  # as the engine: the schedule follows real steps
                sched.step()
            opt.zero_grad()
    return plugin, model


def _fabric(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for share in SHARES:
        ckpt = os.path.join(root, "half.ckpt") if share == "small" else None
        plugin, model = _fabric_run(rank, world, share, save=ckpt)
        out[share] = outcome(model, plugin.adaptive.changes, plugin.scaler.skipped_steps)
        out[share]["metrics"] = plugin.metrics_dict()  # for fabric.log_dict
        plugin.adaptive.close()
        if ckpt is not None:
            plugin, model = _fabric_run(rank, world, share, load=ckpt)
            out["resumed"] = outcome(model, plugin.adaptive.changes, plugin.scaler.skipped_steps)
            plugin.adaptive.close()
    return out


@_needs("lightning")
def test_fabric(tmp_path: Path) -> None:
    results = run_ranks(_fabric, 2, str(tmp_path), timeout=300)
    _check_all(results)
    for r in results:  # fabric.save / fabric.load with the plugin in the state
        assert r["resumed"]["changes"] == r["small"]["changes"]
        assert r["resumed"]["params"] == r["small"]["params"]
    for share in SHARES:  # the change reaches the metrics a Fabric loop logs
        assert results[0][share]["metrics"]["distamp/precision_bits/net.hot.fc"] == 32.0


# ---------------------------------------------------------------------------- Lightning Trainer


def _lightning_fit(
    rank: int, share: str, root: str, *, save: str | None = None, resume: str | None = None
) -> tuple[Any, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import CSVLogger

    from distamp.integrations.lightning import DistAMPEnvironment, DistAMPTrainerPrecision

    class Lit(Scenario, pl.LightningModule):
        def training_step(self, batch: Any, index: int) -> Any:
            return self()

        def configure_optimizers(self) -> Any:
            opt = optimizer(self)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": make_schedule(opt), "interval": "step"},
            }

    class SaveAt(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if save is not None and trainer.global_step == HALF:
                trainer.save_checkpoint(save)

    plugin = DistAMPTrainerPrecision("16-mixed", device="cpu", policy=_policy())
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
        plugins=[plugin, DistAMPEnvironment()], default_root_dir=root,
        logger=CSVLogger(root, name=share), callbacks=[SaveAt()], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )  # fmt: skip
    model = Lit(share, rank)
    if resume is not None:
        model.calls = HALF
    data: Any = torch.utils.data.DataLoader(list(range(STEPS)), batch_size=None)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.fit(model, data, ckpt_path=resume)
    return plugin, model


def _lightning_trainer(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for share in SHARES:
        ckpt = os.path.join(root, "half.ckpt") if share == "small" else None
        plugin, model = _lightning_fit(rank, share, root, save=ckpt)
        out[share] = outcome(model, plugin.adaptive.changes, plugin.skipped_steps)
        plugin.adaptive.close()
        if ckpt is not None:
            plugin, model = _lightning_fit(rank, share, os.path.join(root, "resumed"), resume=ckpt)
            out["resumed"] = outcome(model, plugin.adaptive.changes, plugin.skipped_steps)
            plugin.adaptive.close()
    return out


@_needs("lightning")
def test_lightning_trainer(tmp_path: Path) -> None:
    results = run_ranks(_lightning_trainer, 2, str(tmp_path), timeout=400)
    _check_all(results)
    for r in results:
        assert r["resumed"]["changes"] == r["small"]["changes"]
        assert r["resumed"]["params"] == r["small"]["params"]
    logged = "".join(p.read_text() for p in tmp_path.glob("small/*/metrics.csv"))
    assert "distamp/precision_bits/net.hot.fc" in logged  # through the Trainer's logger


# ---------------------------------------------------------------------------- Hugging Face Trainer


def _hf_train(rank: int, share: str, out: str, resume: str | None = None) -> tuple[Any, Any]:
    from transformers import TrainingArguments

    from distamp.integrations.transformers import DistAMPTrainer

    class HFScenario(Scenario):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return {"loss": super().forward()}  # the Trainer reads outputs["loss"]

    args = TrainingArguments(
        output_dir=out, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=1,
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="linear", max_grad_norm=0.0,
        optim="adamw_torch", logging_steps=10, report_to="none", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, fp16=True, remove_unused_columns=False,
        save_strategy="steps" if share == "small" else "no", save_steps=HALF,
    )  # fmt: skip
    model = HFScenario(share, rank)
    if resume is not None:
        model.calls = HALF
    data = [{"step": k} for k in range(STEPS)]
    trainer = DistAMPTrainer(model=model, args=args, train_dataset=data, policy=_policy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.train(resume_from_checkpoint=resume)
    return trainer, model


def _hf(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    out: dict[str, Any] = {}
    for share in SHARES:
        trainer, model = _hf_train(rank, share, os.path.join(root, share))
        adaptive = trainer.accelerator.adaptive
        out[share] = outcome(model, adaptive.changes, trainer.scaler.skipped_steps)
        out[share]["logs"] = [e for e in trainer.state.log_history if "loss" in e]
        adaptive.close()
        if share == "small":
            ckpt = os.path.join(root, share, f"checkpoint-{HALF}")
            trainer, model = _hf_train(rank, share, os.path.join(root, "resumed"), resume=ckpt)
            adaptive = trainer.accelerator.adaptive
            out["resumed"] = outcome(model, adaptive.changes, trainer.scaler.skipped_steps)
            adaptive.close()
    return out


@_needs("transformers", "accelerate")
def test_hugging_face_trainer(tmp_path: Path) -> None:
    results = run_ranks(_hf, 2, str(tmp_path), timeout=400)
    _check_all(results)
    for r in results:
        assert r["resumed"]["changes"] == r["small"]["changes"]
        assert r["resumed"]["params"] == r["small"]["params"]
    step = results[0]["small"]["changes"][0][0]  # the change is in the log of its window
    logged = [e for e in results[0]["small"]["logs"] if "distamp/precision_bits/net.hot.fc" in e]
    assert [e["step"] for e in logged] == [step], results[0]["small"]["logs"]


# ---------------------------------------------------------------------------- refusals


def test_plugins_refuse_rules_they_cannot_run() -> None:
    """What a plug-in cannot drive is refused, naming the plug-in; a policy without rules
    gives no run at all."""
    from torch import nn

    from distamp import AutocastPolicy, DistributedGradScaler
    from distamp.precision.adaptive_run import AdaptiveRun

    scaler = DistributedGradScaler("cpu")

    def build(policy: Any, precision: str = "fp16", scaler: Any = scaler) -> Any:
        model = nn.Sequential(nn.Linear(4, 4))
        return AdaptiveRun.for_plugin(
            model, policy=policy, precision=precision, scaler=scaler, owner="Plug"
        )

    assert build(AutocastPolicy("fp16")) is None
    assert build(None) is None
    with pytest.raises(
        ValueError, match=r"Plug: AutocastPolicy\('bf16', adaptive=...\) with 'fp16'"
    ):
        build(AutocastPolicy("bf16", adaptive=True))
    with pytest.raises(ValueError, match=r"Plug: adaptive fp8 .* train fp8 through it"):
        build(AutocastPolicy("bf16", adaptive=True), precision="fp8")
    with pytest.raises(ValueError, match=r"Plug: .* needs fp16 or bf16 mixed precision"):
        build(AutocastPolicy("fp16", adaptive=True), precision="no")
    with pytest.raises(ValueError, match=r"Plug: .*backward_scales=.* has no scaler"):
        build(AutocastPolicy("fp16", backward_scales=True), scaler=None)
    run = build(AutocastPolicy("fp16", adaptive=True))
    with pytest.raises(RuntimeError, match="already drives an adaptive run"):
        build(AutocastPolicy("fp16", adaptive=True))  # one run per scaler
    run.close()
    build(AutocastPolicy("fp16", adaptive=True)).close()  # closed: the scaler is free again


def _pipeline_stage(rank: int, world: int, policy: Any, seed: int = 0) -> tuple[Any, Any, Any]:
    """``Net`` of the scenario ("small") split in two stages, one per rank (hot and mid; out),
    under a DistAMP engine, and its GPipe schedule."""
    from adaptive_scenarios import Net
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    import distamp

    class First(nn.Module):
        def __init__(self, net: Net) -> None:
            super().__init__()
            self.hot, self.mid = net.hot, net.mid

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.mid(self.hot(x)))

    class Last(nn.Module):
        def __init__(self, net: Net) -> None:
            super().__init__()
            self.out = net.out

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.out(h)

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(seed)
    net = Net("small")
    module = First(net) if rank == 0 else Last(net)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), group=mesh.get_group())
    amp = distamp.DistAMP("fp16", mesh=mesh, policy=policy)
    amp.setup(stage, optimizer)
    mse = amp.scaled_loss_fn(lambda out, y: torch.nn.functional.mse_loss(out.float(), y))
    return amp, ScheduleGPipe(stage, 2, loss_fn=mse), module


def _pipeline_train(amp: Any, schedule: Any, rank: int, steps: range) -> None:
    from adaptive_scenarios import batch

    for k in steps:
        x, y = batch(k, 1)  # the overflowing data
        amp.pipeline_step(schedule, x) if rank == 0 else amp.pipeline_step(schedule, target=y)


def _pipeline(rank: int, world: int, root: str) -> dict[str, Any]:
    amp, schedule, module = _pipeline_stage(rank, world, _policy())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _pipeline_train(amp, schedule, rank, range(HALF))
        amp.save_state(root)
        _pipeline_train(amp, schedule, rank, range(HALF, STEPS))
    out = {
        "changes": [(c.step, c.module) for c in amp.adaptive.changes],
        "skipped": amp.scaler.skipped_steps,
        "params": [p.detach().flatten().tolist() for p in module.parameters()],
    }
    amp.close()
    again, schedule, module = _pipeline_stage(rank, world, _policy(), seed=7)
    assert again.load_state(root) and again.step_count == HALF
    _pipeline_train(again, schedule, rank, range(HALF, STEPS))
    out["resumed"] = [p.detach().flatten().tolist() for p in module.parameters()]
    out["resumed_changes"] = [(c.step, c.module) for c in again.adaptive.changes]
    again.close()
    return out


def test_pipeline_stage_promotes_what_its_modules_caused(tmp_path: Path) -> None:
    """Two stages: the first holds the overflowing module, the second only inherits its NaN.
    The skip is blamed job-wide on the first stage's module, which alone is promoted (step 10,
    on the report both stages agree on); the second changes nothing. The engine's checkpoint
    holds both stages' parts: a resume from step 60 ends bitwise where the whole run ended."""
    first, last = run_ranks(_pipeline, 2, str(tmp_path), timeout=300)
    assert first["changes"] == [(10, "hot.fc")], first["changes"]
    assert last["changes"] == [], last["changes"]
    assert first["skipped"] == last["skipped"] == 10
    for stage in (first, last):
        assert stage["resumed"] == stage["params"]
        assert stage["resumed_changes"] == stage["changes"]


def _pipeline_refusal(rank: int, world: int) -> list[str]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    import distamp
    from distamp import AutocastPolicy

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    group = mesh.get_group()
    stages = [
        PipelineStage(nn.Linear(4, 4), i, 2 * world, torch.device("cpu"), group=group)
        for i in (rank, rank + world)
    ]  # two stages per rank: an interleaved schedule's
    out = []
    for kwargs in (
        {"policy": AutocastPolicy("fp16", adaptive=True)},
        {"policy": AutocastPolicy("fp16", backward_scales=True)},
        {"numerics_interval": 10},
    ):
        amp = distamp.DistAMP("fp16", mesh=mesh, **kwargs)
        with pytest.raises(ValueError, match="several pipeline stages on one rank") as e:
            amp.setup(stages, lambda p: torch.optim.SGD(p, lr=0.1))
        out.append(str(e.value))
    return out


def test_several_stages_per_rank_refuse_the_monitor_before_any_collective() -> None:
    """Interleaved schedules (several stages on a rank) are refused at setup, naming what to do
    instead: the job-wide segments take one stage per rank."""
    r0, r1 = run_ranks(_pipeline_refusal, 2, timeout=120)
    assert r0 == r1 and "fp32_modules=" in r0[0]
