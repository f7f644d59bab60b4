"""A checkpoint resumed with another optimizer, other parameter groups or another model is
refused with ONE message naming both sides, not as a damaged file, and changes nothing
(distamp/engine/checkpoint_optimizer.py)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

import distamp
from distamp.engine.checkpoint import CheckpointError
from distamp.engine.integrity import record_listing

Factory = Callable[[torch.nn.Module], Any]


def _adamw(m: torch.nn.Module) -> Any:
    return torch.optim.AdamW(m.parameters(), lr=1e-3)


def _sgd(momentum: float) -> Factory:
    return lambda m: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=momentum)


def _two_groups(m: torch.nn.Module) -> Any:
    weights = [p for n, p in m.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in m.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}])


def _engine(opt: Factory, width: int = 8) -> distamp.DistAMP:
    amp = distamp.DistAMP(precision="bf16", strategy="auto", device="cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 1))
    amp.setup(model, opt(model))
    return amp


def _saved(directory: Path, opt: Factory, steps: int = 2) -> Path:
    amp = _engine(opt)
    for _ in range(steps):
        with amp.autocast():
            loss = amp.model(torch.randn(3, 4)).float().square().mean()
        amp.backward_and_step(loss)
    path = amp.save_state(directory)
    amp.close()
    return path


def _refused(amp: distamp.DistAMP, directory: Path) -> str:
    """Load, expecting one refusal; the model and optimizer are as they were."""
    params = [p.detach().clone() for p in amp.model.parameters()]
    state = copy.deepcopy(amp.optimizer.state_dict())
    with pytest.raises(CheckpointError) as info:
        amp.load_state(directory)
    assert info.value.__cause__ is None and info.value.__suppress_context__ in (True, False)
    message = str(info.value)
    assert "truncated or corrupted" not in message and "nothing was loaded" in message
    for a, b in zip(amp.model.parameters(), params, strict=True):
        assert torch.equal(a.detach(), b)
    after = amp.optimizer.state_dict()
    assert after["param_groups"] == state["param_groups"] and after["state"] == state["state"]
    assert not amp.optimizer.state  # a fresh optimizer stays fresh
    return message


def test_another_optimizer_class_is_named(tmp_path: Path) -> None:
    _saved(tmp_path, _adamw)
    message = _refused(_engine(_sgd(0.9)), tmp_path)
    assert "saved with optimizer AdamW" in message and "optimizer is SGD" in message
    assert "exp_avg" in message and message.count("checkpoint ") == 1


def _strip_layout(step_dir: Path) -> None:
    """Make the checkpoint one written before the optimizer's layout was recorded."""
    trainer = torch.load(step_dir / "trainer.pt", weights_only=True)
    del trainer["meta"]["optimizer"]
    torch.save(trainer, step_dir / "trainer.pt")
    record_listing(step_dir)


def test_older_checkpoint_without_the_layout_names_the_hyper_parameters(tmp_path: Path) -> None:
    _strip_layout(_saved(tmp_path, _adamw))
    message = _refused(_engine(_sgd(0.9)), tmp_path)
    assert "no hyper-parameter dampening, momentum, nesterov of this job's SGD" in message
    assert "betas" in message  # the checkpoint's side
    ok = _engine(_adamw)  # and the same optimizer still loads it
    assert ok.load_state(tmp_path) and ok.step_count == 2


def test_other_optimizer_options_are_named(tmp_path: Path) -> None:
    """SGD without momentum saved, with momentum resumed: same class and hyper-parameters,
    but state the checkpoint lacks (found on the materialised template, then dropped)."""
    _saved(tmp_path, _sgd(0.0))
    message = _refused(_engine(_sgd(0.9)), tmp_path)
    assert "momentum_buffer" in message and "this job's SGD" in message


def test_other_parameter_groups_are_named(tmp_path: Path) -> None:
    _saved(tmp_path, _adamw)
    message = _refused(_engine(_two_groups), tmp_path)
    assert "had 1 parameter group (4 parameters)" in message
    assert "has 2 parameter groups (2, 2 parameters)" in message


def test_another_model_is_named(tmp_path: Path) -> None:
    _saved(tmp_path, _adamw)
    message = _refused(_engine(_adamw, width=6), tmp_path)
    assert "0.weight: shape (8, 4) in the checkpoint, (6, 4) here" in message


def _ddp_another_optimizer(rank: int, world: int, directory: str) -> str:
    path = _saved(Path(directory), _adamw)
    assert path.is_dir()
    message = _refused(_engine(_sgd(0.9)), Path(directory))
    assert message.startswith("ranks 0,1: checkpoint "), message
    assert "saved with optimizer AdamW" in message and "optimizer is SGD" in message
    return "ok"


def test_another_optimizer_under_ddp_on_two_ranks(tmp_path: Path) -> None:
    assert run_ranks(_ddp_another_optimizer, 2, str(tmp_path), timeout=120) == ["ok", "ok"]
