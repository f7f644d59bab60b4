"""16-bit weights with an exact master under a real Lightning Trainer (CPU):
``DistAMPTrainerPrecision("bf16-true")``, ``("16-true")`` and ``weights=WeightPrecision(...)``
(:mod:`distamp.integrations.lightning.weights`).

In one process: the parameters become 16-bit while the policy's fp32 modules stay fp32, the
optimizer the Trainer steps is a ``MasterWeightOptimizer`` (its scheduler still drives it), the
loss falls, updates too small for a bf16 weight are kept (Lightning's own ``"bf16-true"`` loses
them), the checkpoint's model entries are the masters, and bad combinations are refused before
anything is built or cast; a validate after fit and a second fit of the same module keep the
masters. On 2 gloo ranks (``strategy="ddp"``, the ranks' modules built from
different seeds): an inf in one rank's gradient skips the step on both, the replicas and their
masters agree, and a run resumed from a Trainer checkpoint (``ckpt_path=``) is bitwise the
uninterrupted run, with an exact and with a sharded master. The scenarios are in
``tests/lightning_weights_scenarios.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="needs distamp[lightning]"
)

from tests._dist import run_ranks  # noqa: E402

LINEAR = ("net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias")
NORM = ("net.1.weight", "net.1.bias")  # LayerNorm: the default policy's fp32 module


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_weights_are_16_bit_with_masters_and_the_loss_falls(
    tmp_path: Path, precision: str, one_thread: None
) -> None:
    import torch

    from distamp import DistributedGradScaler, MasterWeightOptimizer
    from tests.lightning_weights_scenarios import Net, fit, plugin, steps_loader, trainer

    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float16
    steps = 30
    run, module = fit(tmp_path, precision, steps)
    params = dict(module.named_parameters())
    assert {n: params[n].dtype for n in LINEAR} == dict.fromkeys(LINEAR, dtype)
    assert {n: params[n].dtype for n in NORM} == dict.fromkeys(NORM, torch.float32)
    assert run.precision == precision  # as Lightning's own reports it (its model summary too)
    opt = run.optimizers[0]
    assert isinstance(opt, MasterWeightOptimizer)
    assert isinstance(opt.inner, torch.optim.AdamW)
    scaler = run.precision_plugin.scaler
    assert isinstance(scaler, DistributedGradScaler)
    assert scaler.check_only == (precision == "bf16-true")  # fp16: loss scaling
    scheduler = run.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is opt.inner and opt.param_groups is opt.inner.param_groups
    real_steps = steps - run.precision_plugin.skipped_steps
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**real_steps)
    assert sum(module.losses[-5:]) < 0.5 * sum(module.losses[:5]), module.losses
    held = dict(opt.master_tensors())
    masters = {n: held[p] for n, p in params.items()}
    for name in LINEAR:  # the masters carry what the 16-bit weights do not hold
        assert masters[name].dtype == torch.float32
        assert torch.equal(masters[name].to(dtype), params[name].detach()), name
        assert not torch.equal(masters[name], params[name].detach().float()), name

    # The checkpoint's model entries are the masters: an fp32 module loads them bit for bit.
    run.save_checkpoint(tmp_path / "end.ckpt")
    saved = torch.load(tmp_path / "end.ckpt", weights_only=False)["state_dict"]
    fp32 = Net()
    fp32.load_state_dict(saved)
    for name, p in fp32.named_parameters():
        want = masters[name] if name in LINEAR else params[name].detach()
        assert p.dtype == torch.float32 and torch.equal(p.detach(), want), name

    # After fit, the Trainer hands the wrapped optimizers back (validate); a second fit of the
    # same module with the same plug-in wraps its new optimizer over the masters the first
    # one stepped (another plug-in knows no masters of it: refused, nothing changed).
    run.validate(module, steps_loader(2), verbose=False)
    assert run.optimizers == [opt]
    with pytest.raises(ValueError, match=r"no master this plug-in kept.*the same plug-in"):
        trainer(tmp_path, 10, plugin(precision)).fit(module, steps_loader(10))
    again = trainer(tmp_path, 10, run.precision_plugin)
    again.fit(module, steps_loader(10))
    assert again.optimizers[0] is not opt and isinstance(again.optimizers[0], MasterWeightOptimizer)
    assert {n: p.dtype for n, p in module.named_parameters()} == {
        n: p.dtype for n, p in params.items()
    }
    assert sum(module.losses[-5:]) < 0.5 * sum(module.losses[:5]), module.losses


def test_small_updates_are_kept_where_lightnings_bf16_true_loses_them(
    tmp_path: Path, one_thread: None
) -> None:
    """An AdamW step of ~1e-5 is far below half a bf16 step of a weight above 0.05: Lightning's
    ``precision="bf16-true"`` leaves every such weight as it was; every master moves."""
    import lightning.pytorch as pl
    import torch

    from distamp.integrations.lightning import DistAMPEnvironment
    from tests.lightning_weights_scenarios import Net, plugin, steps_loader

    steps = 5
    initial = {n: p.detach().clone() for n, p in Net().named_parameters()}
    theirs = Net(lr=1e-5)
    pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, precision="bf16-true",
        plugins=[DistAMPEnvironment()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    ).fit(theirs, steps_loader(steps))  # fmt: skip
    ours = Net(lr=1e-5)
    run = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, plugins=[plugin("bf16-true"),
        DistAMPEnvironment()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    run.fit(ours, steps_loader(steps))
    weight = "net.0.weight"
    start = initial[weight]
    large = start.abs() > 0.05  # half a bf16 step there: > 1e-4, ten AdamW steps of 1e-5
    lost = dict(theirs.named_parameters())[weight].float()
    assert bool(large.any()) and torch.equal(lost[large], start.bfloat16().float()[large])
    master = dict(run.optimizers[0].master_tensors())[dict(ours.named_parameters())[weight]]
    moved = (master - start).abs()
    assert bool((moved > 0).all()) and float(moved.max()) < 1e-4  # every element moved, a little


def test_bad_combinations_are_refused_before_anything_is_built(
    tmp_path: Path, one_thread: None
) -> None:
    import torch
    from lightning.pytorch.strategies import ModelParallelStrategy

    from distamp import DistributedGradScaler, SpikeGuard, WeightPrecision
    from distamp.integrations.lightning import DistAMPFSDPPrecision, DistAMPTrainerPrecision
    from tests.lightning_weights_scenarios import Net, plugin, steps_loader, trainer

    cls = DistAMPTrainerPrecision
    refused: list[tuple[Any, type[Exception], str]] = [
        (lambda: cls("bf16-true", "cpu", weights=WeightPrecision("fp16")), ValueError,
         r"compute dtype; pass WeightPrecision\('bf16', \.\.\.\) or precision='16-true'"),
        (lambda: cls("16-mixed", "cpu", weights=WeightPrecision()), ValueError,
         r"WeightPrecision\('fp16', \.\.\.\) or precision='bf16-mixed'"),
        (lambda: cls("bf16-true", "cpu", weights="exact"), TypeError,
         r"weights='exact'.*pass a distamp.WeightPrecision"),
        (lambda: cls("bf16-true", "cpu", DistributedGradScaler("cpu")), ValueError,
         "bf16 needs no loss scaling"),
        (lambda: cls("16-true", "cpu", DistributedGradScaler("cpu", enabled=False)), ValueError,
         "fp16 weights train under loss scaling.*enabled DistributedGradScaler"),
        (lambda: cls("16-true", "cpu", unscale="before_hooks"), ValueError,
         "never unscaled in fp16.*unscale='auto' or 'at_clip'"),
        (lambda: cls("16-true", "cpu", spike_guard=SpikeGuard()), ValueError,
         "spike_guard.*precision='bf16-true'"),
        (lambda: cls("32-true", "cpu"), ValueError,
         r"'16-mixed' or 'bf16-mixed', or '16-true' or 'bf16-true'"),
        (lambda: DistAMPFSDPPrecision("bf16-true", "cpu"), ValueError,
         r"Precision must be '16-mixed' or 'bf16-mixed'; 'bf16-true' .* not by "
         "DistAMPFSDPPrecision yet"),
    ]  # fmt: skip
    for build, error, message in refused:
        with pytest.raises(error, match=message):
            build()

    # When the Trainer sets the model up: refused in convert_module, nothing cast.
    def refused_at_setup(plugin: Any, module: Any, message: str, **kw: Any) -> None:
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        with pytest.raises(ValueError, match=message):
            trainer(tmp_path, 2, plugin, **kw).fit(module, steps_loader(2))
        after = dict(module.named_parameters())
        assert all(torch.equal(after[n].detach(), p) for n, p in before.items())
        assert all(after[n].dtype == p.dtype for n, p in before.items())

    sharded = cls("bf16-true", "cpu", weights=WeightPrecision(master="sharded"))
    refused_at_setup(sharded, Net(), "master='sharded'.*under SingleDeviceStrategy.*'ddp'")
    refused_at_setup(  # the LayerNorm's are the policy's fp32 module's: not counted
        plugin("bf16-true"), Net().bfloat16(), "4 parameters are 16-bit already.*in fp32"
    )

    class Adagrad(Net):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adagrad(self.parameters())

    refused_at_setup(cls("bf16-true", "cpu"), Adagrad(), "Adagrad")  # cast, then uncast exactly

    # ModelParallelStrategy (FSDP2, TP) would need a process group here: its convert_module.
    module = Net()
    module.trainer = SimpleNamespace(strategy=ModelParallelStrategy())  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"under ModelParallelStrategy: not covered yet.*'ddp'"):
        cls("bf16-true", "cpu").convert_module(module)
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_fp16_weights_refuse_clipping_by_value(tmp_path: Path, one_thread: None) -> None:
    """fp16 gradients stay scaled until the step divides them in fp32: clipping by value
    would need them unscaled in fp16, and is refused naming norm clipping."""
    import torch

    from tests.lightning_weights_scenarios import fit

    with pytest.raises(ValueError, match="gradient_clip_algorithm='norm'"):
        fit(tmp_path, "16-true", 2, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    run, module = fit(tmp_path, "16-true", 3, gradient_clip_val=0.5)  # by norm: fine
    assert run.precision_plugin.last_grad_norm is not None
    assert all(torch.isfinite(p).all() for p in module.parameters())


# ---------------------------------------------------------------------------- 2 gloo ranks
@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    from tests.lightning_weights_scenarios import ddp_runs

    root = tmp_path_factory.mktemp("ddp_weights")
    return root, run_ranks(ddp_runs, 2, str(root), timeout=120)


def test_ddp_inf_on_one_rank_skips_the_step_on_both(
    ddp: tuple[Path, list[dict[str, Any]]],
) -> None:
    from tests.lightning_weights_scenarios import BAD, STEPS

    _, (r0, r1) = ddp
    bad = [step in BAD for step in range(STEPS)]
    for run, dtype in (("exact", "torch.bfloat16"), ("fp16", "torch.float16")):
        assert r0[run]["nonfinite"] == [False] * STEPS, "rank 0 must never see the inf itself"
        assert r1[run]["nonfinite"] == bad, "rank 1 overflows at the injected steps only"
        for r in (r0, r1):
            assert r[run]["optimizer"] == "MasterWeightOptimizer"
            assert r[run]["grad_dtypes"] == sorted(["torch.float32", dtype])  # 16-bit on the wire
            assert r[run]["skipped"] == bad and r[run]["skipped_steps"] == len(BAD), run
            assert r[run]["lr"] == pytest.approx(1e-2 * 0.9 ** (STEPS - len(BAD)))
        # The ranks began from different weights: DDP made them rank 0's, the masters followed.
        assert r0[run]["weights"] == r1[run]["weights"], run
        assert r0[run]["masters"] == r1[run]["masters"], run
    assert r0["fp16_scale"] == r1["fp16_scale"] == 2.0**10 / 2 ** len(BAD)


def test_ddp_resume_from_a_trainer_checkpoint_is_bitwise_the_uninterrupted_run(
    ddp: tuple[Path, list[dict[str, Any]]],
) -> None:
    from tests.lightning_weights_scenarios import BAD, MIDDLE, STEPS

    _, results = ddp
    for rank, r in enumerate(results):
        whole, resumed = r["exact"], r["exact_resumed"]
        assert resumed["skipped"] == [step in BAD for step in range(MIDDLE, STEPS)]
        assert resumed["skipped_steps"] == len(BAD)  # the scaler's count came back
        assert resumed["losses"] == whole["losses"][MIDDLE:], rank
        for key in ("weights", "masters", "exp_avg", "lr"):
            assert resumed[key] == whole[key], (rank, key)
        # A sharded master is the exact one bit for bit; each rank holds its share.
        sharded = r["sharded_resumed"]
        assert sharded["optimizer"] == "GatheringMasterOptimizer"
        assert sharded["losses"] == whole["losses"][MIDDLE:], rank
        assert sharded["weights"] == whole["weights"], rank
        assert sharded["masters"] and set(sharded["masters"]) < set(whole["masters"])
        for name, master in sharded["masters"].items():
            assert master == whole["masters"][name], (rank, name)
    held = [set(r["sharded_resumed"]["masters"]) for r in results]
    assert not held[0] & held[1] and held[0] | held[1] == set(results[0]["exact"]["masters"])


def test_ddp_checkpoints_hold_every_master(ddp: tuple[Path, list[dict[str, Any]]]) -> None:
    """Rank 0 writes the checkpoint: its model entries and its optimizer state hold every
    parameter's master, also when the masters are sharded over the ranks (gathered to rank 0
    for the checkpoint), and they are the uninterrupted run's."""
    import torch

    root, (r0, _) = ddp
    whole = torch.load(root / "exact_end.ckpt", weights_only=False)
    for name in ("exact_resumed_end", "sharded_resumed_end"):
        ckpt = torch.load(root / f"{name}.ckpt", weights_only=False)
        for key, value in whole["state_dict"].items():
            assert value.dtype == torch.float32, key
            assert torch.equal(ckpt["state_dict"][key], value), (name, key)
            want = r0["exact"]["masters"].get(key) or r0["exact"]["weights"][key]
            assert value.flatten().tolist() == want, key
        state = ckpt["optimizer_states"][0]["state"]
        assert sorted(state) == list(range(6)), name  # every parameter's moments
        assert sum("master" in entry for entry in state.values()) == 4, name  # the 16-bit ones
