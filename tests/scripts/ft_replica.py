"""One torchft replica group of one rank, training a small model under fp16 autocast with
distamp's scaler agreeing through the torchft Manager (started by tests/test_torchft.py).

Usage: ft_replica.py REPLICA_ID LIGHTHOUSE OUT_JSON --steps N [--inf-at STEP ...]
[--exit-at STEP] [--exit-after-unscale] [--sleep S] [--no-scaler] [--no-heal-state] [--engine]

``--inf-at`` writes an inf into this replica's gradient after backward at those torchft steps
(the manager's step, identical on every replica of a quorum). ``--exit-at`` makes the process
die (``os._exit``) at that step: before it joins the step's quorum, or between its unscale and
its commit with ``--exit-after-unscale``. The JSON written at the end holds, per iteration, the
manager step, the skip decision, the scale and whether torchft committed it, plus the final
parameters and timings. ``--engine`` trains through ``DistAMP(precision="fp16",
ft_manager=manager)`` instead (it wraps the model, starts the quorums and steps).
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
from torch import nn

import distamp


def wait_for(files: list[str], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f) for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"never appeared: {files}")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("replica", type=int)
    ap.add_argument("lighthouse")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--inf-at", type=int, nargs="*", default=[])
    ap.add_argument("--exit-at", type=int, default=-1)
    ap.add_argument("--exit-after-unscale", action="store_true")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--no-scaler", action="store_true")
    ap.add_argument("--no-heal-state", action="store_true")
    ap.add_argument("--engine", action="store_true", help="train through DistAMP(ft_manager=)")
    ap.add_argument("--join-first", action="store_true",
                    help="with --engine: ask for the first quorum before creating --ready, so that "
                    "a survivor paused until then finds this replica in its quorum")  # fmt: skip
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--wait-for", nargs="*", default=[],
                    help="files to wait for before the first step (the other replicas' ready "
                    "files), so that the first quorum holds every replica")  # fmt: skip
    ap.add_argument("--pause-at", type=int, default=-1)
    ap.add_argument("--pause-until", default="", help="file whose existence ends the pause")
    ap.add_argument("--ready", default="", help="file to create once the Manager is up")
    ap.add_argument("--comm-hook", default=None, help="with --engine: DistAMP's comm_hook")
    ap.add_argument("--inf-loss-at", type=int, nargs="*", default=[],
                    help="with --engine: an inf in this replica's loss (inside its gradient "
                    "buckets, before the exchange) at those steps")  # fmt: skip
    ap.add_argument("--neg-inf-element-at", type=int, nargs="*", default=[],
                    help="with --engine: one element of this replica's raw gradient set to -inf "
                    "during backward (before the exchange) at those steps")  # fmt: skip
    ap.add_argument("--gpt", action="store_true",
                    help="with --engine: the main job's GPT in fp32 on this replica's shard of "
                    "the text; the held-out loss at the end")  # fmt: skip
    args = ap.parse_args()
    torch.set_num_threads(1)

    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    if args.gpt:
        from launch.model import GPT, GPTConfig

        model = GPT(GPTConfig())
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                              nn.Linear(args.width, 1))  # fmt: skip
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def load_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state,
        state_dict=save_state,
        min_replica_size=1,
        replica_id=f"replica_{args.replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
    )
    ready_at = time.perf_counter()
    if args.engine:
        _engine_loop(args, manager, model, inner, ready_at)
    if args.ready:
        open(args.ready, "w").close()
    wait_for(args.wait_for)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    scaler = None
    if not args.no_scaler:
        scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**10, growth_interval=3,
                                               process_group=manager)  # fmt: skip
        if args.no_heal_state:  # the scaler's state left out of what heals (benchmark baseline)
            scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**10, growth_interval=3)

    log: list[dict] = []
    step_times: list[float] = []
    first_commit: float | None = None
    start = time.perf_counter()
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        step = manager.current_step()
        if step == args.pause_at:  # wait (outside any collective) for a restarted replica
            wait_for([args.pause_until])
        if step == args.exit_at and not args.exit_after_unscale:
            # Before joining the step's quorum: torchft 0.2's DDP comm hook fails with an
            # AssertionError on the survivors when a peer dies inside the gradient all-reduce.
            os._exit(3)
        optimizer.zero_grad()  # starts the quorum
        g = torch.Generator().manual_seed(1000 * args.replica + step)
        x = torch.randn(16, args.width, generator=g)
        y = torch.randn(16, 1, generator=g)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(ddp(x).float(), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
            log.append({"step": step, "skipped": False, "scale": 1.0, "skipped_steps": 0,
                        "committed": manager.current_step() > step})  # fmt: skip
        else:
            scaler.scale(loss).backward()
            if step in args.inf_at:
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.unscale_(optimizer)
            if step == args.exit_at:
                os._exit(3)  # between the unscale (and the flag agreement) and the commit
            scaler.step(optimizer)
            scaler.update()
            log.append({"step": step, "skipped": bool(scaler.last_step_skipped),
                        "scale": scaler.get_scale(), "committed": manager.current_step() > step,
                        "skipped_steps": scaler.skipped_steps})  # fmt: skip
        step_times.append(time.perf_counter() - t0)
        if first_commit is None and manager.current_step() > step:
            first_commit = time.perf_counter() - ready_at  # includes healing, if any
        if args.sleep:
            time.sleep(args.sleep)
    params = [p.detach().tolist() for p in model.parameters()]
    out = {"log": log, "params": params, "step_times": step_times,
           "elapsed": time.perf_counter() - start, "first_commit_s": first_commit}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(out, f)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)


def _engine_loop(args: argparse.Namespace, manager, model, inner, ready_at: float) -> None:
    """The same training through the engine: DistAMP wraps the model in torchft's DDP, builds
    nothing else (the scaler is passed for its test settings), starts each step's quorum and
    votes in ``step()``."""
    scaler = None  # fp32: the engine builds its check-only scaler on the Manager
    if not args.gpt:  # fp16 matmuls are slow on CPUs: the main job's model runs in fp32
        scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**10, growth_interval=3,
                                               process_group=manager)  # fmt: skip
    precision = "fp32" if args.gpt else "fp16"
    amp = distamp.DistAMP(precision, ft_manager=manager, scaler=scaler,
                          device="cpu", comm_hook=args.comm_hook,
                          max_grad_norm=1.0 if args.gpt else None)  # fmt: skip
    ddp, _ = amp.setup(model, inner)
    batch = _gpt_batches(args.replica) if args.gpt else None
    residuals_reset: list[bool] = []
    if args.join_first:
        with amp.autocast():  # the first step's quorum (later calls in the step ask nothing)
            pass
    if args.ready:  # after setup: a restarted replica asks for its first quorum right away
        open(args.ready, "w").close()
    wait_for(args.wait_for)
    log: list[dict] = []
    step_times: list[float] = []
    first_commit: float | None = None
    start = time.perf_counter()
    while manager.current_step() < args.steps:
        t0 = time.perf_counter()
        step = manager.current_step()
        if step == args.pause_at:
            wait_for([args.pause_until])
            # The restarted replica asked for its quorum before creating the file, but torchft
            # sends the request from a background thread: give it time to reach the Lighthouse
            # (else this replica, the previous quorum's only member, forms one alone at once).
            time.sleep(1.0)
        if step == args.exit_at:
            os._exit(3)
        if batch is not None:
            from launch.model import lm_loss

            with amp.autocast():
                loss = lm_loss(ddp, batch(step))
        else:
            g = torch.Generator().manual_seed(1000 * args.replica + step)
            x = torch.randn(16, args.width, generator=g)
            y = torch.randn(16, 1, generator=g)
            with amp.autocast():
                loss = nn.functional.mse_loss(ddp(x).float(), y)
        if step in args.inf_loss_at:
            loss = loss * float("inf")
        poisoned = step in args.neg_inf_element_at
        hook = next(model.parameters()).register_hook(_neg_inf_element) if poisoned else None
        amp.backward(loss)
        if hook is not None:
            hook.remove()
        if step in args.inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        nonfinite_bucket = step in args.inf_loss_at or poisoned
        if nonfinite_bucket and getattr(amp.comm_hook_state, "error_feedback", False):
            kept = amp.comm_hook_state.residuals  # written by this step's exchange
            residuals_reset.append(bool(kept) and all(bool((r == 0).all()) for r in kept.values()))
        result = amp.step()
        log.append({"step": step, "skipped": not result.stepped, "scale": result.loss_scale,
                    "committed": manager.current_step() > step,
                    "skipped_steps": amp.scaler.skipped_steps})  # fmt: skip
        step_times.append(time.perf_counter() - t0)
        if first_commit is None and manager.current_step() > step:
            first_commit = time.perf_counter() - ready_at
    params = [p.detach().flatten().tolist() for p in model.parameters()]
    stats = amp.metrics.collect(scaler=amp.scaler)  # the run's gradient bytes per step
    out = {"log": log, "params": params, "step_times": step_times, "strategy": amp.strategy,
           "wrapper": type(ddp).__module__ + "." + type(ddp).__name__,
           "elapsed": time.perf_counter() - start, "first_commit_s": first_commit,
           "grad_bytes": stats.grad_bytes, "grad_scale_bytes": stats.grad_scale_bytes,
           "residuals_reset": residuals_reset}  # fmt: skip
    if batch is not None:
        from launch.model import lm_loss

        with torch.no_grad():
            out["held_out"] = float(lm_loss(model, _gpt_batches(0, held_out=True)(0)))
    with open(args.out, "w") as f:
        json.dump(out, f)
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)


def _neg_inf_element(grad: torch.Tensor) -> torch.Tensor:
    """One element of the raw gradient set to -inf, as one overflowing product would."""
    grad = grad.clone()
    grad.view(-1)[0] = float("-inf")
    return grad


def _gpt_batches(replica: int, held_out: bool = False):  # a batch(k) function
    """The main job's text: this replica's shard (2 replicas), or the held-out batch."""
    from launch.model import DATA_FILE, GPTConfig, ShardedText, load_text

    cfg, text = GPTConfig(), load_text(DATA_FILE)
    size, rank, world, seed = (64, 0, 1, 99) if held_out else (16, replica, 2, 0)
    data = ShardedText(text, context=cfg.context, batch_size=size, rank=rank, world_size=world,
                       seed=seed, device=torch.device("cpu"))  # fmt: skip
    return data.batch


if __name__ == "__main__":
    main()
