"""DistAMP(weights=...): 16-bit weights with their master in the engine, on 2 gloo ranks with
the main job's medium GPT (tests/weights_scenarios.py), and the engine's refusals."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import distamp
from distamp.cluster.spawn import run_ranks
from tests import weights_scenarios as scenarios


@pytest.mark.parametrize(
    ("precision", "value", "where"),
    [("fp16", math.inf, "backward"), ("bf16", math.nan, "after"), ("fp16", -math.inf, "after")],
)
def test_an_overflow_on_one_rank_skips_on_both_and_changes_no_master(
    precision: str, value: float, where: str
) -> None:
    results = run_ranks(scenarios.overflow_on_one_rank, 2, precision, value, where, timeout=240)
    dtype = "torch.float16" if precision == "fp16" else "torch.bfloat16"
    for r in results:
        assert r["param_dtype"] == dtype
        assert r["grad_dtypes"] == [dtype]  # DDP all-reduced 16-bit gradients
        assert r["stepped"] == [True, False, True]
        assert r["skipped"] == 1
        before, after = r["digests"][1]
        assert before == after  # the skipped step wrote no master
        assert r["digests"][0][0] != r["digests"][0][1]  # a taken step did
    assert results[0]["digests"] == results[1]["digests"]
    assert results[0]["weights"] == results[1]["weights"]


@pytest.mark.parametrize(("strategy", "weights"), [("fsdp2", "exact"), ("ddp", "sharded")])
def test_a_resumed_run_is_bitwise_the_uninterrupted_one(
    tmp_path: Path, strategy: str, weights: str
) -> None:
    results = run_ranks(scenarios.resume, 2, str(tmp_path / "ckpt"), strategy, weights, timeout=300)
    for r in results:
        assert r["straight"] == r["resumed"]
    assert results[0]["straight"][1] == results[1]["straight"][1]  # the weights agree


def test_fsdp2_masters_load_exactly_into_an_fp32_run_on_one_rank(tmp_path: Path) -> None:
    """Saved by 2 FSDP2 ranks with 16-bit weights, read by 1 process with fp32 weights: the
    checkpoint's entries are the masters, bit for bit (resharded by DCP)."""
    directory = str(tmp_path / "ckpt")
    out = tmp_path / "masters.pt"
    run_ranks(scenarios.full_masters, 2, directory, "exact", str(out), timeout=300)
    masters = torch.load(out)
    loaded = scenarios.fp32_masters_of(directory)
    assert loaded.keys() == masters.keys()
    for name, value in masters.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], value), name


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"precision": "fp32", "weights": "exact"}, "go with 'bf16' or 'fp16'"),
        ({"precision": "fp8", "weights": "exact"}, "go with 'bf16' or 'fp16'"),
        (
            {"precision": "bf16", "weights": distamp.WeightPrecision("fp16")},
            "pass WeightPrecision\\('bf16'",
        ),
        ({"precision": "bf16", "weights": "exact", "strategy": "fsdp"}, "strategy='fsdp2'"),
        ({"precision": "bf16", "weights": "exact", "strategy": "hsdp"}, "strategy='fsdp2'"),
        ({"precision": "bf16", "weights": "exact", "comm_hook": "bf16"}, "drop comm_hook"),
        ({"precision": "bf16", "weights": "fastest"}, "master='fastest'"),
    ],
)
def test_settings_it_cannot_serve_are_refused_before_setup(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        distamp.DistAMP(**kwargs)


def test_a_bad_weights_value_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"distamp\.WeightPrecision"):
        distamp.DistAMP(precision="bf16", weights=16)


def test_an_optimizer_it_cannot_drive_is_refused_before_the_weights_change() -> None:
    model = _model()
    amp = distamp.DistAMP(precision="bf16", strategy="none", weights="exact")
    with pytest.raises(ValueError, match="cannot drive RMSprop"):
        amp.setup(model, torch.optim.RMSprop(model.parameters()))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_model_already_half_is_refused_naming_the_weight_precision() -> None:
    model = _model().half()
    amp = distamp.DistAMP(precision="fp16", strategy="none")
    with pytest.raises(ValueError, match="WeightPrecision"):
        amp.setup(model, torch.optim.AdamW(model.parameters()))


def test_bf16_true_names_the_weight_precision() -> None:
    with pytest.raises(ValueError, match=r"weights=distamp.WeightPrecision\('bf16'\)"):
        distamp.parse_precision("bf16-true")


def test_the_policy_islands_keep_fp32_weights_and_a_scheduler_of_the_original_drives_it() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    amp = distamp.DistAMP(precision="bf16", strategy="none", weights="exact", policy="default")
    model, wrapped = amp.setup(model, opt, sched)
    assert isinstance(wrapped, distamp.MasterWeightOptimizer)
    assert model[0].weight.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32  # LayerNorm: an fp32 module of the policy
    for _ in range(2):
        with amp.autocast():
            loss = model(torch.randn(3, 4)).float().square().mean()
        assert amp.backward_and_step(loss).stepped
    assert wrapped.param_groups[0]["lr"] == 0.25  # the scheduler stepped twice
    amp.close()


def test_a_promoted_island_computes_from_the_exact_master() -> None:
    """Adaptive precision's fp32 island over 16-bit weights reads each weight's master (not its
    bf16 rounding), and the gradient still reaches the 16-bit parameter."""
    from distamp.precision.promotion import Island

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    fp32 = (layer.weight.detach().clone(), layer.bias.detach().clone())
    opt = distamp.master_weights(layer, torch.optim.AdamW(layer.parameters()))
    x = torch.randn(4, 16)
    island = Island(layer, opt.exact_weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.nn.functional.linear(x, *fp32))  # the masters, bit for bit
    out.sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.bfloat16
    island.remove()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


def test_the_engine_hands_adaptive_islands_the_masters() -> None:
    model = _model()
    policy = distamp.AutocastPolicy("bf16", adaptive=True)
    amp = distamp.DistAMP(precision="bf16", strategy="none", weights="exact", policy=policy)
    _, opt = amp.setup(model, torch.optim.AdamW(model.parameters()))
    assert amp.adaptive is not None and amp.adaptive.adaptive is not None
    assert amp.adaptive.adaptive.exact_weights == opt.exact_weight
    amp.close()


def test_bf16_moments_follow_a_slow_second_moment() -> None:
    """With beta2=0.999 a second moment changes by 0.1% a step, below half a bf16 step: rounded
    to nearest it would never decay; stochastically rounded it follows fp32 on average."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        distamp.master_weights(
            m, torch.optim.AdamW(m.parameters(), lr=1e-4), distamp.WeightPrecision(states=s)
        )
        for m, s in zip(models, ("fp32", "bf16"), strict=True)
    ]
    for step in range(300):
        for m in models:
            for p in m.parameters():
                p.grad = torch.ones_like(p) if step == 0 else torch.zeros_like(p)
        for o in opts:
            o.step()
    exact, low = (o.state[o.param_groups[0]["params"][0]]["exp_avg_sq"] for o in opts)
    assert low.dtype == torch.bfloat16
    ratio = (low.float().mean() / exact.mean()).item()
    assert abs(ratio - 1) < 0.02, ratio  # rounded to nearest it stays at the first value: 1.35


def test_a_factory_optimizer_it_cannot_drive_leaves_the_weights_fp32() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    amp = distamp.DistAMP(precision="bf16", strategy="none", weights="exact")
    with pytest.raises(ValueError, match="cannot drive RMSprop"):
        amp.setup(model, lambda params: torch.optim.RMSprop(params))
    for p, b in zip(model.parameters(), before, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, b)


def test_unscale_of_fp16_weights_is_refused_and_names_the_clip_that_keeps_them_scaled() -> None:
    model = torch.nn.Linear(8, 8)
    opt = distamp.master_weights(
        model, torch.optim.AdamW(model.parameters()), distamp.WeightPrecision("fp16")
    )
    scaler = distamp.DistributedGradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8)).float().square().mean()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match=r"scaler\.clip_grad_norm_\(optimizer, max_norm\)"):
        scaler.unscale_(opt)
    norm = scaler.clip_grad_norm_(opt, 1.0)  # the way that keeps them scaled
    scaler.step(opt)
    scaler.update()
    assert torch.isfinite(norm) and model.weight.dtype == torch.float16


@pytest.mark.parametrize(
    ("weights", "expected"),
    [(None, 16.0), ("exact", 14.0), (distamp.WeightPrecision(states="bf16"), 10.0)],
)
def test_the_window_reports_the_mode_and_the_bytes_per_parameter(
    weights: Any, expected: float
) -> None:
    """What the report and the main job's summary show: the weight precision and the bytes
    per parameter counted by storage (AdamW: weights, gradients, masters, two moments)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    amp = distamp.DistAMP(precision="bf16", strategy="none", weights=weights)
    model, _ = amp.setup(model, torch.optim.AdamW(model.parameters()))
    with amp.autocast():
        loss = model(torch.randn(4, 64)).float().square().mean()
    amp.backward_and_step(loss)
    stats = amp.metrics.collect(scaler=amp.scaler)
    assert stats.weights == ("fp32" if weights is None else amp.config.weights.short())
    assert stats.bytes_per_param == pytest.approx(expected, abs=0.01)
    amp.close()


def test_ddp_replicas_start_from_rank_0s_masters() -> None:
    first, second = run_ranks(scenarios.masters_after_setup, 2, timeout=120)
    assert first == second


def test_stochastic_rounding_resumes_bitwise() -> None:
    """The rounding's random numbers are drawn from (seed, group, chunk, step): a run resumed
    from its state dicts rounds as the uninterrupted one did (weights and bf16 moments)."""
    precision = distamp.WeightPrecision(master="stochastic", states="bf16", chunk_elements=100)

    def build() -> tuple[torch.nn.Module, distamp.MasterWeightOptimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
        return model, distamp.master_weights(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision
        )

    def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for step in steps:
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    model, opt = build()
    train(model, opt, range(3))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    train(model, opt, range(3, 6))
    again, again_opt = build()
    again.load_state_dict(saved["model"])
    again_opt.load_state_dict(saved["opt"])
    train(again, again_opt, range(3, 6))
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_stochastic_rounding_draws_apart_for_each_tensor() -> None:
    """Two equal parameters with equal gradients in one chunk are rounded with different
    random numbers (one stream per chunk, consumed in turn, not reseeded per tensor)."""
    a, b = torch.nn.Parameter(torch.randn(256)), torch.nn.Parameter(torch.zeros(256))
    with torch.no_grad():
        b.copy_(a)
    model = torch.nn.ParameterList([a, b])
    precision = distamp.WeightPrecision(master="stochastic", states="bf16")
    opt = distamp.master_weights(model, torch.optim.SGD(model.parameters(), lr=1e-3), precision)
    for _ in range(5):
        g = torch.randn(256).to(torch.bfloat16)
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
    assert not torch.equal(a, b)
