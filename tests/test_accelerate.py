"""DistAMPAccelerator with real Accelerate objects on 2 gloo processes (CPU).

What is checked: fp16 on CPU really runs in fp16 (forward hook), an inf injected into one rank's
gradient is skipped on both ranks and reported by ``step_was_skipped`` (plain and fused AdamW,
with gradient accumulation and clipping), the replicas stay identical, ``save_state`` /
``load_state`` round-trip the scaler, and a resume from a checkpoint taken before the skipped
step ends bitwise where the uninterrupted run ended. At its edges: a bad ``scaler.pt`` is
refused before anything is loaded, ``clip_grad_norm_`` with an infinite max norm reads the norm
only (the Hugging Face Trainer's way to turn clipping off), and ranks built with different
precisions fail at construction, naming the field.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None, reason="needs distamp[accelerate]"
)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from distamp import AutocastPolicy  # noqa: E402
from distamp.cluster import SettingsMismatchError  # noqa: E402
from tests._dist import run_ranks, run_torchrun  # noqa: E402
from tests.snapshots import same_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS, ACCUM, BAD_STEP, SAVE_AT = 4, 2, 2, 1


def _train(rank: int, world: int, ckpt: str, fused: bool) -> dict[str, Any]:
    import torch
    from accelerate.utils import DistributedType

    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=ACCUM)
    assert acc.distributed_type == DistributedType.MULTI_CPU, acc.distributed_type
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: dtypes.append(out.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    model, opt, sched = acc.prepare(model, opt, sched)
    skipped, lrs, scales, norms = [], [], [], []
    unchanged = False

    def run(first: int, record: bool) -> list[bool]:
        nonlocal unchanged
        was_skipped = []
        for step in range(first, STEPS):
            if record and step == SAVE_AT:
                acc.save_state(ckpt + "-mid")  # resumed from below
            before_bad: list[torch.Tensor] = []
            for micro in range(ACCUM):
                gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
                with acc.accumulate(model):
                    loss = model(torch.randn(4, 8, generator=gen)).float().pow(2).mean()
                    acc.backward(loss)
                    if acc.sync_gradients:
                        if step == BAD_STEP:
                            before_bad = [p.detach().clone() for p in model.parameters()]
                            if rank == 1:  # a rank-local overflow (as a shard or hook would see)
                                next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
                        norm = float(acc.clip_grad_norm_(model.parameters(), 1.0))
                        if record:
                            norms.append(norm)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
            was_skipped.append(opt.step_was_skipped)
            if record:
                lrs.append(sched.get_last_lr()[0])
                scales.append(acc.scaler.get_scale())
            if record and step == BAD_STEP:
                unchanged = all(
                    torch.equal(a, b) for a, b in zip(before_bad, model.parameters(), strict=True)
                )
        return was_skipped

    skipped = run(0, record=True)
    metrics = acc.amp_metrics_dict()
    # plain lists: tensors would travel through shared memory the exited worker owned
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    acc.save_state(ckpt)
    acc.wait_for_everyone()  # rank 0 writes the files; nobody reads before it is done
    saved = acc.scaler.state_dict()
    acc.scaler.update(new_scale=3.0)  # clobber, then load
    acc.load_state(ckpt)
    loaded = acc.scaler.state_dict()
    acc.wait_for_everyone()
    # resume from the checkpoint taken before step SAVE_AT: the same skips, bitwise the same end
    acc.load_state(ckpt + "-mid")
    resumed_skipped = run(SAVE_AT, record=False)
    resumed = [p.detach().flatten().tolist() for p in model.parameters()]
    acc.wait_for_everyone()
    return {
        "dtypes": sorted({str(d) for d in dtypes}),
        "skipped": skipped,
        "any_skipped": acc.optimizer_step_was_skipped,
        "lrs": lrs,
        "scales": scales,
        "norms": norms,
        "unchanged_on_skip": unchanged,
        "params": params,
        "metrics": metrics,
        "saved": saved,
        "loaded": loaded,
        "resumed_skipped": resumed_skipped,
        "resumed_params": resumed,
    }


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_inf_on_one_rank_skipped_on_both(tmp_path: Path, fused: bool) -> None:
    r0, r1 = run_ranks(_train, 2, str(tmp_path / "ckpt"), fused, timeout=90)
    for r in (r0, r1):
        assert r["dtypes"] == ["torch.float16"], r["dtypes"]  # fp16 on CPU, really
        assert r["skipped"] == [k == BAD_STEP for k in range(STEPS)], r["skipped"]
        assert r["unchanged_on_skip"]
        assert r["scales"][BAD_STEP] == r["scales"][BAD_STEP - 1] / 2
        assert r["norms"][BAD_STEP] == float("inf")
        # the scheduler did not advance at the skipped step (Accelerate asks step_was_skipped)
        assert r["lrs"][BAD_STEP] == r["lrs"][BAD_STEP - 1]
        assert r["metrics"]["skipped_steps"] == 1
        assert r["metrics"]["overflow_rate"] == pytest.approx(1 / STEPS)
        assert r["metrics"]["loss_scale"] == r["scales"][-1]
        assert r["loaded"] == r["saved"] and r["saved"]["skipped_steps"] == 1
        assert r["resumed_skipped"] == r["skipped"][SAVE_AT:]
        assert r["resumed_params"] == r["params"]  # bitwise: resumed == uninterrupted
    # replicas identical: both ranks took the same decisions
    assert r0["params"] == r1["params"]
    assert r0["norms"] == r1["norms"]


def test_unsupported_version_message() -> None:
    from distamp.integrations import check_version

    with pytest.raises(ImportError, match=r"accelerate 0\.34\.2 is older.*1\.15\.0"):
        check_version("accelerate", installed="0.34.2")
    assert check_version("accelerate", installed="1.15.0")


def test_import_distamp_does_not_import_frameworks() -> None:
    code = (
        "import sys, distamp, distamp.integrations, distamp.observe.writers; "
        "print(sorted(m for m in ('accelerate', 'lightning', 'tensorboard') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_example_runs(tmp_path: Path) -> None:
    """launch/accelerate_example.py end to end under torchrun, 2 processes, fused AdamW."""
    out = run_torchrun(
        ROOT / "launch" / "accelerate_example.py",
        *("--steps", "4", "--log-interval", "2", "--fused", "--out", str(tmp_path)),
    )
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    last = lines[-1]
    assert last["loss_scale"] > 0 and last["tokens_per_s"] > 0 and last["grad_norm"] > 0
    assert json.loads(out.strip().splitlines()[-1])["world_size"] == 2
    assert (tmp_path / "state" / "scaler.pt").exists()


def _policy_dtypes(rank: int, world: int) -> dict[str, str]:
    import torch

    from distamp.integrations.accelerate import DistAMPAccelerator
    from distamp.precision.policy import AutocastPolicy

    acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True, policy=AutocastPolicy("fp16"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    seen: dict[str, str] = {}

    def hook(name: str) -> Any:
        def record(_m: Any, _i: Any, out: torch.Tensor) -> None:
            seen[name] = str(out.dtype)

        return record

    for name, mod in model.named_children():
        mod.register_forward_hook(hook(name))
    model = acc.prepare(model)
    model(torch.randn(2, 8))
    return seen


def test_policy_keeps_its_modules_in_fp32() -> None:
    (seen,) = run_ranks(_policy_dtypes, 1, timeout=60)
    # the policy's fp32 module (LayerNorm) inside Accelerate's fp16 autocast
    assert seen == {"0": "torch.float16", "1": "torch.float32", "2": "torch.float16"}


def _accelerate_checkpointing(rank: int, world: int) -> dict[str, Any]:
    from recipe_scenarios import plugin_run

    return {ac: plugin_run("accelerate", ac) for ac in (False, True)}


def test_policy_holds_under_activation_checkpointing() -> None:
    """The blocks checkpointed as Accelerate's FSDP plugin (``activation_checkpointing=True``)
    does (that plugin needs CUDA; the wrapping is torch's, the same here): bitwise the run
    without it."""
    (runs,) = run_ranks(_accelerate_checkpointing, 1, timeout=240)
    assert runs[True]["wrappers"] == 4 and runs[False]["wrappers"] == 0
    assert runs[True]["digest"] == runs[False]["digest"]
    assert runs[True]["losses"] == runs[False]["losses"]


def _accelerate_refusals(rank: int, world: int, out: str) -> list[str]:
    from accelerate import Accelerator

    from distamp.integrations.accelerate import DistAMPAccelerator

    messages = []
    for mode in ("bf16", "no"):
        try:
            DistAMPAccelerator(mixed_precision=mode, cpu=True, policy=AutocastPolicy("fp16"))
        except ValueError as exc:
            messages.append(str(exc))
    acc = DistAMPAccelerator(mixed_precision="bf16", cpu=True, policy=AutocastPolicy("bf16"))
    assert isinstance(acc, Accelerator)
    if importlib.util.find_spec("transformers") is not None:  # the same rule, as fp16=/bf16=
        from transformers import TrainingArguments

        from distamp.integrations.transformers import DistAMPTrainer

        args = TrainingArguments(out, bf16=True, use_cpu=True, report_to=[])
        try:
            DistAMPTrainer(model=nn.Linear(4, 2), args=args, policy=AutocastPolicy("fp16"))
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
def test_accelerate_and_hf_trainer_refuse_a_policy_of_another_precision(tmp_path: Path) -> None:
    (messages,) = run_ranks(_accelerate_refusals, 1, str(tmp_path), timeout=120)
    assert "mixed_precision='bf16' trains in bf16" in messages[0], messages
    assert "no loss scaling" in messages[0] and "same precision" in messages[0], messages
    assert "mixed_precision='no' trains in fp32" in messages[1], messages
    if importlib.util.find_spec("transformers") is not None:
        assert len(messages) == 3 and "TrainingArguments" in messages[2], messages


# ---------------------------------------------------------------------------- step guards
def _accelerate_guarded(rank: int, world: int, what: str) -> dict[str, Any]:
    """DistAMPAccelerator (fp16, 2 CPU processes) with a prepared scheduler and the guards:
    ``what="spike"``: rank 1's loss x1e3 at one step; ``what="limit"``: a +inf gradient element
    on rank 1 at every step."""
    import torch
    from accelerate.utils import GradScalerKwargs
    from guard_scenarios import (
        GUARD,
        INIT_SCALE,
        LIMIT,
        STEPS,
        batch,
        digest,
        inject_inf,
        loss_of,
        model,
        same_on_every_rank,
        snapshot,
        unchanged,
    )

    from distamp import ConsecutiveSkipsError
    from distamp.integrations.accelerate import DistAMPAccelerator

    spike = what == "spike"
    acc = DistAMPAccelerator(
        mixed_precision="fp16",
        cpu=True,
        kwargs_handlers=[GradScalerKwargs(init_scale=INIT_SCALE)],
        spike_guard=GUARD if spike else None,
        max_consecutive_skips=None if spike else LIMIT,
    )
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
    net, opt, sched = acc.prepare(net, opt, sched)
    skipped, kept = [], []
    try:
        for step in range(STEPS):
            acc.backward(loss_of(net, batch(rank, step), rank if spike else 0, step))
            if not spike:
                inject_inf(net, rank)
            before = snapshot(net)
            opt.step()
            sched.step()
            opt.zero_grad()
            skipped.append(opt.step_was_skipped)
            kept.append(unchanged(before, net))
    except ConsecutiveSkipsError as exc:
        return {"raised_at": len(skipped), "message": str(exc)}
    same_on_every_rank(digest(net))
    return {
        "skipped": skipped,
        "kept": kept,
        "metrics": acc.amp_metrics_dict(),
        "scale": acc.scaler.get_scale(),
        "scheduler_steps": sched.scheduler.last_epoch,
    }


def test_accelerate_spike_on_one_rank_is_skipped_on_both() -> None:
    """Rank 1's loss x1e3 at one step: that step (only) is skipped on both ranks, the
    parameters unchanged by it and bitwise equal across ranks at the end, the prepared
    scheduler not stepped then, one spike skip and no overflow skip in the metrics."""
    from guard_scenarios import INIT_SCALE, SPIKE_AT, STEPS

    for r in run_ranks(_accelerate_guarded, 2, "spike", timeout=120):
        assert r["skipped"] == [k == SPIKE_AT for k in range(STEPS)], r["skipped"]
        assert r["kept"] == r["skipped"], r["kept"]
        assert r["metrics"]["spike_skips"] == 1 and r["metrics"]["skipped_steps"] == 0
        assert r["scale"] == INIT_SCALE
        assert r["scheduler_steps"] == 2 * (STEPS - 1), r  # Accelerate steps it per process


def test_accelerate_consecutive_skips_raise_on_both_ranks() -> None:
    """A +inf gradient element on rank 1 at every step: ConsecutiveSkipsError from the
    prepared optimizer's step on both ranks at the same step (read every 8 steps)."""
    from guard_scenarios import LIMIT

    results = run_ranks(_accelerate_guarded, 2, "limit", timeout=120)
    assert [r["raised_at"] for r in results] == [7, 7], results
    for r in results:
        assert f"max_consecutive_skips={LIMIT}" in r["message"], r["message"]
        assert "overflow at iteration" in r["message"], r["message"]


def test_accelerate_guard_settings_refused_naming_the_field() -> None:
    from distamp.integrations.accelerate import DistAMPAccelerator

    with pytest.raises(ValueError, match="max_consecutive_skips=0"):
        DistAMPAccelerator(cpu=True, max_consecutive_skips=0)
    with pytest.raises(TypeError, match=r"spike_guard=1\.5"):
        DistAMPAccelerator(cpu=True, spike_guard=1.5)  # type: ignore[arg-type]


# ---- at its edges: a bad scaler.pt, clipping turned off, ranks built differently ----------------


def _small_model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def test_accelerate_refuses_a_bad_scaler_file_before_loading_anything(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True)
    model = acc.prepare(_small_model())
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
    assert same_state(model.state_dict(), before)


def test_accelerate_clip_with_infinite_max_norm_reads_the_norm_only() -> None:
    # The Hugging Face Trainer with max_grad_norm=0 (its way to turn clipping off) asks for the
    # norm with clip_grad_norm_(params, inf) at every step.
    pytest.importorskip("accelerate")
    from distamp.integrations.accelerate import DistAMPAccelerator

    acc = DistAMPAccelerator(mixed_precision="fp16", cpu=True)
    model = _small_model()
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
