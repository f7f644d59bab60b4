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
