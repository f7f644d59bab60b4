"""DDP gradient communication side by side: bytes, error, host time and final loss per hook.

On 2 and 4 gloo ranks (CPU), the main job's GPT (``launch/model.py``, fp32 compute, AdamW,
clipping at 1.0) trained ``--steps`` steps through ``DistAMP(strategy="ddp", comm_hook=...)``
with each hook: ``"fp32"`` (DDP's own all-reduce, counted), ``"bf16"``, ``"fp16"``, ``"fp8"``,
``"fp8-ef"`` and ``"powersgd"``. Printed per hook:

- bytes each rank sends for gradients per step (payload and scales together), counted from the
  tensors handed to the collectives (every call is wrapped; ring volumes: an all-reduce of B
  bytes sends ``2 (w-1)/w B``, an all-to-all ``(w-1)/w B``, an all-gather of a B-byte part
  ``(w-1) B``) over the timed steps (after ``--skip``: PowerSGD all-reduces plainly for its
  first 10 steps), and the ratio to fp32's;
- the relative error of one reduced gradient against the exact fp32 average of the same
  gradients (the second backward of the same weights and data: PowerSGD's first is plain);
- host time per step (median after the first ``--skip`` steps, steps interleaved with nothing:
  each hook in its own run);
- the held-out loss at the end, and its ratio to fp32's.

Run: ``python benchmarks/grad_compression.py [--steps 100] [--worlds 2 4]``. ``--size medium``
(``launch/model.py``'s ``SIZES``: 21M parameters, four DDP buckets at the default cap instead of
the tiny model's one) measures the hooks where a step sends several buckets; on a CPU a dozen
steps are enough for bytes, error and step time
(``--size medium --steps 12 --skip 10 --batch-size 4 --worlds 2``: PowerSGD compresses from its
11th step); its loss after so few steps says little (the first steps swing it by a nat).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distamp
from distamp.agreement.traffic import wire_bytes
from distamp.cluster.spawn import run_ranks
from distamp.parallel import fp8_comm
from launch.model import DATA_FILE, GPT, SIZES, GPTConfig, ShardedText, lm_loss, load_text

HOOKS = ("fp32", "bf16", "fp16", "fp8", "fp8-ef", "powersgd")
_HOOK_MODULES = ("distamp.parallel.comm_hooks", "distamp.parallel.fp8_comm")
_TORCH_HOOKS = "torch.distributed.algorithms.ddp_comm_hooks"  # PowerSGD's and its fallback


class Counter:
    """Wraps the collectives the hooks call and adds up what each rank sends (by the ring
    volumes above); the scaler's and the engine's own collectives are left out."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes = world, 0
        self.real = (dist.all_reduce, dist.all_to_all_single, fp8_comm._all_gather)
        dist.all_reduce = self._wrap("all_reduce", 0)  # type: ignore[assignment]
        dist.all_to_all_single = self._wrap("all_to_all", 1)  # type: ignore[assignment]
        fp8_comm._all_gather = self._wrap("all_gather", 1)

    def _wrap(self, kind: str, arg: int) -> Any:
        real = {"all_reduce": self.real[0], "all_to_all": self.real[1], "all_gather": self.real[2]}

        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in _HOOK_MODULES or caller.startswith(_TORCH_HOOKS):
                t = args[arg]
                self.bytes += wire_bytes(kind, t.numel() * t.element_size(), self.world)
            return real[kind](*args, **kwargs)

        return call


def _grad_error(hook: str, rank: int, world: int, cfg: GPTConfig, batch: Any) -> float:
    """One backward through DDP with ``hook`` against the exact average of the same grads."""
    from distamp.parallel.comm_hooks import register_comm_hook

    torch.manual_seed(0)
    model, plain = GPT(cfg), GPT(cfg)
    plain.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # PowerSGD compresses from its first step only without its cross-step state
    psgd = {"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False}
    options = psgd if hook == "powersgd" else {}
    register_comm_hook(ddp, hook, **options)
    lm_loss(ddp, batch).backward()  # PowerSGD's first step is uncompressed: measure the second
    model.zero_grad()
    lm_loss(ddp, batch).backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    lm_loss(plain, batch).backward()
    exact = torch.cat([p.grad.flatten() for p in plain.parameters()])
    dist.all_reduce(exact)
    exact /= world
    return float((got - exact).norm() / exact.norm())


def _worker(
    rank: int, world: int, steps: int, size: str, batch_size: int, skip: int
) -> dict[str, Any]:
    cfg, text = SIZES[size], load_text(DATA_FILE)
    device = torch.device("cpu")
    held_out = ShardedText(text, context=cfg.context, batch_size=64, rank=0, world_size=1,
                           seed=99, device=device).batch(0)  # fmt: skip
    out: dict[str, Any] = {}
    for hook in HOOKS:
        data = ShardedText(text, context=cfg.context, batch_size=batch_size, rank=rank,
                           world_size=world, seed=0, device=device)  # fmt: skip
        error = _grad_error(hook, rank, world, cfg, data.batch(0))
        torch.manual_seed(0)
        amp = distamp.DistAMP("fp32", strategy="ddp", comm_hook=hook, max_grad_norm=1.0)
        amp.setup(GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3))
        counter = Counter(world)
        times = []
        try:
            for k in range(steps):
                if k == skip:
                    counter.bytes = 0  # the bytes of the timed steps only
                t0 = time.perf_counter()
                loss = lm_loss(amp.model, data.batch(k))
                amp.backward_and_step(loss)
                times.append(time.perf_counter() - t0)
        finally:
            dist.all_reduce, dist.all_to_all_single, fp8_comm._all_gather = counter.real
        with torch.no_grad():
            final = float(lm_loss(amp.model, held_out))
        out[hook] = {"bytes": counter.bytes / (steps - skip), "error": error,
                     "ms": statistics.median(times[skip:]) * 1e3, "loss": final}  # fmt: skip
        amp.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--size", choices=SIZES, default="tiny", help="the main job's --size")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    parser.add_argument(
        "--skip", type=int, default=3, help="first steps left out of the step time (warm-up)"
    )
    args = parser.parse_args()
    if not 0 <= args.skip < args.steps:
        parser.error(f"argument --skip: expected 0 <= --skip < --steps={args.steps}")
    params = sum(p.numel() for p in GPT(SIZES[args.size]).parameters())
    print(f"torch {torch.__version__}, cpu, gloo, main job's GPT --size {args.size} "
          f"({params:,} parameters), batch {args.batch_size}, {args.steps} steps (step time: "
          f"median after {args.skip}), fp32 compute")  # fmt: skip
    for world in args.worlds:
        run = (args.steps, args.size, args.batch_size, args.skip)
        res = run_ranks(_worker, world, *run, timeout=3600, threads=1)[0]
        base = res["fp32"]
        print(f"\n{world} ranks")
        print(f"{'hook':9} {'bytes/step':>11} {'vs fp32':>8} {'grad err':>9} {'ms/step':>8} "
              f"{'loss':>8} {'vs fp32':>8}")  # fmt: skip
        for hook in HOOKS:
            r = res[hook]
            print(f"{hook:9} {r['bytes']:11.0f} {r['bytes'] / base['bytes']:8.3f} "
                  f"{r['error']:9.2e} {r['ms']:8.2f} {r['loss']:8.4f} "
                  f"{r['loss'] / base['loss']:8.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
