"""DistAMPPrecision and DistAMPEnvironment with real Lightning Fabric on 2 gloo processes (CPU).

What is checked: fp16 activations on CPU (forward hook), an inf injected into one rank's gradient
skipped on both ranks and reported by the plugin (plain and fused AdamW, clipping included), the
replicas stay identical, ``fabric.save``/``fabric.load`` round-trip the scaler, the environment
adapter reads the layout distamp reads, and the example runs under torchrun.
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

from distamp import AutocastPolicy  # noqa: E402
from tests._dist import run_ranks, run_torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, BAD_STEP = 4, 2


def _train(rank: int, world: int, ckpt: str, fused: bool) -> dict[str, Any]:
    import torch
    from lightning.fabric import Fabric

    from distamp.integrations.lightning import DistAMPEnvironment, DistAMPPrecision

    plugin = DistAMPPrecision("16-mixed", device="cpu")
    env = DistAMPEnvironment()
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp", plugins=[plugin, env])
    fabric.launch()
    assert fabric.world_size == 2 and fabric.global_rank == rank
    assert fabric.strategy.precision is plugin and fabric.strategy.cluster_environment is env
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    model, opt = fabric.setup(model, opt)
    gen = torch.Generator().manual_seed(1 + rank)
    skipped, scales, norms, unchanged = [], [], [], False
    for step in range(STEPS):
        loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
        fabric.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        if step == BAD_STEP and rank == 1:  # a rank-local overflow (as a shard or hook would see)
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
        norms.append(float(plugin.clip_grad_norm_(opt, 1.0)))
        opt.step()
        opt.zero_grad()
        skipped.append(plugin.step_was_skipped)
        scales.append(plugin.scaler.get_scale())
        if step == BAD_STEP:
            unchanged = all(
                torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)
            )
    metrics = plugin.metrics_dict()
    state = {"model": model, "optimizer": opt, "scaler": plugin}
    fabric.save(ckpt, state)
    saved = plugin.scaler.state_dict()
    plugin.scaler.update(new_scale=3.0)  # clobber, then load
    fabric.load(ckpt, state)
    fabric.barrier()
    return {
        "dtypes": sorted({str(d) for d in dtypes}),
        "skipped": skipped,
        "scales": scales,
        "norms": norms,
        "unchanged_on_skip": unchanged,
        "params": [p.detach().flatten().tolist() for p in model.parameters()],
        "metrics": metrics,
        "saved": saved,
        "loaded": plugin.scaler.state_dict(),
        "node_rank": env.node_rank(),
        "local_rank": env.local_rank(),
    }


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_inf_on_one_rank_skipped_on_both(tmp_path: Path, fused: bool) -> None:
    r0, r1 = run_ranks(_train, 2, str(tmp_path / "ckpt"), fused, timeout=90)
    for rank, r in enumerate((r0, r1)):
        assert r["dtypes"] == ["torch.float16"], r["dtypes"]
        assert r["skipped"] == [k == BAD_STEP for k in range(STEPS)], r["skipped"]
        assert r["unchanged_on_skip"]
        assert r["scales"][BAD_STEP] == r["scales"][BAD_STEP - 1] / 2
        assert r["norms"][BAD_STEP] == float("inf")
        assert r["metrics"]["skipped_steps"] == 1
        assert r["metrics"]["overflow_rate"] == pytest.approx(1 / STEPS)
        assert r["metrics"]["grad_norm"] == pytest.approx(r["norms"][-1])
        assert r["loaded"] == r["saved"] and r["saved"]["skipped_steps"] == 1
        assert (r["node_rank"], r["local_rank"]) == (0, rank)
    assert r0["params"] == r1["params"]
    assert r0["norms"] == r1["norms"]


def test_environment_reads_distamp_detection() -> None:
    from distamp.integrations.lightning import DistAMPEnvironment

    slurm = {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_TASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_NNODES": "2",
        "MASTER_PORT": "29511",
    }
    env = DistAMPEnvironment(slurm)
    assert env.dist_env.launcher == "slurm" and env.main_address == "n1"
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (5, 8, 1, 1)
    assert env.creates_processes_externally and env.main_port == 29511
    with pytest.raises(ValueError, match="world size 4"):
        env.set_world_size(4)
    single = DistAMPEnvironment({})
    assert not single.creates_processes_externally and single.world_size() == 1
    assert single.main_address == "127.0.0.1"


def test_bad_arguments() -> None:
    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPPrecision

    with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'"):
        DistAMPPrecision("32-true")
    with pytest.raises(ValueError, match="does not use a scaler"):
        DistAMPPrecision("bf16-mixed", device="cpu", scaler=DistributedGradScaler("cpu"))


def test_example_runs(tmp_path: Path) -> None:
    """launch/lightning_example.py end to end under torchrun, 2 processes, fused AdamW."""
    out = run_torchrun(
        ROOT / "launch" / "lightning_example.py",
        *("--steps", "4", "--log-interval", "2", "--fused", "--out", str(tmp_path)),
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    last = lines[-1]
    assert last["loss_scale"] > 0 and last["tokens_per_s"] > 0 and last["grad_norm"] > 0
    assert json.loads(out.strip().splitlines()[-1])["world_size"] == 2
    assert (tmp_path / "state.ckpt").exists()


def _policy_dtypes(rank: int, world: int) -> dict[str, str]:
    import torch
    from lightning.fabric import Fabric

    from distamp.integrations.lightning import DistAMPPrecision
    from distamp.precision.policy import AutocastPolicy

    plugin = DistAMPPrecision("16-mixed", device="cpu", policy=AutocastPolicy("fp16"))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    seen: dict[str, str] = {}

    def hook(name: str) -> Any:
        def record(_m: Any, _i: Any, out: torch.Tensor) -> None:
            seen[name] = str(out.dtype)

        return record

    for name, mod in model.named_children():
        mod.register_forward_hook(hook(name))
    model = fabric.setup_module(model)
    model(torch.randn(2, 8))
    return seen


def test_policy_keeps_its_modules_in_fp32() -> None:
    (seen,) = run_ranks(_policy_dtypes, 1, timeout=60)
    assert seen == {"0": "torch.float16", "1": "torch.float32", "2": "torch.float16"}


def _fabric_checkpointing(rank: int, world: int) -> dict[str, Any]:
    from recipe_scenarios import plugin_run

    return {ac: plugin_run("fabric", ac) for ac in (False, True)}


def test_fabric_policy_holds_under_activation_checkpointing() -> None:
    """The blocks checkpointed as Lightning's ``activation_checkpointing_policy`` does (its FSDP
    and ModelParallel strategies need CUDA; the wrapping is torch's, the same here): bitwise
    the run without it."""
    (runs,) = run_ranks(_fabric_checkpointing, 1, timeout=240)
    assert runs[True]["wrappers"] == 4 and runs[False]["wrappers"] == 0
    assert runs[True]["digest"] == runs[False]["digest"]
    assert runs[True]["losses"] == runs[False]["losses"]


def test_fabric_plugin_refuses_a_policy_of_another_precision() -> None:
    pytest.importorskip("lightning", reason="needs distamp[lightning]")
    from distamp.integrations.lightning import DistAMPPrecision

    with pytest.raises(ValueError, match=r"^the policy is for fp16.*same precision.*no loss") as e:
        DistAMPPrecision("bf16-mixed", device="cpu", policy=AutocastPolicy("fp16", adaptive=True))
    # the cause first, the policy in short at the end (its precision and what differs)
    assert str(e.value).endswith("policy: AutocastPolicy('fp16'; adaptive))"), str(e.value)
    DistAMPPrecision("bf16-mixed", device="cpu", policy=AutocastPolicy("bf16"))  # agrees


# ---------------------------------------------------------------------------- step guards
def _fabric_guarded(rank: int, world: int, what: str) -> dict[str, Any]:
    """Fabric under DDP with the plug-in's guards: ``what="spike"``: rank 1's loss x1e3 at one
    step; ``what="limit"``: a +inf gradient element on rank 1 at every step."""
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
    from lightning.fabric import Fabric

    from distamp import ConsecutiveSkipsError, DistributedGradScaler
    from distamp.integrations.lightning import DistAMPPrecision

    spike = what == "spike"
    plugin = DistAMPPrecision(
        "16-mixed",
        device="cpu",
        scaler=DistributedGradScaler("cpu", init_scale=INIT_SCALE),
        spike_guard=GUARD if spike else None,
        max_consecutive_skips=None if spike else LIMIT,
    )
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp", plugins=[plugin])
    fabric.launch()
    net = model()
    net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    skipped, kept = [], []
    try:
        for step in range(STEPS):
            fabric.backward(loss_of(net, batch(rank, step), rank if spike else 0, step))
            if not spike:
                inject_inf(net, rank)
            before = snapshot(net)
            opt.step()
            opt.zero_grad()
            skipped.append(plugin.step_was_skipped)
            kept.append(unchanged(before, net))
    except ConsecutiveSkipsError as exc:
        return {"raised_at": len(skipped), "message": str(exc)}
    same_on_every_rank(digest(net))
    scale = plugin.scaler.get_scale()
    return {"skipped": skipped, "kept": kept, "metrics": plugin.metrics_dict(), "scale": scale}


def test_fabric_spike_on_one_rank_is_skipped_on_both() -> None:
    """Rank 1's loss x1e3 at one step: that step (only) is skipped on both ranks, the
    parameters unchanged by it and bitwise equal across ranks at the end, one spike skip and no
    overflow skip in the metrics."""
    from guard_scenarios import INIT_SCALE, SPIKE_AT, STEPS

    for r in run_ranks(_fabric_guarded, 2, "spike", timeout=120):
        assert r["skipped"] == [k == SPIKE_AT for k in range(STEPS)], r["skipped"]
        assert r["kept"] == r["skipped"], r["kept"]  # parameters unchanged exactly then
        assert r["metrics"]["spike_skips"] == 1 and r["metrics"]["skipped_steps"] == 0
        assert r["scale"] == INIT_SCALE  # a spike does not back the scale off


def test_fabric_consecutive_skips_raise_on_both_ranks() -> None:
    """A +inf gradient element on rank 1 at every step: ConsecutiveSkipsError on both ranks at
    the same step (the streak is read every 8 steps without a spike guard)."""
    from guard_scenarios import LIMIT

    results = run_ranks(_fabric_guarded, 2, "limit", timeout=120)
    assert [r["raised_at"] for r in results] == [7, 7], results
    for r in results:
        assert f"max_consecutive_skips={LIMIT}" in r["message"], r["message"]
        assert "overflow at iteration" in r["message"], r["message"]


def test_fabric_guard_settings_refused_naming_the_field() -> None:
    from distamp.integrations.lightning import DistAMPPrecision

    with pytest.raises(ValueError, match="max_consecutive_skips=0"):
        DistAMPPrecision("16-mixed", device="cpu", max_consecutive_skips=0)
    with pytest.raises(TypeError, match="spike_guard=3"):
        DistAMPPrecision("16-mixed", device="cpu", spike_guard=3)  # type: ignore[arg-type]


def test_fabric_a_replaced_scaler_is_the_one_stepped_and_read() -> None:
    """As Lightning's own plug-ins: ``plugin.scaler`` replaced after construction (a wrapped
    distamp scaler, a plain ``torch.amp.GradScaler``) is the one that scales, unscales and
    steps, and the skip is read from it, with the outcome of the scaler given at construction."""
    from unittest.mock import Mock

    import torch
    from lightning.fabric import Fabric

    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import DistAMPPrecision

    steps, bad = 4, 1
    outcomes = {}
    for kind in ("given", "mock", "torch"):
        plugin = DistAMPPrecision(
            "16-mixed", device="cpu", scaler=DistributedGradScaler("cpu", init_scale=2.0**8)
        )
        if kind == "mock":
            plugin.scaler = Mock(wraps=plugin.scaler)
        elif kind == "torch":
            plugin.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        net, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        skipped = []
        for step in range(steps):
            loss = net(torch.randn(4, 8, generator=torch.Generator().manual_seed(step)))
            loss = loss.float().pow(2).mean()
            fabric.backward(loss * float("inf") if step == bad else loss)
            plugin.clip_grad_norm_(opt, 1.0)
            opt.step()
            opt.zero_grad()
            skipped.append(plugin.step_was_skipped)
        assert skipped == [k == bad for k in range(steps)], (kind, skipped)
        assert plugin.scaler.get_scale() == 2.0**7, kind  # backed off once
        if kind == "mock":
            assert plugin.scaler.scale.call_count == steps
            assert plugin.scaler.step.call_count == plugin.scaler.update.call_count == steps
        outcomes[kind] = [p.detach().clone() for p in net.parameters()]
    for kind in ("mock", "torch"):
        for got, want in zip(outcomes[kind], outcomes["given"], strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
