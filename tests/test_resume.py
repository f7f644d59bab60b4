"""Elastic kill-and-resume: SIGKILL a worker under ``torchrun --max-restarts`` and finish bitwise.

Each run is ``tests/scripts/fault_train.py`` on 2 gloo ranks under real torchrun, in its own
session with a hard timeout (a hung job is killed with all its processes). A SIGKILLed worker
makes the agent stop the round and start a new one; the new workers resume from the last
complete checkpoint through ``DistAMP.load_state``, and their final parameters, optimizer state
and scaler state must equal an uninterrupted run's exactly (deterministic CPU settings, batches
drawn by index). The main job's medium GPT (13 FSDP2 units) saves and resumes bitwise through
the engine on 2 gloo ranks.

What ``DistAMP.load_state`` restores besides the tensors (distamp/engine/resume.py, with the
layout checks of distamp/engine/checkpoint_layout.py), in one process: a refused load changes
nothing (a bad field of ``trainer.pt``, a checkpoint of another model, a path that is no
checkpoint directory), a checkpoint of another precision is converted explicitly, and fuzzed
``trainer.pt`` contents are either refused naming the file, with nothing changed, or loaded and
trained on.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import medium_scenarios as medium
import pytest
import torch
from _dist import launcher_free_env, run_ranks
from hypothesis import event, example, given
from hypothesis import strategies as st
from torch import nn

from distamp import DistAMP, ScaleUnderflowError
from distamp.engine.checkpoint import CheckpointError
from distamp.engine.integrity import record_listing
from tests.snapshots import same_state

REPO = Path(__file__).resolve().parents[1]
SCRIPT = str(REPO / "tests" / "scripts" / "fault_train.py")
STEPS, INTERVAL = 12, 2
# Generous restarts: a restarted round can fail its rendezvous (a stale peer address) and then
# the next one succeeds; the workers' own rendezvous timeout makes such a round fail fast.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "4", "--monitor-interval", "0.2"]  # fmt: skip
RUN_TIMEOUT_S = 120.0


def _start(tmp: Path, *extra: str) -> subprocess.Popen[str]:
    env = launcher_free_env()
    cmd = [*TORCHRUN, SCRIPT, "--steps", str(STEPS), "--checkpoint-interval", str(INTERVAL),
           "--out", str(tmp / "ckpt"), "--result", str(tmp / "result"),
           "--progress", str(tmp / "progress.jsonl"), "--timeout", "20", *extra]  # fmt: skip
    (tmp / "progress.jsonl").touch()
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], deadline: float) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish in time\n{err[-4000:]}")
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}\n{err[-4000:]}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result line\n{err[-4000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _progress(tmp: Path) -> list[dict[str, Any]]:
    text = (tmp / "progress.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def _final_state(tmp: Path) -> list[dict[str, Any]]:
    return [torch.load(tmp / "result" / f"rank_{r}.pt", weights_only=True) for r in (0, 1)]


def _assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits_a, bits_b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(bits_a, bits_b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run every interrupted one must match."""
    tmp = tmp_path_factory.mktemp("reference")
    result = _finish(_start(tmp), time.monotonic() + RUN_TIMEOUT_S)
    assert result["steps"] == STEPS and result["round"] == 0 and result["resumed_from"] is None
    # The NaN losses of rank 1 are skipped on both ranks (plus fp16 overflows of the first steps).
    assert result["skipped_steps"] >= 2
    states = _final_state(tmp)
    _assert_bitwise_equal(states[0], states[1], "replica rank 1 vs rank 0")
    return states


@pytest.mark.parametrize("seed", [0, 1])
def test_sigkill_a_rank_at_a_random_step_resumes_bitwise(
    seed: int, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    rng = random.Random(seed)
    kill_step, kill_rank = rng.randrange(3, STEPS - 2), rng.randrange(2)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    proc = _start(tmp_path, "--step-delay", "0.15")
    killed = None
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        for line in _progress(tmp_path):
            if line["round"] == 0 and line["rank"] == kill_rank and line["step"] >= kill_step:
                os.kill(line["pid"], signal.SIGKILL)
                killed = line
                break
        time.sleep(0.02)
    assert killed is not None, "the job ended before the kill step: raise --step-delay"
    result = _finish(proc, deadline)
    assert result["round"] >= 1, result  # the agent restarted the workers
    # Resumed from the last checkpoint written before the kill (a save may have been under way).
    last_saved = killed["step"] - killed["step"] % INTERVAL
    assert result["resumed_from"] in (last_saved - INTERVAL, last_saved), (killed, result)
    assert result["steps"] == STEPS
    print(f"seed {seed}: SIGKILL rank {kill_rank} at step {killed['step']}, resumed from "
          f"{result['resumed_from']} in round {result['round']}")  # fmt: skip
    for rank, state in enumerate(_final_state(tmp_path)):
        _assert_bitwise_equal(state, reference[rank], f"rank {rank}")


@pytest.mark.parametrize("point", ["state", "commit"])
def test_sigkill_during_checkpoint_write_keeps_previous_checkpoint(
    point: str, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    """Killed mid-save of step 10: the manifest still names step 8, which loads; the job ends
    bitwise equal to the uninterrupted one."""
    proc = _start(tmp_path, "--kill-in-save", f"10:{point}")
    result = _finish(proc, time.monotonic() + RUN_TIMEOUT_S)
    assert result["round"] >= 1 and result["resumed_from"] == 8, result
    for rank, state in enumerate(_final_state(tmp_path)):
        _assert_bitwise_equal(state, reference[rank], f"rank {rank}")


def _medium_gpt_resume(rank: int, world: int, directory: Path) -> dict[str, Any]:
    """FSDP2: 2 steps, save, a 3rd step; a new engine loads the save and takes the 3rd step."""
    from distamp import DistAMP

    def warmup(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)

    def engine() -> tuple[DistAMP, torch.nn.Module]:
        model = medium.gpt()
        amp = DistAMP("fp16", strategy="fsdp2", device="cpu", max_grad_norm=1.0)
        amp.setup(model, medium.optimizer, warmup)
        return amp, model

    batches = medium.data(rank, world)
    amp, model = engine()
    medium.train(amp, batches, 0, 2)
    saved = amp.save_state(directory)
    medium.train(amp, batches, 2, 3)
    whole = (medium.digest(model), amp.scaler.get_scale(), amp.scaler.skipped_steps)
    amp.close()
    amp, model = engine()
    assert amp.load_state(directory) and amp.step_count == 2
    medium.train(amp, batches, 2, 3)
    resumed = (medium.digest(model), amp.scaler.get_scale(), amp.scaler.skipped_steps)
    amp.close()
    files = {str(f.relative_to(saved)): f.stat().st_size for f in saved.rglob("*") if f.is_file()}
    return {"whole": whole, "resumed": resumed, "files": files}


@pytest.mark.slow
def test_medium_gpt_resumes_bitwise_under_fsdp2(tmp_path: Path) -> None:
    """After the resumed step, the parameters (digest of the gathered tensors), loss scale and
    skips equal those of the run that saved and went on; the sharded state holds parameters and
    both AdamW moments once, split between the ranks' files."""
    r0, r1 = run_ranks(_medium_gpt_resume, 2, tmp_path / "ckpt", timeout=240)
    assert r0["whole"] == r1["whole"] == r0["resumed"] == r1["resumed"], (r0, r1)
    params = sum(p.numel() for p in medium.gpt().parameters())
    shards = [size for name, size in r0["files"].items() if name.endswith(".distcp")]
    assert len(shards) == 2, r0["files"]
    assert 3 * 4 * params <= sum(shards) <= 1.05 * 3 * 4 * params, (shards, params)
    assert all(0.4 <= size / sum(shards) <= 0.6 for size in shards), shards


# -------------------- what load_state restores, checked before anything moves (one process)
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
    assert same_state(_snapshot(amp), before)


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
    assert same_state(_snapshot(amp), before)


def test_a_checkpoint_with_extra_entries_is_not_loaded_as_a_subset(tmp_path: Path) -> None:
    amp = DistAMP("fp16", device="cpu")
    big = nn.Sequential(_model(), nn.Linear(2, 2))
    amp.setup(big, torch.optim.AdamW(big.parameters()))
    amp.save_state(tmp_path)
    small, _ = _engine()
    before = _snapshot(small)
    with pytest.raises(CheckpointError, match="entries this model does not have"):
        small.load_state(tmp_path)
    assert same_state(_snapshot(small), before)


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


_VALUES = st.one_of(
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([None, "abc", "fp16", "bf16", "fp8", "fp64", True, [], {}, {"foo": 1}]),
)


_SCALER_KEYS = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
    "hysteresis",
    "_hysteresis_tracker",
    "skipped_steps",
    "min_scale",
)


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
            assert same_state(_snapshot(amp), before), "a refused load changed something"
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
