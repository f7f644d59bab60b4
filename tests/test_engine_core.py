"""The engine's step (distamp/engine/core.py) with a loss that is NaN before scaling: the step is
skipped and reported, the parameters are untouched, and training goes on, with loss scaling
(fp16) and without (bf16, fp32)."""

from __future__ import annotations

import pytest
import torch
from engine_scenarios import clipped_engine as _engine
from engine_scenarios import train_steps as _train


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
