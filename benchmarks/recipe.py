"""The large-model memory recipe on the main job's medium model: distamp's engine against torch's
own autocast loop, per precision x activation checkpointing (AC) x ``torch.compile``.

Both loops train ``launch/model.py``'s GPT (``SIZES["medium"]``: 12 blocks, 384 wide, 21.5M
parameters) from the same initial weights on the same batches (``ShardedText``, seed 0), with
the main job's optimizer (AdamW, lr 3e-3, betas 0.9/0.95, weight decay 0.1) and clipping at 1.0.
The recipe is applied to each copy of the model identically and before anything else sees it, in
torchtitan's order: ``distamp.apply_activation_checkpointing(model, ac)`` (torch's
``checkpoint_wrapper`` on every block; ``selective`` saves every other matmul's output), then
``distamp.compile_blocks(model, backend=...)`` (``Module.compile`` on every block). The loops:

- ``torch``: the loop torch's AMP documentation gives: ``torch.autocast("cpu", dtype)`` around
  the forward and the loss; for fp16 ``torch.amp.GradScaler`` with ``scale(loss).backward()``,
  ``unscale_``, ``clip_grad_norm_``, ``step``, ``update``; for bf16 no scaler; for fp8 the Linear
  layers converted by torchao's ``convert_to_float8_training`` (before AC, torchtitan's order)
  under bf16 autocast. ``zero_grad(set_to_none=True)`` comes after the step, where the engine
  releases its gradients too, so that neither loop carries a step's gradients into the next;
- ``distamp``: ``DistAMP(precision=p, policy=AutocastPolicy(p), strategy="none",
  max_grad_norm=1.0)`` (fp8: ``AutocastPolicy("fp8", fp8_min_features=64)``, so that every
  Linear of the model is float8, as in torch's loop), ``amp.setup(model, AdamW)``,
  ``with amp.autocast()`` and ``amp.backward_and_step(loss)``. The policy keeps its fp32
  modules (here the LayerNorms) and fp32 ops (here the loss) in fp32 on every device, where CPU
  autocast has its own lists; what the policy costs is part of what is measured.

What is measured, per cell (a precision, an AC mode, compile off or on):

- **time**: one fresh process builds both loops and alternates them step by step (the order
  flips every step); after ``--warmup`` steps each (the compile happens in the first),
  ``--steps`` timed steps, each ended by a host read of the loss. ``s/step`` is each loop's
  median; ``speed`` is the median over the timed steps of torch's time / distamp's in the same
  step (the two ran back to back, so a change in the machine's load falls on both; above 1.00
  distamp is faster).
- **memory**: each loop alone in its own fresh process (nothing of the other loop, or of an
  earlier cell, is resident), with glibc told to serve every allocation of 64 KiB or more by
  its own ``mmap`` (``MALLOC_MMAP_THRESHOLD_=65536``, which also turns off glibc's growing
  threshold): a freed tensor goes back to the kernel at once, so the resident set follows the
  live tensors and not what the heap kept (torch's CPU allocator takes its memory from glibc
  and keeps no cache of its own). The process records ``VmRSS`` once the model, optimizer and
  batches exist, runs the first step (compile, the optimizer's state), resets the kernel's
  high-water mark (``/proc/self/clear_refs``) and runs ``--memory-steps`` more, reading
  ``VmRSS`` before and after each forward. ``peak MB`` is ``VmHWM`` above the first ``VmRSS``:
  gradients, AdamW's moments (the same in both loops), what a step keeps for backward and its
  temporaries and, in compiled cells, what compile left resident (graphs, generated code;
  compile's own transient peak in the first step is not counted). ``saved MB`` is the ``VmRSS``
  after a forward above the ``VmRSS`` before it: the activations kept for backward, which is
  what AC reduces (the peak of a step is the larger of that plus the optimizer's state, and the
  gradients plus the optimizer's state; at a small batch the second wins and AC does not move
  the peak). ``mem`` and ``ratio`` are distamp's / torch's (at or below 1.00: distamp keeps no
  more). The memory processes' step times are not used.

Targets: with AC, distamp's peak no higher than torch's with the same AC (``mem`` <= 1.00), and
its step time within 5% of torch's (``speed`` >= 0.95).

    python benchmarks/recipe.py [--precisions fp16,bf16] [--ac none,full,selective]
        [--compile off,on] [--compile-backend inductor] [--batch-size 8] [--steps 6]
        [--warmup 2] [--memory-steps 1] [--threads 1] [--size medium] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distamp import AutocastPolicy, DistAMP, apply_activation_checkpointing, compile_blocks
from distamp.parallel.recompute import AC_MODES
from launch.model import GPT, SIZES, ShardedText, lm_loss, load_text

ROOT = Path(__file__).resolve().parents[1]
LOOPS = ("torch", "distamp")
PRECISIONS = ("fp16", "bf16", "fp8")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
COMPILE = ("off", "on")
BACKENDS = ("inductor", "aot_eager")
MMAP_THRESHOLD = 65536  # bytes: every allocation this large or larger is its own mmap
TIMEOUT_S = 3600  # one cell's process (a compiled cell on a shared 2-core CPU takes minutes)

Batch = tuple[torch.Tensor, torch.Tensor]


def _optimizer(params: Any) -> torch.optim.Optimizer:
    """The main job's optimizer (launch/train.py)."""
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def _fp8_policy() -> AutocastPolicy:
    """Every Linear of the medium model in float8 (distamp's default threshold is 2048)."""
    return AutocastPolicy("fp8", fp8_min_features=64)


@dataclass
class Loop:
    """One training loop, split where the memory processes look: ``forward`` returns the loss
    (the activations backward needs are then alive), ``finish`` runs backward, clipping and the
    optimizer step and returns the loss read on the host (so that a step is timed to its end)."""

    forward: Callable[[Batch], torch.Tensor]
    finish: Callable[[torch.Tensor], float]

    def step(self, batch: Batch) -> float:
        return self.finish(self.forward(batch))


def build(loop: str, precision: str, ac: str, backend: str | None, size: str) -> Loop:
    """``loop`` in ``precision`` with the recipe applied (see the module doc)."""
    torch.manual_seed(0)  # the same initial weights for every loop and cell
    model = GPT(SIZES[size])
    if loop == "distamp":
        apply_activation_checkpointing(model, ac)
        if backend is not None:
            compile_blocks(model, backend=backend)
        policy = _fp8_policy() if precision == "fp8" else AutocastPolicy(precision)
        amp = DistAMP(precision=precision, policy=policy, strategy="none", max_grad_norm=1.0)
        amp.setup(model, _optimizer)

        def engine_forward(batch: Batch) -> torch.Tensor:
            with amp.autocast():
                return lm_loss(amp.model, batch)

        def engine_finish(loss: torch.Tensor) -> float:
            amp.backward_and_step(loss)  # releases the gradients (set to None) after the step
            return float(loss.detach())

        return Loop(engine_forward, engine_finish)
    if precision == "fp8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)  # every Linear: all are multiples of 16 wide
    apply_activation_checkpointing(model, ac)
    if backend is not None:
        compile_blocks(model, backend=backend)
    opt = _optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = DTYPES[precision]

    def torch_forward(batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return lm_loss(model, batch)

    def torch_finish(loss: torch.Tensor) -> float:
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        # After the step rather than before the next forward (the same for training): no
        # gradient outlives its step, as in the engine, so neither loop carries the last
        # step's gradients through the next forward.
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return Loop(torch_forward, torch_finish)


def _data(size: str, batch_size: int) -> ShardedText:
    cfg = SIZES[size]
    return ShardedText(load_text(), context=cfg.context, batch_size=batch_size, rank=0,
                       world_size=1, seed=0)  # fmt: skip


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (Linux only)")


def reset_peak() -> None:
    """VmHWM back to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_memory(cell: dict[str, Any], loop: str) -> dict[str, Any]:
    """In this (fresh) process: ``loop``'s peak RSS above the RSS before its first step, and
    what its forward keeps alive for backward (the RSS after the forward above the RSS before
    it, the largest over the measured steps)."""
    run = build(loop, cell["precision"], cell["ac"], cell["backend"], cell["size"])
    data = _data(cell["size"], cell["batch_size"])
    batches = [data.batch(k) for k in range(1 + cell["memory_steps"])]
    before = status_kib("VmRSS")
    loss = run.step(batches[0])  # compile and the optimizer's state
    reset_peak()
    saved = 0
    for batch in batches[1:]:
        start = status_kib("VmRSS")
        out = run.forward(batch)
        saved = max(saved, status_kib("VmRSS") - start)
        loss = run.finish(out)
        del out
    peak = status_kib("VmHWM")
    return {"peak_mb": (peak - before) / 1024, "saved_mb": saved / 1024, "loss": loss}


def measure_time(cell: dict[str, Any]) -> dict[str, Any]:
    """In this (fresh) process: both loops alternated step by step. Per loop the median seconds
    per step; ``speed``, the median over the timed steps of torch's time / distamp's in the
    same step (the two ran back to back, so a change of the machine's load falls on both)."""
    runs = {
        loop: build(loop, cell["precision"], cell["ac"], cell["backend"], cell["size"])
        for loop in LOOPS
    }
    data = _data(cell["size"], cell["batch_size"])
    times: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    losses: dict[str, float] = {}
    first: dict[str, float] = {}
    for k in range(cell["warmup"] + cell["steps"]):
        batch = data.batch(k)
        for loop in LOOPS if k % 2 == 0 else tuple(reversed(LOOPS)):
            t0 = time.perf_counter()
            losses[loop] = runs[loop].step(batch)
            elapsed = time.perf_counter() - t0
            if k == 0:
                first[loop] = elapsed
            if k >= cell["warmup"]:
                times[loop].append(elapsed)
    result: dict[str, Any] = {
        loop: {"s": statistics.median(times[loop]), "first_s": first[loop], "loss": losses[loop]}
        for loop in LOOPS
    }
    result["speed"] = statistics.median(
        t / d for t, d in zip(times["torch"], times["distamp"], strict=True)
    )
    return result


def _spawn(what: str, cell: dict[str, Any], threads: int) -> dict[str, Any]:
    """Run ``--child WHAT`` for ``cell`` in a fresh process; its last stdout line is JSON."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    if what != "time":  # a memory process: freed tensors go back to the kernel at once
        env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, __file__, "--child", what, "--cell", json.dumps(cell)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} {cell}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_cell(cell: dict[str, Any], threads: int) -> dict[str, Any]:
    """One cell's row: each loop's peak MB and median step seconds, and the two ratios."""
    t0 = time.perf_counter()
    memory = {loop: _spawn(loop, cell, threads) for loop in LOOPS}
    timing = _spawn("time", cell, threads)
    row: dict[str, Any] = {k: cell[k] for k in ("precision", "ac", "compile")}
    for loop in LOOPS:
        row[loop] = {**timing[loop], **{k: memory[loop][k] for k in ("peak_mb", "saved_mb")}}
    row["mem"] = row["distamp"]["peak_mb"] / row["torch"]["peak_mb"]
    row["saved"] = row["distamp"]["saved_mb"] / row["torch"]["saved_mb"]
    row["speed"] = timing["speed"]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _choices(text: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated list of values of ``allowed`` (argparse type for the list options:
    argparse prefixes the message with the argument's name)."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(allowed)}; got {text!r}"
        )
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"GPT --size {args.size}, one CPU process, {args.threads} thread(s), batch "
          f"{args.batch_size} x {SIZES[args.size].context} tokens, compile backend "
          f"{args.compile_backend}, torch {torch.__version__}; t/d: torch/distamp; time: "
          f"{args.steps} steps after {args.warmup} (speed: median of torch/distamp per step); "
          f"memory: {args.memory_steps} step(s) after the first, in a fresh process per loop "
          f"(peak: RSS high-water mark above the RSS before the first step; saved: RSS after "
          f"a forward above the RSS before it)")  # fmt: skip
    header = (f"{'precision':9} {'AC':9} {'compile':7} | {'peak MB t/d':>11} {'mem':>5} | "
              f"{'saved MB t/d':>12} {'ratio':>5} | {'s/step t/d':>11} {'speed':>5} | "
              f"{'1st step s t/d':>14} | {'loss t/d':>15}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        t, d = r["torch"], r["distamp"]
        cells = [
            f"{r['precision']:9} {r['ac']:9} {r['compile']:7}",
            f"{t['peak_mb']:5.0f}/{d['peak_mb']:<5.0f} {r['mem']:5.2f}",
            f"{t['saved_mb']:6.1f}/{d['saved_mb']:<5.1f} {r['saved']:5.2f}",
            f"{t['s']:5.2f}/{d['s']:<5.2f} {r['speed']:5.2f}",
            f"{t['first_s']:6.0f}/{d['first_s']:<7.0f}",
            f"{t['loss']:7.4f}/{d['loss']:<7.4f}",
        ]
        print(" | ".join(cells), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--precisions",
        type=lambda s: _choices(s, PRECISIONS),
        default="fp16,bf16",
        help="comma-separated: fp16, bf16, fp8 (fp8: torchao; 4-5x slower than bf16 on a CPU)",
    )
    p.add_argument("--ac", type=lambda s: _choices(s, AC_MODES),
                   default="none,full,selective", help="comma-separated AC modes")  # fmt: skip
    p.add_argument("--compile", type=lambda s: _choices(s, COMPILE),
                   default="off,on", help="comma-separated: off, on")  # fmt: skip
    p.add_argument("--compile-backend", choices=BACKENDS, default="inductor",
                   help="the backend of the compiled cells")  # fmt: skip
    p.add_argument("--size", choices=SIZES, default="medium",
                   help="the main job's model (tiny: a quick check of the script)")  # fmt: skip
    p.add_argument("--batch-size", type=_positive, default=8, help="sequences per step")
    p.add_argument("--steps", type=_positive, default=6, help="timed steps per loop")
    p.add_argument("--warmup", type=_positive, default=2, help="untimed steps per loop first")
    p.add_argument("--memory-steps", type=_positive, default=1,
                   help="steps after the first in each memory process")  # fmt: skip
    p.add_argument("--threads", type=_positive, default=1, help="CPU threads per process")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    p.add_argument("--child", choices=(*LOOPS, "time"), help=argparse.SUPPRESS)
    p.add_argument("--cell", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        cell = json.loads(args.cell)
        result = measure_time(cell) if args.child == "time" else measure_memory(cell, args.child)
        print(json.dumps(result))
        return
    rows = []
    for precision in args.precisions:
        for compiled in args.compile:
            for ac in args.ac:
                cell = {
                    "precision": precision, "ac": ac, "compile": compiled, "size": args.size,
                    "backend": args.compile_backend if compiled == "on" else None,
                    "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                    "memory_steps": args.memory_steps,
                }  # fmt: skip
                rows.append(run_cell(cell, args.threads))
                print(f"cell {precision} AC {ac} compile {compiled}: {rows[-1]['wall_s']} s",
                      file=sys.stderr, flush=True)  # fmt: skip
    _print_table(rows, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "size": args.size, "torch": torch.__version__, "threads": args.threads,
            "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
            "memory_steps": args.memory_steps, "compile_backend": args.compile_backend,
        }  # fmt: skip
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n", "utf-8")


if __name__ == "__main__":
    main()
