"""The engine's step guards (distamp.engine.guards): the spike guard and the limit on consecutive
skips, on 2 real gloo ranks under DDP, plus their refusals and their state in checkpoints.

The 2-rank scenarios run in ONE spawned process group; every rank asserts what it sees and
returns what the report needs (the skipped step, its reason, the value against the limit).
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import distamp
from distamp import ConsecutiveSkipsError, DistAMP, DistributedGradScaler, SpikeGuard

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from launch.model import GPT, GPTConfig, lm_loss  # noqa: E402

CFG = GPTConfig(context=8, d_model=16, n_layers=2, n_heads=2)
STEPS, SPIKE_AT = 14, 9
GUARD = SpikeGuard(window=8, sigmas=6.0, min_history=4)


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _batch(rank: int, k: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + k)
    seq = torch.randint(0, CFG.vocab_size, (size, CFG.context + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _same_on_every_rank(value: Any) -> None:
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, value)
    assert all(v == seen[0] for v in seen), seen


def _spike_run(rank: int, what: str) -> dict[str, Any]:
    """STEPS fp16 steps under DDP with a scheduler; at SPIKE_AT rank 1 alone spikes: its loss
    times 1e3 (``what="loss"``), or one parameter's gradient times 1e3 during backward with
    clipping on (``what="grad_norm"``). The step is skipped on both ranks for a spike."""
    clip = 1e6 if what == "grad_norm" else None  # measures the norm, never clips
    amp = DistAMP(
        strategy="ddp",
        precision="fp16",
        max_grad_norm=clip,
        spike_guard=GUARD,
        scaler=DistributedGradScaler("cpu", init_scale=2.0**8),
    )
    model, _ = amp.setup(
        _model(),
        lambda p: torch.optim.SGD(p, lr=0.05),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99),
    )
    inject = {"on": False}
    head = next(p for n, p in model.named_parameters() if n.endswith("head.weight"))
    head.register_hook(lambda g: g * 1e3 if inject["on"] else g)
    reasons, checks = [], []
    for step in range(STEPS):
        before, scale_before = _params(model), amp.scaler.get_scale()
        inject["on"] = what == "grad_norm" and rank == 1 and step == SPIKE_AT
        with amp.autocast():
            loss = lm_loss(model, _batch(rank, step))
        if what == "loss" and rank == 1 and step == SPIKE_AT:
            loss = loss * 1e3
        result = amp.backward_and_step(loss)
        assert result is not None
        reasons.append(result.skip_reason)
        checks.append(amp.guards.spike.last)  # type: ignore[union-attr]
        changed = any(not torch.equal(a, b) for a, b in zip(before, _params(model), strict=True))
        assert changed == result.stepped, f"step {step}: changed={changed}, {result}"
        if result.skip_reason == "spike":
            assert result.loss_scale == scale_before, "a spike backed the scale off"
            assert all(p.grad is None for p in model.parameters()), "gradients kept"
    expected = [None] * STEPS
    expected[SPIKE_AT] = "spike"
    assert reasons == expected, reasons
    assert amp.scheduler.last_epoch == STEPS - 1, "the scheduler stepped on the skipped step"
    assert amp.scaler.skipped_steps == 0 and amp.scaler.get_scale() == 2.0**8
    stats = amp.metrics.collect(step=amp.step_count, scaler=amp.scaler)
    assert stats.spike_skips == 1 and stats.skipped_steps == 0, stats
    _same_on_every_rank(_digest(model))
    spike = checks[SPIKE_AT]
    assert spike is not None and spike.spike
    out = {
        "step": SPIKE_AT,
        "loss": spike.loss,
        "loss_limit": spike.loss_limit,
        "grad_norm": spike.grad_norm,
        "norm_limit": spike.norm_limit,
        "history": len(amp.guards.spike.losses),
    }
    _same_on_every_rank(out)
    amp.close()
    return out


def _skip_limit(rank: int, with_scheduler: bool) -> int:
    """+inf in one gradient element on rank 1, every step, during backward: with
    max_consecutive_skips=3 every rank raises ConsecutiveSkipsError with the overflow report;
    at the third skip when a scheduler reads each decision, else at the streak's next read."""
    amp = DistAMP(strategy="ddp", precision="fp16", max_consecutive_skips=3)
    sched = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1)) if with_scheduler else None
    model, _ = amp.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05), sched)
    name, first = next(iter(model.named_parameters()))

    def poison(g: torch.Tensor) -> torch.Tensor:
        if rank != 1:
            return g
        g = g.clone()
        g.view(-1)[0] = math.inf
        return g

    first.register_hook(poison)
    for step in range(20):
        with amp.autocast():
            loss = lm_loss(model, _batch(rank, step))
        try:
            result = amp.backward_and_step(loss)
        except ConsecutiveSkipsError as exc:
            text = str(exc)
            assert "max_consecutive_skips=3" in text and "overflow at iteration" in text, text
            assert name.removeprefix("module.") in text, text  # the report names it
            _same_on_every_rank(step)
            return step
        assert result is not None and result.skip_reason == "overflow"
    raise AssertionError("no ConsecutiveSkipsError after 20 skipped steps")


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    return {
        "loss": _spike_run(rank, "loss"),
        "grad_norm": _spike_run(rank, "grad_norm"),
        "limit_scheduler": _skip_limit(rank, True),
        "limit_plain": _skip_limit(rank, False),
    }


def test_guards_on_two_ranks() -> None:
    results = run_ranks(_scenarios, 2, timeout=300)
    assert results[0] == results[1]
    out = results[0]
    loss, norm = out["loss"], out["grad_norm"]
    print("loss spike:", loss, "\ngrad-norm spike:", norm)
    assert loss["loss"] > loss["loss_limit"] and loss["history"] == 8
    assert norm["grad_norm"] > norm["norm_limit"] and norm["loss"] <= (norm["loss_limit"] or 0)
    assert out["limit_scheduler"] == 2  # the third skipped step (index 2)
    assert 2 <= out["limit_plain"] <= 2 + distamp.engine.guards.READ_EVERY


# ---------------------------------------------------------------- single process


def _train(amp: DistAMP, model: torch.nn.Module, steps: int, start: int = 0) -> list[Any]:
    out = []
    for k in range(start, start + steps):
        with amp.autocast():
            loss = lm_loss(model, _batch(0, k))
        result = amp.backward_and_step(loss)
        assert result is not None
        out.append(result.skip_reason)
    return out


def test_no_guard_keeps_the_step_as_it_was() -> None:
    """Without a guard nothing reads the loss: the same parameters as a run of the engine's
    previous step (torch's AMP loop), bitwise, and skip_reason None throughout."""
    amp = DistAMP(precision="bf16", strategy="none", max_consecutive_skips=None)
    model, _ = amp.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05))
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    assert _train(amp, model, 4) == [None] * 4
    for k in range(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(ref, _batch(0, k))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert _digest(ref) == _digest(model)
    assert amp.guards.spike is None and amp.guards.streak is None


def test_an_overflow_in_a_spike_step_wins() -> None:
    """fp16 at the default scale: the loss times 1e3 also overflows the gradients. The step's
    reason is "overflow", the scale backs off, and no spike skip is counted."""
    guard = SpikeGuard(window=8, sigmas=6.0, min_history=4)
    amp = DistAMP(precision="fp16", strategy="none", spike_guard=guard)
    model, _ = amp.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05))
    reasons = _train(amp, model, 6)
    with amp.autocast():
        loss = lm_loss(model, _batch(0, 6)) * 1e3
    result = amp.backward_and_step(loss)
    assert result is not None and amp.guards.spike is not None
    assert reasons == [None] * 6 and result.skip_reason == "overflow", result
    assert amp.guards.spike.last is not None and amp.guards.spike.last.spike
    assert result.loss_scale == 2.0**15 and amp.guards.spike.spike_skips == 0
    assert amp.metrics.collect(scaler=amp.scaler).spike_skips == 0
    assert _train(amp, model, 2, start=7) == [None, None]
    assert len(amp.guards.spike.losses) == 7  # the overflow step did not enter the history


def test_guard_state_survives_a_checkpoint(tmp_path: Path) -> None:
    guard = SpikeGuard(window=4, sigmas=3.0, min_history=2)
    a = DistAMP(precision="bf16", strategy="none", max_grad_norm=10.0, spike_guard=guard)
    model_a, _ = a.setup(_model(), lambda p: torch.optim.SGD(p, lr=0.05))
    _train(a, model_a, 6)
    a.save_state(tmp_path)
    saved = a.state_dict()["spike_guard"]
    assert len(saved["losses"]) == 4 and len(saved["grad_norms"]) == 4
    b = DistAMP(precision="bf16", strategy="none", max_grad_norm=10.0, spike_guard=guard)
    model_b, _ = b.setup(_model(5), lambda p: torch.optim.SGD(p, lr=0.05))
    assert b.load_state(tmp_path)
    assert b.state_dict()["spike_guard"] == saved
    assert _train(a, model_a, 3, start=6) == _train(b, model_b, 3, start=6)
    assert a.state_dict()["spike_guard"] == b.state_dict()["spike_guard"]
    with pytest.raises(ValueError, match="losses"):
        b.guards.spike.check_state_dict({**saved, "losses": ["x"]})  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"window": 0}, "window"),
        ({"window": 1}, "window"),
        ({"window": 2.5}, "window"),
        ({"window": "8"}, "window"),
        ({"sigmas": 0}, "sigmas"),
        ({"sigmas": -1.0}, "sigmas"),
        ({"sigmas": float("nan")}, "sigmas"),
        ({"sigmas": "6"}, "sigmas"),
        ({"sigmas": True}, "sigmas"),
        ({"min_history": 1}, "min_history"),
        ({"window": 4, "min_history": 5}, "min_history"),
    ],
)
def test_bad_spike_guard_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SpikeGuard(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"spike_guard": "on"}, "spike_guard"),
        ({"spike_guard": {"window": 8}}, "spike_guard"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"max_consecutive_skips": -3}, "max_consecutive_skips"),
        ({"max_consecutive_skips": 2.5}, "max_consecutive_skips"),
        ({"max_consecutive_skips": True}, "max_consecutive_skips"),
        ({"max_consecutive_skips": "100"}, "max_consecutive_skips"),
    ],
)
def test_bad_guard_settings_refused_up_front(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DistAMP(**kwargs)
    with pytest.raises(ValueError, match=field):
        distamp.check_settings(**kwargs)


def test_defaults() -> None:
    assert SpikeGuard() == SpikeGuard(window=128, sigmas=6.0, min_history=64)
    assert DistAMP().config.max_consecutive_skips == 100
    assert DistAMP(max_consecutive_skips=None).config.spike_guard is None
