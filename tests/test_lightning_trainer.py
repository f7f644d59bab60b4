"""The Trainer precision plugins with a real Lightning Trainer on 2 gloo processes (CPU, fp16).

What is checked: an inf injected into one rank's gradient after DDP's all-reduce is skipped on
both ranks, the per-step LR scheduler steps only at real optimizer steps, and the replicas stay
identical; a resumed Trainer restores the scale and the skip counter; Trainer clipping with a fused
AdamW gives what distamp's engine gives; FSDP (CPU through a subclass, see ``_CPUFSDPStrategy``)
and ``ModelParallelStrategy`` (FSDP2) agree on skips; ``DistAMPEnvironment`` gives the Trainer
the ranks of SLURM, torchrun and Open MPI jobs; the example runs under torchrun.

Every inf is injected in ``on_after_backward`` on rank 1 only, and each rank records whether its
own gradients were finite there, so a test that counts skips also proves the inf was one-sided.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs distamp[lightning]"
)

from tests._dist import run_ranks  # noqa: E402

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
