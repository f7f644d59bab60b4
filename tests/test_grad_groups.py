"""The per-optimizer cache of the scaler's gradient walk: right after every kind of replacement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp import DistributedGradScaler
from distamp.scaler.grad_groups import GradPlans


def _step(scaler: DistributedGradScaler, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(opt)
    scaler.update()


def test_plan_is_reused_while_parameters_stay_and_rebuilt_when_they_change() -> None:
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([a], lr=0.1)
    plans = GradPlans()
    first = plans.for_optimizer(opt)
    assert plans.for_optimizer(opt) is first
    opt.add_param_group({"params": [b]})
    grown = plans.for_optimizer(opt)
    assert grown is not first and grown.params == [a, b]
    c = nn.Parameter(torch.ones(3))
    opt.param_groups[0]["params"][0] = c  # swapped in place, same list, same length
    swapped = plans.for_optimizer(opt)
    assert swapped is not grown and swapped.params[0] is c


def test_fresh_gradients_every_step_are_the_ones_unscaled() -> None:
    """zero_grad(set_to_none=True) gives new tensors each step: nothing stale is unscaled."""
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = DistributedGradScaler("cpu", init_scale=8.0)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        scaler.unscale_(opt)
        torch.testing.assert_close(model.bias.grad, torch.full((3,), 2.0))  # 8 * 2 / 8
        scaler.step(opt)
        scaler.update()


def test_gradient_of_another_dtype_or_missing_is_grouped_right() -> None:
    p32, p16, frozen = (nn.Parameter(torch.ones(4)) for _ in range(3))
    p16.grad_dtype = None  # allow a gradient of another dtype (as a low-precision reduce gives)
    opt = torch.optim.SGD([p32, p16, frozen], lr=1.0)
    scaler = DistributedGradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # creates the scale
    p32.grad = torch.full((4,), 8.0)
    p16.grad = torch.full((4,), 8.0, dtype=torch.bfloat16)
    groups = scaler._steps.plans.for_optimizer(opt).groups()
    assert sorted(str(g.dtype) for g in groups) == ["torch.bfloat16", "torch.float32"]
    scaler.unscale_(opt)
    assert torch.equal(p32.grad, torch.full((4,), 2.0))
    assert torch.equal(p16.grad, torch.full((4,), 2.0, dtype=torch.bfloat16))
    assert frozen.grad is None
    p16.grad = torch.full((4,), float("inf"), dtype=torch.bfloat16)  # replaced after unscale
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 4.0  # the flag was taken before the replacement, as in torch


def test_a_new_parameter_is_checked_after_add_param_group() -> None:
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DistributedGradScaler("cpu", init_scale=4.0)
    _step(scaler, model, opt)
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra]})
    opt.zero_grad()
    scaler.scale(model(torch.ones(2, 4)).sum() + (extra * float("inf")).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert bool(scaler.last_step_skipped)
    assert scaler.get_scale() == 2.0


class _KeepsMasters(torch.optim.SGD):
    """An optimizer that keeps its 16-bit parameters' masters (as MasterWeightOptimizer)."""

    keeps_16bit_masters = True


def test_fp16_gradient_is_refused_for_unscale_but_allowed_for_fused_check() -> None:
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    p.grad = torch.ones(4, dtype=torch.float16)
    opt = _KeepsMasters([p], lr=0.1)  # another optimizer's fp16 parameters are refused
    scaler = DistributedGradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="FP16 gradients"):
        scaler.unscale_(opt)
    assert scaler._steps.plans.for_optimizer(opt).groups(allow_fp16=True)[0].dtype == torch.float16
