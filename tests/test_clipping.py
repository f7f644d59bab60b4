"""DistributedGradScaler.clip_grad_norm_: same numbers as torch's unscale_ + clip_grad_norm_,
one read pass, one collective, the same norm on every rank (DDP, FSDP1, FSDP2, HSDP);
``max_norm=math.inf`` measures without clipping, as torch's does, and the max norms torch turns
into damage (0, negative, NaN) are refused."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from _dist import run_ranks
from torch import nn

from distamp import DistributedGradScaler

INF = float("inf")


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def _opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(params, lr=1e-2, fused=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-1, momentum=0.9, foreach=True)
    return torch.optim.AdamW(params, lr=1e-2, foreach=True)


def _train(
    kind: str, *, ours: bool, poison: dict[int, float], norm_type: float = 2.0, explicit=False
) -> tuple[list[torch.Tensor], list[float], list[float], int]:
    model = _model()
    opt = _opt(kind, model.parameters())
    cls = DistributedGradScaler if ours else torch.amp.GradScaler
    scaler = cls("cpu", init_scale=2.0**10, growth_interval=3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    norms, scales = [], []
    for step in range(7):
        opt.zero_grad()
        loss = (model(x) - y).square().mean() * (1 + step)  # growing gradients: clipping bites
        scaler.scale(loss).backward()
        if step in poison:
            model[2].weight.grad[3, 5] = poison[step]
        if ours and not explicit:
            norm = scaler.clip_grad_norm_(opt, 0.5, norm_type)
        else:
            scaler.unscale_(opt)
            if ours:
                norm = scaler.clip_grad_norm_(opt, 0.5, norm_type)
            else:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type)
        norms.append(float(norm))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    skipped = scaler.skipped_steps if ours else -1
    return [p.detach().clone() for p in model.parameters()], norms, scales, skipped


@pytest.mark.parametrize("kind", ["fused", "foreach", "sgd"])
@pytest.mark.parametrize("norm_type", [2.0, INF, 1.0])
def test_matches_torch_unscale_then_clip(kind: str, norm_type: float) -> None:
    poison = {2: INF, 4: float("nan")}
    ref_params, ref_norms, ref_scales, _ = _train(
        kind, ours=False, poison=poison, norm_type=norm_type
    )
    for explicit in (False, True):
        params, norms, scales, skipped = _train(
            kind, ours=True, poison=poison, norm_type=norm_type, explicit=explicit
        )
        assert scales == ref_scales and skipped == 2
        finite = [i for i in range(len(norms)) if i not in poison]
        assert all(math.isfinite(norms[i]) for i in finite)
        assert all(not math.isfinite(norms[i]) for i in poison)
        for i in finite:
            assert norms[i] == pytest.approx(ref_norms[i], rel=1e-5)
        assert max(ref_norms[i] for i in finite) > 0.5  # the clip was active
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fused_optimizer_takes_the_factor_without_touching_grads() -> None:
    model = _model()
    opt = _opt("fused", model.parameters())
    scaler = DistributedGradScaler("cpu", init_scale=2.0**10)
    scaler.scale(model(torch.randn(4, 8)).square().sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    scaler.clip_grad_norm_(opt, 0.1)
    after = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # no write pass
    scaler.step(opt)
    scaler.update()


def test_disabled_scaler_still_clips_like_torch() -> None:
    a, b = _model(), _model()
    for m in (a, b):
        (m(torch.ones(4, 8)).sum() * 100).backward()
    scaler = DistributedGradScaler("cpu", enabled=False)
    opt = _opt("foreach", a.parameters())
    norm = scaler.clip_grad_norm_(opt, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
    assert float(norm) == pytest.approx(float(ref), rel=1e-6) and float(ref) > 1.0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    scaler.step(opt)
    scaler.update()  # a no-op when disabled: the next iteration clips again without complaint
    assert float(scaler.clip_grad_norm_(opt, 1.0)) == pytest.approx(1.0, rel=1e-4)


def test_misuse_is_reported() -> None:
    model = _model()
    opt = _opt("foreach", model.parameters())
    scaler = DistributedGradScaler("cpu")
    with pytest.raises(RuntimeError, match="before scale"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    for bad in (0.0, -1.0, float("nan"), -INF, True, "1"):  # +inf: the norm only
        with pytest.raises(ValueError, match="max_norm"):
            scaler.clip_grad_norm_(opt, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="norm_type"):
        scaler.clip_grad_norm_(opt, 1.0, 0.5)
    scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.clip_grad_norm_(opt, 1.0)
    with pytest.raises(RuntimeError, match="clip_grad_norm_ unscales too"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.update()
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    model[0].weight.grad[0, 0] = INF
    with pytest.raises(RuntimeError, match="non-finite"):
        scaler.clip_grad_norm_(opt, 1.0, error_if_nonfinite=True)


# ---------------------------------------------------------------------------- max_norm=inf
def _clip_case(enabled: bool, fused: bool, max_norm: Any) -> tuple[float, float, bool]:
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), fused=fused or None, foreach=None)
    scaler = DistributedGradScaler("cpu", init_scale=8.0, enabled=enabled)
    x = torch.randn(5, 4)
    scaler.scale(model(x).sum()).backward()
    norm = scaler.clip_grad_norm_(opt, max_norm)
    ref(x).sum().backward()
    torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)
    left = 8.0 if enabled and fused else 1.0  # a fused step divides by its grad_scale
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    same = all(
        g is not None and r is not None and torch.allclose(g / left, r, rtol=1e-6) for g, r in grads
    )
    scaler.step(opt)
    scaler.update()
    return float(norm), float(torch_norm), same


@pytest.mark.parametrize("max_norm", [math.inf, np.float64("inf"), torch.tensor(math.inf)])
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_infinite_max_norm_measures_without_clipping(
    max_norm: Any, enabled: bool, fused: bool
) -> None:
    """torch's ``clip_grad_norm_(params, inf)`` returns the norm and multiplies by 1 (the
    Hugging Face Trainer turns clipping off so); distamp's returns the same norm, unscales and
    clips nothing."""
    norm, torch_norm, unclipped = _clip_case(enabled, fused, max_norm)
    assert norm == pytest.approx(torch_norm, rel=1e-6) and norm > 1.0
    assert unclipped


@pytest.mark.parametrize("bad", [0.0, -1.0, -math.inf, math.nan, np.float32("nan")])
def test_max_norms_that_torch_turns_into_damage_are_refused(bad: Any) -> None:
    """torch zeroes the gradients at 0, flips their sign below 0 and makes them NaN at NaN."""
    scaler = DistributedGradScaler("cpu")
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    with pytest.raises(ValueError, match=r"`max_norm` must be a number > 0 \(math\.inf"):
        scaler.clip_grad_norm_(opt, bad)
    scaler.clip_grad_norm_(opt, 1.0)  # nothing was recorded by the refused call


# ---------------------------------------------------------------------------- distributed
def _wrap(strategy: str, model: nn.Module, world: int) -> nn.Module:
    if strategy == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if strategy == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_params(strategy: str, model: nn.Module) -> list[torch.Tensor]:
    if strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for p in model.parameters()
    ]


def _clip_on_ranks(rank: int, world: int, strategy: str, kind: str) -> dict[str, Any]:
    """Train a replica of the same model twice: torch's way (unscale_, the wrapper's own clip)
    and distamp's (clip_grad_norm_), with an inf on rank 1 at step 2. Returns what must agree."""
    torch.manual_seed(0)
    xs = [torch.randn(8, 8) for _ in range(5)]  # same on every rank, then split by rank below
    out: dict[str, Any] = {}
    for ours in (False, True):
        model = _wrap(strategy, _model(), world)
        opt = _opt(kind, model.parameters())
        scaler = DistributedGradScaler("cpu", init_scale=2.0**10)
        if ours:
            scaler.register_module(model, trust_ddp_sync=True)
        norms, collectives = [], []
        for step, x in enumerate(xs):
            opt.zero_grad()
            x = x[rank::world] * (1 + step)
            if step == 2 and rank == 1 and strategy == "ddp":
                # A real overflow: in the forward, so DDP's all-reduce carries it to every rank
                # (the registered zero-collective mode relies on exactly that).
                x[0, 0] = INF
            loss = model(x).square().mean()
            scaler.scale(loss).backward()
            if step == 2 and rank == 1 and strategy != "ddp":  # one rank's shard only
                p = next(q for q in model.parameters() if q.grad is not None)
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = INF
            before = scaler.collectives_issued
            if ours:
                norm = scaler.clip_grad_norm_(opt, 0.05)
            else:
                scaler.unscale_(opt)
                if strategy == "fsdp1":
                    norm = model.clip_grad_norm_(0.05)
                else:
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            scaler.step(opt)
            scaler.update()
            collectives.append(scaler.collectives_issued - before)
            norms.append(float(norm))
        key = "ours" if ours else "torch"
        out[key] = {
            "norms": norms,
            "collectives": collectives,
            "skipped": scaler.skipped_steps,
            "params": [t.tolist() for t in _full_params(strategy, model)],
        }
    return out


def _check(results: list[dict[str, Any]], strategy: str) -> None:
    first = results[0]
    for other in results[1:]:  # norms (nan included), skips, params: identical on every rank
        assert repr(other["ours"]) == repr(first["ours"])
    ours, ref = first["ours"], first["torch"]
    assert ours["skipped"] == 1 and not math.isfinite(ours["norms"][2])
    for i in (0, 1, 3, 4):
        assert ours["norms"][i] == pytest.approx(ref["norms"][i], rel=1e-5), (strategy, i)
    assert max(ref["norms"]) > 0.05  # the clip was active
    expected = 0 if strategy == "ddp" else 1  # DDP registered: its all-reduce spread the inf
    assert ours["collectives"] == [expected] * 5
    for p, q in zip(ours["params"], ref["params"], strict=True):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("strategy", "kind"), [("ddp", "foreach"), ("fsdp1", "foreach"), ("fsdp2", "fused")]
)
def test_same_norm_and_decision_on_every_rank(strategy: str, kind: str) -> None:
    _check(run_ranks(_clip_on_ranks, 2, strategy, kind, timeout=180), strategy)


def test_hsdp_counts_replicated_shards_once() -> None:
    _check(run_ranks(_clip_on_ranks, 4, "hsdp", "foreach", timeout=240), "hsdp")


def _clip_run(check_only: bool, max_norm: float, *, host: bool, monkeypatch: Any) -> tuple:
    """Six clipped steps with the CPU route on or off; parameters, norms, and the ops each clip
    ran (names of the aten ops, through a dispatch mode)."""
    from distamp.scaler import clipping
    from distamp.torch_compat import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(clipping, "reads_on_host", (lambda: True) if host else (lambda: False))
    model = _model()
    opt = _opt("adamw", model.parameters())
    scaler = DistributedGradScaler("cpu", init_scale=2.0**10, check_only=check_only)
    x, y = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1)
    norms, ops = [], []
    for step in range(6):
        opt.zero_grad()
        loss = (model(x) - y).square().mean() * (1 + step)
        scaler.scale(loss).backward()
        if step == 3:
            model[2].weight.grad[3, 5] = INF
        with Ops() as seen:
            norms.append(scaler.clip_grad_norm_(opt, max_norm))
        ops.append(seen.names)
        scaler.step(opt)
        scaler.update()
    return [p.detach().clone() for p in model.parameters()], torch.stack(norms), ops


@pytest.mark.parametrize("check_only", [False, True])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_cpu_route_is_bitwise_the_device_route(
    check_only: bool, max_norm: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a clip reads its numbers on the host (no dispatcher, no multiply by exactly
    1): parameters, norms and the skipped step are bitwise those of the route a device takes.
    A check-only scaler's step within ``max_norm`` makes no multiply pass at all."""
    params, norms, ops = _clip_run(check_only, max_norm, host=True, monkeypatch=monkeypatch)
    ref_params, ref_norms, _ = _clip_run(check_only, max_norm, host=False, monkeypatch=monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
    assert torch.equal(norms, ref_norms) and not bool(norms[3].isfinite())
    for step, names in enumerate(ops):
        # check-only: the factor is 1 / divisor, exactly 1 within max_norm and on the skipped
        # step (a non-finite norm leaves the gradients as they are)
        unit = check_only and (max_norm > 1e3 or step == 3)
        assert ("aten._foreach_mul_.Tensor" in names) != unit, (step, names)
