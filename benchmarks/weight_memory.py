"""16-bit weights with a master (``distamp.master_weights``) against torch's fp32-master AMP loop:
bytes per parameter, peak memory of a step, step time and what training reaches.

Every loop trains ``launch/model.py``'s GPT (``--size``, default ``medium``: 12 x 384, 21.5M
parameters) from the same initial weights on the same batches, with the main job's optimizer
(AdamW, lr 3e-3, betas 0.9/0.95, weight decay 0.1, ``foreach=True``) under
``torch.autocast("cpu", dtype=torch.bfloat16)``. The modes:

- ``torch``: fp32 parameters and gradients, AdamW's fp32 moments: torch's own loop
  (``loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``), the reference of every
  ratio;
- ``exact-fp32``, ``exact-bf16``, ``sharded-fp32``, ``stochastic-bf16``, ``kahan-bf16``:
  ``opt = distamp.master_weights(model, AdamW(...), WeightPrecision(master=M, states=S))``
  stepped through ``DistributedGradScaler("cpu", check_only=True)``
  (``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()``). In one process
  ``sharded`` has no ranks to shard over: it holds the whole fp32 copy.

On two ranks the model is wrapped in ``DistributedDataParallel(gradient_as_bucket_view=True)``
after ``master_weights``, in every mode: the gradients then ARE DDP's communication buckets
(torch's default, ``False``, keeps the buckets beside the gradients: one more gradient's worth,
4 bytes a parameter in torch's loop, 2 with 16-bit weights). Ranks are gloo processes started by
``distamp.cluster.spawn.run_ranks``, one thread each. What is measured:

1. **bytes per parameter**, per rank: after one step, the unique untyped storages
   (``t.untyped_storage()``, by ``data_ptr``, ``nbytes``) of the parameters, their gradients,
   the masters (``MasterWeightOptimizer.masters[p].low``) and the optimizer's state tensors
   (step counts included), over the model's parameter count; beside the designed figure
   (``distamp.optim.bytes_per_parameter``). On two ranks, the largest rank's (``sharded``
   assigns whole parameters, so its ranks differ a little) and the mean.
2. **peak memory** of a step, each mode alone in a fresh process (two ranks: a fresh process
   that starts two fresh ranks), with glibc serving every allocation of 64 KiB or more by its
   own ``mmap`` (``MALLOC_MMAP_THRESHOLD_=65536``) so that the resident set follows the live
   tensors (``benchmarks/recipe.py``'s method). The process warms the same loop up on the tiny
   model, makes its batches, records ``VmRSS`` (the baseline), builds the loop, runs two steps
   (the optimizer's state; DDP rebuilds its buckets after the first), then resets the kernel's
   high-water mark (``/proc/self/clear_refs``) before the forward and again before the
   optimizer step. ``held`` is ``VmRSS`` before the measured step (weights, masters, states;
   under DDP the gradient buckets too, which outlive the step), ``fwd+bwd`` and ``step`` each
   window's ``VmHWM``, ``peak`` the larger, all above the baseline: the whole model's memory,
   not only the step's.
3. **time**, one process (and two ranks) holding every mode's loop at once, alternated step by
   step in a rotating order so that machine noise falls on all alike: ``iteration`` is forward,
   backward and step (each loop's own calls, scaler included), ``opt.step`` the optimizer alone
   (``opt.step()`` on the same gradients, repeated). Medians of wall time; the ratio is the
   median over the rounds of the mode's time over torch's in the same round, of wall time and
   of the process's CPU time (``time.process_time``: what other load on a shared machine
   disturbs far less; on two ranks it leaves out the wait for the other rank and counts
   gloo's threads).
4. **quality**: (a) an MLP (64-256-256-10) classifies scikit-learn's digits (1,437 train / 360
   test images, a fixed split) on two DDP ranks, each mode and an fp32-master reference (torch's
   loop) from the same seeds: the mean test accuracy over the seeds and its difference in
   points, and the last epoch's mean training loss, beside plain bf16 weights without a master
   (``model.bfloat16()``, torch's AdamW) as the control the masters exist for. (b) with
   ``--main-job``: the main job (``distamp launch --nproc-per-node 2 launch/train.py --steps
   300 --precision bf16``) with ``--weights M --states S`` against ``--weights fp32``; its
   final loss and the relative difference.

Targets (bf16 weights, AdamW, per rank at 2 ranks): bytes per parameter torch 16, exact-fp32
<= 14, exact-bf16 <= 10, sharded <= 10, stochastic <= 8; peak <= 0.75x torch's with bf16 states
or sharding; time <= 1.10x; accuracy within 0.5 points (stochastic; the others closer); main
job's final loss within 0.1% (exact-fp32, sharded), 0.5% (exact-bf16), 1% (stochastic, kahan).

    python benchmarks/weight_memory.py [--size medium] [--parts bytes,peak,time,quality]
        [--steps 8] [--batch-size 16] [--main-job] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.recipe import reset_peak, status_kib  # noqa: E402
from distamp import DistributedGradScaler, WeightPrecision, master_weights  # noqa: E402
from distamp.cluster.spawn import run_ranks  # noqa: E402
from distamp.optim import bytes_per_parameter  # noqa: E402
from launch.model import GPT, SIZES, ShardedText, lm_loss, load_text  # noqa: E402

MODES: dict[str, WeightPrecision | None] = {
    "torch": None,
    "exact-fp32": WeightPrecision(master="exact", states="fp32"),
    "exact-bf16": WeightPrecision(master="exact", states="bf16"),
    "sharded-fp32": WeightPrecision(master="sharded", states="fp32"),
    "stochastic-bf16": WeightPrecision(master="stochastic", states="bf16"),
    "kahan-bf16": WeightPrecision(master="kahan", states="bf16"),
}
WORLD = 2
BYTES_TARGET = {
    "torch": 16,
    "exact-fp32": 14,
    "exact-bf16": 10,
    "sharded-fp32": 10,
    "stochastic-bf16": 8,
}
PEAK_TARGET = 0.75  # x torch's, with bf16 states or sharding
TIME_TARGET = 1.10
POINTS_TARGET = 0.5
LOSS_TARGET = {
    "exact-fp32": 0.1,
    "sharded-fp32": 0.1,
    "exact-bf16": 0.5,
    "stochastic-bf16": 1.0,
    "kahan-bf16": 1.0,
}  # percent
MMAP_THRESHOLD = 65536  # bytes: every allocation this large or larger is its own mmap
PARTS = ("bytes", "peak", "time", "quality")


# ----------------------------------------------------------------------------- the loops
def _adamw(params: Any, lr: float = 3e-3) -> torch.optim.Optimizer:
    """The main job's optimizer (launch/train.py), on torch's foreach path."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


@dataclass
class Loop:
    """One mode's training loop, split where the measurements look."""

    mode: str
    model: nn.Module  # the module whose parameters are counted (inside DDP, if any)
    net: nn.Module  # what the forward calls: the model or its DDP wrapper
    opt: torch.optim.Optimizer
    scaler: DistributedGradScaler | None

    def backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(self.net, batch)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        return float(loss.detach())

    def apply(self) -> None:
        """The optimizer step, through the scaler if there is one."""
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()

    def step(self) -> None:
        self.apply()
        self.opt.zero_grad(set_to_none=True)

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        loss = self.backward(batch)
        self.step()
        return loss


def build(mode: str, size: str, world: int) -> Loop:
    """``mode``'s loop on the GPT of ``size`` (seed 0), wrapped in DDP when ``world`` > 1."""
    torch.manual_seed(0)
    model = GPT(SIZES[size])
    opt = _adamw(model.parameters())
    scaler = None
    if MODES[mode] is not None:
        opt = master_weights(model, opt, MODES[mode])
        scaler = DistributedGradScaler("cpu", check_only=True)
    net = DDP(model, gradient_as_bucket_view=True) if world > 1 else model
    return Loop(mode, model, net, opt, scaler)


def _batches(size: str, batch_size: int, rank: int, world: int, count: int) -> list[Any]:
    data = ShardedText(
        load_text(),
        context=SIZES[size].context,
        batch_size=batch_size,
        rank=rank,
        world_size=world,
        seed=0,
    )
    return [data.batch(k) for k in range(count)]


# ----------------------------------------------------------------------------- 1. bytes
def storage_bytes(loop: Loop) -> dict[str, float]:
    """Bytes per parameter of each kind, each untyped storage counted once (a gradient that is
    a view of DDP's bucket counts the bucket, once), and their total."""
    params = list(loop.model.parameters())
    masters = getattr(loop.opt, "masters", {})
    kinds: dict[str, list[Any]] = {
        "weights": params,
        "grads": [p.grad for p in params],
        "masters": [m.low for m in masters.values()],
        "states": [v for s in loop.opt.state.values() for v in s.values()],
    }
    seen: set[int] = set()
    out: dict[str, float] = {}
    count = sum(p.numel() for p in params)
    for kind, tensors in kinds.items():
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        out[kind] = total / count
    out["total"] = sum(out.values())
    return out


def count_bytes(rank: int, world: int, size: str, modes: list[str], batch_size: int) -> dict:
    """Every mode's bytes per parameter after one step, taken before its ``zero_grad``."""
    batch = _batches(size, batch_size, rank, world, 1)[0]
    out = {}
    for mode in modes:
        loop = build(mode, size, world)
        loop.backward(batch)
        loop.apply()
        out[mode] = storage_bytes(loop)
        del loop
        gc.collect()
    return out


# ----------------------------------------------------------------------------- 2. peak
def measure_peak(rank: int, world: int, mode: str, size: str, batch_size: int) -> dict:
    """In this fresh process: ``mode``'s memory above the RSS before its loop was built (MB)."""
    warm = build(mode, "tiny", world)
    for batch in _batches("tiny", 2, rank, world, 3):
        warm.train_step(batch)
    del warm
    gc.collect()
    batches = _batches(size, batch_size, rank, world, 3)
    base = status_kib("VmRSS")
    loop = build(mode, size, world)
    for batch in batches[:2]:
        loop.train_step(batch)
    held = status_kib("VmRSS") - base
    reset_peak()
    loop.backward(batches[2])
    forward_backward = status_kib("VmHWM") - base
    reset_peak()
    loop.step()
    step = status_kib("VmHWM") - base
    mb = {"held": held, "fwd+bwd": forward_backward, "step": step}
    return {k: v / 1024 for k, v in mb.items()} | {"peak": max(forward_backward, step) / 1024}


def _peak_child(cell: dict) -> dict:
    """``--child peak``: one process, or two fresh ranks (the largest of each figure)."""
    mode, size, bs = cell["mode"], cell["size"], cell["batch_size"]
    if cell["world"] == 1:
        return measure_peak(0, 1, mode, size, bs)
    ranks = run_ranks(measure_peak, cell["world"], mode, size, bs, timeout=1200)
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def _spawn_peak(cell: dict) -> dict:
    """Run one peak cell in a fresh process, glibc set to return freed memory at once."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        "MALLOC_TRIM_THRESHOLD_": "0",
    }
    cmd = [sys.executable, __file__, "--child", "peak", "--cell", json.dumps(cell)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"peak {cell}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    result: dict = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ----------------------------------------------------------------------------- 3. time
def measure_time(
    rank: int, world: int, size: str, modes: list[str], batch_size: int, steps: int
) -> dict:
    """Every mode's loop at once, alternated in a rotating order (see the module doc): the wall
    and process CPU seconds of each round's iteration and of ``opt.step()`` alone, per mode."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    loops = {mode: build(mode, size, world) for mode in modes}
    warmup = 2
    batches = _batches(size, batch_size, rank, world, warmup + steps)
    times: dict[str, dict[str, list[float]]] = {m: {} for m in modes}

    def timed(phase: str, k: int, call: Callable[[Loop], Any]) -> None:
        for mode in modes[k % len(modes) :] + modes[: k % len(modes)]:
            wall, cpu = time.perf_counter(), time.process_time()
            call(loops[mode])
            if k >= warmup:
                times[mode].setdefault(phase, []).append(time.perf_counter() - wall)
                times[mode].setdefault(phase + " cpu", []).append(time.process_time() - cpu)

    for k, batch in enumerate(batches):
        timed("iteration", k, functools.partial(Loop.train_step, batch=batch))
    for loop in loops.values():  # gradients for the optimizer alone
        loop.backward(batches[0])
    for k in range(warmup + steps):
        # No scaler: found_inf is unset, so every step applies.
        timed("opt.step", k, lambda loop: loop.opt.step())
    return times


def _time_summary(times: dict[str, dict[str, list[float]]]) -> dict:
    """Per mode and phase: the median seconds, and the median over the rounds of the mode's
    time over torch's in the same round."""
    out: dict[str, dict[str, float]] = {}
    for mode, phases in times.items():
        out[mode] = {}
        for phase, ts in phases.items():
            out[mode][phase] = statistics.median(ts)
            ratios = (t / r for t, r in zip(ts, times["torch"][phase], strict=True))
            out[mode][phase + " ratio"] = statistics.median(ratios)
    return out


# ----------------------------------------------------------------------------- 4a. digits
def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits, pixels scaled to [0, 1], a fixed 1,437 / 360 split."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:-360], perm[-360:]
    return x[train], y[train], x[test], y[test]


def train_digits(
    rank: int, world: int, modes: list[str], seeds: list[int], epochs: int, batch_size: int
) -> dict[str, dict[str, list[float]]]:
    """Per mode and seed: the test accuracy (%) and this rank's mean training loss over the
    last epoch; each rank takes every ``world``-th sample of a global batch of ``batch_size``.
    ``"bf16 weights"``: no master (the control)."""
    xtr, ytr, xte, yte = _digits()
    out: dict[str, dict[str, list[float]]] = {m: {"accuracy": [], "loss": []} for m in modes}
    for seed in seeds:
        for mode in modes:
            torch.manual_seed(seed)
            model = nn.Sequential(
                nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
            )
            if mode == "bf16 weights":
                model = model.bfloat16()
            opt: torch.optim.Optimizer = torch.optim.AdamW(
                model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True
            )
            scaler = None
            if MODES.get(mode) is not None:
                opt = master_weights(model, opt, MODES[mode])
                scaler = DistributedGradScaler("cpu", check_only=True)
            net = DDP(model, gradient_as_bucket_view=True) if world > 1 else model
            order = torch.Generator().manual_seed(seed)
            for _ in range(epochs):
                perm = torch.randperm(len(ytr), generator=order)
                losses = []
                for start in range(0, len(perm) - batch_size + 1, batch_size):
                    idx = perm[start : start + batch_size][rank::world]
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = F.cross_entropy(net(xtr[idx]).float(), ytr[idx])
                    if scaler is None:
                        loss.backward()
                        opt.step()
                    else:
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
                    opt.zero_grad(set_to_none=True)
                    losses.append(float(loss.detach()))
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                hits = (model(xte).argmax(1) == yte).float().mean()
            out[mode]["accuracy"].append(100 * float(hits))
            out[mode]["loss"].append(statistics.fmean(losses))
    return out


# ----------------------------------------------------------------------------- 4b. main job
def _launcher() -> list[str]:
    """The ``distamp`` command (its console script, else the same entry point by hand)."""
    exe = shutil.which("distamp")
    if exe:
        return [exe]
    return [sys.executable, "-c", "import sys, distamp.cli; sys.exit(distamp.cli.main())"]


def main_job(modes: list[str], steps: int, timeout: float) -> dict[str, float] | str:
    """The main job's final loss per mode (``"torch"``: ``--weights fp32``, fp32 weights cast
    per op), or why it did not run (a ``launch/train.py`` without the weight flags)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    train = str(ROOT / "launch" / "train.py")
    usage = [sys.executable, train, "--help"]
    helptext = subprocess.run(usage, cwd=ROOT, env=env, capture_output=True, text=True).stdout
    if "--weights" not in helptext or "--states" not in helptext:
        return "launch/train.py has no --weights and --states flags"
    losses = {}
    for mode in modes:
        master, _, states = mode.partition("-")
        flags = (
            ["--weights", "fp32"] if mode == "torch" else ["--weights", master, "--states", states]
        )
        with tempfile.TemporaryDirectory() as out:
            job = ["--steps", str(steps), "--precision", "bf16", *flags, "--out", out]
            cmd = [*_launcher(), "launch", "--nproc-per-node", str(WORLD), train, *job]
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        losses[mode] = json.loads(proc.stdout.strip().splitlines()[-1])["final_loss"]
        print(f"main job {mode}: final loss {losses[mode]:.5f}", file=sys.stderr, flush=True)
    return losses


# ----------------------------------------------------------------------------- tables
def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("ok" if ok else "MISSED")


def print_bytes(single: dict, ranks: list[dict], modes: list[str]) -> dict:
    print(
        f"\n1. persistent bytes per parameter, by unique storage (weights + grads + masters + "
        f"optimizer states), after one step; {WORLD} ranks: the largest rank (mean)"
    )
    head = (
        f"{'mode':16} | {'weights':>7} {'grads':>6} {'master':>6} {'states':>6} | "
        f"{'1 proc':>6} {'design':>6} {'ratio':>5} | {f'{WORLD} ranks':>14} {'design':>6} "
        f"{'ratio':>5} {'target':>6}"
    )
    print(head + "\n" + "-" * len(head))
    rows = {}
    for mode in modes:
        one, per = single[mode], [r[mode] for r in ranks]
        worst = max(r["total"] for r in per)
        mean = statistics.fmean(r["total"] for r in per)
        design1 = bytes_per_parameter(MODES[mode])
        design2 = bytes_per_parameter(MODES[mode], world_size=WORLD)
        target = BYTES_TARGET.get(mode)
        ratio1, ratio2 = (
            one["total"] / single["torch"]["total"],
            worst / max(r["torch"]["total"] for r in ranks),
        )
        print(
            f"{mode:16} | {one['weights']:7.2f} {one['grads']:6.2f} {one['masters']:6.2f} "
            f"{one['states']:6.2f} | {one['total']:6.2f} {design1:6.1f} {ratio1:5.2f} | "
            f"{worst:6.2f} {f'({mean:.2f})':>7} {design2:6.1f} {ratio2:5.2f} "
            f"{'' if target is None else f'<= {target}':>6} "
            f"{_verdict(None if target is None else worst <= target + 0.01)}"
        )
        rows[mode] = {
            "one_process": one,
            "ranks": per,
            "design_one": design1,
            "design_ranks": design2,
            "ratio_one": ratio1,
            "ratio_ranks": ratio2,
        }
    return rows


def print_peak(peaks: dict[tuple[str, int], dict], modes: list[str]) -> None:
    print(
        "\n2. memory of a training step above the RSS before the loop was built (MB), a fresh "
        "process per mode; ratio: peak / torch's peak at the same ranks"
    )
    head = (
        f"{'mode':16} {'ranks':>5} | {'held':>7} {'fwd+bwd':>7} {'step':>7} {'peak':>7} | "
        f"{'ratio':>5} {'target':>7}"
    )
    print(head + "\n" + "-" * len(head))
    for (mode, world), r in peaks.items():
        ratio = r["peak"] / peaks[("torch", world)]["peak"]
        r["ratio"] = ratio
        wp = MODES[mode]
        target = wp is not None and (wp.states == "bf16" or (wp.master == "sharded" and world > 1))
        print(
            f"{mode:16} {world:5} | {r['held']:7.1f} {r['fwd+bwd']:7.1f} {r['step']:7.1f} "
            f"{r['peak']:7.1f} | {ratio:5.2f} {'<= 0.75' if target else '':>7} "
            f"{_verdict(ratio <= PEAK_TARGET if target else None)}"
        )


def print_time(summaries: dict[int, dict]) -> None:
    print(
        "\n3. time (s, median over the rounds); ratio: median of mode / torch in the same round "
        "(target <= 1.10), of wall time and of the process's CPU time (which other load on a "
        "shared machine disturbs less)"
    )
    head = (
        f"{'mode':16} {'ranks':>5} | {'iteration':>9} {'ratio':>5} {'cpu':>5} {'':6} | "
        f"{'opt.step':>8} {'ratio':>5} {'cpu':>5}"
    )
    print(head + "\n" + "-" * len(head))
    for world, summary in summaries.items():
        for mode, r in summary.items():
            cells = []
            for phase in ("iteration", "opt.step"):
                wall, cpu = r[f"{phase} ratio"], r[f"{phase} cpu ratio"]
                ok = None if mode == "torch" else max(wall, cpu) <= TIME_TARGET
                cells.append(f"{r[phase]:8.3f} {wall:5.2f} {cpu:5.2f} {_verdict(ok):6}")
            print(f"{mode:16} {world:5} | {cells[0]} | {cells[1]}")


def print_quality(results: dict[str, dict[str, list[float]]], seeds: int, epochs: int) -> dict:
    print(
        f"\n4a. digits MLP (64-256-256-10), {WORLD} DDP ranks, AdamW lr 1e-3, {epochs} epochs, "
        f"{seeds} seeds: mean test accuracy (%) and its difference to torch's fp32-master loop "
        f"(points); mean training loss of the last epoch and its difference (%)"
    )
    head = (
        f"{'mode':16} | {'accuracy':>8} {'min':>6} {'max':>6} | {'diff':>6} {'target':>8} | "
        f"{'loss':>7} {'diff':>7}"
    )
    print(head + "\n" + "-" * len(head))
    ref_acc = statistics.fmean(results["torch"]["accuracy"])
    ref_loss = statistics.fmean(results["torch"]["loss"])
    rows = {}
    for mode, r in results.items():
        acc, loss = statistics.fmean(r["accuracy"]), statistics.fmean(r["loss"])
        diff, rel = acc - ref_acc, 100 * (loss - ref_loss) / ref_loss
        target = mode not in ("torch", "bf16 weights")
        print(
            f"{mode:16} | {acc:8.2f} {min(r['accuracy']):6.2f} {max(r['accuracy']):6.2f} | "
            f"{diff:+6.2f} {'|d|<=0.5' if target else '':>8} "
            f"{_verdict(abs(diff) <= POINTS_TARGET if target else None):6} | {loss:7.4f} "
            f"{rel:+6.2f}%"
        )
        rows[mode] = {
            **r,
            "mean_accuracy": acc,
            "diff_points": diff,
            "mean_loss": loss,
            "loss_relative_percent": rel,
        }
    return rows


def print_main_job(losses: dict[str, float] | str, steps: int) -> dict:
    print(f"\n4b. the main job, {WORLD} ranks, --steps {steps} --precision bf16: final loss")
    if isinstance(losses, str):
        print(f"skipped: {losses}")
        return {"skipped": losses}
    ref = losses["torch"]
    rows = {}
    for mode, loss in losses.items():
        rel = 100 * (loss - ref) / ref
        target = LOSS_TARGET.get(mode)
        print(
            f"{mode:16} | {loss:8.5f} {rel:+7.3f}% "
            f"{'' if target is None else f'<= {target}%':>8} "
            f"{_verdict(None if target is None else abs(rel) <= target)}"
        )
        rows[mode] = {"final_loss": loss, "relative_percent": rel}
    return rows


# ----------------------------------------------------------------------------- main
def _parts(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in PARTS for v in values):
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of {', '.join(PARTS)}; got {text!r}"
        )
    return values


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every requested part, printed as it finishes; the figures."""
    modes = list(MODES)
    out: dict[str, Any] = {
        "size": args.size,
        "torch": torch.__version__,
        "batch_size": args.batch_size,
    }
    params = sum(p.numel() for p in GPT(SIZES[args.size]).parameters())
    print(
        f"GPT --size {args.size} ({params / 1e6:.2f}M parameters), batch {args.batch_size} x "
        f"{SIZES[args.size].context} per rank, bf16 autocast, AdamW foreach; torch "
        f"{torch.__version__}, CPU, 1 thread per process"
    )
    if "bytes" in args.parts:
        single = count_bytes(0, 1, args.size, modes, args.batch_size)
        ranks = run_ranks(count_bytes, WORLD, args.size, modes, args.batch_size, timeout=1200)
        out["bytes"] = print_bytes(single, ranks, modes)
    if "peak" in args.parts:
        peaks = {}
        for world in (1, WORLD):
            for mode in modes:
                cell = {
                    "mode": mode,
                    "size": args.size,
                    "batch_size": args.batch_size,
                    "world": world,
                }
                peaks[(mode, world)] = _spawn_peak(cell)
        print_peak(peaks, modes)
        out["peak"] = [{"mode": m, "ranks": w, **r} for (m, w), r in peaks.items()]
    if "time" in args.parts:
        summaries = {
            1: _time_summary(measure_time(0, 1, args.size, modes, args.batch_size, args.steps))
        }
        per_rank = run_ranks(
            measure_time, WORLD, args.size, modes, args.batch_size, args.steps, timeout=3600
        )
        summaries[WORLD] = _time_summary(per_rank[0])
        print_time(summaries)
        out["time"] = {str(w): s for w, s in summaries.items()}
    if "quality" in args.parts:
        seeds, epochs = (2, 3) if args.quick else (5, 30)
        per_rank = run_ranks(
            train_digits,
            WORLD,
            ["torch", *modes[1:], "bf16 weights"],
            list(range(seeds)),
            epochs,
            64,
            timeout=3600,
        )
        for mode, r in per_rank[0].items():  # the ranks' weights agree; their losses are halves
            halves = zip(*(q[mode]["loss"] for q in per_rank), strict=True)
            r["loss"] = [statistics.fmean(x) for x in halves]
        out["quality"] = print_quality(per_rank[0], seeds, epochs)
    if args.main_job:
        losses = main_job(modes, args.main_job_steps, timeout=1800)
        out["main_job"] = print_main_job(losses, args.main_job_steps)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=SIZES, default="medium", help="the main job's model")
    p.add_argument(
        "--parts",
        type=_parts,
        default=",".join(PARTS),
        help="comma-separated: bytes, peak, time, quality",
    )
    p.add_argument("--steps", type=int, default=8, help="timed rounds (after 2 untimed)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank (train.py's)")
    p.add_argument(
        "--main-job",
        action="store_true",
        help="also train the main job per mode (~100 s a run on 2 CPU cores)",
    )
    p.add_argument("--main-job-steps", type=int, default=300)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a check of the script: 2 timed rounds, 2 seeds x 3 epochs of digits",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--child", choices=("peak",), help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child == "peak":
        torch.set_num_threads(1)
        print(json.dumps(_peak_child(json.loads(args.cell))))
        return {}
    if args.quick:
        args.steps = min(args.steps, 2)
    out = run(args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n", "utf-8")
    return out


if __name__ == "__main__":
    main()
