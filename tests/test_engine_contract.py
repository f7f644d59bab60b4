"""``DistAMPAccelerator`` at its edges: a bad ``scaler.pt`` is refused before anything is loaded,
``clip_grad_norm_`` with an infinite max norm reads the norm only (the Hugging Face Trainer's way
to turn clipping off), and ranks built with different precisions fail at construction, naming
the field (real gloo processes)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

from distamp.cluster import SettingsMismatchError


def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b or (a != a and b != b))  # NaN equals NaN here


def test_accelerate_refuses_a_bad_scaler_file_before_loading_anything(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True)
    model = acc.prepare(_model())
    acc.save_state(str(tmp_path))
    state = torch.load(tmp_path / "scaler.pt", weights_only=True)
    state["scale"] = float("nan")
    torch.save(state, tmp_path / "scaler.pt")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # differs from the checkpoint: a load would show
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"scaler\.pt") as info:
        acc.load_state(str(tmp_path))
    assert "nothing was loaded" in str(info.value)
    assert _same(model.state_dict(), before)


def test_accelerate_clip_with_infinite_max_norm_reads_the_norm_only() -> None:
    # The Hugging Face Trainer with max_grad_norm=0 (its way to turn clipping off) asks for the
    # norm with clip_grad_norm_(params, inf) at every step.
    pytest.importorskip("accelerate")
    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    with acc.autocast():
        loss = model(torch.randn(8, 4)).float().pow(2).mean()  # no fp16 overflow at 2**16
    acc.backward(loss)
    norm = acc.clip_grad_norm_(model.parameters(), float("inf"))
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.isfinite(torch.as_tensor(norm))
    assert torch.allclose(torch.as_tensor(norm, dtype=torch.float32), grads.norm(), rtol=1e-4)
    opt.step()
    assert not acc.optimizer_step_was_skipped


def _accelerate_rank(rank: int, world: int) -> str:
    from distamp.integrations.accelerate import DistAMPAccelerator

    try:
        DistAMPAccelerator(mixed_precision="fp16" if rank == 0 else "bf16", cpu=True)
    except SettingsMismatchError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(90)
def test_accelerate_ranks_built_differently_fail_at_construction() -> None:
    pytest.importorskip("accelerate")
    messages = run_ranks(_accelerate_rank, 2, timeout=60)
    assert all("precision: ranks 0: 'fp16'; ranks 1: 'bf16'" in m for m in messages), messages
