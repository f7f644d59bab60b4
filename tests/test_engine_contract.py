"""The engine's contract at its edges: a refused load or setup changes nothing, a checkpoint of
another precision is converted explicitly, and ranks built with different settings fail at setup
on every rank, naming the field (real gloo processes)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from hypothesis import event, example, given
from hypothesis import strategies as st
from torch import nn

from distamp import DistAMP, ScaleUnderflowError
from distamp.cluster import SettingsMismatchError
from distamp.engine.checkpoint import CheckpointError
from distamp.engine.integrity import record_listing


def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _engine(precision: str = "fp16", width: int = 8, **kwargs: Any) -> tuple[DistAMP, nn.Module]:
    fused = kwargs.pop("fused", None)
    amp = DistAMP(precision, device="cpu", **kwargs)
    model = _model(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    amp.setup(model, opt, sched)
    return amp, model


def _train(amp: DistAMP, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        with amp.autocast():
            loss = nn.functional.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)


def _snapshot(amp: DistAMP) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(amp.model.state_dict()),
        "optim": copy.deepcopy(amp.optimizer.state_dict()),
        "scaler": amp.scaler.state_dict(),
        "sched": copy.deepcopy(amp.scheduler.state_dict()),
        "step": amp.step_count,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b or (a != a and b != b))  # NaN equals NaN here


def _saved(tmp_path: Path, precision: str = "fp16", **kwargs: Any) -> Path:
    amp, _ = _engine(precision, **kwargs)
    _train(amp, 3)
    return amp.save_state(tmp_path)


def _edit_trainer(step_dir: Path, edit: Any) -> None:
    """Change trainer.pt on purpose, and re-record the step's listing (else the load refuses
    the file as damaged before its fields are read)."""
    path = step_dir / "trainer.pt"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    record_listing(step_dir)


def _scaler_scale_nan(s: dict[str, Any]) -> None:
    s["scaler"]["scale"] = float("nan")


def _step_text(s: dict[str, Any]) -> None:
    s["step"] = "abc"


def _no_scaler(s: dict[str, Any]) -> None:
    del s["scaler"]


def _tracker_past_interval(s: dict[str, Any]) -> None:
    s["scaler"]["_growth_tracker"] = s["scaler"]["growth_interval"]


def _foreign_scheduler(s: dict[str, Any]) -> None:
    s["scheduler"] = {"foo": 1}


def _unknown_field(s: dict[str, Any]) -> None:
    s["epoch_of_other_tool"] = 3


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_scaler_scale_nan, "scale"),
        (_step_text, "step"),
        (_no_scaler, "scaler"),
        (_tracker_past_interval, "_growth_tracker"),
        (_foreign_scheduler, "scheduler"),
        (_unknown_field, "epoch_of_other_tool"),
    ],
)
def test_a_refused_load_changes_nothing(edit: Any, field: str, tmp_path: Path) -> None:
    step_dir = _saved(tmp_path)
    _edit_trainer(step_dir, edit)
    amp, _ = _engine()
    _train(amp, 1)  # some state of its own, which must survive the refused load
    before = _snapshot(amp)
    with pytest.raises(ValueError) as info:
        amp.load_state(tmp_path)
    assert "trainer.pt" in str(info.value) and field in str(info.value), info.value
    assert _same(_snapshot(amp), before)


@pytest.mark.parametrize("width", [16, 4])
def test_a_checkpoint_of_another_model_is_refused_before_loading(
    width: int, tmp_path: Path
) -> None:
    _saved(tmp_path, width=width)  # a larger, then a smaller model
    amp, _ = _engine()
    before = _snapshot(amp)
    with pytest.raises(CheckpointError, match="does not fit this model") as info:
        amp.load_state(tmp_path)
    assert "shape" in str(info.value)
    assert _same(_snapshot(amp), before)


def test_a_checkpoint_with_extra_entries_is_not_loaded_as_a_subset(tmp_path: Path) -> None:
    amp = DistAMP("fp16", device="cpu")
    big = nn.Sequential(_model(), nn.Linear(2, 2))
    amp.setup(big, torch.optim.AdamW(big.parameters()))
    amp.save_state(tmp_path)
    small, _ = _engine()
    before = _snapshot(small)
    with pytest.raises(CheckpointError, match="entries this model does not have"):
        small.load_state(tmp_path)
    assert _same(_snapshot(small), before)


def test_a_path_that_is_not_a_checkpoint_directory_is_an_error(tmp_path: Path) -> None:
    step_dir = _saved(tmp_path / "ckpt")
    amp, _ = _engine()
    (tmp_path / "file.pt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        amp.load_state(tmp_path / "file.pt")
    with pytest.raises(CheckpointError, match="pass its parent"):
        amp.load_state(step_dir)
    with pytest.raises(CheckpointError, match=r"bare torch\.distributed\.checkpoint"):
        amp.load_state(step_dir / "state")
    (tmp_path / "ckpt" / "latest.json").unlink()
    with pytest.raises(CheckpointError, match=r"no latest\.json"):
        amp.load_state(tmp_path / "ckpt")
    # Nothing to resume: a missing directory, or one with only a run's other outputs.
    assert amp.load_state(tmp_path / "missing") is False
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text("{}\n")
    assert amp.load_state(tmp_path / "out") is False


def test_fp16_checkpoint_resumed_in_bf16_with_a_fused_optimizer_drops_the_scale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path, "fp16", fused=True)
    amp, _ = _engine("bf16", fused=True)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        assert amp.load_state(tmp_path)
    assert amp.scaler.get_scale() == 1.0  # never the fp16 run's 65536
    assert amp.step_count == 3
    assert any("saved in fp16" in r.getMessage() for r in caplog.records), caplog.text
    _train(amp, 2)
    assert all(torch.isfinite(p).all() for p in amp.model.parameters())


def test_bf16_checkpoint_resumed_in_fp16_starts_at_the_fp16_scale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _saved(tmp_path, "bf16")
    amp, _ = _engine("fp16")
    with caplog.at_level(logging.WARNING, logger="distamp"):
        assert amp.load_state(tmp_path)
    assert amp.scaler.get_scale() == 2.0**16
    assert any("bf16" in r.getMessage() for r in caplog.records), caplog.text


def test_same_precision_resume_keeps_the_scale(tmp_path: Path) -> None:
    amp, _ = _engine("fp16")
    _train(amp, 1)
    amp.scaler.update(1024.0)
    amp.save_state(tmp_path)
    fresh, _ = _engine("fp16")
    assert fresh.load_state(tmp_path)
    assert fresh.scaler.get_scale() == amp.scaler.get_scale()


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


# ---------------------------------------------------------------- fuzzed checkpoint contents
_VALUES = st.one_of(
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([None, "abc", "fp16", "bf16", "fp8", "fp64", True, [], {}, {"foo": 1}]),
)
_SCALER_KEYS = (
    "scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker",
    "hysteresis", "_hysteresis_tracker", "skipped_steps", "min_scale",
)  # fmt: skip
_FIELDS = st.sampled_from(
    ["step", "precision", "scheduler", "adaptive", "epoch"] + [f"scaler.{k}" for k in _SCALER_KEYS]
)
_SAVED: dict[str, Path] = {}


def _saved_once() -> Path:
    """One checkpoint for every example (saved on first use; examples edit copies of it)."""
    if "dir" not in _SAVED:
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="distamp-fuzz-"))
        amp, _ = _engine("fp16")
        _train(amp, 3)
        amp.save_state(root)
        _SAVED["dir"] = root
    return _SAVED["dir"]


@given(
    st.dictionaries(_FIELDS, _VALUES, min_size=1, max_size=3),
    st.sets(st.sampled_from(["step", "scaler", "scheduler", "precision"]), max_size=1),
)
@example({"scaler.scale": float("nan")}, set())
@example({"step": "abc"}, set())
@example({}, {"scaler"})
@example({"scaler._growth_tracker": 2000}, set())
@example({"precision": "bf16"}, set())
@example({"scaler.scale": 185392, "scaler.min_scale": 185392}, set())
def test_fuzzed_checkpoint_contents(changes: dict[str, Any], dropped: set[str]) -> None:
    import shutil
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="distamp-fuzz-"))
    try:
        shutil.copytree(_saved_once(), work, dirs_exist_ok=True)
        step_dir = next(p for p in work.glob("step_*"))

        def edit(state: dict[str, Any]) -> None:
            for key, value in changes.items():
                if key.startswith("scaler."):
                    state["scaler"][key.split(".", 1)[1]] = value
                else:
                    state[key] = value
            for key in dropped:
                state.pop(key, None)

        _edit_trainer(step_dir, edit)
        amp, _ = _engine("fp16")
        _train(amp, 1)
        before = _snapshot(amp)
        try:
            amp.load_state(work)
        except (ValueError, CheckpointError) as exc:
            assert "trainer.pt" in str(exc), f"the file is not named: {exc}"
            assert _same(_snapshot(amp), before), "a refused load changed something"
            event("refused, nothing changed")
            return
        try:
            _train(amp, 3)
            scale = amp.scaler.get_scale()
            event("loaded and trained")
        except ScaleUnderflowError:  # the only error allowed: overflow with the scale at its floor
            event("loaded; ScaleUnderflowError at the floor")
            scale = amp.scaler.state_dict()["scale"]
        assert torch.finfo(torch.float32).tiny <= scale <= torch.finfo(torch.float32).max
        assert all(torch.isfinite(p).all() for p in amp.model.parameters())
    finally:
        shutil.rmtree(work, ignore_errors=True)


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
