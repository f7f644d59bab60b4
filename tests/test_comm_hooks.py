"""Loss-scale-aware DDP comm hooks on 2 real gloo ranks, driven through DistAMP.

One spawned process group runs every scenario (spawning costs seconds per rank); each returns its
figures, and the assertions run in the test process on what rank 0 saw (ranks agree by
construction: DDP averages gradients, and the checks compare replicated values).

Figures (torch 2.13 CPU, this file's MLP, 12 steps, fp16 loss scaling):
- fp16 hook vs uncompressed: max parameter difference 9.1e-6 (tolerance 1e-4); bf16 hook:
  4.7e-5 (tolerance 5e-4); the loss scale trajectories are identical.
- fp32 gradients of order 1-10 at init_scale 65536: torch's fp16 hook overflowed on 4 of 12 steps
  (the first two included), the scale-aware hook on none (the scale grew to 2**20).
- inf injected at step 4, PowerSGD from step 2: the wrapped hook skips exactly that step, every
  later loss is finite and the scale grows back (256 -> 1024); torch's plain hook never takes a
  step again (its residuals and warm-start Q hold NaN): 8 skips in a row, scale 512 -> 2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from _dist import run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from distamp.engine import DistAMP
from distamp.parallel.comm_hooks import _fp16_factor
from distamp.scaler import DistributedGradScaler

STEPS = 12
INF_STEP = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


def _batch(rank: int, k: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + k)
    x = torch.randn(8, 16, generator=gen)
    return x, gain * x[:, :4].sin()


def _train(
    rank: int,
    *,
    comm_hook: str | None = None,
    torch_hook: str | None = None,
    inject_at: int | None = None,
    init_scale: float = 2.0**16,
    fp32_backward: bool = False,
) -> dict[str, Any]:
    scaler = DistributedGradScaler(device="cpu", init_scale=init_scale, growth_interval=3)
    amp = DistAMP(precision="fp16", strategy="ddp", comm_hook=comm_hook, scaler=scaler)
    model, _ = amp.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05))
    if torch_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif torch_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=2.0,
        )  # fmt: skip
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    if comm_hook == "powersgd":
        amp.comm_hook_state.inner.start_powerSGD_iter = 2
    losses, scales, skipped = [], [], []
    for k in range(STEPS):
        if fp32_backward:
            # fp32 gradients of order 1-10 (as fp32 modules and accumulation give): scaled by
            # 65536 they exceed fp16's range, though the backward itself did not overflow.
            x, y = _batch(rank, k, gain=10.0)
            loss = nn.functional.mse_loss(model(x), y)
        else:
            x, y = _batch(rank, k)
            with amp.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
        if inject_at == k and rank == 0:
            loss = loss * math.inf  # one rank overflows: every gradient becomes inf/NaN
        result = amp.backward_and_step(loss)
        assert result is not None
        losses.append(float(loss.detach()))
        scales.append(result.loss_scale)
        skipped.append(not result.stepped)
    params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    return {"losses": losses, "scales": scales, "skipped": skipped, "params": params}


def _scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    low = 2.0**8  # no overflow from the scale itself: isolates the compression error
    return {
        "plain": _train(rank, init_scale=low),
        "fp16": _train(rank, comm_hook="fp16", init_scale=low),
        "bf16": _train(rank, comm_hook="bf16", init_scale=low),
        "fp16_high": _train(rank, comm_hook="fp16", fp32_backward=True),
        "torch_fp16_high": _train(rank, torch_hook="fp16", fp32_backward=True),
        "psgd": _train(rank, comm_hook="powersgd", init_scale=low, inject_at=INF_STEP),
        "torch_psgd": _train(rank, torch_hook="powersgd", init_scale=low, inject_at=INF_STEP),
    }


def test_comm_hooks_on_two_gloo_ranks() -> None:
    r = run_ranks(_scenarios, 2, timeout=120)[0]
    plain = torch.tensor(r["plain"]["params"])
    # Compressed training matches uncompressed within the stated tolerances.
    assert not any(r["fp16"]["skipped"]) and not any(r["bf16"]["skipped"])
    fp16_err = (torch.tensor(r["fp16"]["params"]) - plain).abs().max().item()
    bf16_err = (torch.tensor(r["bf16"]["params"]) - plain).abs().max().item()
    assert fp16_err < 1e-4, fp16_err
    assert bf16_err < 5e-4, bf16_err
    print(
        f"max |param - uncompressed| after {STEPS} steps: fp16 {fp16_err:.2e}, bf16 {bf16_err:.2e}"
    )
    assert fp16_err > 0  # the hook did compress
    # At the default scale, scaled gradients overflow torch's fp16 compression, never ours.
    assert not any(r["fp16_high"]["skipped"]), r["fp16_high"]["scales"]
    assert r["torch_fp16_high"]["skipped"][0], r["torch_fp16_high"]["scales"]
    # PowerSGD with one injected inf: exactly that step is skipped, then training goes on.
    ours = r["psgd"]
    assert ours["skipped"] == [k == INF_STEP for k in range(STEPS)], ours["skipped"]
    assert all(math.isfinite(v) for k, v in enumerate(ours["losses"]) if k != INF_STEP)
    assert ours["scales"][-1] >= ours["scales"][INF_STEP], ours["scales"]  # grows back
    theirs = r["torch_psgd"]
    assert all(theirs["skipped"][INF_STEP:]), theirs["skipped"]  # poisoned for good
    assert theirs["scales"][-1] < ours["scales"][-1] / 64, (theirs["scales"], ours["scales"])


def test_fp16_factor_fits_the_sum_and_passes_nonfinite_through() -> None:
    assert _fp16_factor(torch.tensor(1e-37), 2).item() == 2.0**126  # exponent clamped
    for amax in (1e-20, 3e-5, 1.0, 7.0, 65504.0, 1e20, 1e35, 3e38):
        for world in (2, 3, 64):
            f = _fp16_factor(torch.tensor(amax), world)
            assert math.log2(f.item()).is_integer()
            assert world * amax * f.item() <= 2.0**15 < 2 * world * amax * f.item()
    for bad in (math.inf, math.nan, 0.0):
        assert _fp16_factor(torch.tensor(bad), 4).item() == 1.0
