"""The engine's contract at its edges: a refused load or setup changes nothing, a checkpoint of
another precision is converted explicitly, and ranks built with different settings fail at setup
on every rank, naming the field (real gloo processes)."""

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


# ---------------------------------------------------------------- ranks agree on settings


def _agreeing_rank(rank: int, world: int) -> int:
    from distamp.cluster.agreement import agree_settings

    agree_settings({"a": 1, "b": (2, "x")}, what="test")  # equal: no error
    return 0


@pytest.mark.timeout(60)
def test_equal_settings_pass() -> None:
    assert run_ranks(_agreeing_rank, 2, timeout=45) == [0, 0]


# ---------------------------------------------------------------- plug-ins and the scaler


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


# ---------------------------------------------------------------- fuzzed per-rank settings
def _settings_cases(n: int, seed: int) -> list[tuple[dict[str, Any], str | None, Any]]:
    """``n`` settings dicts, each with at most one field that rank 1 changes (``None``: none)."""
    import random

    rng = random.Random(seed)
    pool: list[Any] = [0, 1, 2**31, -1, 0.5, 1e-30, float("inf"), "fp16", "bf16", None, True,
                       False, (1, 2), ("a",), torch.float16, torch.bfloat16]  # fmt: skip
    cases = []
    for _ in range(n):
        fields = {f"f{i}": rng.choice(pool) for i in range(rng.randint(1, 12))}
        changed = rng.choice([None, *fields])
        other = rng.choice([v for v in pool if repr(v) != repr(fields.get(changed))])
        cases.append((fields, changed, other))
    return cases


def _settings_rank(rank: int, world: int, cases: list[Any]) -> list[str]:
    from distamp.cluster import agree_settings, init_distributed, shutdown_distributed

    init_distributed(timeout=60)
    out = []
    for fields, changed, other in cases:
        mine = dict(fields)
        if rank == 1 and changed is not None:
            mine[changed] = other
        try:
            agree_settings(mine, what="case")
            out.append("agreed")
        except SettingsMismatchError as exc:
            out.append(str(exc))
    shutdown_distributed()
    return out


@pytest.mark.timeout(90)
def test_randomised_settings_disagree_exactly_when_a_field_differs() -> None:
    cases = _settings_cases(40, seed=7)
    per_rank = run_ranks(_settings_rank, 2, cases, timeout=60)
    for i, (fields, changed, other) in enumerate(cases):
        got = [r[i] for r in per_rank]
        assert got[0] == got[1], (fields, changed, got)
        if changed is None:
            assert got[0] == "agreed", (fields, got)
        else:
            assert f"{changed}: ranks 0: {fields[changed]!r}"[:60] in got[0], (changed, got)
            assert f"ranks 1: {other!r}"[:40] in got[0], (changed, other, got)


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
