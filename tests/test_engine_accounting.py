"""The micro-batch cycle's checks (distamp/engine/accounting.py): ``backward()`` takes one number
and a whole token count, and every training call before ``setup()`` (or after ``close()``) names
the call to make instead."""

from __future__ import annotations

import pytest
import torch
from engine_scenarios import tiny_engine as _engine

from distamp import DistAMP


def test_backward_refuses_a_loss_that_is_not_one_number_and_a_token_count_that_is_none() -> None:
    amp, model = _engine()
    x = torch.ones(3, 4)
    with amp.autocast():
        per_sample = model(x).float()
    with pytest.raises(ValueError, match=r"backward\(loss=\.\.\.\): a tensor of shape \(3, 2\)"):
        amp.backward(per_sample)
    with pytest.raises(TypeError, match=r"backward\(tokens='abc'\)"):
        amp.backward(per_sample.mean(), tokens="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"backward\(tokens=-1\)"):
        amp.backward(per_sample.mean(), tokens=-1)
    # Nothing changed: the cycle still expects its one backward; a shape-[1] loss is one number.
    result = amp.backward_and_step(per_sample.mean().reshape(1), tokens=6)
    assert result is not None and result.stepped and amp.step_count == 1


def test_training_calls_before_setup_name_setup() -> None:
    amp = DistAMP("bf16", device="cpu")
    for call in (
        amp.autocast,
        amp.accumulate,
        lambda: amp.backward(torch.ones((), requires_grad=True)),
    ):
        with pytest.raises(
            RuntimeError, match=r"no model set up: call `model, optimizer = amp\.setup"
        ):
            call()
    amp, _ = _engine()
    amp.close()
    with pytest.raises(RuntimeError, match=r"DistAMP\.autocast\(\).*after close\(\), build a new"):
        amp.autocast()
