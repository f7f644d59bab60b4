"""The README's Ray Train recipe: a TorchTrainer whose loop uses DistAMP, 2 CPU workers.

Ray starts the workers and their gloo group; distamp detects launcher "ray" and keeps the group.
An inf is written into worker 1's gradient after backward (after DDP's all-reduce) at two steps:
both workers skip the same steps, the scheduler steps only on real steps, and the parameters
end bitwise equal; a second engine resumed from the first one's checkpoint (saved mid-run with
``amp.save_state``) ends bitwise where the uninterrupted run ended. Ray's start-up dominates the
time (about a minute on 2 CPUs).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.train.torch", reason="needs distamp[ray]")

STEPS, BAD_STEPS, SAVE_AFTER = 6, (2, 4), 3


def _run(config: dict[str, Any], rank: int, seed: int, start: int, stop: int) -> dict[str, Any]:
    """Steps ``start``..``stop - 1`` of the recipe's loop on a fresh engine; from a checkpoint
    when ``start > 0``, saving one after step ``SAVE_AFTER - 1`` otherwise."""
    import torch

    import distamp

    torch.manual_seed(seed)  # a resumed run starts from other weights: the checkpoint must win
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    amp = distamp.DistAMP("fp16", strategy="ddp", device="cpu")
    model, _ = amp.setup(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-2),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k)),
    )
    if start:
        amp.load_state(config["ckpt"])
    stepped = []
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(100 * step + rank)
        with amp.autocast():
            loss = model(torch.randn(4, 8, generator=gen)).float().square().mean()
        amp.backward(loss)
        if step in config["bad_steps"] and rank == 1:
            next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
        stepped.append(amp.step().stepped)
        if not start and step == SAVE_AFTER - 1:
            amp.save_state(config["ckpt"])  # a Ray checkpoint directory would hold this
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    out = {"stepped": stepped, "scheduler_steps": amp.scheduler.last_epoch, "digest": h.hexdigest()}
    amp.close()
    return out


def _loop(config: dict[str, Any]) -> None:
    import torch

    import distamp

    env = distamp.detect_environment()
    whole = _run(config, env.rank, 0, 0, STEPS)
    resumed = _run(config, env.rank, 1, SAVE_AFTER, STEPS)
    mine = {**whole, "resumed": resumed}
    ranks: list[Any] = [None] * env.world_size
    torch.distributed.all_gather_object(ranks, mine)  # Ray keeps rank 0's report only
    if env.rank == 0:  # Ray Train 2.60 keeps reported metrics only with a checkpoint
        Path(config["out"]).write_text(json.dumps({"launcher": env.launcher, "ranks": ranks}))


def test_torch_trainer_with_distamp(tmp_path: Path) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    tests = Path(__file__).resolve().parent  # the workers import this module by name
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    try:
        trainer = TorchTrainer(
            _loop,
            train_loop_config={
                "bad_steps": BAD_STEPS,
                "out": str(tmp_path / "out.json"),
                "ckpt": str(tmp_path / "engine-ckpt"),
            },
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            torch_config=TorchConfig(backend="gloo", timeout_s=120),
            run_config=RunConfig(storage_path=str(tmp_path), name="distamp"),
        )
        trainer.fit()
    finally:
        ray.shutdown()
    m = json.loads((tmp_path / "out.json").read_text())
    assert m["launcher"] == "ray"
    r0, r1 = m["ranks"]
    assert r0["stepped"] == r1["stepped"] == [k not in BAD_STEPS for k in range(STEPS)]
    assert r0["scheduler_steps"] == r1["scheduler_steps"] == STEPS - len(BAD_STEPS)
    assert r0["digest"] == r1["digest"]  # bitwise-equal parameters
    # resumed from the engine's checkpoint after step 2 (from other initial weights): the
    # remaining steps skip alike and end bitwise where the uninterrupted run ended
    for r in (r0, r1):
        assert r["resumed"]["stepped"] == r["stepped"][SAVE_AFTER:]
        assert r["resumed"]["scheduler_steps"] == r["scheduler_steps"]
        assert r["resumed"]["digest"] == r["digest"]
