"""fp8 on a mesh you build yourself: the main job's GPT, tensor parallel MLPs, FSDP2 over dp.

The order is the point: convert the selected Linear layers to float8 FIRST
(:func:`distamp.fp8.convert_for_fp8`), then ``parallelize_module`` with the float8
tensor-parallel styles (:func:`distamp.fp8_parallel.fp8_tp_plan`), then ``fully_shard`` over
``dp`` (weights all-gathered in float8), and only then hand the model to
``DistAMP(precision="fp8", mesh=...)``, which wraps nothing, skips steps on every rank alike and
recomputes the float8 weight scales after every step in one all-reduce::

    distamp launch --nproc-per-node 2 launch/fp8_mesh_example.py            # dp=1 x tp=2
    distamp launch --nproc-per-node 4 launch/fp8_mesh_example.py --tp 2     # dp=2 x tp=2

Rank 0 prints ONE JSON line at the end (final loss, layout, fp8 layers, the TP styles used).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `launch.model` (and a checkout)

from distamp import AutocastPolicy, DistAMP, init_distributed, shutdown_distributed
from launch.model import GPT, GPTConfig, ShardedText, lm_loss, load_text


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the ranks)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=16, help="per data-parallel rank")
    p.add_argument(
        "--fp8-min-features", type=int, default=64, help="the main job's layers are small"
    )
    p.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from distamp.fp8 import convert_for_fp8
    from distamp.fp8_parallel import fp8_tp_plan

    args = parse(argv)
    env = init_distributed()
    if env.world_size % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {env.world_size} ranks")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # identical init on every rank
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(
        device, (env.world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp")
    )
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    policy = AutocastPolicy("fp8", recipe=args.recipe, fp8_min_features=args.fp8_min_features)

    # 1. float8 layers first: the TP styles and fully_shard must see them.
    fp8 = convert_for_fp8(model, policy, fully_sharded=True)
    # 2. tensor parallel MLPs, with torchao's float8 styles on the float8 layers.
    plan = {}
    for i in range(cfg.n_layers):
        plan[f"blocks.{i}.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.out"] = RowwiseParallel()
    plan = fp8_tp_plan(model, plan)
    parallelize_module(model, mesh["tp"], plan)
    # 3. FSDP2 over dp: float8 weights gathered in float8.
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # 4. the engine: nothing wrapped again, one skip decision, the float8 scales each step.
    amp = DistAMP(precision="fp8", policy=policy, mesh=mesh)
    amp.setup(model, lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1))

    dp = mesh.get_local_rank("dp")
    data = ShardedText(
        load_text(),
        context=cfg.context,
        batch_size=args.batch_size,
        rank=dp,  # tensor-parallel peers read the same batch
        world_size=mesh["dp"].size(),
        seed=args.seed,
        device=amp.device,
    )
    stats = amp.fit(data.batch, lm_loss, steps=args.steps, log_interval=max(1, args.steps // 4))
    if env.rank == 0:
        summary = {
            "final_loss": stats.last_loss if stats else None,
            "steps": amp.step_count,
            "skipped_steps": stats.skipped_steps if stats else None,
            "layout": {"dp": mesh["dp"].size(), "tp": args.tp},
            "recipe": args.recipe,
            "fp8_layers": fp8.converted,
            "float8_gathered": amp.fp8.scales.layers if amp.fp8 and amp.fp8.scales else [],
            "tp_styles": sorted({type(s).__name__ for s in plan.values()}),
        }
        print(json.dumps(summary), flush=True)
    amp.close()
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
