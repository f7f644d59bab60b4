"""DistAMPTrainer / with_distamp with a real Hugging Face Trainer on 2 gloo processes (CPU).

A tiny Llama (about 1,100 parameters, built from a config: no hub access) trains 8 steps; an inf
is written into rank 1's gradient after backward (in ``training_step``, where DDP's all-reduce
has already run) at two steps. Checked: fp16 autocast really runs on CPU (a Linear's output
dtype), both ranks skip the same steps, the scheduler steps only on real steps, the parameters
are bitwise equal across ranks, the logs carry ``loss_scale``/``skipped_steps``, and resuming
from the step-4 checkpoint ends bitwise equal to the uninterrupted run. bf16 gets a check-only
scaler with the same agreement. The step guards given to the Trainer (``spike_guard``,
``max_consecutive_skips``) skip a spike on every rank and end a run that no longer trains.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="needs distamp[transformers]")
pytest.importorskip("accelerate", reason="needs distamp[transformers] (accelerate)")

from _dist import run_ranks

STEPS, BAD_STEPS, SAVE_AT = 8, (2, 5), 4


def _model() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    return LlamaForCausalLM(cfg)


class _Tokens:
    """A map-style dataset of random token rows (same on every rank; the sampler splits it)."""

    def __init__(self, n: int) -> None:
        import torch

        gen = torch.Generator().manual_seed(7)
        self.rows = torch.randint(0, 32, (n, 6), generator=gen)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _digest(model: Any) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def _trainer(rank: int, out: str, precision: str, scaler: Any = None, **extra: Any) -> Any:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from distamp.integrations.transformers import with_distamp

    class InjectingTrainer(Trainer):
        """A user's Trainer subclass: writes an inf into rank 1's gradient after backward."""

        injected = 0

        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.state.global_step in BAD_STEPS and rank == 1:
                p = next(q for q in model.parameters() if q.grad is not None)
                p.grad.view(-1)[0] = float("inf")
                self.injected += 1
            return loss

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.skipped: list[bool] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.skipped.append(bool(trainer.accelerator.optimizer_step_was_skipped))

    model = _model()
    dtypes: list[torch.dtype] = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(
        lambda _m, _i, o: dtypes.append(o.dtype)
    )
    settings: dict[str, Any] = {"save_steps": SAVE_AT, "save_strategy": "steps", **extra}
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        fp16=precision == "fp16",
        bf16=precision == "bf16",
        **settings,
    )
    record = Record()
    cls = with_distamp(InjectingTrainer)
    trainer = cls(
        model=model, args=args, train_dataset=_Tokens(64), callbacks=[record], scaler=scaler
    )
    return trainer, record, dtypes


def _run(trainer: Any, record: Any, dtypes: list[Any], **kw: Any) -> dict[str, Any]:
    trainer.train(**kw)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    opt = trainer.optimizer
    while hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return {
        "skipped": record.skipped,
        "injected": trainer.injected,
        "class": type(trainer).__name__,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "scale": trainer.scaler.get_scale(),
        "skipped_steps": trainer.scaler.skipped_steps,
        "log_keys": sorted({k for e in logs for k in ("loss_scale", "skipped_steps") if k in e}),
        "last_log": {k: logs[-1].get(k) for k in ("loss_scale", "skipped_steps")},
        "dtype": str(dtypes[0]) if dtypes else None,
        "fused": bool(opt.defaults.get("fused")),
        "report": trainer.overflow_report() is not None,
        "digest": _digest(trainer.model),
    }


def _on_ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    out: dict[str, Any] = {}
    trainer, record, dtypes = _trainer(rank, f"{root}/fp16", "fp16")
    out["fp16"] = _run(trainer, record, dtypes)
    trainer, record, dtypes = _trainer(rank, f"{root}/fp16", "fp16")
    resumed = _run(trainer, record, dtypes, resume_from_checkpoint=f"{root}/fp16/checkpoint-4")
    out["resumed"] = resumed
    trainer, record, dtypes = _trainer(rank, f"{root}/bf16", "bf16", save_strategy="no")
    out["bf16"] = _run(trainer, record, dtypes)
    return out


def test_trainer_agrees_on_skips_and_resumes_exactly(tmp_path: Path) -> None:
    r0, r1 = run_ranks(_on_ranks, 2, str(tmp_path), timeout=300)
    expected = [k in BAD_STEPS for k in range(STEPS)]
    for key in ("fp16", "bf16"):
        a, b = r0[key], r1[key]
        assert a["skipped"] == b["skipped"] == expected, key
        assert a["digest"] == b["digest"], key  # bitwise-equal parameters
        assert a["scheduler_steps"] == b["scheduler_steps"] == STEPS - len(BAD_STEPS), key
        assert a["skipped_steps"] == b["skipped_steps"] == len(BAD_STEPS), key
        assert a["scale"] == b["scale"], key
        assert a["log_keys"] == ["loss_scale", "skipped_steps"], key
        assert a["last_log"]["skipped_steps"] == len(BAD_STEPS), key
        assert b["injected"] == len(BAD_STEPS) and a["injected"] == 0  # the subclass ran
        assert a["class"] == "DistAMPInjectingTrainer"
        assert a["report"], key
    assert r0["fp16"]["dtype"] == "torch.float16"  # fp16 autocast on CPU, not fp32
    assert r0["bf16"]["dtype"] == "torch.bfloat16"
    assert r0["fp16"]["scale"] == 2.0**16 / 4  # two backoffs from the default 65536
    assert r0["bf16"]["scale"] == 1.0  # check-only: nothing scaled
    for r in (r0, r1):  # the resumed run trained steps 4..7 and ends where the full run did
        assert r["resumed"]["digest"] == r["fp16"]["digest"]
        assert r["resumed"]["scale"] == r["fp16"]["scale"]
        assert r["resumed"]["skipped_steps"] == r["fp16"]["skipped_steps"]
        assert r["resumed"]["scheduler_steps"] == r["fp16"]["scheduler_steps"]


def test_with_distamp_refuses_a_non_trainer() -> None:
    from distamp.integrations.transformers import DistAMPTrainer, with_distamp

    with pytest.raises(TypeError, match=r"transformers\.Trainer subclass"):
        with_distamp(object)
    assert with_distamp(DistAMPTrainer) is DistAMPTrainer


def test_unsupported_version_message() -> None:
    from distamp.integrations import check_version
    from distamp.integrations.transformers import SUPPORTED

    with pytest.raises(ImportError, match=r"transformers 5\.22\.0 is older.*\.\[transformers\]"):
        check_version("transformers", installed="5.22.0")
    assert check_version("transformers", installed=SUPPORTED.newest) == SUPPORTED.newest


def _gpt2() -> Any:
    """A tiny GPT-2: its eager attention softmax and its GELU's ``pow`` run under autocast,
    where the policy makes them fp32 (Llama computes both in fp32 by itself)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


def _checkpointing(rank: int, world: int, root: str) -> dict[str, Any]:
    """``gradient_checkpointing=True`` (the Trainer's own switch, reentrant or not) with a bf16
    policy: the run without it, bitwise, the policy's fp32 softmax in every forward."""
    import torch
    import torch.nn.functional as F
    from transformers import TrainingArguments

    from distamp import AutocastPolicy
    from distamp.integrations.transformers import DistAMPTrainer

    os.environ["HF_HUB_OFFLINE"] = "1"
    out: dict[str, Any] = {}
    for name, extra in [
        ("plain", {}),
        ("reentrant", {"gradient_checkpointing": True,
                       "gradient_checkpointing_kwargs": {"use_reentrant": True}}),
        ("non-reentrant", {"gradient_checkpointing": True,
                           "gradient_checkpointing_kwargs": {"use_reentrant": False}}),
    ]:  # fmt: skip
        model = _gpt2()
        softmax_dtypes: list[torch.dtype] = []
        real_softmax = F.softmax

        def spy(
            *args: Any, seen: Any = softmax_dtypes, real: Any = real_softmax, **kwargs: Any
        ) -> Any:
            result = real(*args, **kwargs)  # what the layers' attention computes
            seen.append(result.dtype)
            return result

        args = TrainingArguments(
            output_dir=f"{root}/{name}", use_cpu=True, max_steps=4, per_device_train_batch_size=2,
            learning_rate=1e-2, report_to="none", disable_tqdm=True, save_strategy="no",
            logging_steps=1, dataloader_num_workers=0, seed=0, bf16=True, **extra,
        )  # fmt: skip
        trainer = DistAMPTrainer(
            model=model, args=args, train_dataset=_Tokens(16), policy=AutocastPolicy("bf16")
        )
        F.softmax = spy  # type: ignore[assignment]
        try:
            trainer.train()
        finally:
            F.softmax = real_softmax  # type: ignore[assignment]
        out[name] = {
            "digest": _digest(trainer.model),
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "softmax": sorted({str(d) for d in softmax_dtypes}),
            "checkpointed": bool(model.transformer.gradient_checkpointing),
        }
    return out


def test_gradient_checkpointing_keeps_the_policy(tmp_path: Path) -> None:
    (runs,) = run_ranks(_checkpointing, 1, str(tmp_path), timeout=300)
    assert not runs["plain"]["checkpointed"]
    assert runs["plain"]["softmax"] == ["torch.float32"], runs["plain"]
    assert len(runs["plain"]["losses"]) == 4
    for name in ("reentrant", "non-reentrant"):
        assert runs[name]["checkpointed"], f"{name}: the Trainer did not checkpoint"
        assert runs[name]["softmax"] == ["torch.float32"], (name, runs[name])
        assert runs[name]["digest"] == runs["plain"]["digest"], f"{name} differs from plain"
        assert runs[name]["losses"] == runs["plain"]["losses"]


# ---- a scaler replaced after construction ---------------------------------------------------


def _replaced_scaler_runs(rank: int, world: int, root: str) -> dict[str, Any]:
    """The same fp16 run three ways: distamp's scaler given to the constructor, a plain
    ``torch.amp.GradScaler`` assigned to ``trainer.accelerator.scaler`` afterwards (as user code
    and transformers' own tests do), and an object that is no scaler assigned there."""
    import torch

    from distamp import DistributedGradScaler

    os.environ["HF_HUB_OFFLINE"] = "1"
    init = 2.0**8  # far from fp16 overflow for this model: the injected infs are the only skips
    out: dict[str, Any] = {}
    trainer, record, dtypes = _trainer(
        1, f"{root}/ours", "fp16", save_strategy="no", scaler=DistributedGradScaler("cpu", init)
    )
    out["ours"] = _run(trainer, record, dtypes)
    out["ours"]["params"] = [p.detach().flatten().tolist() for p in trainer.model.parameters()]
    trainer, record, dtypes = _trainer(1, f"{root}/torch", "fp16", save_strategy="no")
    replacement = torch.amp.GradScaler("cpu", init_scale=init)
    trainer.accelerator.scaler = replacement
    trainer.train()
    out["torch"] = {
        "skipped": record.skipped,
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "scale": replacement.get_scale(),
        "stepped_with": trainer.optimizer.scaler is replacement,
        "params": [p.detach().flatten().tolist() for p in trainer.model.parameters()],
    }
    trainer, record, dtypes = _trainer(1, f"{root}/bad", "fp16", save_strategy="no")
    trainer.accelerator.scaler = object()
    before = _digest(trainer.model)
    try:
        trainer.train()
    except TypeError as exc:
        out["refused"] = str(exc)
    out["unchanged"] = _digest(trainer.model) == before
    return out


def test_a_scaler_assigned_after_construction_is_honoured_or_refused(tmp_path: Path) -> None:
    """``trainer.accelerator.scaler`` is Accelerate's public attribute: a ``torch.amp.GradScaler``
    put there is the one that steps, its skips are read from it (the scheduler holds still on
    them) and the run ends where distamp's own scaler ends it; an object that is no scaler is
    refused at the first backward, before any weight changes."""
    (runs,) = run_ranks(_replaced_scaler_runs, 1, str(tmp_path), timeout=300)
    ours, torch_run = runs["ours"], runs["torch"]
    expected = [step in BAD_STEPS for step in range(STEPS)]
    assert ours["skipped"] == expected and torch_run["skipped"] == expected, runs
    assert torch_run["stepped_with"], runs
    assert ours["scheduler_steps"] == torch_run["scheduler_steps"] == STEPS - len(BAD_STEPS)
    assert torch_run["scale"] == ours["scale"], runs
    # The same steps taken: the weights differ only by the rounding of the clip (torch's
    # scaler unscales, then Accelerate clips; distamp's does both in one pass): 1.3e-6 measured.
    pairs = zip(ours["params"], torch_run["params"], strict=True)
    diff = max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True))
    assert diff < 1e-5, diff
    assert "is no loss scaler" in runs["refused"] and "GradScaler" in runs["refused"], runs
    assert runs["unchanged"], runs


# ---- step guards: spike_guard and max_consecutive_skips ---------------------------------------


# The Llama's fp16 backward of a loss x1e3 overflows from a scale of 2**7 on (measured on all 32
# batches): 2**3 keeps the spike a spike (guard_scenarios' 2**8 suits its smaller model only).
GUARDED_SCALE = 2.0**3


def _guarded(rank: int, world: int, root: str, what: str) -> dict[str, Any]:
    """The tiny Llama through ``with_distamp`` (fp16, starting scale 2**3) with the step guards
    of tests/guard_scenarios.py. ``what="spike"``: rank 1's loss x1e3 at :data:`SPIKE_AT` (a
    ``compute_loss`` override), a spike guard, no skip limit; ``what="limit"``: a +inf element
    in rank 1's first gradient at every step (in ``training_step``, after DDP's all-reduce: a
    rank-local overflow), ``max_consecutive_skips=LIMIT`` and no spike guard."""
    from guard_scenarios import (
        GUARD,
        LIMIT,
        SPIKE_AT,
        STEPS,
        inject_inf,
        same_on_every_rank,
        snapshot,
        unchanged,
    )
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from distamp import ConsecutiveSkipsError, DistributedGradScaler
    from distamp.integrations.transformers import with_distamp

    os.environ["HF_HUB_OFFLINE"] = "1"
    spike = what == "spike"

    class BadRankTrainer(Trainer):
        """A user's Trainer subclass: rank 1's loss spikes, or its gradient overflows."""

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kw)
            if spike and rank == 1 and self.state.global_step == SPIKE_AT:
                loss = loss * 1e3
            return loss

        def training_step(self, model: Any, inputs: Any, *args: Any, **kw: Any) -> Any:
            loss = super().training_step(model, inputs, *args, **kw)
            if not spike:
                inject_inf(model, rank)
            return loss

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.skipped: list[bool] = []
            self.kept: list[bool] = []
            self.scheduler: list[int] = []
            self.before: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.before = snapshot(trainer.model)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.skipped.append(bool(trainer.accelerator.optimizer_step_was_skipped))
            self.kept.append(unchanged(self.before, trainer.model))
            self.scheduler.append(trainer.lr_scheduler.last_epoch)

    args = TrainingArguments(
        output_dir=f"{root}/{what}",
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        fp16=True,
    )
    record = Record()
    trainer = with_distamp(BadRankTrainer)(
        model=_model(),
        args=args,
        train_dataset=_Tokens(64),
        callbacks=[record],
        scaler=DistributedGradScaler("cpu", GUARDED_SCALE),
        spike_guard=GUARD if spike else None,
        max_consecutive_skips=None if spike else LIMIT,
    )
    try:
        trainer.train()
    except ConsecutiveSkipsError as exc:
        return {"raised_at": len(record.skipped), "message": str(exc)}
    same_on_every_rank(_digest(trainer.model))  # bitwise-equal parameters at the end
    logs = [e for e in trainer.state.log_history if "loss" in e]
    return {
        "skipped": record.skipped,
        "kept": record.kept,
        "scheduler": record.scheduler,
        "spike_skips": [e.get("spike_skips") for e in logs],
        "skipped_steps": trainer.scaler.skipped_steps,
        "scale": trainer.scaler.get_scale(),
        "global_step": trainer.state.global_step,
    }


def test_hf_trainer_spike_on_one_rank_is_skipped_on_both(tmp_path: Path) -> None:
    """Rank 1's loss x1e3 at one step, ``spike_guard=SpikeGuard(...)`` given to the Trainer:
    that step (only) is skipped on both ranks, the parameters unchanged by it and bitwise equal
    across ranks at the end, the Trainer's scheduler not stepped then (the step still counted
    in ``global_step``), the logs' ``spike_skips`` 1 from that step on, no overflow skip and the
    scale not backed off."""
    from guard_scenarios import SPIKE_AT, STEPS

    expected = [k == SPIKE_AT for k in range(STEPS)]
    for r in run_ranks(_guarded, 2, str(tmp_path), "spike", timeout=120):
        assert r["skipped"] == expected, r["skipped"]
        assert r["kept"] == expected, r["kept"]
        assert r["scheduler"] == [k + 1 - (k >= SPIKE_AT) for k in range(STEPS)], r["scheduler"]
        assert r["spike_skips"] == [int(k >= SPIKE_AT) for k in range(STEPS)], r["spike_skips"]
        assert r["skipped_steps"] == 0 and r["scale"] == GUARDED_SCALE, r
        assert r["global_step"] == STEPS, r


def test_hf_trainer_consecutive_skips_raise_on_both_ranks(tmp_path: Path) -> None:
    """A +inf gradient element on rank 1 at every step, ``max_consecutive_skips=LIMIT`` given to
    the Trainer: ``ConsecutiveSkipsError`` out of ``train()`` on both ranks at the same step
    (the streak is read every 8 steps), naming the limit and carrying the overflow report."""
    from guard_scenarios import LIMIT

    results = run_ranks(_guarded, 2, str(tmp_path), "limit", timeout=120)
    assert [r["raised_at"] for r in results] == [7, 7], results
    for r in results:
        assert f"max_consecutive_skips={LIMIT}" in r["message"], r["message"]
        assert "overflow at iteration" in r["message"], r["message"]
