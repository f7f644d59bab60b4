"""The Trainer precision plugins with a real Lightning Trainer on 2 gloo processes (CPU, fp16).

What is checked: an inf injected into one rank's gradient after DDP's all-reduce is skipped on
both ranks, the per-step LR scheduler steps only at real optimizer steps, and the replicas stay
identical; a resumed Trainer restores the scale and the skip counter; Trainer clipping with a fused
AdamW gives what distamp's engine gives; FSDP and ``ModelParallelStrategy`` (FSDP2) agree on skips
(Lightning's FSDPStrategy needs CUDA: on CPU the test uses a subclass and wraps the model itself,
see ``_clip_and_sharded``); ``DistAMPEnvironment`` gives the Trainer the ranks of SLURM, torchrun
and Open MPI jobs; the example runs under torchrun. In one process: hooks see unscaled gradients,
the policy's fp32 modules, ``None`` steps, manual optimization, bf16, bad arguments.

Every inf is injected in ``on_after_backward`` on rank 1 only, and each rank records whether its
own gradients were finite there, so a test that counts skips also proves the inf was one-sided.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs distamp[lightning]"
)

from tests._dist import run_ranks, run_torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH, FEATURES = 4, 8


# ---------------------------------------------------------------------------- worker side
def _module(bad_steps: tuple[int, ...], *, fused: bool = False, sharded: str = "") -> Any:
    """A small LightningModule whose rank 1 overflows at ``bad_steps`` (global steps)."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
            )
            self.rank = dist.get_rank()
            self.nonfinite: list[bool] = []  # this rank's gradients held an inf, per step
            self.skipped: list[bool] = []  # what the plugin reported, per step
            self.norms: list[float] = []  # the clipping norm, per step
            self.dtypes: set[str] = set()
            self.at_start: dict[str, Any] = {}

        def configure_model(self) -> None:
            if sharded == "fsdp1" and not isinstance(self.net, FullyShardedDataParallel):
                # Lightning passes device_id=None on CPU, which torch's FSDP1 refuses; wrapped
                # here, the strategy leaves the model as it is.
                self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"))
            if sharded == "fsdp2":  # ModelParallelStrategy: FSDP2 over the data-parallel mesh
                mesh = self.device_mesh["data_parallel"]
                for layer in self.net:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            (x,) = batch
            out = self.net(x)
            self.dtypes.add(str(out.dtype))
            return out.float().pow(2).mean()

        def on_after_backward(self) -> None:
            grads = [p.grad for p in self.trainer.model.parameters() if p.grad is not None]
            if self.global_step in bad_steps and self.rank == 1:
                local = grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]
                local.view(-1)[0] = float("inf")  # one rank, after the all-reduce
            local_grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
            self.nonfinite.append(not all(bool(torch.isfinite(g).all()) for g in local_grads))

        def on_train_batch_end(self, *_: Any) -> None:
            plugin = self.trainer.precision_plugin
            self.skipped.append(plugin.step_was_skipped)
            if plugin.last_grad_norm is not None:
                self.norms.append(float(plugin.last_grad_norm))

        def on_train_start(self) -> None:
            plugin = self.trainer.precision_plugin
            self.at_start = {"scaler": plugin.state_dict(), "skipped": plugin.skipped_steps}

        def configure_optimizers(self) -> Any:
            params = self.trainer.model.parameters() if sharded else self.parameters()
            opt = torch.optim.AdamW(params, lr=1e-2, fused=fused)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def _data(rank: int, steps: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(10 + rank)
    return DataLoader(TensorDataset(torch.randn(steps * BATCH, FEATURES, generator=gen)), BATCH)


def _trainer(root: str, steps: int, plugin: Any, strategy: Any = "ddp", **kw: Any) -> Any:
    import lightning.pytorch as pl

    from distamp.integrations.lightning import DistAMPEnvironment

    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=steps,
        plugins=[plugin, DistAMPEnvironment()], default_root_dir=root, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **kw,
    )  # fmt: skip


def _params(module: Any) -> list[list[float]]:
    """Every parameter, whole (FSDP1's state_dict and DTensor's full_tensor gather shards)."""
    out = []
    for value in module.state_dict().values():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out.append(full.detach().flatten().tolist())
    return out


def _outcome(trainer: Any, module: Any) -> dict[str, Any]:
    plugin = trainer.precision_plugin
    gated = trainer.lr_scheduler_configs[0].scheduler
    return {
        "nonfinite": module.nonfinite,
        "skipped": module.skipped,
        "skipped_steps": plugin.skipped_steps,
        "scale": plugin.scaler.get_scale(),
        "state": plugin.state_dict(),
        "scheduler_steps": gated.scheduler.last_epoch,
        "held": gated.held_steps,
        "lr": gated.get_last_lr()[0],
        "dtypes": sorted(module.dtypes),
        "at_start": module.at_start,
    }


FIRST, SECOND = 6, 9  # max_steps of the first run and of the resumed one
BAD_FIRST, BAD_SECOND = (1, 3), (7,)


def _ddp_fit_and_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPTrainerPrecision

    def plugin() -> DistAMPTrainerPrecision:
        # 2**10: far from fp16 overflow for this model, so the injected infs are the only ones
        return DistAMPTrainerPrecision(
            "16-mixed", device="cpu", scaler=DistributedGradScaler("cpu", init_scale=2.0**10)
        )

    first = _trainer(root, FIRST, plugin(), gradient_clip_val=1.0)
    module = _module(BAD_FIRST)
    first.fit(module, _data(rank, FIRST))
    ckpt = f"{root}/first.ckpt"
    first.save_checkpoint(ckpt)
    out: dict[str, Any] = {"first": _outcome(first, module), "params_first": _params(module)}

    resumed = _trainer(root, SECOND, plugin(), gradient_clip_val=1.0)
    module = _module(BAD_SECOND)
    resumed.fit(module, _data(rank, SECOND), ckpt_path=ckpt)
    out["second"] = _outcome(resumed, module)
    out["params"] = _params(module)
    return out


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ddp")
    return run_ranks(_ddp_fit_and_resume, 2, str(root), timeout=150)  # type: ignore[no-any-return]


def test_inf_on_one_rank_skipped_on_both_and_scheduler_held(
    ddp_run: list[dict[str, Any]],
) -> None:
    r0, r1 = (r["first"] for r in ddp_run)
    bad = [k in BAD_FIRST for k in range(FIRST)]
    assert r0["nonfinite"] == [False] * FIRST, "rank 0 must never see the inf itself"
    assert r1["nonfinite"] == bad, "rank 1 overflows at the injected steps only"
    for r in (r0, r1):
        assert r["dtypes"] == ["torch.float16"]
        assert r["skipped"] == bad
        assert r["skipped_steps"] == len(BAD_FIRST)
        real_steps = FIRST - len(BAD_FIRST)
        assert r["scheduler_steps"] == real_steps, "the scheduler stepped at a skipped step"
        assert r["held"] == len(BAD_FIRST)
        assert r["lr"] == pytest.approx(1e-2 * 0.9**real_steps)
        assert r["scale"] == 2.0**10 / 2 ** len(BAD_FIRST)
    assert ddp_run[0]["params_first"] == ddp_run[1]["params_first"]


def test_resume_restores_scale_and_skip_counter(ddp_run: list[dict[str, Any]]) -> None:
    for r in ddp_run:
        first, second = r["first"], r["second"]
        assert second["at_start"]["scaler"] == first["state"]
        assert second["at_start"]["skipped"] == len(BAD_FIRST)
        resumed_steps = SECOND - FIRST
        assert second["skipped"] == [FIRST + k in BAD_SECOND for k in range(resumed_steps)]
        assert second["skipped_steps"] == len(BAD_FIRST) + len(BAD_SECOND)
        assert second["scheduler_steps"] == SECOND - len(BAD_FIRST) - len(BAD_SECOND)
        assert second["scale"] == first["scale"] / 2 ** len(BAD_SECOND)
    assert ddp_run[0]["second"]["nonfinite"] == [False] * (SECOND - FIRST)
    assert ddp_run[1]["second"]["nonfinite"] == [
        FIRST + k in BAD_SECOND for k in range(SECOND - FIRST)
    ]
    assert ddp_run[0]["params"] == ddp_run[1]["params"]


# ---------------------------------------------------------------------------- clipping, sharding
STEPS, CLIP, BAD_SHARDED = 4, 0.05, (2,)


def _scaler() -> Any:
    from distamp import DistributedGradScaler

    return DistributedGradScaler("cpu", init_scale=2.0**10)


def _clip_and_sharded(rank: int, world: int, root: str) -> dict[str, Any]:
    import torch
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    from distamp import DistAMP
    from distamp.integrations.lightning import DistAMPFSDPPrecision, DistAMPTrainerPrecision

    out: dict[str, Any] = {}
    # 1. Trainer clipping with a fused AdamW, gradients unscaled inside the clip (one pass) or
    #    before the hooks, against distamp's engine on the same model, data and seed.
    for unscale in ("at_clip", "before_hooks"):
        plugin = DistAMPTrainerPrecision("16-mixed", "cpu", _scaler(), unscale=unscale)
        trainer = _trainer(root, STEPS, plugin, gradient_clip_val=CLIP)
        module = _module((), fused=True)
        trainer.fit(module, _data(rank, STEPS))
        out[unscale] = {
            "params": _params(module),
            "norms": module.norms,
            **_outcome(trainer, module),
        }

    amp = DistAMP("fp16", strategy="ddp", max_grad_norm=CLIP, scaler=_scaler(), device="cpu")
    model, _ = amp.setup(
        _module(()).net,
        lambda params: torch.optim.AdamW(params, lr=1e-2, fused=True),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9),
    )
    norms = []
    for (x,) in _data(rank, STEPS):
        with amp.autocast():
            loss = model(x).float().pow(2).mean()
        result = amp.backward_and_step(loss)
        assert result is not None
        norms.append(result.grad_norm)
    out["engine"] = {"params": _params(model.module), "norms": norms}

    # 2. FSDP1 and ModelParallelStrategy (FSDP2), inf on rank 1's shard. Lightning refuses
    #    FSDPStrategy on CPU with an exact-type check (`type(strategy) is FSDPStrategy`), which a
    #    subclass passes; FSDP1 itself runs on CPU with gloo given device_id (configure_model).
    class _CPUFSDPStrategy(FSDPStrategy):
        pass

    plugin = DistAMPFSDPPrecision("16-mixed", "cpu", _scaler())
    trainer = _trainer(root, STEPS, plugin, _CPUFSDPStrategy(), gradient_clip_val=CLIP)
    module = _module(BAD_SHARDED, sharded="fsdp1")
    trainer.fit(module, _data(rank, STEPS))
    assert trainer.strategy.mixed_precision_config is None  # CPU: autocast casts
    out["fsdp"] = {"params": _params(module), "norms": module.norms}
    out["fsdp"].update(_outcome(trainer, module))

    plugin = DistAMPTrainerPrecision("16-mixed", "cpu", _scaler())
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = _trainer(root, STEPS, plugin, strategy, gradient_clip_val=CLIP)
    module = _module(BAD_SHARDED, sharded="fsdp2")
    trainer.fit(module, _data(rank, STEPS))
    out["model_parallel"] = {"params": _params(module), "norms": module.norms}
    out["model_parallel"].update(_outcome(trainer, module))
    return out


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("clip")
    return run_ranks(_clip_and_sharded, 2, str(root), timeout=150)  # type: ignore[no-any-return]


@pytest.mark.parametrize("unscale", ["at_clip", "before_hooks"])
def test_clipping_with_fused_adamw_matches_the_engine(
    sharded_run: list[dict[str, Any]], unscale: str
) -> None:
    import torch

    for r in sharded_run:
        trainer, engine = r[unscale], r["engine"]
        assert trainer["skipped"] == [False] * STEPS
        assert all(n > CLIP for n in engine["norms"]), "the clip must be active at every step"
        assert trainer["norms"] == pytest.approx(engine["norms"], rel=1e-6)
        for a, b in zip(trainer["params"], engine["params"], strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-6, atol=1e-7)
    assert sharded_run[0][unscale]["params"] == sharded_run[1][unscale]["params"]


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_sharded_strategies_agree_on_skips(
    sharded_run: list[dict[str, Any]], strategy: str
) -> None:
    r0, r1 = (r[strategy] for r in sharded_run)
    bad = [k in BAD_SHARDED for k in range(STEPS)]
    assert r0["nonfinite"] == [False] * STEPS and r1["nonfinite"] == bad
    for r in (r0, r1):
        assert r["dtypes"] == ["torch.float16"]
        assert r["skipped"] == bad and r["skipped_steps"] == len(BAD_SHARDED)
        assert r["scheduler_steps"] == STEPS - len(BAD_SHARDED)
        assert r["scale"] == 2.0**10 / 2
        # The norm counts each shard once: the first step's norm is the replicated run's.
        assert r["norms"][0] == pytest.approx(sharded_run[0]["engine"]["norms"][0], rel=1e-3)
        assert r["norms"][BAD_SHARDED[0]] == float("inf")
    assert r0["params"] == r1["params"]
    assert r0["norms"] == r1["norms"]


# ---------------------------------------------------------------------------- the example
def test_example_runs(tmp_path: Path) -> None:
    """launch/lightning_trainer_example.py under torchrun: 2 processes, fused AdamW, an inf on
    rank 1 at step 3 skipped by both, the warmup scheduler held there."""
    out = run_torchrun(
        ROOT / "launch" / "lightning_trainer_example.py",
        *("--steps", "6", "--log-interval", "3", "--fused", "--overflow-at", "3"),
        *("--out", str(tmp_path)),
        timeout=150,
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["steps"] == 6
    assert summary["skipped_steps"] == 1 and summary["scheduler_steps"] == 5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [3, 6]
    assert [r["skipped_steps"] for r in lines] == [0, 1]
    assert lines[-1]["loss_scale"] == lines[0]["loss_scale"] / 2 and lines[-1]["grad_norm"] > 0
    assert (tmp_path / "last.ckpt").exists()


# ---------------------------------------------------------------------------- environment
SLURM = {
    "SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NNODES": "2",
    "MASTER_PORT": "29511",
}  # fmt: skip
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "29511",
}  # fmt: skip
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1",  # rank in node
    "MASTER_ADDR": "n1", "MASTER_PORT": "29511",
}  # fmt: skip


@pytest.mark.parametrize(
    ("launcher", "env"),
    [("slurm", SLURM), ("torchrun", TORCHRUN), ("openmpi", OPENMPI)],
    ids=["slurm", "torchrun", "openmpi"],
)
def test_environment_gives_the_trainer_the_launchers_ranks(
    launcher: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 5 of 8, 4 per node: the Trainer takes the layout from the adapter (and its setters
    check that devices x num_nodes matches the launch)."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities import rank_zero
    from lightning_utilities.core import rank_zero as utils_rank_zero

    from distamp.integrations.lightning import DistAMPEnvironment, DistAMPTrainerPrecision

    # The Trainer sets Lightning's process-wide rank-zero rank: restore it after the test.
    monkeypatch.setattr(rank_zero.rank_zero_only, "rank", rank_zero.rank_zero_only.rank)
    monkeypatch.setattr(utils_rank_zero.rank_zero_only, "rank", utils_rank_zero.rank_zero_only.rank)
    cluster = DistAMPEnvironment(env)
    assert cluster.dist_env.launcher == launcher
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, num_nodes=2, strategy="ddp", logger=False,
        plugins=[DistAMPTrainerPrecision("16-mixed", device="cpu"), cluster],
    )  # fmt: skip
    assert trainer.strategy.cluster_environment is cluster
    assert (trainer.global_rank, trainer.world_size, trainer.local_rank, trainer.node_rank) == (
        5, 8, 1, 1,
    )  # fmt: skip
    assert cluster.main_address == "n1" and cluster.main_port == 29511
    assert cluster.creates_processes_externally  # Lightning's launcher must not spawn more
    with pytest.raises(ValueError, match=r"make devices.*match the launch"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp", plugins=[cluster])

    for key, value in env.items():  # and read from the process environment itself
        monkeypatch.setenv(key, value)
    assert DistAMPEnvironment.detect()
    assert DistAMPEnvironment().global_rank() == 5


# ---------------------------------------------------------------------------- single process
def test_bf16_clips_a_fused_optimizer_and_keeps_schedulers_as_they_are(tmp_path: Path) -> None:
    """One process, in this one: bf16 has no scaler, so nothing is skipped or gated, and norm
    clipping of a fused AdamW (which Lightning's own plugin refuses) still works."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from distamp.integrations.lightning import DistAMPTrainerPrecision

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(FEATURES, 4)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), fused=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    plugin = DistAMPTrainerPrecision("bf16-mixed", device="cpu")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, plugins=[plugin], gradient_clip_val=1e-3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(8, FEATURES)), batch_size=4))
    assert plugin.scaler is None and plugin.state_dict() == {} and plugin.skipped_steps == 0
    assert not plugin.step_was_skipped
    assert plugin.last_grad_norm is not None and float(plugin.last_grad_norm) > 1e-3
    assert type(trainer.lr_scheduler_configs[0].scheduler).__name__ == "StepLR"


def _fit_one_process(module: Any, plugin: Any, root: Path, steps: int, **kw: Any) -> Any:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, **kw,
    )  # fmt: skip
    data = torch.randn(steps * BATCH, FEATURES, generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(TensorDataset(data), batch_size=BATCH))
    return trainer


def test_hooks_see_unscaled_gradients_policy_and_a_none_step(tmp_path: Path) -> None:
    """One process: with an ``on_before_optimizer_step`` override ("auto" unscales before the
    hooks) the hook reads the true gradient norm; the policy keeps LayerNorm in fp32; a
    ``training_step`` that returns None neither steps nor lets the scheduler step."""
    import lightning.pytorch as pl
    import torch

    from distamp.integrations.lightning import DistAMPTrainerPrecision
    from distamp.precision.policy import AutocastPolicy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(FEATURES, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)
            )
            self.dtypes: list[set[str]] = [set(), set(), set()]
            for i, layer in enumerate(self.net):
                layer.register_forward_hook(lambda _m, _i, o, i=i: self.dtypes[i].add(str(o.dtype)))
            self.hook_norms: list[float] = []
            self.clip_norms: list[float] = []

        def training_step(self, batch: Any, idx: int) -> Any:
            if idx == 1:
                return None  # Lightning skips backward and step
            return self.net(batch[0]).float().pow(2).mean()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            if grads:
                self.hook_norms.append(
                    float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
                )

        def on_train_batch_end(self, *_: Any) -> None:
            norm = self.trainer.precision_plugin.last_grad_norm
            self.clip_norms.append(float(norm))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), fused=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    plugin = DistAMPTrainerPrecision("16-mixed", "cpu", policy=AutocastPolicy("fp16"))
    torch.manual_seed(0)  # weights whose scaled fp16 gradients stay finite: no skip expected
    module = Net()
    trainer = _fit_one_process(module, plugin, tmp_path, 4, gradient_clip_val=1e-3)
    assert module.dtypes == [{"torch.float16"}, {"torch.float32"}, {"torch.float16"}]
    gated = trainer.lr_scheduler_configs[0].scheduler
    assert (gated.scheduler.last_epoch, gated.held_steps, plugin.skipped_steps) == (3, 1, 0)
    # the hook ran before the clip, on unscaled gradients: its norm is the clip's norm
    assert len(module.hook_norms) == 3
    assert module.hook_norms == pytest.approx([module.clip_norms[k] for k in (0, 2, 3)], rel=1e-5)


def test_manual_optimization_clips_and_gates_a_scheduler(tmp_path: Path) -> None:
    """Manual optimization: ``self.clip_gradients`` on the LightningOptimizer, then its step;
    a one-process inf is skipped and the user's ``sch.step()`` is held at that step."""
    import lightning.pytorch as pl
    import torch

    from distamp.integrations.lightning import DistAMPTrainerPrecision

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Linear(FEATURES, 4)
            self.skipped: list[bool] = []

        def training_step(self, batch: Any, idx: int) -> None:
            opt, sch = self.optimizers(), self.lr_schedulers()
            self.manual_backward(self.net(batch[0]).float().pow(2).mean())
            if idx == 1:
                self.net.weight.grad.view(-1)[0] = float("nan")
            self.clip_gradients(opt, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sch.step()
            self.skipped.append(self.trainer.precision_plugin.step_was_skipped)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), fused=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    plugin = DistAMPTrainerPrecision("16-mixed", "cpu")
    torch.manual_seed(0)  # only the planted inf may skip a step
    module = Net()
    trainer = _fit_one_process(module, plugin, tmp_path, 3)
    assert module.skipped == [False, True, False] and plugin.skipped_steps == 1
    assert trainer.lr_scheduler_configs[0].scheduler.scheduler.last_epoch == 2


def test_skip_aware_scheduler() -> None:
    import copy
    import pickle

    import torch

    from distamp.integrations.lightning import SkipAwareScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    inner = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    skip = {"now": False}
    gated = SkipAwareScheduler(inner, lambda o: o is opt and skip["now"])
    opt.step()
    gated.step()
    skip["now"] = True
    gated.step()
    assert (inner.last_epoch, gated.held_steps, gated.get_last_lr()) == (1, 1, [0.5])
    assert gated.optimizer is opt and gated.scheduler is inner
    assert gated.state_dict() == inner.state_dict()
    other = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    SkipAwareScheduler(other, lambda o: False).load_state_dict(gated.state_dict())
    assert other.last_epoch == 1
    assert copy.copy(gated).scheduler is inner
    assert pickle.loads(pickle.dumps(SkipAwareScheduler(inner, bool))).last_epoch == 1
    with pytest.raises(TypeError, match="no step, state_dict, load_state_dict, optimizer"):
        SkipAwareScheduler(object(), bool)
    with pytest.raises(TypeError, match="callable"):
        SkipAwareScheduler(inner, None)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    import torch

    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPFSDPPrecision, DistAMPTrainerPrecision
    from distamp.precision.policy import AutocastPolicy

    for cls in (DistAMPTrainerPrecision, DistAMPFSDPPrecision):
        with pytest.raises(ValueError, match=r"precision='32-true'.*'16-mixed' or 'bf16-mixed'"):
            cls("32-true")
        with pytest.raises(ValueError, match="precision='nope'"):
            cls("nope")
        with pytest.raises(ValueError, match="bf16 needs no loss scaling"):
            cls("bf16-mixed", "cpu", DistributedGradScaler("cpu"))
        with pytest.raises(TypeError, match=r"scaler=.*DistributedGradScaler"):
            cls("16-mixed", "cpu", torch.amp.GradScaler("cpu"))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="policy is for bf16"):
            cls("16-mixed", "cpu", policy=AutocastPolicy("bf16"))
        with pytest.raises(ValueError, match="unscale='early'"):
            cls("16-mixed", "cpu", unscale="early")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="gate_schedulers=1"):
            cls("16-mixed", "cpu", gate_schedulers=1)  # type: ignore[arg-type]
    plugin = DistAMPTrainerPrecision("16-mixed", "cpu")
    with pytest.raises(ValueError, match="clip_val='1'"):
        plugin.clip_gradients(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]), "1")  # type: ignore[arg-type]
    fsdp = DistAMPFSDPPrecision("16-mixed", "cpu")
    assert isinstance(fsdp.scaler, DistributedGradScaler) and fsdp.mixed_precision_config is None


# ---------------------------------------------------------------------------- Lightning's contract
def _skipping_module(bad_steps: tuple[int, ...], *, fused: bool = False) -> Any:
    """One Linear; the loss is inf at ``bad_steps``; records the plug-in's skip and the lr."""
    import lightning.pytorch as pl
    import torch

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Linear(FEATURES, 4)
            self.skipped: list[bool] = []
            self.lrs: list[float] = []

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            loss = self.net(batch[0]).float().pow(2).mean()
            return loss * float("inf") if self.global_step in bad_steps else loss

        def on_train_batch_end(self, *_: Any) -> None:
            self.skipped.append(self.trainer.precision_plugin.step_was_skipped)
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=fused)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_a_replaced_scaler_is_the_one_stepped_and_read(tmp_path: Path, fused: bool) -> None:
    """Lightning's plug-ins step whatever ``plugin.scaler`` holds when the step comes (its own
    tests put ``Mock(wraps=plugin.scaler)`` there). So does this one: a wrapped distamp scaler
    and a plain ``torch.amp.GradScaler`` are scaled, unscaled and stepped, and the skip (and so
    the scheduler gate) is read from them, with the same outcome as the scaler given at
    construction (the clip's rounding aside: 1e-6)."""
    from unittest.mock import Mock

    import torch

    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPTrainerPrecision

    steps, bad = 4, (1,)
    expected = [step in bad for step in range(steps)]
    outcomes = {}
    for kind in ("given", "mock", "torch"):
        scaler = DistributedGradScaler("cpu", init_scale=2.0**8)
        plugin = DistAMPTrainerPrecision("16-mixed", device="cpu", scaler=scaler)
        if kind == "mock":
            plugin.scaler = Mock(wraps=plugin.scaler)
        elif kind == "torch":
            plugin.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        module = _skipping_module(bad, fused=fused)
        _fit_one_process(module, plugin, tmp_path, steps, gradient_clip_val=1.0)
        assert module.skipped == expected, (kind, module.skipped)
        assert plugin.skipped_steps == len(bad), kind
        outcomes[kind] = (module.lrs, [p.detach().clone() for p in module.parameters()])
        if kind == "mock":
            assert plugin.scaler.scale.call_count == steps
            assert plugin.scaler.step.call_count == plugin.scaler.update.call_count == steps
        assert plugin.scaler.get_scale() == 2.0**7, kind  # backed off once
    lrs, params = outcomes["given"]
    assert lrs == [1e-2 * 0.5**k for k in (1, 1, 2, 3)]  # held at the skipped step
    for kind in ("mock", "torch"):
        assert outcomes[kind][0] == lrs, kind
        for got, want in zip(outcomes[kind][1], params, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_replacement_that_cannot_be_honoured_is_refused_before_the_step(
    tmp_path: Path,
) -> None:
    """Not a scaler, ``None`` under fp16 (no loss scaling), a loss scaler under bf16, another
    scaler than the one a policy's adaptive rules watch: refused at the next step, naming the
    fix, with the weights untouched."""
    import torch

    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPTrainerPrecision
    from distamp.precision.adaptive import AdaptiveRules
    from distamp.precision.policy import AutocastPolicy

    cases: list[tuple[str, Any, type[Exception], str]] = [
        ("16-mixed", object(), TypeError, "is no loss scaler.*torch.amp.GradScaler"),
        ("16-mixed", None, TypeError, "None with fp16.*'bf16-mixed'"),
        ("bf16-mixed", torch.amp.GradScaler("cpu"), ValueError, "bf16.*set it to None"),
    ]
    for precision, replacement, error, message in cases:
        plugin = DistAMPTrainerPrecision(precision, device="cpu")
        plugin.scaler = replacement
        module = _skipping_module(())
        before = [p.detach().clone() for p in module.parameters()]
        with pytest.raises(error, match=message):
            _fit_one_process(module, plugin, tmp_path, 2)
        assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    policy = AutocastPolicy("fp16", adaptive=AdaptiveRules())
    plugin = DistAMPTrainerPrecision("16-mixed", device="cpu", policy=policy)
    module = _skipping_module(())
    _fit_one_process(module, plugin, tmp_path, 1)
    plugin.scaler = DistributedGradScaler("cpu")
    with pytest.raises(ValueError, match=r"adaptive rules started.*before the model is set up"):
        _fit_one_process(module, plugin, tmp_path, 2)


def test_construction_touches_no_device() -> None:
    """As Lightning's plug-ins, which a job configures on a host without its GPU: built for
    ``"cuda"`` on a CPU-only host, nothing is allocated until the plug-in is used."""
    import warnings

    import torch

    from distamp.integrations.lightning import (
        DistAMPFSDPPrecision,
        DistAMPPrecision,
        DistAMPTrainerPrecision,
    )

    allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    with warnings.catch_warnings():  # without CUDA the scaler disables itself, as torch's does
        warnings.simplefilter("ignore")
        plugins = [
            DistAMPPrecision("16-mixed", device="cuda"),
            DistAMPTrainerPrecision("16-mixed", device="cuda:0"),
            DistAMPFSDPPrecision("16-mixed", device="cuda"),
        ]
    for plugin in (*plugins, DistAMPTrainerPrecision("bf16-mixed", device="cuda")):
        assert plugin.scaler is None or plugin.scaler.get_scale() > 0
    if torch.cuda.is_available():
        assert torch.cuda.memory_allocated() == allocated


@pytest.mark.parametrize("precision", ["16", 16, "bf16", "fp16", "16-true", "32-true", "fp8"])
def test_precision_values_are_lightnings(precision: Any) -> None:
    """The values Lightning's own ``MixedPrecision`` plug-ins (Fabric's and the Trainer's)
    accept are the only ones accepted, refused with a ``ValueError`` naming the valid ones;
    the Trainer's plug-in also takes Lightning's ``"16-true"``/``"bf16-true"`` (16-bit weights,
    kept with an exact master: ``tests/test_lightning_weights.py``)."""
    from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
    from lightning.pytorch.plugins.precision import MixedPrecision

    from distamp.integrations.lightning import DistAMPPrecision, DistAMPTrainerPrecision

    pairs = [(FabricMixedPrecision, DistAMPPrecision), (MixedPrecision, DistAMPTrainerPrecision)]
    for theirs, ours in pairs:
        with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
            theirs(precision, "cpu")
        if ours is DistAMPTrainerPrecision and precision == "16-true":
            continue
        with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
            ours(precision, "cpu")
    for valid in ("16-mixed", "bf16-mixed"):
        assert DistAMPPrecision(valid, "cpu").precision == valid
        assert DistAMPTrainerPrecision(valid, "cpu").precision == valid
    for valid in ("16-true", "bf16-true"):
        assert DistAMPTrainerPrecision(valid, "cpu").precision == valid


def test_fused_optimizers_are_clipped_where_lightning_refuses(tmp_path: Path) -> None:
    """A deliberate difference from Lightning: its ``MixedPrecision`` refuses norm clipping of
    a fused optimizer ("does not allow for gradient clipping"); distamp's plug-in clips it (the
    clip folded into the optimizer's own unscale) and the norm is the clipped gradients'."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPTrainerPrecision

    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        lightnings = MixedPrecision("16-mixed", "cpu")
        _fit_one_process(
            _skipping_module((), fused=True), lightnings, tmp_path, 1, gradient_clip_val=1
        )
    plugin = DistAMPTrainerPrecision(
        "16-mixed", "cpu", scaler=DistributedGradScaler("cpu", init_scale=2.0**8)
    )
    module = _skipping_module((), fused=True)
    _fit_one_process(module, plugin, tmp_path, 2, gradient_clip_val=1e-3)
    assert module.skipped == [False, False]
    assert plugin.last_grad_norm is not None and float(plugin.last_grad_norm) > 1e-3


# ---------------------------------------------------------------------------- step guards
def _trainer_guarded(rank: int, world: int, root: str, what: str) -> dict[str, Any]:
    """The Trainer under DDP with the plug-in's guards and a gated per-step scheduler:
    ``what="spike"``: rank 1's loss x1e3 at one step; ``what="limit"``: a +inf gradient
    element on rank 1 at every step (in ``on_after_backward``)."""
    import lightning.pytorch as pl
    import torch
    from guard_scenarios import (
        GUARD,
        INIT_SCALE,
        LIMIT,
        STEPS,
        batch,
        digest,
        inject_inf,
        loss_of,
        model,
        same_on_every_rank,
        snapshot,
        unchanged,
    )
    from torch.utils.data import DataLoader, TensorDataset

    from distamp import ConsecutiveSkipsError, DistributedGradScaler
    from distamp.integrations.lightning import DistAMPTrainerPrecision

    spike = what == "spike"

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model()
            self.skipped: list[bool] = []
            self.kept: list[bool] = []
            self.before: list[torch.Tensor] = []

        def training_step(self, data: Any, _idx: int) -> torch.Tensor:
            return loss_of(self.net, data[0], rank if spike else 0, self.global_step)

        def on_after_backward(self) -> None:
            if not spike:
                inject_inf(self.net, rank)

        def on_train_batch_start(self, *_: Any) -> None:
            self.before = snapshot(self.net)

        def on_train_batch_end(self, *_: Any) -> None:
            self.skipped.append(self.trainer.precision_plugin.step_was_skipped)
            self.kept.append(unchanged(self.before, self.net))

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    plugin = DistAMPTrainerPrecision(
        "16-mixed",
        device="cpu",
        scaler=DistributedGradScaler("cpu", init_scale=INIT_SCALE),
        spike_guard=GUARD if spike else None,
        max_consecutive_skips=None if spike else LIMIT,
    )
    trainer = _trainer(root, STEPS, plugin)
    module = Net()
    data = torch.cat([batch(rank, k) for k in range(STEPS)])
    try:
        trainer.fit(module, DataLoader(TensorDataset(data), batch_size=len(data) // STEPS))
    except ConsecutiveSkipsError as exc:
        return {"raised_at": len(module.skipped), "message": str(exc)}
    same_on_every_rank(digest(module.net))
    gated = trainer.lr_scheduler_configs[0].scheduler
    return {
        "skipped": module.skipped,
        "kept": module.kept,
        "metrics": plugin.metrics_dict(),
        "scale": plugin.scaler.get_scale(),
        "scheduler_steps": gated.scheduler.last_epoch,
        "held": gated.held_steps,
    }


def test_trainer_spike_on_one_rank_is_skipped_on_both(tmp_path: Path) -> None:
    """Rank 1's loss x1e3 at one step: that step (only) is skipped on both ranks, the
    parameters unchanged by it and bitwise equal across ranks at the end, the per-step
    scheduler held once, one spike skip and no overflow skip in the metrics."""
    from guard_scenarios import INIT_SCALE, SPIKE_AT, STEPS

    for r in run_ranks(_trainer_guarded, 2, str(tmp_path), "spike", timeout=150):
        assert r["skipped"] == [k == SPIKE_AT for k in range(STEPS)], r["skipped"]
        assert r["kept"] == r["skipped"], r["kept"]
        assert r["metrics"]["spike_skips"] == 1 and r["metrics"]["skipped_steps"] == 0
        assert r["scale"] == INIT_SCALE
        assert (r["scheduler_steps"], r["held"]) == (STEPS - 1, 1), r


def test_trainer_consecutive_skips_raise_on_both_ranks(tmp_path: Path) -> None:
    """A +inf gradient element on rank 1 at every step: ConsecutiveSkipsError out of
    ``trainer.fit`` on both ranks at the same step (read every 8 steps without a spike guard)."""
    from guard_scenarios import LIMIT

    results = run_ranks(_trainer_guarded, 2, str(tmp_path), "limit", timeout=150)
    assert [r["raised_at"] for r in results] == [7, 7], results
    for r in results:
        assert f"max_consecutive_skips={LIMIT}" in r["message"], r["message"]


def test_trainer_guard_settings_refused_naming_the_field() -> None:
    from distamp.integrations.lightning import DistAMPFSDPPrecision, DistAMPTrainerPrecision

    for cls in (DistAMPTrainerPrecision, DistAMPFSDPPrecision):
        with pytest.raises(ValueError, match="max_consecutive_skips=-1"):
            cls("16-mixed", "cpu", max_consecutive_skips=-1)
        with pytest.raises(TypeError, match="spike_guard='on'"):
            cls("16-mixed", "cpu", spike_guard="on")  # type: ignore[arg-type]
