"""FSDP2 float8 weight scales: distamp's WeightScales.update vs torchao's precompute, side by side.

Both compute every float8-gathered weight's scale after an optimizer step in one all-reduce;
torchao's goes through DTensor ops (and needs all weights on one mesh), distamp's reduces a flat
vector keyed by mesh and name (any layout). This measures the per-step cost on one FSDP2 mesh,
where both work, timed alternately in one run over real gloo ranks, and checks the scales are
bitwise equal::

    python benchmarks/fp8_scales.py                  # 2 ranks, 8 and 48 layers of 256 x 256
    python benchmarks/fp8_scales.py --layers 96 --width 1024 --ranks 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distamp.cluster.spawn import run_ranks


def _measure(rank: int, world: int, layers: int, width: int, reps: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from distamp import AutocastPolicy
    from distamp.precision.fp8 import convert_for_fp8
    from distamp.precision.fp8_parallel import WeightScales, gathers_in_float8

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    convert_for_fp8(model, AutocastPolicy("fp8", fp8_min_features=16), fully_sharded=True)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    ours = WeightScales([model])
    gathered = [m for m in model.modules() if gathers_in_float8(m)]

    def scales() -> list[torch.Tensor]:
        return [m.weight._local_tensor._precomputed_scale.clone() for m in gathered]

    ours.update()
    mine = scales()
    precompute_float8_dynamic_scale_for_fsdp(model)
    same = all(map(torch.equal, mine, scales()))
    times: dict[str, list[float]] = {"distamp": [], "torchao": []}
    runs = {
        "distamp": ours.update,
        "torchao": lambda: precompute_float8_dynamic_scale_for_fsdp(model),
    }
    for i in range(reps + 3):
        for name, fn in runs.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    return {"same": same, **{k: statistics.median(v) * 1e3 for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, nargs="*", default=[8, 48])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    print(f"{'layers':>6} {'width':>6} {'distamp ms':>11} {'torchao ms':>11} {'ratio':>6}  same")
    for n in args.layers:
        res = run_ranks(_measure, args.ranks, n, args.width, args.reps, timeout=300)[0]
        ratio = res["distamp"] / res["torchao"]
        print(
            f"{n:>6} {args.width:>6} {res['distamp']:>11.3f} {res['torchao']:>11.3f} "
            f"{ratio:>6.2f}  {res['same']}"
        )


if __name__ == "__main__":
    main()
