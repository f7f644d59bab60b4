"""The engine alone steps its optimizer and scheduler (distamp/engine/step_ownership.py): an
extra ``opt.step()`` is refused with nothing applied, a scheduler stepped by hand is refused at
the next engine call; on one process and on 2 gloo ranks with a step skipped on one rank."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

import distamp

LR = 0.1


def _engine(
    *, opt: str = "adamw", weights: str | None = None, accum: int = 1, given: bool = False
) -> tuple[distamp.DistAMP, torch.optim.Optimizer]:
    """A small engine with a warm-up scheduler; ``given``: an optimizer instance, else a
    factory. Returns the engine and the optimizer passed (or the one setup returned)."""
    amp = distamp.DistAMP(
        precision="bf16", strategy="auto", device="cpu", grad_accum_steps=accum, weights=weights
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def build(params: Any) -> torch.optim.Optimizer:
        if opt == "sgd":
            return torch.optim.SGD(params, lr=LR, momentum=0.9)
        return torch.optim.AdamW(params, lr=LR)

    optimizer = build(model.parameters()) if given else build
    _, returned = amp.setup(
        model, optimizer, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1))
    )
    return amp, optimizer if given else returned  # type: ignore[return-value]


def _train(amp: distamp.DistAMP, step: int, *, poison: bool = False) -> distamp.StepResult:
    result = None
    for micro in range(amp.config.grad_accum_steps):
        gen = torch.Generator().manual_seed(100 * step + micro)
        x = torch.randn(4, 8, generator=gen)
        with amp.accumulate(), amp.autocast():
            loss = amp.model(x).float().square().mean()
        if poison:
            loss = loss * float("inf")  # every gradient inf: the step is skipped
        result = amp.backward_and_step(loss) or result
    assert result is not None
    return result


def _snapshot(amp: distamp.DistAMP) -> tuple[list[torch.Tensor], dict[str, Any]]:
    params = [p.detach().clone() for p in amp.model.parameters()]
    return params, copy.deepcopy(amp.optimizer.state_dict())


def _assert_unchanged(amp: distamp.DistAMP, before: tuple[list[torch.Tensor], Any]) -> None:
    params, state = before
    for a, b in zip(amp.model.parameters(), params, strict=True):
        assert torch.equal(a.detach(), b)
    _assert_same(amp.optimizer.state_dict(), state)


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    ("opt", "weights", "given"),
    [("adamw", None, False), ("sgd", None, True), ("adamw", "exact", True)],
)
def test_extra_optimizer_step_is_refused_with_nothing_applied(
    opt: str, weights: str | None, given: bool
) -> None:
    """After a skipped step, ``opt.step()`` on the optimizer setup returned (or on the one
    given to it; under 16-bit weights also the inner one) raises and changes nothing; the
    engine then trains on as if the call had not been made."""
    amp, mine = _engine(opt=opt, weights=weights, given=given)
    _train(amp, 0)
    assert not _train(amp, 1, poison=True).stepped
    before = _snapshot(amp)
    for p in amp.model.parameters():  # gradients as a loop of one's own would leave them
        p.grad = torch.ones_like(p)
    targets = [amp.optimizer, mine]
    if isinstance(amp.optimizer, distamp.optim.MasterWeightOptimizer):
        targets.append(amp.optimizer.inner)
    for target in targets:
        with pytest.raises(RuntimeError, match=r"step\(\) called outside the engine.*Nothing was"):
            target.step()
    _assert_unchanged(amp, before)
    amp.optimizer.zero_grad(set_to_none=True)
    assert _train(amp, 2).stepped and amp.scheduler.last_epoch == 2
    amp.close()
    mine.step()  # released at close: the optimizer is the user's again


def test_scheduler_stepped_by_hand_is_refused_at_the_next_engine_call(tmp_path: Path) -> None:
    """A ``scheduler.step()`` on a skipped step: ``backward``, ``backward_and_step``, ``step``
    and ``fit`` refuse, naming the call and the fix, before anything runs; a checkpoint loaded
    afterwards restores the count and the engine trains on."""
    amp, _ = _engine(accum=2)
    _train(amp, 0)
    amp.save_state(tmp_path)
    assert not _train(amp, 1, poison=True).stepped
    amp.scheduler.step()  # the mistake: the rate moves past a skipped step
    before = _snapshot(amp)
    x = torch.randn(4, 8)
    for call in ("backward", "backward_and_step"):
        with amp.autocast():
            loss = amp.model(x).float().mean()
        with pytest.raises(RuntimeError, match=rf"DistAMP\.{call}\(\): the LR scheduler.*Remove"):
            getattr(amp, call)(loss)
    with pytest.raises(RuntimeError, match=r"DistAMP\.fit\(\): the LR scheduler"):
        amp.fit(lambda k: x, lambda m, b: m(b).float().mean(), steps=5)
    _assert_unchanged(amp, before)
    assert amp.load_state(tmp_path) and amp.scheduler.last_epoch == 1
    assert _train(amp, 1).stepped and amp.scheduler.last_epoch == 2
    amp.close()


def test_fit_and_checkpoints_step_through_the_guard(tmp_path: Path) -> None:
    """``fit`` with accumulation steps and saves; a fresh engine's optimizer (no state yet:
    torch materialises it with a zero-rate step) loads, and so does a DCP state dict of one's
    own; neither is refused."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    amp, _ = _engine(accum=2)
    amp.fit(lambda k: torch.randn(4, 8), lambda m, b: m(b).float().mean(), steps=3)
    amp.save_state(tmp_path)
    fresh, _ = _engine(accum=2)
    get_state_dict(fresh.model, fresh.optimizer)  # materialises the state: let through
    assert fresh.load_state(tmp_path) and fresh.step_count == 3
    _train(fresh, 3)
    for engine in (amp, fresh):
        engine.close()


def _two_ranks(rank: int, world: int) -> str:
    """DDP on 2 ranks, an inf on rank 1 only: both skip; both refuse the extra step with the
    replicas unchanged and equal, then refuse the hand-stepped scheduler at ``backward``."""
    import torch.distributed as dist

    amp, _ = _engine()
    _train(amp, 0)
    with amp.autocast():
        loss = amp.model(torch.randn(4, 8)).float().square().mean()
    if rank == 1:
        loss = loss * float("inf")
    assert not amp.backward_and_step(loss).stepped  # type: ignore[union-attr]
    before = _snapshot(amp)
    for p in amp.model.parameters():
        p.grad = torch.full_like(p, 0.5)
    with pytest.raises(RuntimeError, match="outside the engine"):
        amp.optimizer.step()
    _assert_unchanged(amp, before)
    digest = torch.cat([p.detach().flatten() for p in amp.model.parameters()])
    everyone = [torch.empty_like(digest) for _ in range(world)]
    dist.all_gather(everyone, digest)
    assert torch.equal(everyone[0], everyone[1])
    amp.optimizer.zero_grad(set_to_none=True)
    amp.scheduler.step()  # the rate moves (the user's doing); the engine then refuses
    before = _snapshot(amp)
    with amp.autocast():
        loss = amp.model(torch.randn(4, 8)).float().mean()
    with pytest.raises(RuntimeError, match=r"DistAMP\.backward\(\): the LR scheduler"):
        amp.backward(loss)
    _assert_unchanged(amp, before)
    amp.close()
    return "ok"


def test_refusals_on_two_ranks_with_a_step_skipped_on_one() -> None:
    assert run_ranks(_two_ranks, 2, timeout=120) == ["ok", "ok"]
