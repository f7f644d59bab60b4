"""The main job: a byte-level GPT trained on a public-domain play through distamp's engine.

    python launch/train.py                                   # one process
    torchrun --standalone --nproc-per-node 2 launch/train.py # or mpirun -np 2, srun, distamp launch

Rank 0 draws a progress line on stderr and prints ONE JSON object as its last stdout line
(final_loss, steps, skipped_steps, loss_scale, tokens_per_s, world_size, precision, strategy...;
``--help`` explains each field). Nothing is written to disk unless ``--out DIR`` (checkpoints)
or ``--export PATH`` (the model for inference, docs/guides/deployment.md) is given.
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
import contextlib
import io
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `launch.model` (and a checkout)
from distamp import (
    AutocastPolicy,
    CheckpointError,
    DistAMP,
    ProgressPrinter,
    apply_activation_checkpointing,
    compile_blocks,
    detect_environment,
    export,
    init_distributed,
    parse_precision,
    shutdown_distributed,
)
from distamp.cli import int_arg, real_arg
from distamp.deploy import InputSpec, ModelSpec, record_model, save
from distamp.engine.config import AMPConfig
from distamp.observe.metrics import WindowStats
from distamp.parallel.recompute import AC_MODES
from distamp.parallel.strategies import COMM_HOOKS, STRATEGIES
from distamp.precision.fp8_select import FP8_RECIPES
from launch.model import DATA_FILE, GPT, SIZES, GPTConfig, ShardedText, lm_loss, load_text

QUIET_RANK_WAIT_S = 20.0  # the longest a rank waits for local rank 0 to report a usage error
COMPILE_BACKENDS = ("inductor", "aot_eager")
"""``--compile-backend``: inductor is what a GPU run uses; aot_eager traces the same graphs
(forward and backward, the recomputation of a checkpointed block included) without generating
kernels, so it compiles in seconds on a CPU where inductor takes a minute or more."""


def _precision(text: str) -> str:
    """argparse type for --precision: any spelling parse_precision takes (kept as written)."""
    try:
        parse_precision(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("precision=")) from None
    return text


SUMMARY_FIELDS: dict[str, str] = {
    "final_loss": "mean loss of the last step, over every rank's micro-batches",
    "window_loss": "mean loss since the previous logging step (--log-interval steps)",
    "steps": "the step count at the end: skipped steps and steps before a resume included",
    "skipped_steps": "steps skipped because a gradient was inf/NaN (the scale then backs off)",
    "loss_scale": "the loss scale at the end (fp16; 1.0 where no scaling is needed)",
    "grad_norm": "gradient norm before clipping at the last logging step (null: no clipping)",
    "tokens_per_s": "training tokens per second, all ranks together",
    "grad_bytes": "bytes rank 0 sent for gradients per step, scales included (null: not counted)",
    "world_size": "number of ranks",
    "size": "the model trained (--size: tiny, small or medium)",
    "precision": "the precision trained in",
    "fp8_layers": "Linear layers converted to float8 (fp8 only)",
    "strategy": "the data-parallel wrapper chosen (ddp, fsdp, ...; none for one process)",
    "activation_checkpointing": "activation checkpointing of each block (none, full, selective)",
    "compile": "the torch.compile backend of each block (null: eager, no --compile)",
    "launcher": "the launcher family detected (torchrun, mpirun, srun, single)",
    "resumed_from": "the step the run resumed from (null: a fresh run)",
    "stopped_by_signal": "true if SIGUSR1/SIGTERM/SIGINT stopped it early (after saving)",
    "train_s": "wall-clock seconds of the training loop",
}
"""The fields of the JSON summary line, in order, with what each means (``--help`` lists them)."""


def _epilog() -> str:
    width = max(map(len, SUMMARY_FIELDS))
    fields = "\n".join(f"  {k:<{width}}  {v}" for k, v in SUMMARY_FIELDS.items())
    return (
        "outputs: rank 0 draws a progress line on stderr and prints one JSON summary as its last\n"
        "stdout line; nothing is written to disk unless --out DIR is given (checkpoints,\n"
        "DIR/metrics.jsonl and DIR/model.json, which `distamp export DIR` reads) or --export PATH\n"
        f"(the trained model for inference).\n\nsummary fields:\n{fields}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check every argument: a bad one is a usage error (exit 2) naming it and what is
    allowed, before any process group starts."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = p.add_argument
    add("--steps", type=int_arg(1), default=300, help="optimizer steps (the LR schedule's length)")
    add(
        "--size",
        choices=SIZES,
        default="tiny",
        help="the model: tiny (2 layers, 64 wide), small (4 x 128) or medium (12 x 384, 21.5M "
        "parameters: four DDP buckets, 13 FSDP2 units)",
    )
    add(
        "--precision", type=_precision, default="fp16", help="fp16 | bf16 | fp32 | fp8, 16-mixed..."
    )
    add("--fp8-recipe", choices=FP8_RECIPES, default="tensorwise", help="fp8 scaling recipe")
    add(
        "--fp8-min-features",
        type=int_arg(0),
        default=64,
        help="fp8: smallest in/out features of a float8 Linear (distamp's default is 2048; the "
        "models are 64 wide or wider, so 64 puts every Linear of every --size in fp8)",
    )
    add("--strategy", choices=STRATEGIES, default="auto", help="data-parallel strategy")
    add(
        "--comm-hook",
        choices=COMM_HOOKS,
        default=None,
        help="gradient communication (ddp; fp8 and fp8-ef also fsdp2): compressed or counted",
    )
    add(
        "--activation-checkpointing",
        choices=AC_MODES,
        default="none",
        help="recompute each block's activations in backward (distamp.apply_activation_"
        "checkpointing): full saves a block's input only, selective also every other matmul's "
        "output; the precision policy holds either way, so the losses are those of none",
    )
    add(
        "--compile",
        action="store_true",
        help="torch.compile each block (distamp.compile_blocks), after activation checkpointing "
        "and before the engine wraps the model",
    )
    add(
        "--compile-backend",
        choices=COMPILE_BACKENDS,
        default=None,
        help="the backend of --compile: inductor (the default; generated kernels, the GPU "
        "choice) or aot_eager (the same graphs run by eager kernels: compiles in seconds on a "
        "CPU)",
    )
    add("--grad-accum", type=int_arg(1), default=1, help="micro-batches per step")
    add("--max-grad-norm", type=real_arg(0.0), default=1.0, help="clip norm; 0 disables")
    add("--seed", type=int_arg(0, 2**32 - 1), default=0)
    add("--batch-size", type=int_arg(1), default=16, help="sequences per micro-batch per rank")
    add("--lr", type=real_arg(0.0, above=True), default=3e-3, help="peak learning rate")
    add("--warmup", type=int_arg(0), default=20, help="linear warm-up steps")
    add("--log-interval", type=int_arg(1), default=10, help="steps between metric syncs")
    add("--out", type=Path, default=None, help="checkpoints + metrics.jsonl")
    add("--resume", action="store_true", help="continue from the last checkpoint")
    add(
        "--export",
        type=Path,
        default=None,
        metavar="PATH",
        help="after training, rank 0 exports the model in its trained precision (distamp.export):"
        " PATH.onnx for ONNX, PATH.pte for ExecuTorch, else a torch.export .pt2",
    )
    add("--checkpoint-interval", type=int_arg(0), default=0, help="0: save at the end only")
    add("--stop-at", type=int_arg(1), default=None, help="save and stop after this step")
    add("--data", type=Path, default=DATA_FILE, help="any text file")
    add("--threads", type=int_arg(0, 4096), default=0, help="CPU threads per rank (0: cores/ranks)")
    add("--timeout", type=real_arg(0.0, 2**31 - 1, above=True), default=300.0, help="seconds")
    add(
        "--trace-nonfinite",
        action="store_true",
        help="name the first module whose forward output overflowed in skip reports",
    )
    try:
        local_rank: int | None = detect_environment().local_rank
    except ValueError:
        local_rank = None  # a usage error below, printed by every rank
    with _one_voice_per_node(local_rank):
        args = p.parse_args(argv)
        if args.resume and args.out is None:
            p.error("argument --resume: needs --out DIR (where the checkpoints are)")
        if args.out is not None:
            _check_out(p, args.out)
        if args.stop_at is not None and args.stop_at > args.steps:
            p.error(f"argument --stop-at: expected a step in [1, --steps={args.steps}], "
                    f"got {args.stop_at}")  # fmt: skip
        try:
            world = detect_environment().world_size  # pure: reads the launcher's variables
        except ValueError as exc:
            p.error(f"launcher environment: {exc}")
        _check_comm_hook(p, args, world)
        if args.compile_backend is not None and not args.compile:
            p.error(f"argument --compile-backend: {args.compile_backend} is the backend of "
                    "--compile; pass --compile too")  # fmt: skip
        if args.compile and args.compile_backend is None:
            args.compile_backend = "inductor"
        if args.export is not None and args.strategy in ("fsdp", "fsdp2", "hsdp"):
            p.error(
                f"argument --export: --strategy {args.strategy} shards the model, so no rank "
                "holds it whole; pass --out DIR and run distamp export DIR -o PATH"
            )
        _check_data(p, args.data, args.batch_size * world + SIZES[args.size].context + 1)
    return args


@contextlib.contextmanager
def _one_voice_per_node(local_rank: int | None) -> Iterator[None]:
    """Argparse's output (usage errors, --help) from local rank 0 alone (or from every rank when
    the rank is unknown). The ranks of a node parse the same arguments against the same files,
    so the others would print the same message again, once per rank."""
    if not local_rank:
        yield
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    except SystemExit as exc:
        if exc.code:
            # Exiting at once could let the launcher stop local rank 0 before it has printed
            # (torchrun ends the other ranks at the first failure it sees). Normally the launcher
            # ends this rank as soon as local rank 0 has exited with the same error.
            time.sleep(QUIET_RANK_WAIT_S)
        raise


def _check_out(p: argparse.ArgumentParser, out: Path) -> None:
    """--out must be a directory, or a path whose nearest existing ancestor is a writable
    directory (the run creates the rest): found now, not after training at the first save."""
    if out.exists() and not out.is_dir():
        p.error(f"argument --out: {str(out)!r} exists and is not a directory")
    base = out.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        p.error(f"argument --out: {str(out)!r} cannot be created: {str(base)!r} is a file, "
                "not a directory")  # fmt: skip
    if not os.access(base, os.W_OK | os.X_OK):
        p.error(f"argument --out: {str(out)!r} cannot be created: {str(base)!r} is not "
                "writable")  # fmt: skip


def _check_data(p: argparse.ArgumentParser, path: Path, needed: int) -> None:
    """--data must be a readable file long enough for one batch on every rank."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        p.error(f"argument --data: {str(path)!r} {what}; expected a readable text file")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            f.read(1)
    except OSError as exc:
        p.error(f"argument --data: {str(path)!r} cannot be read ({exc.strerror})")
    if size < needed:
        p.error(f"argument --data: {str(path)!r} holds {size} bytes; this run needs at least "
                f"{needed} (batch size x ranks + context + 1)")  # fmt: skip


def _check_comm_hook(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """--comm-hook against --strategy (the engine's own rule) and the world, before any rank
    starts: a usage error, not a traceback from every rank."""
    if args.comm_hook is None:
        return
    if world < 2:
        p.error(f"argument --comm-hook: {args.comm_hook} exchanges gradients between ranks; "
                "launch 2 or more (distamp launch --nproc-per-node N ...)")  # fmt: skip
    try:
        AMPConfig(precision=parse_precision(args.precision), strategy=args.strategy,
                  comm_hook=args.comm_hook)  # fmt: skip
    except ValueError as exc:
        p.error(f"argument --comm-hook: {exc}")


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
            print(f"{Path(sys.argv[0]).name}: error: argument --resume: {exc} (this run builds "
                  f"--size {args.size}; resume with the --size that wrote it)",
                  file=sys.stderr)  # fmt: skip
        amp.close()
        shutdown_distributed()
        return 2
    if args.out is not None and env.rank == 0:  # how `distamp export DIR` rebuilds the model
        record_model(args.out, _model_spec(args, cfg))
    start_step, end = amp.step_count, min(args.steps, args.stop_at or args.steps)
    printer = ProgressPrinter(end, jsonl=args.out / "metrics.jsonl" if args.out else None)
    main_rank = env.rank == 0
    if main_rank:
        where = (
            f"checkpoints and metrics.jsonl go to {args.out}"
            if args.out
            else ("nothing is saved (pass --out DIR for checkpoints and metrics.jsonl)")
        )
        print(f"{end - start_step} steps on {amp.world_size} rank(s); {where}", file=sys.stderr)
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
            "world_size": amp.world_size,
            "size": args.size,
            "precision": str(amp.precision),
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
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in summary.items()}  # fmt: skip
        print(json.dumps(finite, allow_nan=False), flush=True)
    if args.export is not None and main_rank:  # one process exports; the others wait in close
        suffix = args.export.suffix
        target = {".onnx": "onnx", ".pte": "pte"}.get(suffix, "pt2")
        example = data.batch(0)[0][:1].cpu()
        save(export(amp, (example,), dynamic_shapes="batch"), args.export, target=target)
        print(f"exported to {args.export} ({target}; precision record: {args.export}.json)",
              file=sys.stderr)  # fmt: skip
    amp.close()  # releases the wrapped model, which holds the process group
    shutdown_distributed()  # the group came from init_distributed above
    return stop.exit_code


if __name__ == "__main__":
    sys.exit(main())
