"""Bad input never crashes deep inside torch: arguments, checkpoints, world sizes, NaN losses.

- Fuzzed constructor arguments of the scaler and the engine: either a working object (one real
  training step runs) or a ``ValueError`` that names the offending field.
- A truncated or corrupted checkpoint: a ``CheckpointError`` naming the file; the model and the
  checkpoint directory are left exactly as they were.
- A checkpoint from another world size: loads, resharded through torch.distributed.checkpoint.
- A loss that is NaN before scaling: the step is skipped and reported.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch import nn

from distamp import DistributedGradScaler
from distamp.engine import DistAMP
from distamp.engine.checkpoint import CheckpointError
from distamp.parallel.strategies import STRATEGIES

# Values of every kind, valid or not: each field gets its plausible values and the others.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.just(object()),
)


def _maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, JUNK)  # valid values twice as likely as junk


SCALER_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "init_scale": _maybe(st.floats(1.0, 2.0**20)),
        "growth_factor": _maybe(st.floats(1.01, 8.0)),
        "backoff_factor": _maybe(st.floats(0.01, 0.99)),
        "growth_interval": _maybe(st.integers(1, 5000)),
        "enabled": _maybe(st.booleans()),
        "hysteresis": _maybe(st.integers(1, 8)),
        "min_scale": _maybe(st.one_of(st.none(), st.floats(1e-4, 1.0))),
        "max_scale": _maybe(st.one_of(st.none(), st.floats(2.0**20, 2.0**30))),
        "sync_free": _maybe(st.booleans()),
        "device": _maybe(st.sampled_from(["cpu", "cuda", "meta", "tpu", "cpu:0"])),
    },
)


def _one_step(scaler: DistributedGradScaler) -> None:
    """A real fp16-style step: a constructed scaler must work, not fail later inside torch."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert math.isfinite(scaler.get_scale())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SCALER_ARGS)
def test_fuzzed_scaler_arguments(kwargs: dict[str, Any]) -> None:
    device = kwargs.pop("device", "cpu")
    try:
        scaler = DistributedGradScaler(device, **kwargs)
    except ValueError as exc:
        fields = [*kwargs, "device"]
        assert any(f"`{name}`" in str(exc) for name in fields), f"unnamed field: {exc}"
        event("rejected with ValueError")
        return
    event("constructed, stepped")
    if scaler.is_enabled() and torch.device(device).type != "cpu":
        return  # a valid device this machine lacks: nothing to step on
    _one_step(scaler)


ENGINE_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "precision": _maybe(st.sampled_from(["bf16", "fp16", "fp32", "16-mixed", torch.float16])),
        "strategy": _maybe(st.sampled_from(["auto", "none", "ddp", "fsdp", "fsdp2"])),
        "grad_accum_steps": _maybe(st.integers(1, 4)),
        "max_grad_norm": _maybe(st.one_of(st.none(), st.floats(0.1, 10.0))),
        "timeout": _maybe(st.one_of(st.floats(1.0, 600.0), st.just(timedelta(seconds=-1)))),
        "device": _maybe(st.sampled_from(["cpu", "cpu:0", "cuda:7", "gpu"])),
        "comm_hook": _maybe(st.sampled_from([None, "fp16", "bf16", "powersgd", "zip"])),
        "hsdp_shard_size": _maybe(st.one_of(st.none(), st.integers(1, 4))),
        "policy": _maybe(st.sampled_from([None, "default", "fp32"])),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ENGINE_ARGS)
def test_fuzzed_engine_arguments(kwargs: dict[str, Any]) -> None:
    must_fail = [
        name for name, ok in _ENGINE_DOMAINS.items() if name in kwargs and not ok(kwargs[name])
    ]
    try:
        DistAMP(**kwargs)
    except ValueError as exc:
        assert any(f"{name}=" in str(exc) for name in kwargs), f"unnamed field: {exc}"
        event("rejected with ValueError")
        return
    event("constructed")
    assert not must_fail, f"accepted invalid {must_fail}: {kwargs}"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# Fields whose valid values are simple to state: an invalid one must be refused at construction.
_ENGINE_DOMAINS: dict[str, Any] = {
    "strategy": lambda v: v in STRATEGIES,
    "grad_accum_steps": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "max_grad_norm": lambda v: v is None or (_number(v) and v > 0),
    "timeout": lambda v: (_number(v) and v > 0) or (isinstance(v, timedelta) and v > timedelta()),
    "hsdp_shard_size": lambda v: (
        v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1)
    ),
}


# ---------------------------------------------------------------------------------- checkpoints
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


def _tree_digest(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _corrupt(directory: Path, what: str) -> Path:
    latest = directory / "step_00000004"
    if what == "manifest":
        target = directory / "latest.json"
        target.write_text('{"path": "step_0000')  # a write cut short
    elif what == "trainer":
        target = latest / "trainer.pt"
        target.write_bytes(target.read_bytes()[:100])
    elif what == "shard":
        target = next((latest / "state").glob("*.distcp"))
        data = bytearray(target.read_bytes())
        target.write_bytes(bytes(data[: len(data) // 2]))
    elif what == "rng":
        target = latest / "rng_0.pt"
        target.write_bytes(b"not a torch file")
    elif what == "metadata":
        target = latest / "state" / ".metadata"
        target.write_bytes(b"\x00" * 16)
    else:
        raise AssertionError(what)
    return target


@pytest.mark.parametrize("what", ["manifest", "trainer", "shard", "rng", "metadata"])
def test_corrupted_checkpoint_names_the_file_and_changes_nothing(what: str, tmp_path: Path) -> None:
    amp, model = _engine()
    _train(amp, model, 2)
    amp.save_state(tmp_path)
    _train(amp, model, 2)
    amp.save_state(tmp_path)
    target = _corrupt(tmp_path, what)
    before = _tree_digest(tmp_path)

    fresh, fresh_model = _engine()
    params = [p.detach().clone() for p in fresh_model.parameters()]
    with pytest.raises(CheckpointError) as info:
        fresh.load_state(tmp_path)
    message = str(info.value)
    sharded = what in ("shard", "metadata")  # DCP's files: the message names their directory
    assert str(target.parent if sharded else target) in message, message
    if what != "manifest":
        assert "step_00000002" in message  # the older good checkpoint is pointed out
    assert _tree_digest(tmp_path) == before  # nothing on disk was rewritten or removed
    assert fresh.step_count == 0
    if what == "shard":
        return  # DCP reads into the model in place: it may hold part of the state (documented)
    for p, q in zip(params, fresh_model.parameters(), strict=True):
        assert torch.equal(p, q)  # the model was not modified either


def test_manifest_may_not_point_outside_the_directory(tmp_path: Path) -> None:
    amp, _ = _engine()
    (tmp_path / "latest.json").write_text('{"path": "../elsewhere"}')
    with pytest.raises(CheckpointError, match=r"latest\.json"):
        amp.load_state(tmp_path)


def _save_sharded(rank: int, world: int, strategy: str, directory: str) -> None:
    """Train 3 steps under ``strategy`` on ``world`` ranks, save, and write the full state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    amp, _ = _engine_dist(strategy)
    _train(amp, amp.model, 3)
    amp.save_state(directory)
    full = get_model_state_dict(amp.model, options=StateDictOptions(full_state_dict=True))
    expected = {"model": full, "scaler": amp.scaler.state_dict()}
    if rank == 0:  # through a file: tensors in a result queue outlive their process badly
        torch.save(expected, Path(directory) / "expected.pt")


def _engine_dist(strategy: str) -> tuple[DistAMP, nn.Module]:
    torch.manual_seed(0)
    amp = DistAMP(precision="fp16", strategy=strategy, max_grad_norm=1.0)
    model, _ = amp.setup(
        nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    return amp, model


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_checkpoint_from_another_world_size_loads_resharded(strategy: str, tmp_path: Path) -> None:
    run_ranks(_save_sharded, 2, strategy, str(tmp_path), timeout=120)
    saved = torch.load(tmp_path / "expected.pt", weights_only=True)
    amp, model = _engine_dist("none")  # one process, no group
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert amp.load_state(tmp_path)
    assert any("saved by 2 ranks and is loaded by 1" in str(w.message) for w in caught)
    assert amp.step_count == 3
    assert amp.scaler.state_dict() == saved["scaler"]
    for name, value in model.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    _train(amp, model, 1)  # and it trains on from there


# ------------------------------------------------------------------------------------ NaN loss
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
