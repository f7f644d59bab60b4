"""A directory that not every rank sees, refused before training, on 2 real gloo ranks.

Each rank given a directory of its own stands in for node-local disks (the same path on two
hosts, two different disks): ``check_shared_directory`` and ``fit(checkpoint_dir=...)`` refuse it
on every rank before the first step, naming the directory and the fix; a directory they share
passes and keeps no probe file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

import distamp
from distamp.engine import DistAMP


def _refusal(fn: Any) -> str | None:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    own = Path(root) / f"node{rank}"  # this rank's "local disk"
    shared = Path(root) / "shared"
    out: dict[str, Any] = {
        "own": _refusal(lambda: distamp.check_shared_directory(own)),
        "shared": _refusal(lambda: distamp.check_shared_directory(shared)),
    }
    amp = DistAMP(precision="bf16", strategy="ddp", device="cpu")
    torch.manual_seed(0)
    model, _ = amp.setup(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    stepped: list[int] = []
    out["fit"] = _refusal(
        lambda: amp.fit(
            lambda k: torch.randn(8, 4),
            lambda m, x: m(x).square().mean(),
            steps=3,
            on_step=stepped.append,
            checkpoint_dir=own / "ckpt",
        )
    )
    out["stepped"] = stepped
    after = list(model.parameters())
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    out["step_count"] = amp.step_count
    amp.close()
    return out


def test_directory_not_shared_is_refused_on_every_rank_before_training(tmp_path: Path) -> None:
    results = run_ranks(_scenarios, 2, str(tmp_path), timeout=120)
    for rank, r in enumerate(results):
        for case in ("own", "fit"):
            message = r[case]
            assert message is not None, (rank, case)
            assert f"node{rank}" in message, message  # the directory, as this rank spelled it
            assert "not one filesystem shared by every rank" in message, message
            assert "rank 0 does not see the files rank(s) 1 wrote there" in message, message
            assert "node-local disk" in message, message
        assert r["shared"] is None, r["shared"]
        assert r["stepped"] == [] and r["step_count"] == 0 and r["unchanged"], r
    assert not list((tmp_path / "shared").iterdir()), "probe files left behind"
    assert not (tmp_path / "node0" / "ckpt" / "latest.json").exists()


def test_one_process_only_creates_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    assert distamp.check_shared_directory(target) == target
    assert target.is_dir() and not list(target.iterdir())


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="cannot create directory"):
        distamp.check_shared_directory(tmp_path / "f")
