"""Numeric monitor and adaptive precision: a module whose fp16 output overflows for some inputs.

Static fp16 names the module and stalls (every step skipped); an adaptive policy promotes it to
fp32 at the same step on every rank and ends within 1% of the fp32 run. Real engines, real gloo
process groups; fp16 autocast runs on CPU.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import medium_scenarios as medium
import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import distamp
from distamp import AutocastPolicy
from distamp.observe.numerics import NumericMonitor
from distamp.precision.adaptive import AdaptiveRules

D, STEPS = 16, 150
RULES = AdaptiveRules(interval=2, skips=2, window=4, max_promoted_fraction=0.5)


class Hot(nn.Module):
    """A linear map normalised per row: in fp16 a large input row gives an inf pre-activation,
    inf / inf = NaN; in fp32 the row is fine. It owns its parameters (the watched module)."""

    def __init__(self) -> None:
        super().__init__()
        fc = nn.Linear(D, 8)
        self.weight, self.bias = fc.weight, fc.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias) * 16
        return y / (1 + y.abs().amax(-1, keepdim=True))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hot, self.mid, self.out = Hot(), nn.Linear(8, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.hot(x))))


_W = torch.randn(D, 1, generator=torch.Generator().manual_seed(1))


def batch(
    k: int, rank: int = 0, spiky: bool = True, n: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``k`` of ``rank``; ``spiky``: 4 rows scaled by 6e4, clamped to fp16's range
    (their pre-activation overflows inside ``hot``)."""
    g = torch.Generator().manual_seed(1000 * (rank + 1) + k)
    x = torch.randn(n, D, generator=g)
    if spiky:
        x[:4] = (x[:4] * 6e4).clamp(-6e4, 6e4)  # fp16-representable inputs
    xn = x / (1 + x.abs().amax(-1, keepdim=True))
    y = torch.tanh(4 * xn @ _W) + 0.3 * torch.randn(n, 1, generator=g)
    return x, y


def make(
    precision: str,
    adaptive: bool,
    *,
    strategy: str = "none",
    numerics: int | None = None,
    rules: AdaptiveRules = RULES,
) -> tuple[distamp.DistAMP, nn.Module, AutocastPolicy | None]:
    torch.manual_seed(0)
    net = Net()
    policy = AutocastPolicy(precision, adaptive=rules) if adaptive else None
    amp = distamp.DistAMP(precision, strategy=strategy, policy=policy, numerics_interval=numerics)
    amp.setup(
        net,
        lambda p: torch.optim.AdamW(p, lr=3e-2),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / (STEPS + 1)),
    )  # a decaying rate: both runs settle, so their final losses compare
    return amp, net, policy


def train(amp: distamp.DistAMP, start: int, stop: int, rank: int = 0, spiky: bool = True) -> None:
    for k in range(start, stop):
        x, y = batch(k, rank, spiky)
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)


def eval_loss(net: nn.Module) -> float:
    x, y = batch(99_999, spiky=False, n=4096)
    with torch.no_grad():
        return F.mse_loss(net(x), y).item()


@functools.cache
def fp32_loss() -> float:
    amp, net, _ = make("fp32", False)
    train(amp, 0, STEPS)
    amp.close()
    return eval_loss(net)


# ---------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window": 0}, "window"),
        ({"skips": 0}, "skips"),
        ({"interval": 0}, "interval"),
        ({"max_promoted_fraction": 0.0}, "max_promoted_fraction"),
        ({"max_promoted_fraction": 1.5}, "max_promoted_fraction"),
        ({"demote_below": 0.9}, "demote_below"),
        ({"skips": 5, "window": 3}, "skips"),
    ],
)
def test_bad_rules_name_the_field(kwargs: dict[str, float], field: str) -> None:
    with pytest.raises(ValueError, match=f"AdaptiveRules.{field}="):
        AdaptiveRules(**kwargs)  # type: ignore[arg-type]


def test_adaptive_with_fp32_is_refused() -> None:
    with pytest.raises(ValueError, match="adaptive=True with precision='fp32'"):
        AutocastPolicy("fp32", adaptive=True)
    with pytest.raises(ValueError, match="adaptive='yes'"):
        AutocastPolicy("fp16", adaptive="yes")  # type: ignore[arg-type]


def test_monitor_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval=0"):
        NumericMonitor(Net(), compute_dtype=torch.float16, interval=0)


# ---------------------------------------------------------------------------- single process


def test_static_fp16_names_the_module_and_stalls() -> None:
    amp, net, _ = make("fp16", False, numerics=2)
    before = eval_loss(net)
    train(amp, 0, 20)
    stats = amp.numerics()
    assert amp.scaler.skipped_steps == 20  # every step skipped: the run makes no progress
    assert eval_loss(net) == before
    assert stats is not None and stats.step == 20
    assert [m for _, m in stats.skips] == ["hot", "hot"]  # the last report's two skips
    assert stats.headroom["hot"] == float("inf")
    assert set(stats.underflow) == {n for n, _ in net.named_parameters()}
    metrics = stats.as_metrics()
    assert metrics["numerics/skips"] == 2.0 and "numerics/headroom/hot" in metrics
    amp.close()


def test_embedding_underflow_counts_the_rows_looked_up() -> None:
    """A batch that looks up 4 of 256 rows leaves the other rows' gradient zero by
    construction: the embedding's underflow is measured over the 4 rows (0 here), not 98% of
    the weight. A Linear's exact zeros still count."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 4))
    with torch.no_grad():
        net[1].weight[0] = 0.0  # output 0 unused: its weight row's gradient is zero
    amp = distamp.DistAMP("fp16", strategy="none", numerics_interval=1)
    amp.setup(net, lambda p: torch.optim.SGD(p, lr=1e-3))
    idx = torch.tensor([[3, 7, 7, 40, 200]])
    with amp.autocast():
        loss = amp.model(idx)[..., 1:].float().square().mean()
    amp.backward_and_step(loss)
    stats = amp.numerics()
    assert stats is not None and stats.step == 1
    assert stats.underflow["0.weight"] == 0.0, stats.underflow
    assert stats.underflow["1.weight"] == 0.25, stats.underflow  # a Linear: every element
    amp.close()


def test_adaptive_promotes_and_matches_fp32() -> None:
    amp, net, policy = make("fp16", True)
    train(amp, 0, STEPS)
    assert policy is not None and policy.adaptive is not None
    changes = policy.adaptive.changes
    assert [(c.step, c.module, c.before, c.after) for c in changes] == [(2, "hot", "fp16", "fp32")]
    assert "caused 2 of the last 2 skipped steps" in changes[0].reason
    assert amp.scaler.skipped_steps == 2
    loss, ref = eval_loss(net), fp32_loss()
    assert abs(loss - ref) / ref < 0.01, (loss, ref)
    # the audit lists the change, and the promoted module computes in fp32
    report = distamp.audit(net, batch(0)[0], policy=policy)
    assert "step 2: hot fp16 -> fp32" in str(report)
    assert report.record("hot").output_dtypes == ["float32"]
    assert report.record("mid").output_dtypes == ["float16"]
    amp.close()


def test_cap_refuses_with_a_warning_while_the_run_still_steps() -> None:
    """Spikes on every third batch: the run steps between them, so the cap holds (``hot`` is
    30% of the parameters) and the skips go on, named in the warning."""
    torch.manual_seed(0)
    policy = AutocastPolicy(
        "fp16", adaptive=AdaptiveRules(interval=2, skips=2, max_promoted_fraction=0.1)
    )
    amp = distamp.DistAMP("fp16", strategy="none", policy=policy)
    amp.setup(Net(), lambda p: torch.optim.AdamW(p, lr=2e-2))
    with pytest.warns(RuntimeWarning, match="not promoting 'hot'.*max_promoted_fraction=0.1"):
        for k in range(12):
            train(amp, k, k + 1, spiky=k % 3 == 0)
    assert policy.adaptive is not None and policy.adaptive.changes == []
    assert amp.scaler.skipped_steps == 4
    amp.close()


def _dead_run_rescued(rank: int, world: int) -> dict[str, object]:
    """The default rules, ``hot`` (29.8% of the parameters) over the default cap of 25%, and only
    rank 1's data overflowing; then the same run in fp32."""
    rules = AdaptiveRules()
    amp, net, policy = make("fp16", True, strategy="ddp", rules=rules)
    with pytest.warns(RuntimeWarning, match=r"promoting 'hot'.*over the cap.*29\.8% of the"):
        train(amp, 0, STEPS, rank=rank, spiky=rank == 1)
    assert policy is not None and policy.adaptive is not None
    reason = policy.adaptive.changes[0].reason
    loss = eval_loss(net)
    out = _outcome(amp, net, policy)
    ref_amp, ref_net, _ = make("fp32", False, strategy="ddp")
    train(ref_amp, 0, STEPS, rank=rank, spiky=rank == 1)
    ref = eval_loss(ref_net)
    ref_amp.close()
    return {**out, "loss": loss, "fp32": ref, "reason": reason}


def test_default_cap_yields_when_no_step_can_be_taken() -> None:
    """A module over ``max_promoted_fraction`` that makes every step skip is promoted at the
    first report anyway: 140 of 150 steps step (not 0), on both ranks alike, and the run ends
    within 5% of fp32 (the same run, same data, in fp32)."""
    r0, r1 = run_ranks(_dead_run_rescued, 2, timeout=240)
    assert r0["changes"] == r1["changes"] == [(10, "hot")]
    assert r0["skipped"] == r1["skipped"] == 10
    assert r0["params"] == r1["params"]
    assert "no step could be taken" in str(r0["reason"])
    loss, ref = float(r0["loss"]), float(r0["fp32"])  # type: ignore[arg-type]
    assert abs(loss - ref) / ref < 0.05, (loss, ref)


def test_save_resume_is_bitwise_equal(tmp_path: Path) -> None:
    amp, net, policy = make("fp16", True)
    train(amp, 0, 30)
    ref = [p.detach().clone() for p in net.parameters()]
    ref_changes = list(policy.adaptive.changes)  # type: ignore[union-attr]
    amp.close()

    amp, _, _ = make("fp16", True)
    train(amp, 0, 11)  # a save in the middle of a report window (interval 2)
    amp.save_state(tmp_path)
    amp.close()
    amp, net, policy = make("fp16", True)
    assert amp.load_state(tmp_path)
    assert policy is not None and policy.adaptive is not None
    assert policy.adaptive.promoted == ("hot",)  # replayed before the first resumed step
    train(amp, 11, 30)
    assert policy.adaptive.changes == ref_changes
    for a, b in zip(ref, net.parameters(), strict=True):
        assert torch.equal(a, b)
    amp.close()


# ---------------------------------------------------------------------------- two ranks


def _outcome(
    amp: distamp.DistAMP, net: nn.Module, policy: AutocastPolicy | None
) -> dict[str, object]:
    """What the multi-rank tests compare (whole parameters, gathered where sharded), then the
    engine closed. Plain lists: tensors through the result queue outlive their sender's shared
    memory."""
    assert policy is not None and policy.adaptive is not None
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in net.parameters()]
    out = {
        "changes": [(c.step, c.module) for c in policy.adaptive.changes],
        "skipped": amp.scaler.skipped_steps,
        "params": [p.detach().flatten().tolist() for p in params],
    }
    amp.close()
    return out


def _two_ranks(rank: int, world: int) -> dict[str, object]:
    amp, net, policy = make("fp16", True, strategy="ddp")
    train(amp, 0, 40, rank=rank, spiky=rank == 1)  # only rank 1's data overflows
    headroom = amp.numerics().headroom  # type: ignore[union-attr]
    return {**_outcome(amp, net, policy), "headroom": headroom}


def test_two_ranks_promote_together() -> None:
    r0, r1 = run_ranks(_two_ranks, 2, timeout=240)
    assert r0["changes"] == r1["changes"] == [(2, "hot")]
    assert r0["skipped"] == r1["skipped"] == 2
    assert r0["headroom"] == r1["headroom"]  # agreed numbers
    assert r0["params"] == r1["params"]  # bitwise: fp32 values as Python floats


def test_warnings_are_not_errors() -> None:
    """The monitor alone (no adaptive policy) changes nothing in the run."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp, net, _ = make("fp16", False, numerics=5)
        train(amp, 0, 5, spiky=False)
        ref_amp, ref_net, _ = make("fp16", False)
        train(ref_amp, 0, 5, spiky=False)
    for a, b in zip(net.parameters(), ref_net.parameters(), strict=True):
        assert torch.equal(a, b)
    amp.close()
    ref_amp.close()


def _fsdp2(rank: int, world: int) -> dict[str, object]:
    amp, net, policy = make("fp16", True, strategy="fsdp2")
    train(amp, 0, 12, rank=rank, spiky=rank == 1)
    return _outcome(amp, net, policy)


def test_fsdp2_promotes_inside_the_unit() -> None:
    """FSDP2 gathers parameters in fp16: the promoted module upcasts them too, not re-wrapped."""
    r0, r1 = run_ranks(_fsdp2, 2, timeout=240)
    assert r0["changes"] == r1["changes"] == [(2, "hot")]
    assert r0["skipped"] == r1["skipped"] == 2  # training goes on after the promotion
    assert r0["params"] == r1["params"]


def test_headroom_rule_demotion_and_hysteresis() -> None:
    """The rules on hand-made agreed reports: promote on headroom, demote when calm, and a
    module promoted a second time stays."""
    from distamp.observe.numerics import NumericStats
    from distamp.precision.adaptive import AdaptivePrecision

    rules = AdaptiveRules(patience=2, demote=True, calm_reports=2, max_promoted_fraction=0.5)
    adaptive = AdaptivePrecision(rules, "fp16")
    adaptive.bind(Net())

    def report(step: int, hot: float) -> list[tuple[int, str, str]]:
        stats = NumericStats(step, headroom={"hot": hot, "mid": 0.01, "out": 0.01})
        return [(c.step, c.before, c.after) for c in adaptive.decide(stats)]

    assert report(10, 0.7) == []  # one hot report: patience is 2
    assert report(20, 0.8) == [(20, "fp16", "fp32")]
    assert report(30, 0.01) == [] and report(40, 0.01) == [(40, "fp32", "fp16")]
    assert adaptive.promoted == ()
    report(50, 0.9)
    assert report(60, 0.9) == [(60, "fp16", "fp32")]
    assert [report(s, 0.0) for s in (70, 80, 90)] == [[], [], []]  # pinned: never demoted
    assert adaptive.promoted == ("hot",)
    inf = NumericStats(100, headroom={"mid": float("inf")})
    assert adaptive.decide(inf) == adaptive.decide(inf) == []  # the skip rule's business


def test_torch_compile_recompiles_once_per_promotion() -> None:
    """A compiled model: the promotion (an instance forward with autocast off) is traced whole,
    with no graph break, costs one recompile, and trains as the eager model does."""
    import torch._dynamo

    def run(compiled: bool) -> tuple[list[tuple[int, str]], list[int], list[torch.Tensor]]:
        torch._dynamo.reset()
        graphs: list[int] = []

        def backend(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        amp, net, policy = make("fp16", True)
        model = torch.compile(amp.model, backend=backend) if compiled else amp.model
        per_step = []
        for k in range(12):
            x, y = batch(k)
            with amp.autocast():
                loss = F.mse_loss(model(x).float(), y)
            amp.backward_and_step(loss)
            per_step.append(len(graphs))
        assert policy is not None and policy.adaptive is not None
        changes = [(c.step, c.module) for c in policy.adaptive.changes]
        params = [p.detach().clone() for p in net.parameters()]
        amp.close()
        return changes, per_step, params

    torch._dynamo.utils.counters.clear()
    changes, graphs, params = run(compiled=True)
    assert not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"]
    )
    eager_changes, _, eager_params = run(compiled=False)
    assert changes == eager_changes == [(2, "hot")]
    # change.step 2 = after two updates: the promoted module first runs in the third forward;
    # the one recompile before it is the monitor's first report (its hooks' state)
    assert graphs[2] - graphs[1] == 1, graphs
    assert graphs[2:] == [graphs[2]] * (len(graphs) - 2), graphs  # nothing recompiles after
    for p, q in zip(params, eager_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _tensor_parallel(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    net = Net()
    parallelize_module(net, mesh, {"mid": ColwiseParallel(), "out": RowwiseParallel()})
    policy = AutocastPolicy("fp16", adaptive=RULES)
    amp = distamp.DistAMP("fp16", mesh=mesh, policy=policy)
    amp.setup(net, lambda p: torch.optim.AdamW(p, lr=3e-2))
    train(amp, 0, 12)  # tensor parallel: both ranks see the same batches
    return _outcome(amp, net, policy)


def test_tensor_parallel_promotes_on_every_rank_as_one_process_does() -> None:
    """mid/out tensor-parallel (DTensor) beside the plain module that overflows: the decision
    is the same on both ranks and the same as one process training the whole model."""
    r0, r1 = run_ranks(_tensor_parallel, 2, timeout=240)
    torch.manual_seed(0)
    net = Net()
    policy = AutocastPolicy("fp16", adaptive=RULES)
    amp = distamp.DistAMP("fp16", strategy="none", policy=policy)
    amp.setup(net, lambda p: torch.optim.AdamW(p, lr=3e-2))
    train(amp, 0, 12)
    assert policy.adaptive is not None
    single = [(c.step, c.module) for c in policy.adaptive.changes]
    assert r0["changes"] == r1["changes"] == single == [(2, "hot")]
    assert r0["skipped"] == r1["skipped"] == amp.scaler.skipped_steps == 2
    assert r0["params"] == r1["params"]  # gathered: the same whole model on both ranks
    # fp16 matmuls of shards round differently from the whole one: close, not bitwise
    for got, want in zip(r0["params"], net.parameters(), strict=True):  # type: ignore[call-overload]
        diff = (torch.tensor(got) - want.detach().flatten()).abs().max().item()
        assert diff < 1e-3, diff
    amp.close()


def _medium_gpt(rank: int, world: int) -> dict[str, object]:
    model = medium.gpt()
    medium.make_spiky(model, 5, 1e6 if rank == 1 else 1.0)  # overflows on rank 1 alone
    policy = AutocastPolicy("fp16", adaptive=AdaptiveRules(interval=1, skips=1))
    amp = distamp.DistAMP("fp16", strategy="fsdp2", policy=policy, max_grad_norm=1.0, device="cpu")
    amp.setup(model, medium.optimizer)
    stepped = medium.train(amp, medium.data(rank, world), 0, 2)
    stats = amp.numerics()
    assert stats is not None and policy.adaptive is not None
    out = {
        "changes": [(c.step, c.module) for c in policy.adaptive.changes],
        "stepped": stepped,
        "digest": medium.digest(model),
        "headroom": stats.headroom,
        "underflow": stats.underflow,
    }
    amp.close()
    return out


@pytest.mark.slow
def test_medium_gpt_promotes_one_linear_among_twelve_blocks() -> None:
    """The main job's medium GPT under FSDP2 (13 units, 76 watched modules, 149 parameters),
    ``blocks.5.fc`` overflowing on rank 1's forward only: promoted at the first report on both
    ranks, the next step steps; the statistics agree and read sensibly."""
    r0, r1 = run_ranks(_medium_gpt, 2, timeout=240)
    assert r0["changes"] == r1["changes"] == [(1, "blocks.5.fc")]
    assert r0["stepped"] == r1["stepped"] == [False, True]
    assert r0["digest"] == r1["digest"]
    assert r0["headroom"] == r1["headroom"] and r0["underflow"] == r1["underflow"]
    headroom, underflow = r0["headroom"], r0["underflow"]
    assert len(headroom) == medium.MODULES and len(underflow) == medium.PARAMS  # type: ignore[arg-type]
    assert max(headroom.values()) < 1e-2  # type: ignore[union-attr]  # all finite, promoted
    assert underflow["tok.weight"] < 0.05  # type: ignore[index]  # looked-up rows only
