"""Per-step cost of the scaler itself: collectives, host syncs and time, vs torch's scalers.

Two gloo ranks train a model with a few hundred parameter tensors under DDP and FSDP1. Around
each scaler call (``scale``, ``step`` — which unscales —, ``update``) the benchmark counts the
``torch.distributed`` collectives issued from Python and the host syncs (``Tensor.item``,
``Tensor.__bool__``, ``Tensor.tolist``, ``Tensor.cpu``), and times the calls. distamp is measured
side by side with ``torch.amp.GradScaler`` and FSDP's ``ShardedGradScaler`` in the same run.

A second table runs four gloo ranks on the N-D layouts of the scaler tests
(``tests/nd_scenarios.py``): pp=2 x dp=2 (FSDP2 per stage, GPipe) and dp=2 x tp=2 (sequence
parallel, FSDP2 over dp), with clipping. There it times ``clip`` (distamp's ``clip_grad_norm_``;
torch's ``unscale_`` + ``torch.nn.utils.clip_grad_norm_``), ``step`` and ``update``, and counts
collectives including DTensor's own (functional collectives). torch's scaler does not agree
across pipeline stages nor clip to the whole model's norm there: its rows are a timing baseline.

    python benchmarks/scaler_overhead.py [--steps 30] [--layers 100] [--nd-steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
# The N-D layouts are the scaler tests' fixtures; the spawned ranks import them too.
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from distamp.cluster.spawn import run_ranks  # noqa: E402

_SYNC_METHODS = ("item", "__bool__", "tolist", "cpu")
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
)
# DTensor reduces (found_inf of torch's scaler, norms, full_tensor) through these.
_FUNCOL = ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single")


class _Counter:
    """Counts collectives and host syncs while active (patched at the Python level)."""

    def __init__(self) -> None:
        self.collectives = 0
        self.syncs = 0
        self.active = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        import torch.distributed._functional_collectives as funcol

        saved_t = {m: getattr(torch.Tensor, m) for m in _SYNC_METHODS}
        saved_d = {c: getattr(dist, c) for c in _COLLECTIVES}
        saved_f = {c: getattr(funcol, c) for c in _FUNCOL}

        def wrap_sync(fn: Any) -> Any:
            def inner(*a: Any, **k: Any) -> Any:
                if self.active:
                    self.syncs += 1
                return fn(*a, **k)

            return inner

        def wrap_coll(fn: Any) -> Any:
            def inner(*a: Any, **k: Any) -> Any:
                if self.active:
                    self.collectives += 1
                return fn(*a, **k)

            return inner

        for m, fn in saved_t.items():
            setattr(torch.Tensor, m, wrap_sync(fn))
        for c, fn in saved_d.items():
            setattr(dist, c, wrap_coll(fn))
        for c, fn in saved_f.items():
            setattr(funcol, c, wrap_coll(fn))
        try:
            yield
        finally:
            for m, fn in saved_t.items():
                setattr(torch.Tensor, m, fn)
            for c, fn in saved_d.items():
                setattr(dist, c, fn)
            for c, fn in saved_f.items():
                setattr(funcol, c, fn)

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(32, 32), nn.LayerNorm(32)]
    return nn.Sequential(*blocks)  # 4 tensors per layer


def _make_scaler(name: str, model: nn.Module) -> Any:
    from distamp import DistributedGradScaler

    if name == "torch GradScaler":
        return torch.amp.GradScaler("cpu")
    if name == "ShardedGradScaler":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler("cpu")
    scaler = DistributedGradScaler("cpu", report_overflow="no report" not in name)
    if name == "distamp (DDP registered)":
        scaler.register_module(model, trust_ddp_sync=True)
    return scaler


def _wrap(strategy: str, model: nn.Module) -> nn.Module:
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
    )


def _exclude_optimizer_step(opt: torch.optim.Optimizer, counter: _Counter) -> list[float]:
    """Keep the optimizer's own update out of the counts, and time it (returned list's one
    entry) so that it can be subtracted: it is the same whatever the scaler."""
    opt_time = [0.0]
    inner_step = opt.step

    def step_uncounted(*a: Any, **k: Any) -> Any:
        was, counter.active = counter.active, False
        t = time.perf_counter()
        try:
            return inner_step(*a, **k)
        finally:
            opt_time[0] += time.perf_counter() - t
            counter.active = was

    opt.step = step_uncounted  # type: ignore[method-assign]
    return opt_time


def _measure(
    rank: int, strategy: str, name: str, steps: int, layers: int, counter: _Counter
) -> dict[str, float]:
    model = _wrap(strategy, _model(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    scaler = _make_scaler(name, model)
    # The optimizer's own syncs and time are the same whatever the scaler: exclude them.
    opt_time = _exclude_optimizer_step(opt, counter)
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {"scale": [], "unscale+gate": [], "update": []}
    counter.collectives = counter.syncs = 0
    for i in range(steps + 3):
        opt.zero_grad()
        loss = model(torch.randn(8, 32, generator=gen)).square().mean()
        with counter.counting():
            t0 = time.perf_counter()
            scaled = scaler.scale(loss)
            t1 = time.perf_counter()
        scaled.backward()
        with counter.counting():
            opt_time[0] = 0.0
            t2 = time.perf_counter()
            scaler.step(opt)
            t3 = time.perf_counter()
            scaler.update()
            t4 = time.perf_counter()
        if i == 2:  # warm-up done
            counter.collectives = counter.syncs = 0
            for v in times.values():
                v.clear()
        else:
            times["scale"].append(t1 - t0)
            times["unscale+gate"].append(t3 - t2 - opt_time[0])
            times["update"].append(t4 - t3)
    n = steps
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["total"] = sum(out.values())
    out["collectives"] = counter.collectives / n
    out["syncs"] = counter.syncs / n
    out["tensors"] = float(sum(1 for _ in model.parameters()))
    return out


CASES = [
    ("ddp", "torch GradScaler"),
    ("ddp", "distamp"),
    ("ddp", "distamp (no report)"),
    ("ddp", "distamp (DDP registered)"),
    ("fsdp1", "torch GradScaler"),
    ("fsdp1", "ShardedGradScaler"),
    ("fsdp1", "distamp"),
]


def _worker(rank: int, world: int, steps: int, layers: int) -> list[Any]:
    counter = _Counter()
    results = []
    with counter.installed():
        for strategy, name in CASES:
            results.append((strategy, name, _measure(rank, strategy, name, steps, layers, counter)))
            dist.barrier()
    return results


ND_CASES = [
    ("pp2 x dp2 FSDP2 GPipe", "PP_FSDP2_GPIPE", "torch GradScaler"),
    ("pp2 x dp2 FSDP2 GPipe", "PP_FSDP2_GPIPE", "distamp"),
    ("dp2 x tp2 SP + FSDP2", "DP_TP", "torch GradScaler"),
    ("dp2 x tp2 SP + FSDP2", "DP_TP", "distamp"),
]
ND_MAX_NORM = 1.0


def _nd_setup(rank: int, layout_name: str, name: str) -> tuple[Any, Any, Any]:
    """Scaler, built layout and clip function (clip(optimizer) -> norm) for one N-D case."""
    import nd_scenarios as nd

    from distamp import DistributedGradScaler

    layout = getattr(nd, layout_name)
    if name == "distamp":
        scaler: Any = DistributedGradScaler("cpu")
        loss_fn = scaler.scaled_loss_fn(nd.mse) if layout.kind == "pp" else None

        def clip(opt: torch.optim.Optimizer) -> Any:
            return scaler.clip_grad_norm_(opt, ND_MAX_NORM)

    else:
        scaler = torch.amp.GradScaler("cpu")
        # torch's scaler creates its scale in the first scale(): a stage that computes no loss
        # would never have one and could not step. Create it on every rank.
        scaler.scale(torch.zeros(()))

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return scaler.scale(nd.mse(out, target))

        def clip(opt: torch.optim.Optimizer) -> Any:
            scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            return torch.nn.utils.clip_grad_norm_(params, ND_MAX_NORM)

    built = nd.build(layout, rank, scaler, loss_fn)
    if name == "distamp":
        for module in built.to_register:
            scaler.register_module(module)
    return scaler, built, clip


def _measure_nd(
    rank: int, layout_name: str, name: str, steps: int, counter: _Counter
) -> dict[str, float]:
    scaler, built, clip = _nd_setup(rank, layout_name, name)
    opt = built.optimizer
    opt_time = _exclude_optimizer_step(opt, counter)
    times: dict[str, list[float]] = {"clip": [], "step": [], "update": []}
    for i in range(steps + 3):
        opt.zero_grad()
        built.forward_backward(i)
        if i == 3:  # warm-up done
            counter.collectives = counter.syncs = 0
            for v in times.values():
                v.clear()
        with counter.counting():
            opt_time[0] = 0.0
            t0 = time.perf_counter()
            clip(opt)
            t1 = time.perf_counter()
            scaler.step(opt)
            t2 = time.perf_counter()
            scaler.update()
            t3 = time.perf_counter()
        times["clip"].append(t1 - t0)
        times["step"].append(t2 - t1 - opt_time[0])
        times["update"].append(t3 - t2)
    out = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["total"] = sum(out.values())
    out["collectives"] = counter.collectives / steps
    out["syncs"] = counter.syncs / steps
    return out


def _nd_worker(rank: int, world: int, steps: int) -> list[Any]:
    import logging
    import warnings

    # torch's notes on FSDP2 modules returning views and on two-step gathers: not ours.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    counter = _Counter()
    results = []
    with counter.installed():
        for label, layout_name, name in ND_CASES:
            m = _measure_nd(rank, layout_name, name, steps, counter)
            results.append((label, name, m))
            dist.barrier()
    return results


def _print_nd(results: list[tuple[str, str, dict[str, float]]], steps: int) -> None:
    base = {label: m["total"] for label, name, m in results if name == "torch GradScaler"}
    print(
        f"\n4 ranks gloo, N-D layouts of tests/nd_scenarios.py, clipping, median of {steps} steps"
    )
    header = (
        f"{'layout':22} {'scaler':17} {'coll/step':>9} {'syncs/step':>10} {'clip ms':>8} "
        f"{'step ms':>8} {'update ms':>9} {'total ms':>8} {'vs torch':>8}"
    )
    print(header)
    print("-" * len(header))
    for label, name, m in results:
        print(
            f"{label:22} {name:17} {m['collectives']:9.1f} {m['syncs']:10.1f} {m['clip']:8.3f} "
            f"{m['step']:8.3f} {m['update']:9.3f} {m['total']:8.3f} "
            f"{m['total'] / base[label]:8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=100, help="4 parameter tensors per layer")
    parser.add_argument(
        "--nd-steps", type=int, default=10, help="steps per N-D case on 4 ranks (0: skip them)"
    )
    args = parser.parse_args()
    results = run_ranks(_worker, 2, args.steps, args.layers, timeout=600)[0]
    base = {s: m["total"] for s, n, m in results if n == "torch GradScaler"}
    print(
        f"2 ranks gloo, {int(results[0][2]['tensors'])} parameter tensors, "
        f"median of {args.steps} steps"
    )
    header = (
        f"{'strategy':8} {'scaler':26} {'coll/step':>9} {'syncs/step':>10} {'scale ms':>8} "
        f"{'unsc+gate ms':>12} {'update ms':>9} {'total ms':>8} {'vs torch':>8}"
    )
    print(header)
    print("-" * len(header))
    for strategy, name, m in results:
        print(
            f"{strategy:8} {name:26} {m['collectives']:9.1f} {m['syncs']:10.1f} {m['scale']:8.3f} "
            f"{m['unscale+gate']:12.3f} {m['update']:9.3f} {m['total']:8.3f} "
            f"{m['total'] / base[strategy]:8.2f}"
        )
    if args.nd_steps > 0:
        _print_nd(run_ranks(_nd_worker, 4, args.nd_steps, timeout=900)[0], args.nd_steps)


if __name__ == "__main__":
    main()
