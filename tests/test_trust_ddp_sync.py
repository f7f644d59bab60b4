"""Safe by default: an inf written into one rank's gradient *after* DDP's all-reduce.

User code between backward and step (or a corrupted value) can change one rank's gradient after
DDP has averaged it; DDP's all-reduce then cannot have spread the inf. By default the engine and
a scaler given the DDP module still agree on every skip with one small collective; with
``trust_ddp_sync=True`` they take none, and this test shows the ranks then split (which is why
it is an opt-in). 2 gloo processes, CPU, fp16.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks

from distamp import DistAMP, DistributedGradScaler

STEPS, BAD_STEPS, RESUME_AT = 10, (3, 7), 5


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


def _engine(trust: bool) -> tuple[DistAMP, torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    amp = DistAMP("fp16", strategy="ddp", device="cpu", trust_ddp_sync=trust)
    wrapped, _ = amp.setup(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    )
    return amp, wrapped, next(iter(wrapped.parameters()))


def _train(rank: int, amp: DistAMP, model: torch.nn.Module, first: Any, steps: range) -> dict:
    stepped, collectives = [], []
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * step + rank)
        with amp.autocast():
            loss = model(torch.randn(4, 8, generator=gen)).float().square().mean()
        before = amp.scaler.collectives_issued
        amp.backward(loss)
        if step in BAD_STEPS and rank == 1:  # after DDP's all-reduce: rank 1 only
            first.grad.view(-1)[0] = float("inf")
        stepped.append(amp.step().stepped)
        collectives.append(amp.scaler.collectives_issued - before)
    return {
        "stepped": stepped,
        "collectives": collectives,
        "scale": amp.scaler.get_scale(),
        "scheduler_steps": amp.scheduler.last_epoch,
        "digest": _digest(model),
    }


def _engine_run(rank: int, world: int, trust: bool, ckpt: str) -> dict[str, Any]:
    amp, model, first = _engine(trust)
    out = _train(rank, amp, model, first, range(STEPS))
    amp.close()
    if trust:
        return out
    # Resume: train to RESUME_AT, save, rebuild, load, train to STEPS; must equal the above.
    amp, model, first = _engine(trust)
    _train(rank, amp, model, first, range(RESUME_AT))
    amp.save_state(ckpt)
    amp.close()
    amp, model, first = _engine(trust)
    assert amp.load_state(ckpt)
    tail = _train(rank, amp, model, first, range(RESUME_AT, STEPS))
    out["resumed"] = {k: tail[k] for k in ("scale", "scheduler_steps", "digest")}
    amp.close()
    return out


def test_engine_agrees_by_default_and_resumes_exactly(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_engine_run, 2, False, str(tmp_path / "ckpt"), timeout=180)
    assert r0["stepped"] == r1["stepped"]
    assert r0["stepped"].count(False) == len(BAD_STEPS)
    assert [not s for s in r0["stepped"]] == [k in BAD_STEPS for k in range(STEPS)]
    assert r0["digest"] == r1["digest"]  # bitwise-equal parameters
    assert r0["scale"] == r1["scale"]
    assert r0["scheduler_steps"] == r1["scheduler_steps"] == STEPS - len(BAD_STEPS)
    assert r0["collectives"] == [1] * STEPS  # the price of safety: one small collective a step
    for r in (r0, r1):
        assert r["resumed"] == {k: r[k] for k in ("scale", "scheduler_steps", "digest")}


def test_engine_trusting_ddp_takes_no_collective_and_misses_a_late_inf() -> None:
    """The opt-in does what it says: no collective, and so no agreement on a gradient changed
    after the all-reduce (the ranks split). This is the failure the default prevents."""
    r0, r1 = run_ranks(_engine_run, 2, True, "", timeout=180)
    assert r0["collectives"] == r1["collectives"] == [0] * STEPS
    assert r0["stepped"] == [True] * STEPS
    assert r1["stepped"].count(False) == len(BAD_STEPS)
    assert r0["digest"] != r1["digest"]


def _scaler_run(rank: int, world: int, trust: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = DistributedGradScaler("cpu", init_scale=2.0**10)
    if trust is None:
        scaler.register_module(model)  # the default
    else:
        scaler.register_module(model, trust_ddp_sync=trust)
    skipped, collectives = [], []
    for step in range(6):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step + rank)))
        before = scaler.collectives_issued
        scaler.scale(loss.float().square().mean()).backward()
        if step == 2 and rank == 1:
            model.module.weight.grad.view(-1)[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
        collectives.append(scaler.collectives_issued - before)
    return {"skipped": skipped, "collectives": collectives, "digest": _digest(model)}


@pytest.mark.parametrize("trust", [None, False])
def test_scaler_register_module_is_safe_by_default(trust: bool | None) -> None:
    r0, r1 = run_ranks(_scaler_run, 2, trust, timeout=120)
    assert r0["skipped"] == r1["skipped"] == [False, False, True, False, False, False]
    assert r0["collectives"] == [1] * 6
    assert r0["digest"] == r1["digest"]


def test_scaler_register_module_trusting_ddp_takes_no_collective() -> None:
    r0, r1 = run_ranks(_scaler_run, 2, True, timeout=120)
    assert r0["collectives"] == r1["collectives"] == [0] * 6
    assert r0["skipped"] != r1["skipped"]  # the late inf went unseen by rank 0


def test_trust_ddp_sync_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="trust_ddp_sync="):
        DistAMP("fp16", trust_ddp_sync="yes")  # type: ignore[arg-type]
