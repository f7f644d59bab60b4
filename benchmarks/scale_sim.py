"""The scaler's host cost at simulated world sizes, through torch's fake process group.

One process plays rank 0 of a job of ``world`` ranks: ``init_process_group("fake")`` with torch's
``FakeStore`` makes every collective a no-op, so what is timed is the host work that grows (or
must not grow) with the world size: meshes, topology, agreement groups, the step's bookkeeping.
Layouts, each on a small model (4 layers of 64 x 64):

- ``dp x tp``: mesh (dp=world/2, tp=2), Colwise/Rowwise ``parallelize_module`` then
  ``fully_shard`` over dp;
- ``pp x dp``: mesh (pp=4, dp=world/4), this rank's pipeline stage ``fully_shard``-ed over its dp
  sub-mesh (the scaler agrees over the whole job, every stage);
- ``experts``: dense layers ``fully_shard``-ed over all ranks, expert weights DTensors on a mesh
  (edp=world/8, ep=8) with ``(Replicate(), Shard(0))``.

Per world size and layout: setup (the scaler's construction plus its first clip + step + update,
where topology and groups are built) and the median per-step cost of ``clip_grad_norm_`` + ``step``
+ ``update`` over ``--steps`` steps (forward/backward untimed). The last line gives the ratio of
the largest to the smallest world size (target <= 1.3 per step; setup < 2 s at 16384).

    python benchmarks/scale_sim.py [--worlds 8,64,512,4096,16384] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("dp x tp", "pp x dp", "experts")
WIDTH, LAYERS, EXPERTS_PER_RANK = 64, 4, 2


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _build(layout: str, world: int) -> tuple[list[nn.Parameter], Callable[[], torch.Tensor]]:
    """This rank's parameters and a loss function (forward) for ``layout`` at ``world`` ranks."""
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    x = torch.randn(4, WIDTH)
    if layout == "dp x tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = _mlp()
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(4)}
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
        return list(model.parameters()), lambda: model(x).square().mean()
    if layout == "pp x dp":
        mesh = init_device_mesh("cpu", (4, world // 4), mesh_dim_names=("pp", "dp"))
        stage = _mlp()  # rank 0 holds stage 0; the other stages' ranks hold the same shapes
        fully_shard(stage, mesh=mesh["dp"])
        return list(stage.parameters()), lambda: stage(x).square().mean()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ep = min(8, world)
    expert_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    dense = _mlp()
    fully_shard(dense, mesh=mesh)
    full = torch.randn(EXPERTS_PER_RANK * ep, WIDTH, WIDTH) * 0.01
    experts = nn.Parameter(distribute_tensor(full, expert_mesh, [Replicate(), Shard(0)]))

    def loss() -> torch.Tensor:
        local = experts.to_local() if isinstance(experts, DTensor) else experts
        h = dense(x)
        return h.square().mean() + torch.einsum("bi,eij->bej", h, local).square().mean()

    return [*dense.parameters(), experts], loss


def _measure(layout: str, world: int, steps: int) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distamp import DistributedGradScaler

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        t0 = time.perf_counter()
        params, loss_fn = _build(layout, world)
        mesh_s = time.perf_counter() - t0
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        times: list[float] = []
        setup = 0.0
        for i in range(steps + 1):
            opt.zero_grad()
            t = time.perf_counter()
            if i == 0:
                scaler = DistributedGradScaler("cpu")
            scaled = scaler.scale(loss_fn())
            t_scale = time.perf_counter() - t
            scaled.backward()
            t = time.perf_counter()
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
            elapsed = time.perf_counter() - t
            if i == 0:
                setup = elapsed + t_scale
            else:
                times.append(elapsed)
        return {"mesh_s": mesh_s, "setup_s": setup, "step_ms": statistics.median(times) * 1e3}
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", default="8,64,512,4096,16384")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    layouts = [name.strip() for name in args.layouts.split(",")]
    for name in layouts:
        if name not in LAYOUTS:
            raise ValueError(f"--layouts: {name!r} is not one of {LAYOUTS}")
    torch.set_num_threads(1)
    print(
        f"fake process group, rank 0 of N, 1 thread; median of {args.steps} steps of "
        "clip_grad_norm_ + step + update (foreach AdamW); setup = scaler built + first step"
    )
    header = f"{'layout':8} {'world':>6} | {'mesh+wrap s':>11} {'setup ms':>9} {'step ms':>8}"
    print(header)
    print("-" * len(header))
    for name in layouts:  # warm-up: first-use imports and caches belong to no world size
        _measure(name, worlds[0], 2)
    for name in layouts:
        rows: dict[int, dict[str, float]] = {}
        for world in worlds:
            r = rows[world] = _measure(name, world, args.steps)
            print(
                f"{name:8} {world:6d} | {r['mesh_s']:11.2f} {r['setup_s'] * 1e3:9.1f} "
                f"{r['step_ms']:8.2f}"
            )
        lo, hi = rows[worlds[0]], rows[worlds[-1]]
        print(
            f"{name:8} {worlds[-1]}/{worlds[0]}: step x{hi['step_ms'] / lo['step_ms']:.2f}, "
            f"setup x{hi['setup_s'] / lo['setup_s']:.2f}"
        )


if __name__ == "__main__":
    main()
