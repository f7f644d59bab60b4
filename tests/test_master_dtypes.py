"""distamp.scaler.master_dtypes: 16-bit parameters stepped without a master are refused by the
scaler at the next step, fused optimizer or not, naming them, with nothing changed; 16-bit
parameters by the user's choice (bf16 at setup under bf16) and distamp's master-weight
optimizer step as before."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import distamp
from distamp import DistributedGradScaler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _backward(model: nn.Module, scaler: DistributedGradScaler, dtype: torch.dtype) -> None:
    x = torch.randn(3, 4, dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):
        loss = model(x).float().square().mean()
    scaler.scale(loss).backward()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [p.detach().clone() for p in model.parameters()] + grads


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("call", ["step", "clip"])
def test_a_cast_after_setup_is_refused_with_nothing_changed(
    fused: bool, dtype: torch.dtype, call: str
) -> None:
    """The model cast in place after the optimizer was built and the model registered (what
    TRL's continuous-batching rollouts do): the next step (or clip) raises ValueError naming
    the parameters and the fix; weights, gradients, optimizer state and scale unchanged."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused, foreach=not fused or None)
    scaler = DistributedGradScaler("cpu", init_scale=2.0**8, check_only=dtype == torch.bfloat16)
    scaler.register_module(model)
    model.to(dtype)  # in place: the optimizer holds the same (now 16-bit) parameters
    _backward(model, scaler, dtype)
    before = _state(model, opt)
    with pytest.raises(ValueError) as info:
        if call == "step":
            scaler.step(opt)
        else:
            scaler.clip_grad_norm_(opt, 1.0)
    message = str(info.value)
    short = "fp16" if dtype == torch.float16 else "bf16"
    assert f"AdamW would step 4 16-bit parameter(s) with no master: 0.weight ({short})" in message
    assert "and 1 more" in message
    assert "distamp.WeightPrecision" in message and "master_weights" in message
    assert "use_transformers_continuous_batching" in message
    assert _same(before, _state(model, opt)) and not opt.state
    assert scaler.get_scale() == (2.0**8 if dtype == torch.float16 else 1.0)


def test_an_unregistered_fp16_model_is_refused_for_a_fused_optimizer_too() -> None:
    """No module registered (a loop of one's own): fp16 parameters are refused all the same,
    shown by their place in the optimizer (torch's scaler lets a fused optimizer step them)."""
    model = _model().half()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    scaler = DistributedGradScaler("cpu")
    _backward(model, scaler, torch.float16)
    with pytest.raises(ValueError, match=r"the optimizer's parameter 0 \(4, 4\) \(fp16\)"):
        scaler.step(opt)
    assert not opt.state


def test_bf16_parameters_chosen_at_setup_train_under_bf16() -> None:
    """bf16 weights the user chose before setup, trained under bf16 (a check-only scaler): the
    scaler steps them, as the setup checks allow; the same parameters under fp16 loss scaling
    are refused."""
    model = _model().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = DistributedGradScaler("cpu", check_only=True)
    scaler.register_module(model)
    before = _state(model, opt)
    _backward(model, scaler, torch.bfloat16)
    scaler.step(opt)
    scaler.update()
    assert not _same(before[:4], _state(model, opt)[:4])  # stepped
    scaling = DistributedGradScaler("cpu")
    scaling.register_module(model)
    opt.zero_grad()
    _backward(model, scaling, torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit parameter"):
        scaling.step(opt)


def test_the_master_weight_optimizer_steps_its_16bit_parameters() -> None:
    """distamp's master-weight optimizer keeps the masters: its fp16 parameters step under
    the scaler (fused AdamW inside)."""
    model = _model()
    opt = distamp.master_weights(
        model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True),
        distamp.WeightPrecision("fp16"),
    )  # fmt: skip
    scaler = DistributedGradScaler("cpu", init_scale=2.0**8)
    scaler.register_module(model)
    before = _state(model, opt)
    _backward(model, scaler, torch.float16)
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped
    assert not _same(before[:4], _state(model, opt)[:4])
