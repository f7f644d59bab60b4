"""Checkpoints: nothing half-applied, no rank left waiting (2 real gloo ranks, CPU).

One job of 2 ranks runs every scenario (the processes start once: importing the frameworks is
most of the cost), and each test checks its part:

- A model shard cut short, or a byte of it flipped: refused before any tensor is written (the
  sizes and CRC-32s recorded at save time are checked first), on both ranks, naming the file;
  model, optimizer, scaler, scheduler, comm-hook residuals and step unchanged on every rank.
- A ``rank_<r>.pt`` that is a valid torch file of the wrong structure on rank 1 only: both ranks
  refuse, naming rank 1's file; neither rank loaded anything.
- A save whose directory one rank cannot create (a regular file in the way: it blocks root too),
  or whose state one rank cannot write: every rank raises within seconds (not after the
  collective timeout), naming the rank, and nothing is committed.
- The Hugging Face ``DistAMPTrainer`` resumed from a folder whose ``distamp_adaptive.pt`` was
  cut short: refused on both ranks before the Trainer loads the model or moves its step.
- The Lightning Trainer resumed (with ``DistAMPResumeCheck``) from a checkpoint whose scaler
  state the plug-in refuses: refused on both ranks before Lightning restores the model.
- ``save_state(keep=...)`` with a bad ``keep``: refused before anything is written (one process).
- A checkpoint written before listings existed (no ``files.json``) still loads (one process).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

from distamp import DistAMP
from distamp.engine.checkpoint import CheckpointError, save_checkpoint
from distamp.engine.integrity import LISTING, record_listing
from tests.snapshots import same_state

TIMEOUT_S = 60  # the process group's collective timeout: a rank left waiting would hit it


def _engine(strategy: str = "ddp", hook: str | None = "fp8-ef") -> DistAMP:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2)
    )
    amp = DistAMP("fp16", strategy=strategy, comm_hook=hook, device="cpu", timeout=TIMEOUT_S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp.setup(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2))
    return amp


def _train(amp: DistAMP, steps: int, seed: int, rank: int = 0) -> None:
    gen = torch.Generator().manual_seed(100 * seed + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 2, generator=gen)
        with amp.autocast():
            loss = nn.functional.mse_loss(amp.model(x).float(), y)
        amp.backward_and_step(loss)


def _snapshot(amp: DistAMP) -> dict[str, Any]:
    hook = amp.comm_hook_state
    return copy.deepcopy({
        "model": amp.model.state_dict(),
        "optim": amp.optimizer.state_dict(),
        "scaler": amp.scaler.state_dict(),
        "sched": amp.scheduler.state_dict(),
        "step": amp.step_count,
        "residuals": hook.state_dict() if hasattr(hook, "state_dict") else None,
    })  # fmt: skip


def _refused_load(amp: DistAMP, root: Path) -> dict[str, Any]:
    before = _snapshot(amp)
    try:
        amp.load_state(root)
    except CheckpointError as exc:
        return {"error": str(exc), "unchanged": same_state(before, _snapshot(amp))}
    return {"error": None, "unchanged": same_state(before, _snapshot(amp))}


def _blocked_save(amp: DistAMP, root: Path, blocked: int, rank: int) -> dict[str, Any]:
    """Rank ``blocked`` cannot create its checkpoint directory (a regular file is in its way)."""
    base = root / f"blocked{blocked}" / f"r{rank}"
    base.parent.mkdir(parents=True, exist_ok=True)
    if rank == blocked:
        base.write_text("a file where a directory must go")
    start = time.monotonic()
    try:
        amp.save_state(base / "ckpt")
        error = None
    except CheckpointError as exc:
        error = str(exc)
    return {"error": error, "after_s": time.monotonic() - start}


def _engine_part(rank: int, root: Path) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    saved = _engine()
    _train(saved, 3, seed=1, rank=rank)
    step_dir = saved.save_state(root / "ckpt")
    fresh = _engine()
    _train(fresh, 1, seed=2, rank=rank)  # state of its own, which a refused load must keep

    # A model shard cut short (a copy that lost its last bytes).
    shard = max((step_dir / "state").glob("*.distcp"), key=lambda p: p.stat().st_size)
    original = shard.read_bytes()
    dist.barrier()
    if rank == 0:
        shard.write_bytes(original[: len(original) - 100])
    dist.barrier()
    out["truncated"] = {**_refused_load(fresh, root / "ckpt"), "file": str(shard)}
    # The same size, one byte flipped near its end.
    dist.barrier()
    if rank == 0:
        shard.write_bytes(original[:-200] + bytes([original[-200] ^ 0xFF]) + original[-199:])
    dist.barrier()
    out["flipped"] = _refused_load(fresh, root / "ckpt")
    dist.barrier()
    if rank == 0:
        shard.write_bytes(original)
    # Rank 1's own file: a valid torch file of the wrong structure (re-recorded, so that the
    # sizes and CRCs pass and the structure is what is checked).
    rank_file = step_dir / "rank_1.pt"
    if rank == 0:
        torch.save({"not_fp8_comm": 1}, rank_file)
        record_listing(step_dir)
    dist.barrier()
    out["rank_file"] = {**_refused_load(fresh, root / "ckpt"), "file": str(rank_file)}

    # Saves that one rank cannot complete.
    out["blocked"] = [_blocked_save(fresh, root, blocked, rank) for blocked in (0, 1)]
    start = time.monotonic()
    try:  # rank 1's own state cannot be pickled (a write error on that rank alone)
        save_checkpoint(
            root / "unpicklable", step=1, model=fresh.model, optimizer=fresh.optimizer,
            trainer_state={"step": 1}, rank_state={"f": lambda: 0} if rank == 1 else None,
        )  # fmt: skip
        out["unpicklable"] = {"error": None}
    except CheckpointError as exc:
        out["unpicklable"] = {"error": str(exc), "after_s": time.monotonic() - start}
    dist.barrier()  # rank 0 removes what was written before it raises; the others do not wait
    out["committed"] = sorted(p.name for p in (root / "unpicklable").iterdir())

    # No rank was left behind: both train on in step.
    _train(fresh, 1, seed=3, rank=rank)
    out["params"] = [p.detach().flatten().tolist() for p in fresh.model.parameters()]
    fresh.close()
    saved.close()
    return out


def _hf_part(rank: int, root: Path) -> dict[str, Any]:
    """A checkpoint folder (weights moved away from the initial ones, step 2) whose adaptive
    run's file was cut short; a fresh ``DistAMPTrainer`` resumed from it."""
    import safetensors.torch
    import torch.distributed as dist
    from transformers import TrainerState, TrainingArguments

    from distamp import AutocastPolicy
    from distamp.integrations.accelerate import ADAPTIVE_FILE
    from distamp.integrations.transformers import DistAMPTrainer

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": self.fc(x).float().square().mean()}

    os.environ["HF_HUB_OFFLINE"] = "1"
    args = TrainingArguments(
        output_dir=str(root / "hf"), use_cpu=True, max_steps=4, per_device_train_batch_size=2,
        report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0, fp16=True,
        remove_unused_columns=False,
    )  # fmt: skip
    data = [{"x": torch.randn(4)} for _ in range(8)]
    policy = AutocastPolicy("fp16", adaptive=True)
    trainer = DistAMPTrainer(model=Net(), args=args, train_dataset=data, policy=policy)
    ckpt = root / "hf" / "checkpoint-2"
    if rank == 0:
        ckpt.mkdir(parents=True)
        moved = {k: v + 0.5 for k, v in Net().state_dict().items()}
        safetensors.torch.save_file(moved, str(ckpt / "model.safetensors"))
        state = TrainerState(global_step=2, max_steps=4, train_batch_size=2)
        state.save_to_json(str(ckpt / "trainer_state.json"))
        torch.save(
            {"monitor": {"step": 2, "firsts": [], "window_amax": None}}, ckpt / ADAPTIVE_FILE
        )
        whole = (ckpt / ADAPTIVE_FILE).read_bytes()
        (ckpt / ADAPTIVE_FILE).write_bytes(whole[: len(whole) // 2])  # a copy cut short
    dist.barrier()
    before = copy.deepcopy(trainer.model.state_dict())
    try:
        trainer.train(resume_from_checkpoint=str(ckpt))
        error = None
    except ValueError as exc:
        error = str(exc)
    unchanged = same_state(before, trainer.model.state_dict())
    return {"error": error, "unchanged": unchanged, "step": trainer.state.global_step}


def _lightning_part(rank: int, root: Path) -> dict[str, Any]:
    """A Trainer checkpoint whose scaler state the plug-in refuses (a NaN scale), resumed with
    ``DistAMPResumeCheck``."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from distamp import DistributedGradScaler
    from distamp.integrations.lightning import (
        DistAMPEnvironment,
        DistAMPResumeCheck,
        DistAMPTrainerPrecision,
    )

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.fc = nn.Linear(4, 1)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            return self.fc(batch[0]).float().square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(net: Net, steps: int, ckpt: str | None = None, **kw: Any) -> Any:
        scaler = DistributedGradScaler("cpu", init_scale=2.0**10)
        plugin = DistAMPTrainerPrecision("16-mixed", device="cpu", scaler=scaler)
        trainer = pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
            plugins=[plugin, DistAMPEnvironment()], default_root_dir=str(root / "pl"),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            use_distributed_sampler=False, **kw,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(rank)
        data = DataLoader(TensorDataset(torch.randn(4 * steps, 4, generator=gen)), 4)
        trainer.fit(net, data, ckpt_path=ckpt)
        return trainer

    first = fit(Net(), 2)
    ckpt = str(root / "refused.ckpt")
    first.save_checkpoint(ckpt)
    if rank == 0:
        state = torch.load(ckpt, weights_only=False)  # written just above by this test
        state["DistAMPTrainerPrecision"]["scale"] = float("nan")
        torch.save(state, ckpt)
    dist.barrier()
    net = Net()
    before = copy.deepcopy(net.state_dict())
    try:
        fit(net, 4, ckpt, callbacks=[DistAMPResumeCheck()])
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"error": error, "unchanged": same_state(before, net.state_dict())}


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


HF = _installed("transformers", "accelerate", "safetensors")
LIGHTNING = _installed("lightning")


def _job(rank: int, world: int, root_s: str) -> dict[str, Any]:
    root = Path(root_s)
    out = {"engine": _engine_part(rank, root)}
    if HF:
        out["hf"] = _hf_part(rank, root)
    if LIGHTNING:
        out["lightning"] = _lightning_part(rank, root)
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("integrity")
    return run_ranks(_job, 2, str(root), timeout=TIMEOUT_S)  # type: ignore[no-any-return]


def test_damaged_file_is_refused_on_every_rank_with_nothing_changed(
    job: list[dict[str, Any]],
) -> None:
    for r in (x["engine"] for x in job):
        cut = r["truncated"]
        assert cut["error"] and cut["file"] in cut["error"], cut  # the shard is named
        assert "bytes" in cut["error"] and "ranks 0,1" in cut["error"], cut
        assert cut["unchanged"], "a truncated shard was partly applied"
        assert "CRC-32" in r["flipped"]["error"] and r["flipped"]["unchanged"], r["flipped"]


def test_one_ranks_bad_own_file_refuses_the_load_on_every_rank(
    job: list[dict[str, Any]],
) -> None:
    for r in (x["engine"] for x in job):
        own = r["rank_file"]
        assert own["error"] and own["file"] in own["error"] and "rank 1" in own["error"], own
        assert own["unchanged"], "a rank loaded although rank 1's file was refused"
    assert job[0]["engine"]["params"] == job[1]["engine"]["params"]  # both train on in step


def test_a_save_one_rank_cannot_complete_fails_every_rank_at_once(
    job: list[dict[str, Any]],
) -> None:
    for r in (x["engine"] for x in job):
        for blocked, save in enumerate(r["blocked"]):
            assert save["error"] and f"rank {blocked}" in save["error"], save
            assert save["after_s"] < 10, f"the refusal took {save['after_s']:.1f} s"
        bad = r["unpicklable"]
        assert bad["error"] and "rank 1" in bad["error"] and bad["after_s"] < 10, bad
        assert r["committed"] == [], r["committed"]  # no manifest, no half-written directory
    took = max(s["after_s"] for x in job for s in x["engine"]["blocked"])
    print(f"blocked saves failed on both ranks within {took:.2f} s (timeout {TIMEOUT_S} s)")


@pytest.mark.skipif(not HF, reason="needs distamp[transformers]")
def test_hf_trainer_refuses_a_damaged_adaptive_file_before_loading_the_model(
    job: list[dict[str, Any]],
) -> None:
    for r in (x["hf"] for x in job):
        assert r["error"] and "distamp_adaptive.pt" in r["error"] and "ranks 0,1" in r["error"], r
        assert r["unchanged"], "the Trainer loaded the model before the refusal"
        assert r["step"] == 0, "the Trainer moved its step before the refusal"


@pytest.mark.skipif(not LIGHTNING, reason="needs distamp[lightning]")
def test_lightning_refuses_a_plugin_state_before_restoring_the_model(
    job: list[dict[str, Any]],
) -> None:
    for r in (x["lightning"] for x in job):
        assert r["error"] and "refused.ckpt" in r["error"] and "scale" in r["error"], r
        assert "ranks 0,1" in r["error"], r
        assert r["unchanged"], "Lightning restored the model before the refusal"


@pytest.mark.parametrize("keep", [None, True, 0, -1, 1.5, "2"])
def test_bad_keep_is_refused_before_anything_is_written(keep: Any, tmp_path: Path) -> None:
    amp = _engine("none", hook=None)
    _train(amp, 1, seed=1)
    with pytest.raises(ValueError, match="keep"):
        amp.save_state(tmp_path / "ckpt", keep=keep)
    assert not (tmp_path / "ckpt").exists()


def test_checkpoint_without_listing_loads_as_before(tmp_path: Path) -> None:
    amp = _engine("none", hook=None)
    _train(amp, 2, seed=1)
    step_dir = amp.save_state(tmp_path)
    assert (step_dir / LISTING).is_file()
    (step_dir / LISTING).unlink()  # as written before listings existed
    expected = _snapshot(amp)
    fresh = _engine("none", hook=None)
    assert fresh.load_state(tmp_path)
    got = _snapshot(fresh)
    assert same_state(got["model"], expected["model"]) and got["step"] == expected["step"] == 2
