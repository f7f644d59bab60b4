"""Inference latency and error of the main job's model: eager torch against distamp's exports.

For each model size (``launch/model.py``'s SIZES: tiny and medium by default) the model is first
trained briefly in fp32 on the bundled text (``--train-steps``; untrained weights give near-uniform
logits, whose top-1 agreement says nothing), then run by:

- torch eager in fp32 (the reference every ratio divides by), and under ``torch.autocast`` in
  fp16 and bf16 (torch's own mixed-precision path);
- ``distamp.export`` programs (``.pt2``, ``program.module()``) computing in fp32, fp16 and bf16,
  with the default policy's fp32 islands (the LayerNorms); one export with a dynamic batch
  serves both batch sizes;
- the same programs compiled by AOTInductor, run by ONNX Runtime, and lowered to ExecuTorch
  (XNNPACK), where installed (``--targets``).

Latency: the median (p50) and 95th percentile (p95) of single forward passes at batch 1 and 32
(sequences of 64 bytes), after a warm-up call, ``--rounds`` calls each at batch 1 (a quarter at
batch 32), the paths taking turns call by call, on ``--threads`` threads (default 1). Error: on
one batch of 32 sequences of the text, against fp32 eager, the largest absolute difference of
the logits relative to their largest magnitude, and how often the top-1 byte agrees. On a
shared machine the ratios are more stable than the times.

    python benchmarks/inference.py [--sizes tiny,medium] [--targets pt2,aoti,onnx,pte]
        [--rounds 40] [--threads 1] [--train-steps 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from distamp.deploy import export, require_target, save  # noqa: E402
from distamp.torch_compat import aoti_load_package  # noqa: E402
from launch.model import ShardedText, build, lm_loss, load_text  # noqa: E402

BATCHES = (1, 32)
Runner = Callable[[torch.Tensor], Any]
SUFFIXES = {"aoti": "_aoti.pt2", "onnx": ".onnx", "pte": ".pte"}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def trained_model(size: str, steps: int) -> nn.Module:
    """The main job's model of ``size`` after ``steps`` fp32 AdamW steps on the bundled text."""
    torch.manual_seed(0)
    model = build(size)
    data = ShardedText(load_text(), context=64, batch_size=16, rank=0, world_size=1, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(steps):
        lm_loss(model, data.batch(k)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


def latencies(runs: list[Runner], x: torch.Tensor, rounds: int) -> list[tuple[float, float]]:
    """p50 and p95 of one call of each runner, in milliseconds. The runners take turns, one call
    each per round (the order reversed every other round), so that the load of a shared
    machine falls on all of them alike."""
    times: list[list[float]] = [[] for _ in runs]
    with torch.no_grad():
        for run in runs:  # warm-up: first-call allocations, lazy initialisation
            run(x)
        for r in range(rounds):
            order = list(range(len(runs)))
            for i in order if r % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                runs[i](x)
                times[i].append((time.perf_counter() - t0) * 1e3)
    out = []
    for t in times:
        t.sort()
        out.append((statistics.median(t), t[min(len(t) - 1, round(0.95 * (len(t) - 1)))]))
    return out


def error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max |out - ref| / max |ref|, top-1 agreement)."""
    out, ref = out.float(), ref.float()
    rel = float((out - ref).abs().max() / ref.abs().max())
    return rel, float((out.argmax(-1) == ref.argmax(-1)).float().mean())


def _ort(path: Path) -> Runner:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: torch.from_numpy(session.run(None, {name: x.numpy()})[0])


def _pte(path: Path) -> Runner:
    from executorch.runtime import Runtime

    method = Runtime.get().load_program(str(path)).load_method("forward")
    assert method is not None
    return lambda x: method.execute([x])[0]


def variants(
    model: nn.Module, example: torch.Tensor, args: argparse.Namespace, tmp: Path
) -> list[tuple[str, Runner, float]]:
    """(label, callable, seconds to build it) for every path that runs here."""
    found: list[tuple[str, Runner, float]] = [("eager fp32", model, 0.0)]
    for name in ("fp16", "bf16"):
        dtype = DTYPES[name]

        def autocast(x: torch.Tensor, dtype: torch.dtype = dtype) -> Any:
            with torch.autocast("cpu", dtype=dtype):
                return model(x)

        found.append((f"eager autocast {name}", autocast, 0.0))
    for name in args.precisions:
        t0 = time.perf_counter()
        program = export(model, (example,), policy=name, dynamic_shapes="batch",
                         max_batch=max(BATCHES))  # fmt: skip
        built = time.perf_counter() - t0
        found.append((f"pt2 {name}", program.module(), built))
        for target in args.targets:
            if target == "pt2" or (target == "pte" and name == "bf16"):
                continue  # XNNPACK has no bf16 kernels: ExecuTorch would run portable ones
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    require_target(target)
            except (ImportError, RuntimeError) as exc:
                print(f"  skipped {target}: {exc}", file=sys.stderr)
                continue
            path = tmp / f"{name}{SUFFIXES[target]}"
            t0 = time.perf_counter()
            try:
                save(program, path, target=target)
                run = {"aoti": aoti_load_package, "onnx": _ort, "pte": _pte}[target](
                    str(path) if target == "aoti" else path
                )
                run(example)
            except Exception as exc:  # a runtime without kernels for this dtype
                print(f"  {target} {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            found.append((f"{target} {name}", run, built + time.perf_counter() - t0))
    return found


def measure(size: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    print(f"{size}: training {args.train_steps} fp32 steps ...", file=sys.stderr)
    model = trained_model(size, args.train_steps)
    data = ShardedText(load_text(), context=64, batch_size=32, rank=0, world_size=1, seed=7)
    probe = data.batch(0)[0].contiguous()  # ExecuTorch takes contiguous inputs only
    inputs = {b: probe[:b].contiguous() for b in BATCHES}
    with torch.no_grad():
        ref = model(probe)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        found = variants(model, inputs[1], args, Path(tmp))
        for label, run, built in found:
            with torch.no_grad():
                rel, top1 = error(run(probe), ref)
            rows.append({"size": size, "path": label, "build_s": built, "max_rel": rel,
                         "top1": top1})  # fmt: skip
        for b in BATCHES:
            print(f"  timing batch {b} ...", file=sys.stderr)
            rounds = args.rounds if b == 1 else max(3, args.rounds // args.b32_divisor)
            for row, (p50, p95) in zip(rows, latencies([f[1] for f in found], inputs[b], rounds),
                                       strict=True):  # fmt: skip
                row[f"p50_b{b}"], row[f"p95_b{b}"] = p50, p95
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,medium")
    p.add_argument("--precisions", default="fp32,fp16,bf16", help="of the exported programs")
    p.add_argument("--targets", default="pt2,aoti,onnx,pte")
    p.add_argument("--rounds", type=int, default=40, help="timed calls of each path at batch 1")
    p.add_argument("--b32-divisor", type=int, default=4, help="batch 32: rounds / this (>= 3)")
    p.add_argument("--threads", type=int, default=1, help="torch's, ORT's and XNNPACK's")
    p.add_argument("--train-steps", type=int, default=100)
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    args.precisions = args.precisions.split(",")
    args.targets = args.targets.split(",")
    # One thread: on a shared 2-core machine two OpenMP threads wait on each other whenever
    # another process takes a core, and the times become the neighbours' (CPU x 10 seen).
    torch.set_num_threads(args.threads)
    rows = [row for size in args.sizes.split(",") for row in measure(size, args)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; latency in ms "
          "(sequences of 64 bytes); error vs eager fp32 on 32 sequences of the text")  # fmt: skip
    header = (f"{'size':<7}{'path':<22}{'b1 p50':>9}{'b1 p95':>9}{'b32 p50':>10}{'b32 p95':>10}"
              f"{'b1 x':>7}{'b32 x':>7}{'max rel':>10}{'top-1':>8}{'build s':>9}")  # fmt: skip
    print(header)
    print("-" * len(header))
    base = {r["size"]: r for r in rows if r["path"] == "eager fp32"}
    for r in rows:
        ref = base[r["size"]]
        print(f"{r['size']:<7}{r['path']:<22}{r['p50_b1']:>9.2f}{r['p95_b1']:>9.2f}"
              f"{r['p50_b32']:>10.1f}{r['p95_b32']:>10.1f}{r['p50_b1'] / ref['p50_b1']:>7.2f}"
              f"{r['p50_b32'] / ref['p50_b32']:>7.2f}{r['max_rel']:>10.2e}{r['top1']:>8.4f}"
              f"{r['build_s']:>9.1f}")  # fmt: skip
    print("b1 x, b32 x: p50 latency / eager fp32's at that batch (below 1: faster)")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
