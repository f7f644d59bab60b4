"""Reading a checkpoint (distamp/engine/checkpoint_load.py): damage is refused naming the file,
and a checkpoint of another world size loads resharded.

- A truncated or corrupted file (manifest, ``trainer.pt``, a shard, an RNG file, DCP's
  metadata): a ``CheckpointError`` naming the file and the older good checkpoint; the model and
  the checkpoint directory are left exactly as they were.
- A manifest pointing outside the checkpoint directory is refused.
- A checkpoint saved by 2 ranks (DDP, FSDP2) loads on 1 process, resharded through
  ``torch.distributed.checkpoint``, and trains on.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from engine_scenarios import clipped_engine as _engine
from engine_scenarios import train_steps as _train
from torch import nn

from distamp.engine import DistAMP
from distamp.engine.checkpoint import CheckpointError


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
