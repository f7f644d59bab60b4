"""One rank of a torchft replica group of two ranks that shards the model with FSDP2 inside the
group, distamp's scaler agreeing over the group and then across replicas through the Manager
(started by tests/test_torchft.py; four processes for two replica groups).

Usage: ft_fsdp2_replica.py REPLICA_ID LIGHTHOUSE OUT_JSON --rank R --port P --steps N
[--inf-at STEP ...] [--ready FILE] [--wait-for FILE ...]

The replica group's ranks meet on their own TCPStore (``--port``; rank 0 hosts it): their
default process group (gloo) for FSDP2 and the store of their Manager. FSDP2 reduce-scatters the
gradients inside the group; its all-reduce hook averages each rank's shard with the same shard of
the other replica groups through ``Manager.allreduce`` (torchft 0.2's way of replicating FSDP
across replica groups). ``--inf-at`` writes an inf into this rank's gradient shard after
backward at those steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from ft_replica import wait_for  # this directory: the sibling script
from torch import nn

import distamp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("replica", type=int)
    ap.add_argument("lighthouse")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--inf-at", type=int, nargs="*", default=[])
    ap.add_argument("--ready", default="")
    ap.add_argument("--wait-for", nargs="*", default=[])
    args = ap.parse_args()
    torch.set_num_threads(1)
    timeout = timedelta(seconds=30)
    store = dist.TCPStore("localhost", args.port, 2, is_master=args.rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("default", store), rank=args.rank,
                            world_size=2, timeout=timeout)  # fmt: skip

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft import Manager, Optimizer, ProcessGroupGloo

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state, state_dict=save_state,
        min_replica_size=1, replica_id=f"replica_{args.replica}", store_addr="localhost",
        store_port=args.port, rank=args.rank, world_size=2, lighthouse_addr=args.lighthouse,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        init_sync=False,  # seeded alike; a step-0 heal of a sharded model: README's limits
    )  # fmt: skip

    def across_replicas(shard: torch.Tensor) -> None:  # in place, averaged over the quorum
        manager.allreduce(shard).wait()

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(across_replicas)
    optimizer = Optimizer(manager, inner)
    scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**10, growth_interval=3,
                                           process_group=manager)  # fmt: skip
    if args.ready:
        open(args.ready, "w").close()
    wait_for(args.wait_for)
    log: list[dict] = []
    start = time.perf_counter()
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        g = torch.Generator().manual_seed(1000 * args.replica + 10 * args.rank + step)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step in args.inf_at:
            next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        log.append({"step": step, "skipped": bool(scaler.last_step_skipped),
                    "scale": scaler.get_scale(), "committed": manager.current_step() > step,
                    "skipped_steps": scaler.skipped_steps})  # fmt: skip
    params = [p.full_tensor().detach().tolist() for p in model.parameters()]
    out = {"log": log, "params": params, "elapsed": time.perf_counter() - start}
    with open(args.out, "w") as f:
        json.dump(out, f)
    manager.shutdown(wait=False)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
