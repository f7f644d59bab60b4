"""DistributedGradScaler on CUDA: parity with torch, low-precision gradients, fused optimizers.

Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from distamp import DistributedGradScaler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

INF = float("inf")
NAN = float("nan")
SCHEDULE = [1.0, INF, 1.0, 1.0, NAN, 1.0, 1.0, 1.0, INF, 1.0]


def _train(scaler: torch.amp.GradScaler, kind: str, dtype: torch.dtype = torch.float16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    ).cuda()
    kw = {"fused": True} if kind == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
    gen = torch.Generator(device="cuda").manual_seed(1)
    scales = []
    for poison in SCHEDULE:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = model(torch.randn(16, 64, device="cuda", generator=gen)).float().square().mean()
        scaler.scale(loss).backward()
        if poison != 1.0:
            model[0].weight.grad[0, 0] = poison
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_parity_with_torch(kind: str, dtype: torch.dtype) -> None:
    kw = dict(device="cuda", init_scale=1024.0, growth_interval=3)
    ref_scales, ref_params = _train(torch.amp.GradScaler(**kw), kind, dtype)
    scales, params = _train(DistributedGradScaler(**kw), kind, dtype)
    assert scales == ref_scales
    for a, b in zip(params, ref_params, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_low_precision_grads(dtype: torch.dtype) -> None:
    # bf16 gradients on CUDA: torch's unscale kernel may lack bf16 (pytorch issue 127176).
    p = torch.nn.Parameter(torch.ones(1000, device="cuda", dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0)
    s = DistributedGradScaler("cuda", init_scale=8.0, sync_free=True)
    s.scale(p.float().sum()).backward()
    if dtype == torch.float16:
        with pytest.raises(ValueError, match="FP16"):
            s.unscale_(opt)
        return
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.zeros_like(p))
    opt.zero_grad()
    s.scale(p.float().sum()).backward()
    p.grad[-1] = NAN
    s.step(opt)
    s.update()
    assert bool(s.last_step_skipped) and torch.equal(p.detach(), torch.zeros_like(p))


def test_gradients_on_two_devices_share_one_decision() -> None:
    """One optimizer over a CPU and a CUDA parameter: an inf on either device skips both."""
    cpu_p = torch.nn.Parameter(torch.ones(4))
    gpu_p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    opt = torch.optim.SGD([cpu_p, gpu_p], lr=1.0)
    s = DistributedGradScaler("cuda", init_scale=4.0)
    for poisoned in (None, cpu_p, gpu_p):
        opt.zero_grad()
        loss = cpu_p.sum().cuda() + gpu_p.sum()
        s.scale(loss).backward()
        if poisoned is not None:
            poisoned.grad[0] = INF
        before = (cpu_p.detach().clone(), gpu_p.detach().clone())
        s.step(opt)
        s.update()
        moved = not torch.equal(before[0], cpu_p.detach())
        assert moved == (poisoned is None)
        assert torch.equal(before[1], gpu_p.detach()) == (poisoned is not None)
    assert s.skipped_steps == 2


def _graph_setup(opt_kind: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    ).cuda()
    if opt_kind == "fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=True)
    scaler = DistributedGradScaler("cuda", init_scale=1024.0, growth_interval=1000, sync_free=True)
    return model, opt, scaler


@pytest.mark.parametrize("opt_kind", ["fused", "foreach"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_whole_step_in_a_cuda_graph_honours_skips(opt_kind: str, set_to_none: bool) -> None:
    """Forward, backward, clip_grad_norm_, step and update captured once and replayed: a replay
    whose input overflows leaves the parameters untouched and halves the scale."""
    model, opt, scaler = _graph_setup(opt_kind)
    static_x = torch.randn(16, 64, device="cuda")

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(static_x).float().square().mean()
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, 0.5)
        scaler.step(opt)
        scaler.update()
        return norm

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: optimizer state, kernel tables, autocast caches
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if set_to_none:
        opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_norm = step()
    good = torch.randn(16, 64, device="cuda")
    for i in range(4):
        static_x.copy_(good)
        if i == 2:
            static_x[0, 0] = INF
        before = [p.detach().clone() for p in model.parameters()]
        scale_before = scaler.get_scale()
        graph.replay()
        torch.cuda.synchronize()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert moved == (i != 2), f"replay {i}: params moved={moved}"
        assert bool(torch.isfinite(static_norm)) == (i != 2)
        assert scaler.get_scale() == (scale_before / 2 if i == 2 else scale_before)
        assert bool(scaler.last_step_skipped) == (i == 2)


@pytest.mark.parametrize("opt_kind", ["fused", "foreach"])
def test_sync_free_step_never_syncs_the_device(opt_kind: str) -> None:
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronizing call."""
    model, opt, scaler = _graph_setup(opt_kind)
    x = torch.randn(16, 64, device="cuda")
    for i in range(4):
        if i == 1:  # the first step creates optimizer state (a sync for non-fused optimizers)
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x if i != 2 else x * INF).float().square().mean()
            scaler.scale(loss).backward()
            scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert scaler.skipped_steps == 1
