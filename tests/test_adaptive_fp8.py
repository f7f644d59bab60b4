"""Adaptive fp8: a float8 layer whose input outruns e4m3's dynamic range falls back to bf16.

One element a batch of the first layer's input is 1e6. torchao scales the input tensorwise
(448 / amax), so every value under about 2.2 lands below half e4m3's smallest subnormal and
flushes to zero: static fp8 trains that layer on an all-but-empty input. The monitor reports the
flushed fraction, the adaptive rule promotes the layer fp8 -> bf16 (a plain bf16 linear on the
same weight) and the run ends within 2% of the bf16 run. torchao float8 runs on CPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import distamp
from distamp import AutocastPolicy
from distamp.precision.adaptive import AdaptiveRules

D, STEPS = 64, 150
RULES = AdaptiveRules(interval=2, patience=1, max_promoted_fraction=0.6)
_W = torch.randn(D, 1, generator=torch.Generator().manual_seed(1))


def _torchao() -> Any:
    return pytest.importorskip("torchao.float8", reason="precision='fp8' needs torchao")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide, self.mid, self.out = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.wide(x)))))


def batch(k: int, n: int = 64, spike: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``k``; ``spike``: one input element is 1e6 (bf16-representable, e4m3 is not wide
    enough to keep it and the rest)."""
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randn(n, D, generator=g)
    y = torch.tanh(x @ _W / 2) + 0.3 * torch.randn(n, 1, generator=g)
    if spike:
        x[0, 0] = 1e6
    return x, y


def make(
    precision: str, adaptive: bool
) -> tuple[distamp.DistAMP, nn.Module, AutocastPolicy | None]:
    torch.manual_seed(0)
    net = Net()
    policy = (
        AutocastPolicy("fp8", fp8_min_features=16, adaptive=RULES if adaptive else False)
        if precision == "fp8"
        else None
    )
    amp = distamp.DistAMP(
        precision,
        strategy="none",
        policy=policy,
        numerics_interval=None if adaptive else 2,
        device="cpu",
    )
    amp.setup(
        net,
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / (STEPS + 1)),
    )
    return amp, net, policy


def train(amp: distamp.DistAMP, start: int, stop: int) -> None:
    for k in range(start, stop):
        x, y = batch(k)
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)


def eval_loss(amp: distamp.DistAMP) -> float:
    x, y = batch(99_999, n=2048, spike=False)
    with torch.no_grad(), amp.autocast():
        return F.mse_loss(amp.model(x).float(), y).item()


@functools.cache
def bf16_loss() -> float:
    amp, _, _ = make("bf16", False)
    train(amp, 0, STEPS)
    loss = eval_loss(amp)
    amp.close()
    return loss


@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_bad_flush_limit_names_the_field(limit: float) -> None:
    with pytest.raises(ValueError, match=r"AdaptiveRules\.fp8_flush_limit="):
        AdaptiveRules(fp8_flush_limit=limit)


def test_static_fp8_reports_the_flush_and_degrades() -> None:
    _torchao()
    amp, net, _ = make("fp8", False)
    train(amp, 0, STEPS)
    stats = amp.numerics()
    assert stats is not None and set(stats.fp8_flush) == {"wide", "mid"}
    # the monitor's figure is what a real e4m3 cast of the last batch's input does
    x = batch(STEPS - 1)[0].to(torch.bfloat16).float()
    scaled = (x * (448.0 / x.abs().amax())).to(torch.float8_e4m3fn)
    flushed = ((scaled.float() == 0) & (x != 0)).sum() / (x != 0).sum()
    assert stats.fp8_flush["wide"] == pytest.approx(flushed.item(), abs=1e-6)
    assert stats.fp8_flush["wide"] > 0.9 and stats.fp8_flush["mid"] < 0.01
    assert "numerics/fp8_flush/wide" in stats.as_metrics()
    assert eval_loss(amp) > 1.5 * bf16_loss()
    amp.close()
    del net


def test_adaptive_fp8_falls_back_to_bf16_and_matches_bf16() -> None:
    _torchao()
    amp, net, policy = make("fp8", True)
    train(amp, 0, STEPS)
    assert policy is not None and policy.adaptive is not None
    changes = [(c.step, c.module, c.before, c.after) for c in policy.adaptive.changes]
    assert changes == [(2, "wide", "fp8", "bf16")]
    assert "flushes to zero in e4m3" in policy.adaptive.changes[0].reason
    loss, ref = eval_loss(amp), bf16_loss()
    assert abs(loss - ref) / ref < 0.02, (loss, ref)
    report = distamp.audit(net, batch(0)[0], policy=policy)
    assert "step 2: wide fp8 -> bf16" in str(report)
    # the promoted layer is a bf16 linear on its own weight; the other stays float8
    x = torch.randn(4, D, dtype=torch.bfloat16)
    with torch.no_grad():
        ref_out = F.linear(x, net.wide.weight.bfloat16(), net.wide.bias.bfloat16())
        assert torch.equal(net.wide(x), ref_out)
        assert not torch.equal(
            net.mid(x), F.linear(x, net.mid.weight.bfloat16(), net.mid.bias.bfloat16())
        )
    amp.close()


def test_resume_replays_the_fallback_bitwise(tmp_path: Path) -> None:
    _torchao()
    amp, net, policy = make("fp8", True)
    train(amp, 0, 16)
    ref = [p.detach().clone() for p in net.parameters()]
    ref_changes = list(policy.adaptive.changes)  # type: ignore[union-attr]
    amp.close()

    amp, _, _ = make("fp8", True)
    train(amp, 0, 7)  # after the promotion, in the middle of a report window
    amp.save_state(tmp_path)
    amp.close()
    amp, net, policy = make("fp8", True)
    assert amp.load_state(tmp_path)
    assert policy is not None and policy.adaptive is not None
    assert policy.adaptive.promoted == ("wide",)  # replayed before the first resumed step
    train(amp, 7, 16)
    assert policy.adaptive.changes == ref_changes
    for a, b in zip(ref, net.parameters(), strict=True):
        assert torch.equal(a, b)
    amp.close()


def _fsdp2_float8_gather(rank: int, world: int) -> list[str]:
    out = []
    for gather in (None, False):  # None: the default, float8 all-gather under FSDP2
        policy = AutocastPolicy("fp8", fp8_min_features=16, adaptive=True, fp8_all_gather=gather)
        amp = distamp.DistAMP("fp8", strategy="fsdp2", policy=policy, device="cpu")
        try:
            amp.setup(Net(), lambda p: torch.optim.AdamW(p))
            out.append("ok")
        except ValueError as e:
            out.append(str(e))
    return out


def test_fsdp2_float8_all_gather_is_refused() -> None:
    """Float8-gathered weights have no bf16 linear to fall back on: refused, naming the fix."""
    _torchao()
    (refused, plain), *_ = run_ranks(_fsdp2_float8_gather, 1, timeout=180)
    assert "'mid' has its weight all-gathered in float8 by FSDP2" in refused
    assert "fp8_all_gather=False" in refused
    assert plain == "ok"


def _two_ranks(rank: int, world: int) -> dict[str, object]:
    torch.manual_seed(0)
    net = Net()
    policy = AutocastPolicy("fp8", fp8_min_features=16, adaptive=RULES)
    amp = distamp.DistAMP("fp8", strategy="ddp", policy=policy, device="cpu")
    amp.setup(net, lambda p: torch.optim.AdamW(p, lr=3e-3))
    for k in range(8):
        x, y = batch(100 * rank + k, spike=rank == 1)  # only rank 1's input has the outlier
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)
    assert policy.adaptive is not None
    stats = amp.numerics()
    out = {
        "changes": [(c.step, c.module, c.before, c.after) for c in policy.adaptive.changes],
        "flush": None if stats is None else stats.fp8_flush,
        "params": [p.detach().flatten().tolist() for p in net.parameters()],
    }
    amp.close()
    return out


def test_two_ranks_fall_back_together() -> None:
    """The outlier is in one rank's data: the agreed flush fraction promotes on both ranks."""
    _torchao()
    r0, r1 = run_ranks(_two_ranks, 2, timeout=240)
    assert r0["changes"] == r1["changes"] == [(2, "wide", "fp8", "bf16")]
    assert r0["flush"] == r1["flush"] and r0["flush"]["wide"] > 0.9  # type: ignore[index]
    assert r0["params"] == r1["params"]


def _layout(rank: int, world: int, layout: str) -> dict[str, object]:
    """Adaptive fp8 on 2 ranks, the same data on both (so the run is the one-process run):
    "fsdp2" without float8 all-gather, or "tp" (``wide`` and ``mid`` column- and row-parallel
    through distamp's float8 plan)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from distamp.precision.fp8 import convert_for_fp8
    from distamp.precision.fp8_parallel import fp8_tp_plan

    torch.manual_seed(0)
    net = Net()
    policy = AutocastPolicy("fp8", fp8_min_features=16, adaptive=RULES, fp8_all_gather=False)
    kwargs: dict[str, Any] = {"strategy": "fsdp2"}
    if layout == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        convert_for_fp8(net, policy)
        plan = fp8_tp_plan(net, {"wide": ColwiseParallel(), "mid": RowwiseParallel()})
        parallelize_module(net, mesh, plan)
        kwargs = {"mesh": mesh}
    amp = distamp.DistAMP("fp8", policy=policy, device="cpu", **kwargs)
    amp.setup(
        net,
        lambda p: torch.optim.AdamW(p, lr=3e-3),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / (STEPS + 1)),
    )
    train(amp, 0, STEPS)
    assert policy.adaptive is not None
    out = {
        "changes": [(c.step, c.module, c.before, c.after) for c in policy.adaptive.changes],
        "loss": eval_loss(amp),
    }
    amp.close()
    return out


@pytest.mark.parametrize("layout", ["fsdp2", "tp"])
def test_fallback_under_fsdp2_and_tensor_parallelism(layout: str) -> None:
    """The outlier layer falls back at the same step on both ranks and the run ends within 2% of
    bf16 (FSDP2 gathering the high-precision weights; tensor-parallel float8 layers)."""
    _torchao()
    r0, r1 = run_ranks(_layout, 2, layout, timeout=300)
    assert r0["changes"] == r1["changes"] and r0["changes"][0][1:] == ("wide", "fp8", "bf16")  # type: ignore[index]
    loss, ref = float(r0["loss"]), bf16_loss()  # type: ignore[arg-type]
    assert abs(loss - ref) / ref < 0.02, (loss, ref)


def test_fallen_back_layer_returns_to_fp8_with_hysteresis() -> None:
    """``demote=True``: the outlier goes away, the layer's flush fraction stays under
    ``fp8_demote_below`` for ``calm_reports`` reports and it computes in fp8 again; the outlier
    comes back, it falls back a second time and then stays in bf16 for good."""
    _torchao()
    torch.manual_seed(0)
    rules = AdaptiveRules(
        interval=2, patience=1, max_promoted_fraction=0.6, demote=True, calm_reports=3
    )
    policy = AutocastPolicy("fp8", fp8_min_features=16, adaptive=rules)
    amp = distamp.DistAMP("fp8", strategy="none", policy=policy, device="cpu")
    amp.setup(Net(), lambda p: torch.optim.AdamW(p, lr=3e-3))
    for k in range(70):
        x, y = batch(k, spike=k < 10 or 30 <= k < 40)
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)
    assert policy.adaptive is not None
    changes = [(c.step, c.module, c.before, c.after) for c in policy.adaptive.changes]
    assert changes == [
        (2, "wide", "fp8", "bf16"),
        (16, "wide", "bf16", "fp8"),  # calm at the reports of steps 12, 14 and 16
        (32, "wide", "fp8", "bf16"),
    ], changes
    assert "e4m3 flush < 0.01 for 3 reports" in policy.adaptive.changes[1].reason
    assert policy.adaptive.state_dict()["pinned"] == ["wide"]
    amp.close()
