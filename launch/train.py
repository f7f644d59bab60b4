"""The main job: a byte-level GPT trained on a public-domain play through distamp's engine.

    python launch/train.py                                   # one process
    torchrun --standalone --nproc-per-node 2 launch/train.py # or mpirun -np 2, srun, distamp launch

Rank 0 draws a progress line on stderr and prints ONE JSON object as its last stdout line
(final_loss, steps, skipped_steps, loss_scale, tokens_per_s, world_size, precision, strategy...;
``--help`` explains each field). The run is kept: checkpoints, metrics.jsonl and model.json go
to ``--out DIR``, by default ``runs/<start time>`` (printed at the start, and at the end with
the ``distamp export`` command that turns it into a model for inference); ``--export PATH``
also exports at the end (docs/guides/deployment.md).
The same seed gives the same final loss whichever launcher started the ranks; ``--out DIR
--resume`` continues from the last checkpoint to the same final state, bitwise on CPU. SIGUSR1 or
SIGTERM (a scheduler's "time is nearly up") makes every rank stop at the next logging step, save
to ``--out`` and exit 0, which is what the sbatch scripts in ``multinode/`` rely on to requeue;
SIGINT (Ctrl-C) does the same and exits 130 (a second Ctrl-C interrupts at once).

The precision defaults to fp16 so that every default run exercises the loss scaler, the piece of
distamp that bf16 does not need. On CPUs without fp16 matrix units that is ~8x slower than fp32,
which is why the default step count is modest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `launch.model` (and a checkout)
from distamp import (
    AutocastPolicy,
    CheckpointError,
    DistAMP,
    ProgressPrinter,
    Telemetry,
    WindowStats,
    apply_activation_checkpointing,
    check_shared_directory,
    compile_blocks,
    export,
    init_distributed,
    parse_precision,
    shutdown_distributed,
)
from distamp.deploy import InputSpec, ModelSpec, record_model, save
from launch.arguments import RUNS, SUMMARY_FIELDS, parse, weights_of
from launch.model import GPT, SIZES, GPTConfig, ShardedText, lm_loss, load_text

__all__ = ["SUMMARY_FIELDS", "StopFlag", "main", "parse", "warmup_cosine"]


def _grad_bytes(stats: WindowStats | None) -> float | None:
    """Rank 0's gradient bytes per step in the last window, payload and scales together."""
    if stats is None or stats.grad_bytes is None:
        return None
    return stats.grad_bytes + (stats.grad_scale_bytes or 0.0)


def _model_spec(args: argparse.Namespace, cfg: GPTConfig) -> ModelSpec:
    """What ``distamp export DIR`` needs to rebuild this run's model (DIR/model.json)."""
    fp8 = parse_precision(args.precision).float8_linears
    return ModelSpec(
        factory="launch.model:build",
        kwargs={"size": args.size},
        precision=parse_precision(args.precision).name,
        policy={"recipe": args.fp8_recipe, "fp8_min_features": args.fp8_min_features}
        if fp8
        else None,
        inputs=(InputSpec(shape=(None, cfg.context), dtype="int64", high=cfg.vocab_size),),
        source=str(Path(__file__).resolve().parents[1]),
    )


def _run_directory() -> Path:
    """``runs/<start time>`` (under the working directory; git ignores ``runs/``): where a run
    without --out is kept, so that it can be exported or resumed without training again. Rank
    0 names it and sends the name to every rank (their clocks may straddle a second), which
    all save to it."""
    name: list[str | None] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name[0], k = stamp, 1
        while (RUNS / str(name[0])).exists():  # two runs started in one second
            k += 1
            name[0] = f"{stamp}-{k}"
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return RUNS / str(name[0])


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up, then cosine decay to 10% at ``total`` steps."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))

    return factor


class StopFlag:
    """Set by SIGUSR1, SIGTERM or SIGINT: the engine polls it and all ranks stop together at
    the next logging step, after saving when --out is given. SIGINT (Ctrl-C) is a request like
    the others, not a KeyboardInterrupt traceback from every rank; a second SIGINT interrupts
    at once. ``exit_code``: 130 after SIGINT (a shell's code for an interrupted command, so
    scripts still see the interruption), 0 after the others (the job saved as asked)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.exit_code = 0
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.exit_code = 128 + signal.SIGINT
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one interrupts
        self.event.set()
        print(
            f"\nsignal {signal.Signals(signum).name}: saving at the next log step", file=sys.stderr
        )

    def is_set(self) -> bool:
        return self.event.is_set()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    stop = StopFlag()  # before the group starts: a signal during setup is a request too
    env = init_distributed(timeout=args.timeout, warn_if_single=False)  # one process is fine
    # Same thread count under every launcher (torchrun sets OMP_NUM_THREADS=1, mpirun does not):
    # CPU kernels may split reductions by thread, so this is part of the determinism.
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // env.local_world_size))
    torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
    torch.manual_seed(args.seed)  # identical init on every rank (FSDP does not broadcast it)
    if args.out is None:
        args.out = _run_directory()
    try:  # node-local --out on several hosts: refused now, not when the first save fails
        check_shared_directory(args.out)
    except ValueError as exc:  # every rank raises; the usage error is printed once
        if env.rank == 0:
            print(f"{Path(sys.argv[0]).name}: error: argument --out: {exc}", file=sys.stderr)
        shutdown_distributed()
        return 2
    cfg = SIZES[args.size]
    # fp8 takes its layer selection from a precision policy (fp32 norms and softmax included).
    policy = (
        AutocastPolicy(
            args.precision, recipe=args.fp8_recipe, fp8_min_features=args.fp8_min_features
        )
        if parse_precision(args.precision).float8_linears
        else None
    )
    amp = DistAMP(
        precision=args.precision,
        strategy=args.strategy,
        comm_hook=args.comm_hook,
        policy=policy,
        grad_accum_steps=args.grad_accum,
        max_grad_norm=args.max_grad_norm or None,
        timeout=args.timeout,
        trace_nonfinite=args.trace_nonfinite,
        weights=weights_of(args),  # --weights/--states: 16-bit weights, their master
        # Every rank's per-module numbers, kept next to metrics.jsonl: what `distamp report` draws.
        telemetry=(
            Telemetry(args.out, interval=args.telemetry_interval)
            if args.telemetry_interval and parse_precision(args.precision).compute_dtype
            else None
        ),
    )
    # The memory recipe in torchtitan's order: checkpointing, then compile, both per block (the
    # entries of model.blocks), before setup wraps or shards the model (FSDP2's units are the
    # same blocks). Parameter names do not change, so checkpoints load either way.
    model = apply_activation_checkpointing(GPT(cfg), args.activation_checkpointing)
    if args.compile:
        compile_blocks(model, backend=args.compile_backend)
    amp.setup(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps)),
    )
    data = ShardedText(
        load_text(args.data),
        context=cfg.context,
        batch_size=args.batch_size,
        rank=env.rank,
        world_size=amp.world_size,
        seed=args.seed,
        device=amp.device,
    )
    try:
        resumed = amp.load_state(args.out) if args.resume else False
    except CheckpointError as exc:
        # The engine refuses a checkpoint that does not fit (another --size: other shapes) on
        # every rank alike, before anything is loaded: a usage error printed once, not a
        # traceback from every rank.
        if env.rank == 0:
            print(
                f"{Path(sys.argv[0]).name}: error: argument --resume: {exc} (this run builds "
                f"--size {args.size}; resume with the --size that wrote it)",
                file=sys.stderr,
            )
        amp.close()
        shutdown_distributed()
        return 2
    if env.rank == 0:  # how `distamp export DIR` rebuilds the model
        record_model(args.out, _model_spec(args, cfg))
    start_step, end = amp.step_count, min(args.steps, args.stop_at or args.steps)
    printer = ProgressPrinter(end, jsonl=args.out / "metrics.jsonl")
    main_rank = env.rank == 0
    if main_rank:
        print(
            f"{end - start_step} steps on {amp.world_size} rank(s); checkpoints and "
            f"metrics.jsonl go to {args.out}",
            file=sys.stderr,
        )
    t0 = time.perf_counter()
    stats = amp.fit(
        data.batch,
        lm_loss,
        steps=end,
        tokens_per_batch=data.tokens_per_batch,
        log_interval=args.log_interval,
        on_log=printer.log if main_rank else None,
        on_step=printer.step if main_rank else None,
        stop_requested=stop.is_set,
        checkpoint_dir=args.out,
        checkpoint_interval=args.checkpoint_interval,
    )
    wall = time.perf_counter() - t0
    if main_rank:
        printer.close()
        tokens = (amp.step_count - start_step) * args.grad_accum * data.tokens_per_batch
        summary = {
            "final_loss": stats.last_loss if stats else None,
            "window_loss": stats.loss if stats else None,
            "steps": amp.step_count,
            "skipped_steps": stats.skipped_steps if stats else amp.scaler.skipped_steps,
            "loss_scale": stats.loss_scale if stats else None,
            "grad_norm": stats.grad_norm if stats else None,
            "tokens_per_s": tokens * amp.world_size / wall if wall > 0 else None,
            "grad_bytes": _grad_bytes(stats),
            "bytes_per_param": round(stats.bytes_per_param, 3)
            if stats and stats.bytes_per_param is not None
            else None,
            "world_size": amp.world_size,
            "size": args.size,
            "precision": str(amp.precision),
            "weights": stats.weights if stats else None,
            "fp8_layers": len(amp.fp8.converted) if amp.fp8 is not None else 0,
            "strategy": amp.strategy,
            "activation_checkpointing": args.activation_checkpointing,
            "compile": args.compile_backend if args.compile else None,
            "launcher": env.launcher,
            "resumed_from": start_step if resumed else None,
            "stopped_by_signal": bool(stats and stats.stop),
            "train_s": round(wall, 3),
        }
        assert list(summary) == list(SUMMARY_FIELDS)  # --help documents every field
        print("summary (fields: python launch/train.py --help):", file=sys.stderr, flush=True)
        # strict JSON: a non-finite number (the grad norm of a skipped last step) is null
        finite = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in summary.items()
        }
        print(json.dumps(finite, allow_nan=False), flush=True)
        print(
            f"saved to {args.out}; for inference: distamp export {args.out} -o model.pt2 "
            f"(continue it: --out {args.out} --resume)",
            file=sys.stderr,
        )
        print(f"its precision, drawn: distamp report {args.out}", file=sys.stderr)
    if args.export is not None and main_rank:  # one process exports; the others wait in close
        suffix = args.export.suffix
        target = {".onnx": "onnx", ".pte": "pte"}.get(suffix, "pt2")
        example = data.batch(0)[0][:1].cpu()
        save(export(amp, (example,), dynamic_shapes="batch"), args.export, target=target)
        print(
            f"exported to {args.export} ({target}; precision record: {args.export}.json)",
            file=sys.stderr,
        )
    amp.close()  # releases the wrapped model, which holds the process group
    shutdown_distributed()  # the group came from init_distributed above
    return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
