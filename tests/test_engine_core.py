"""The engine's step (distamp/engine/core.py) with a loss that is NaN before scaling: the step is
skipped and reported, the parameters are untouched, and training goes on, with loss scaling
(fp16) and without (bf16, fp32)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distamp.engine import DistAMP


def _engine(precision: str = "fp16") -> tuple[DistAMP, nn.Module]:
    torch.manual_seed(0)
    amp = DistAMP(precision=precision, strategy="none", max_grad_norm=1.0)
    model, _ = amp.setup(nn.Linear(8, 2), lambda p: torch.optim.AdamW(p, lr=1e-2))
    return amp, model


def _train(amp: DistAMP, model: nn.Module, steps: int, nan_at: int | None = None) -> list[bool]:
    stepped = []
    for k in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        with amp.autocast():
            loss = model(x).float().square().mean()
        if k == nan_at:
            loss = loss * float("nan")
        result = amp.backward_and_step(loss)
        assert result is not None
        stepped.append(result.stepped)
    return stepped


def test_nan_loss_before_scaling_is_skipped_and_reported() -> None:
    amp, model = _engine("fp16")
    stepped = _train(amp, model, 2)
    params = [p.detach().clone() for p in model.parameters()]
    scale = amp.scaler.get_scale()
    assert _train(amp, model, 1, nan_at=0) == [False]
    for p, q in zip(params, model.parameters(), strict=True):
        assert torch.equal(p, q)  # the NaN never reached the parameters
    assert (
        amp.scaler.get_scale() == scale / 2 and amp.scaler.skipped_steps == stepped.count(False) + 1
    )
    assert _train(amp, model, 2) == [True, True]  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_nan_loss_is_skipped_without_loss_scaling_too(precision: str) -> None:
    amp, model = _engine(precision)
    assert _train(amp, model, 1, nan_at=0) == [False]
    assert all(torch.isfinite(p).all() for p in model.parameters())
