"""distamp's host cost at simulated world sizes, through torch's fake process group.

One process plays rank 0 of a job of ``world`` ranks: ``init_process_group("fake")`` with torch's
``FakeStore`` makes every collective a no-op, so what is timed is the host work that grows (or
must not grow) with the world size: meshes, topology, agreement groups, float8 weight-scale
keys, the step's bookkeeping. Layouts, each on a small model (4 layers of 64 x 64):

- ``dp x tp``: mesh (dp=world/2, tp=2), Colwise/Rowwise ``parallelize_module`` (fp8: the float8
  styles of ``fp8_tp_plan``) then ``fully_shard`` over dp;
- ``pp x dp``: mesh (pp=4, dp=world/4), this rank's pipeline stage ``fully_shard``-ed over its dp
  sub-mesh (the scaler agrees over the whole job, every stage);
- ``experts``: dense layers ``fully_shard``-ed over all ranks, expert weights DTensors on a mesh
  (edp=world/8, ep=8) with ``(Replicate(), Shard(0))``.

Each layout runs in fp16 (loss scaling) and fp8 (torchao float8 Linear layers, converted by
``distamp.fp8.convert_for_fp8`` before parallelising; FSDP2 gathers them in float8, so the
engine sets up and updates their weight scales). The model goes through
``DistAMP(precision, mesh=..., max_grad_norm=1.0).setup``. Columns:

- ``torch s``: torch's own setup: ``init_device_mesh``, ``parallelize_module``, ``fully_shard``
  (and ``distribute_tensor`` of the experts), plus the optimizer's own first step (its DTensor
  foreach ops propagate shardings once per mesh; timed through the optimizer's step hooks);
- ``distamp s``: distamp's: ``convert_for_fp8`` (fp8), ``DistAMP(...)`` and ``setup`` (the
  scaler, the float8 weight-scale keys), plus the first ``step()`` less the optimizer's own step
  (topology, agreement groups and gradient groups are built there);
- ``step ms`` / ``best ms``: median / minimum of ``--steps`` ``step()`` calls (clip + optimizer
  step + update, and fp8: the weight-scale update); forward and backward untimed;
- ``distamp``: median of the step less the optimizer's own ``step`` (the optimizer's step hooks):
  distamp's share of the step (clip, flag and norm agreement, update, bookkeeping);
- ``adamw``: median of torch's own foreach AdamW step inside it: the same kind of host work, all
  torch's, in the same process. Everything in a process playing 16384 ranks runs slower (torch's
  step included, by about as much as distamp's share: a profile shows every function slower, none
  called more often), so "distamp's share per AdamW step" separates growth in distamp's own work
  from the process's;
- ``calls``: Python and C function calls of one more step (``sys.setprofile``): the host work
  itself, which a shared machine's timing noise cannot blur.

The ratio lines give the largest over the smallest world size (targets: step <= 1.3,
distamp's setup < 2 s at 16384). The experts use ``ep = min(8, world / 2)`` so that they are
replicated over at least two ranks at every size (the same gradient groups at 8 and 16384).

    python benchmarks/scale_sim.py [--worlds 8,64,512,4096,16384] [--steps 20]
        [--precisions fp16,fp8] [--layouts "dp x tp,pp x dp,experts"]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYOUTS = ("dp x tp", "pp x dp", "experts")
PRECISIONS = ("fp16", "fp8")
WIDTH, LAYERS, EXPERTS_PER_RANK = 64, 4, 2


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _policy(precision: str) -> Any:
    from distamp import AutocastPolicy

    # 64-wide layers: below the default size at which fp8 pays, admitted on purpose here.
    return AutocastPolicy(precision, fp8_min_features=16) if precision == "fp8" else None


def _convert(model: nn.Module, precision: str) -> float:
    """Convert ``model``'s Linear layers to float8 for fp8 (distamp's part); its seconds."""
    if precision != "fp8":
        return 0.0
    from distamp.fp8 import convert_for_fp8

    t = time.perf_counter()
    convert_for_fp8(model, _policy(precision), fully_sharded=True)
    return time.perf_counter() - t


@dataclass
class _Built:
    model: nn.Module
    mesh: Any
    loss: Callable[[], torch.Tensor]
    torch_s: float  # meshes, parallelize_module, fully_shard
    convert_s: float  # convert_for_fp8


def _build(layout: str, world: int, precision: str) -> _Built:
    """This rank's model and a loss function (forward) for ``layout`` at ``world`` ranks."""
    from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from distamp.fp8_parallel import fp8_tp_plan

    x = torch.randn(4, WIDTH)
    model = _mlp()
    convert_s = _convert(model, precision)
    t0 = time.perf_counter()
    if layout == "dp x tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        plan: dict[str, Any] = {
            str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(LAYERS)
        }
        if precision == "fp8":
            t = time.perf_counter()
            plan = fp8_tp_plan(model, plan)  # distamp's part
            convert_s += time.perf_counter() - t
            t0 += time.perf_counter() - t
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])
        return _Built(model, mesh, lambda: model(x), time.perf_counter() - t0, convert_s)
    if layout == "pp x dp":
        mesh = init_device_mesh("cpu", (4, world // 4), mesh_dim_names=("pp", "dp"))
        # rank 0 holds stage 0; the other stages' ranks hold the same shapes
        fully_shard(model, mesh=mesh["dp"])
        return _Built(model, mesh, lambda: model(x), time.perf_counter() - t0, convert_s)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ep = min(8, world // 2)  # experts replicated over >= 2 ranks at every size: one layout
    expert_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("edp", "ep"))
    full = torch.randn(EXPERTS_PER_RANK * ep, WIDTH, WIDTH) * 0.01
    model.experts = nn.Parameter(distribute_tensor(full, expert_mesh, [Replicate(), Shard(0)]))
    fully_shard(model, mesh=mesh, ignored_params={model.experts})
    torch_s = time.perf_counter() - t0

    def loss() -> torch.Tensor:
        experts = model.experts
        local = experts.to_local() if isinstance(experts, DTensor) else experts
        h = model(x)
        return h + torch.einsum("bi,eij->bej", h, local.to(h.dtype)).mean(1)

    return _Built(model, mesh, loss, torch_s, convert_s)


def _one_step(amp: Any, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
    """Forward and backward now; the returned call runs the step (what is timed)."""
    with amp.autocast():
        loss = loss_fn().float().square().mean()
    amp.backward(loss)
    return amp.step


def _count_calls(prepare: Callable[[], Callable[[], Any]]) -> float:
    """Python and C function calls made by one step: host work that a loaded machine's timing
    noise does not blur (equal counts at two world sizes: no work grows with the world)."""
    step = prepare()
    count = [0]

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return float(count[0])


def _measure(layout: str, world: int, precision: str, steps: int) -> dict[str, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distamp import DistAMP

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        built = _build(layout, world, precision)
        opt = torch.optim.AdamW(built.model.parameters(), lr=1e-4, foreach=True)
        t = time.perf_counter()
        amp = DistAMP(
            precision=precision, policy=_policy(precision), mesh=built.mesh, max_grad_norm=1.0
        )
        _, opt = amp.setup(built.model, opt)
        distamp_s = built.convert_s + time.perf_counter() - t
        # The optimizer's own first step is torch's (DTensor sharding propagation of its foreach
        # ops, cached per mesh afterwards): timed through its hooks and counted as torch's.
        inner = {"start": 0.0, "seconds": 0.0}
        pre = opt.register_step_pre_hook(lambda *_: inner.update(start=time.perf_counter()))
        post = opt.register_step_post_hook(
            lambda *_: inner.update(seconds=time.perf_counter() - inner["start"])
        )
        times: list[float] = []
        own: list[float] = []  # the step less the optimizer's own step: distamp's share
        adamw: list[float] = []  # torch's own AdamW step inside it: the same process's yardstick
        torch_s = built.torch_s
        for i in range(steps + 1):
            step = _one_step(amp, built.loss)
            t = time.perf_counter()
            step()
            elapsed = time.perf_counter() - t
            if i == 0:  # topology, agreement and gradient groups: built lazily
                distamp_s += elapsed - inner["seconds"]
                torch_s += inner["seconds"]
            else:
                times.append(elapsed)
                own.append(elapsed - inner["seconds"])
                adamw.append(inner["seconds"])
        pre.remove()
        post.remove()
        calls = _count_calls(lambda: _one_step(amp, built.loss))
        amp.close()
        return {
            "calls": calls,
            "best_ms": min(times) * 1e3,
            "own_ms": statistics.median(own) * 1e3,
            "adamw_ms": statistics.median(adamw) * 1e3,
            "torch_s": torch_s,
            "distamp_s": distamp_s,
            "step_ms": statistics.median(times) * 1e3,
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--worlds", default="8,64,512,4096,16384")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    layouts = [name.strip() for name in args.layouts.split(",")]
    precisions = [name.strip() for name in args.precisions.split(",")]
    for name in layouts:
        if name not in LAYOUTS:
            raise ValueError(f"--layouts: {name!r} is not one of {LAYOUTS}")
    for name in precisions:
        if name not in PRECISIONS:
            raise ValueError(f"--precisions: {name!r} is not one of {PRECISIONS}")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # FSDP2's view-output and torchao's notices, per run
    print(
        f"fake process group, rank 0 of N, 1 thread; step = DistAMP.step() (clip + foreach "
        f"AdamW + update [+ fp8 weight scales]), median and best of {args.steps}; calls = Python "
        "and C calls in one step; distamp setup = convert + DistAMP.setup + first step"
    )
    header = (
        f"{'layout':8} {'prec':4} {'world':>6} | {'torch s':>8} {'distamp s':>9} | "
        f"{'step ms':>8} {'best ms':>8} {'distamp':>8} {'adamw':>6} {'calls':>6}"
    )
    print(header)
    print("-" * len(header))
    for name in layouts:  # warm-up: first-use imports and caches belong to no world size
        for precision in precisions:
            _measure(name, worlds[0], precision, 2)
    for name in layouts:
        for precision in precisions:
            rows: dict[int, dict[str, float]] = {}
            for world in worlds:
                gc.collect()
                r = rows[world] = _measure(name, world, precision, args.steps)
                print(
                    f"{name:8} {precision:4} {world:6d} | {r['torch_s']:8.2f} "
                    f"{r['distamp_s']:9.3f} | {r['step_ms']:8.2f} {r['best_ms']:8.2f} "
                    f"{r['own_ms']:8.2f} {r['adamw_ms']:6.2f} {r['calls']:6.0f}",
                    flush=True,
                )
            lo, hi = rows[worlds[0]], rows[worlds[-1]]
            print(
                f"{name:8} {precision:4} {worlds[-1]}/{worlds[0]}: "
                f"step x{hi['step_ms'] / lo['step_ms']:.2f} (best x"
                f"{hi['best_ms'] / lo['best_ms']:.2f}, distamp's share x"
                f"{hi['own_ms'] / lo['own_ms']:.2f}, torch's own AdamW step x"
                f"{hi['adamw_ms'] / lo['adamw_ms']:.2f}, distamp's share per AdamW step x"
                f"{(hi['own_ms'] / hi['adamw_ms']) / (lo['own_ms'] / lo['adamw_ms']):.2f}, "
                f"calls x{hi['calls'] / lo['calls']:.2f}), "
                f"distamp setup {hi['distamp_s']:.3f} s, torch setup {hi['torch_s']:.2f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
