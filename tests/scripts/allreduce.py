"""Join the group the launcher describes, all-reduce rank+1 over it and print one result line.

Started by the launcher tests (torchrun, mpirun, SLURM-like environments); exits non-zero on a wrong
sum so the launcher's exit code carries the verdict. ``ALLREDUCE_BACKEND`` overrides the backend:
the tests set gloo so that several ranks can share a machine with a single GPU.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from distamp.cluster import init_distributed

TIMEOUT_S = 30.0


def main() -> int:
    torch.set_num_threads(1)
    env = init_distributed(backend=os.environ.get("ALLREDUCE_BACKEND") or None, timeout=TIMEOUT_S)
    try:
        on_gpu = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only
        device = (
            torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        )
        total = torch.tensor([float(env.rank + 1)], device=device)
        dist.all_reduce(total)
        expected = env.world_size * (env.world_size + 1) / 2
        # One write per line: the ranks share the launcher's stdout.
        sys.stdout.write(
            f"rank={env.rank} world_size={env.world_size} launcher={env.launcher} "
            f"local_rank={env.local_rank} sum={total.item():g} expected={expected:g} "
            f"device={device.type}\n"
        )
        sys.stdout.flush()
        return 0 if total.item() == expected else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
