"""What ``DistAMP.setup`` checks of what it is given (distamp/engine/setup_checks.py).

- The model, the optimizer (or its factory) and the scheduler are of the right kind and belong
  together; a scaler passed in works on the training device.
- fp16 or bf16 parameters are refused (the master weights stay in fp32 under autocast), except
  pure bf16 training, which is a choice.
- Ranks built with different settings fail at setup on every rank, naming the field (real gloo
  processes).
- A second engine in the same process sets up promptly (its own rendezvous keys).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest
import torch
from _dist import free_port, run_ranks
from engine_scenarios import square_loss as _loss
from engine_scenarios import tiny_engine as _engine
from torch import nn

from distamp import AutocastPolicy, DistAMP, DistributedGradScaler
from distamp.cluster import SettingsMismatchError
from distamp.precision.adaptive import AdaptiveRules


def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


@pytest.mark.parametrize(
    ("precision", "dtype", "refused"),
    [
        ("fp16", torch.float16, True),
        ("bf16", torch.float16, True),  # the check-only scaler refuses fp16 gradients too
        ("fp16", torch.bfloat16, True),  # bf16 weights drop what loss scaling keeps
        ("bf16", torch.bfloat16, False),  # pure bf16 training: a choice, it works
    ],
)
def test_low_precision_parameters_are_refused_at_setup(
    precision: str, dtype: torch.dtype, refused: bool
) -> None:
    model = nn.Linear(4, 2).to(dtype)
    if not refused:
        amp, wrapped = _engine(precision, model)
        with amp.autocast():
            loss = _loss(wrapped, torch.ones(3, 4))
        assert amp.backward_and_step(loss) is not None
        return
    amp = DistAMP(precision, device="cpu")
    with pytest.raises(ValueError, match=rf"{dtype}.*master weights in fp32.*autocast") as info:
        amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "'weight'" in str(info.value) and f"precision={precision!r}" in str(info.value)
    with pytest.raises(RuntimeError, match="setup"):  # refused: nothing was set up
        amp.model  # noqa: B018


def test_setup_checks_what_it_is_given() -> None:
    model = _model()
    other = _model()
    with pytest.raises(TypeError, match=r"nn\.Module"):
        DistAMP("fp16", device="cpu").setup("my model", lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(TypeError, match="Optimizer or a factory"):
        DistAMP("fp16", device="cpu").setup(model, None)
    with pytest.raises(ValueError, match="not a parameter"):
        DistAMP("fp16", device="cpu").setup(model, torch.optim.SGD(other.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"must return a torch\.optim\.Optimizer"):
        DistAMP("fp16", device="cpu").setup(model, lambda params: "sgd")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stray = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(other.parameters(), lr=0.1), 1)
    with pytest.raises(ValueError, match="drives another optimizer"):
        DistAMP("fp16", device="cpu").setup(model, opt, stray)
    with pytest.raises(TypeError, match="LR scheduler"):
        DistAMP("fp16", device="cpu").setup(model, opt, 3)


def test_a_scaler_for_a_missing_device_is_refused_with_the_fix() -> None:
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.warns(UserWarning):
        cuda = DistributedGradScaler("cuda")  # torch disables it, with a warning
    model = _model()
    amp = DistAMP("fp16", device="cpu", scaler=cuda)
    with pytest.raises(ValueError, match=r"DistributedGradScaler\('cpu'"):
        amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


_MISMATCHES: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "precision": ({"precision": "fp16"}, {"precision": "bf16"}, "precision"),
    "init_scale": ({"init_scale": 2.0**16}, {"init_scale": 2.0**10}, "scaler.scale"),
    "max_grad_norm": ({"max_grad_norm": 1.0}, {}, "max_grad_norm"),
    "grad_accum": ({"grad_accum_steps": 2}, {"grad_accum_steps": 1}, "grad_accum_steps"),
    "strategy": ({"strategy": "ddp"}, {"strategy": "fsdp2"}, "strategy"),
    "policy": ({"policy": "default"}, {}, "policy"),
    "rules": (
        {"policy": AutocastPolicy("fp16", adaptive=True)},
        {"policy": AutocastPolicy("fp16", adaptive=AdaptiveRules(interval=5))},
        "policy.adaptive",
    ),
    "comm_hook": ({"comm_hook": "fp16"}, {}, "comm_hook"),
}


def _mismatched_rank(rank: int, world: int) -> dict[str, str]:
    from distamp.cluster import init_distributed, shutdown_distributed

    init_distributed(timeout=60)  # one group for every case: the engines do not own it
    messages = {}
    for case, sides in _MISMATCHES.items():
        mine = dict(sides[rank])
        init_scale = mine.pop("init_scale", None)
        precision = mine.pop("precision", "fp16")
        if init_scale is not None:
            mine["scaler"] = DistributedGradScaler("cpu", init_scale=init_scale)
        amp = DistAMP(precision, device="cpu", timeout=60, **mine)
        try:
            amp.setup(_model(), lambda params: torch.optim.SGD(params, lr=0.1))
            messages[case] = "no error"
        except SettingsMismatchError as exc:
            messages[case] = str(exc)
    shutdown_distributed()
    return messages


@pytest.mark.timeout(120)
def test_ranks_built_differently_fail_at_setup_naming_the_field() -> None:
    per_rank = run_ranks(_mismatched_rank, 2, timeout=90)
    for case, (_, _, field) in _MISMATCHES.items():
        messages = [m[case] for m in per_rank]
        for message in messages:
            assert f"{field}:" in message, (case, message)
            assert "ranks 0" in message and "ranks 1" in message, (case, message)
        assert messages[0] == messages[1]


def _two_engines(rank: int, world: int, port: int) -> list[float]:
    torch.distributed.destroy_process_group()  # the harness's group: the engines make their own
    os.environ["MASTER_PORT"] = str(port)
    took = []
    for _ in range(2):
        start = time.monotonic()
        amp = DistAMP("bf16", device="cpu", timeout=15)
        model, _ = amp.setup(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
        assert torch.distributed.get_world_size() == world  # the engine made the group
        with amp.autocast():
            loss = _loss(model, torch.ones(3, 4) * (rank + 1))
        result = amp.backward_and_step(loss)
        assert result is not None and result.stepped
        amp.close()
        assert not torch.distributed.is_initialized()
        took.append(time.monotonic() - start)
    return took


def test_a_second_engine_in_the_same_process_sets_up_promptly() -> None:
    # Before: the second setup() met the first group's keys in the store, and its first
    # collective waited for the whole timeout.
    for took in run_ranks(_two_engines, 2, free_port(), timeout=90):
        assert took[1] < 12, took


_LAUNCH = "distamp launch --nproc-per-node N script.py"


def test_ddp_without_a_process_group_names_the_launch_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No launcher, so setup() made no group: the fix is the launch command (calling
    init_distributed() again would make none either), and the message says so."""
    monkeypatch.setenv("DISTAMP_LAUNCHER", "single")
    model = _model()
    amp = DistAMP("bf16", strategy="ddp", device="cpu")
    with pytest.raises(ValueError, match="no launcher started this process") as info:
        amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _LAUNCH in str(info.value) and "torchrun --nproc-per-node N" in str(info.value)
    assert "init_distributed" not in str(info.value)
    assert "strategy='none'" in str(info.value)


def test_ddp_over_a_group_of_one_rank_trains_without_the_no_group_advice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group of one rank exists (made by hand here, as a script might): DDP over it is valid
    (a job launched with ``--nproc-per-node 1``), so setup() goes on, silently, and trains."""
    monkeypatch.setenv("DISTAMP_LAUNCHER", "single")
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        model = _model()
        amp = DistAMP("bf16", strategy="ddp", device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no advice to start a group that exists
            amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with amp.autocast():
            loss = _loss(amp.model, torch.ones(3, 4))
        assert amp.backward_and_step(loss) is not None
        amp.close()
    finally:
        torch.distributed.destroy_process_group()
