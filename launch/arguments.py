"""The main job's command line (``launch/train.py``): the parser, its help (the summary fields
each run prints) and every check that argparse cannot make one argument at a time, so that a bad
argument is a usage error naming it before any process group starts.

Each rank parses the same arguments; argparse's output comes from local rank 0 alone.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from distamp import (
    AC_MODES,
    COMM_HOOKS,
    FP8_RECIPES,
    STRATEGIES,
    WeightPrecision,
    check_settings,
    detect_environment,
    parse_precision,
)
from distamp.cli import int_arg, real_arg
from distamp.deploy import require_runnable
from distamp.optim.config import MASTERS
from launch.model import DATA_FILE, SIZES

__all__ = ["COMPILE_BACKENDS", "RUNS", "SUMMARY_FIELDS", "parse"]

RUNS = Path("runs")  # where a run without --out is kept: runs/<start time> (launch/train.py)
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
    "bytes_per_param": "bytes rank 0 keeps per parameter: weights, gradients, masters, states",
    "world_size": "number of ranks",
    "size": "the model trained (--size: tiny, small or medium)",
    "precision": "the precision trained in",
    "weights": "how the weights are kept (--weights, --states; fp32: cast per op)",
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
        "stdout line; the run is kept in --out DIR, by default runs/<start time> (checkpoints,\n"
        "DIR/metrics.jsonl and DIR/model.json, which `distamp export DIR` reads; the path and\n"
        "that command are printed at the end); --export PATH also writes the trained model for\n"
        f"inference.\n\nsummary fields:\n{fields}"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check every argument: a bad one is a usage error (exit 2) naming it and what is
    allowed, before any process group starts."""
    p = argparse.ArgumentParser(
        description="The main job: a byte-level GPT trained on a public-domain play through "
        "distamp's engine.",
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
        "--weights",
        choices=("fp32", *MASTERS),
        default="fp32",
        help="fp32 weights (cast per op), or 16-bit weights and gradients (the --precision's "
        "dtype) with this master (distamp.WeightPrecision): exact (bf16 + 16-bit remainder), "
        "sharded (fp32 copy over the ranks), stochastic, kahan",
    )
    add(
        "--states",
        choices=("fp32", "bf16"),
        default="fp32",
        help="the optimizer's moments with 16-bit --weights: fp32 or bf16",
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
    add(
        "--out",
        type=Path,
        default=None,
        help="checkpoints, metrics.jsonl and model.json (default: runs/<start time>)",
    )
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
    add(
        "--telemetry-interval",
        type=int_arg(0),
        default=10,
        metavar="N",
        help="per-module precision telemetry every N steps into --out DIR/telemetry, drawn by "
        "distamp report DIR (0: off; fp32 has none)",
    )
    try:
        local_rank: int | None = detect_environment().local_rank
    except ValueError:
        local_rank = None  # a usage error below, printed by every rank
    with _one_voice_per_node(local_rank):
        args = p.parse_args(argv)
        if args.resume and args.out is None:
            p.error("argument --resume: needs --out DIR (where the checkpoints are)")
        _check_out(p, RUNS if args.out is None else args.out)
        if args.stop_at is not None and args.stop_at > args.steps:
            p.error(
                f"argument --stop-at: expected a step in [1, --steps={args.steps}], "
                f"got {args.stop_at}"
            )
        try:
            found = detect_environment()  # pure: reads the launcher's variables
        except ValueError as exc:
            p.error(f"launcher environment: {exc}")
        world = found.world_size
        if found.launcher == "single" and args.strategy not in ("auto", "none"):
            p.error(_needs_launcher(args.strategy, sys.argv[1:] if argv is None else argv))
        _check_comm_hook(p, args, world)
        _check_weights(p, args)
        if args.compile_backend is not None and not args.compile:
            p.error(
                f"argument --compile-backend: {args.compile_backend} is the backend of "
                "--compile; pass --compile too"
            )
        if args.compile and args.compile_backend is None:
            args.compile_backend = "inductor"
        if args.export is not None and args.strategy in ("fsdp", "fsdp2", "hsdp"):
            p.error(
                f"argument --export: --strategy {args.strategy} shards the model, so no rank "
                "holds it whole; pass --out DIR and run distamp export DIR -o PATH"
            )
        if args.export is not None and args.export.suffix == ".onnx":
            _check_onnx(p, args.export, args.precision)
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


def _needs_launcher(strategy: str, argv: list[str]) -> str:
    """The usage error of a --strategy that needs a process group, started without a launcher
    (one plain process has none): the command that starts the same run on 2 ranks."""
    script = os.path.relpath(Path(__file__).with_name("train.py"))
    command = shlex.join(["distamp", "launch", "--nproc-per-node", "2", script, *argv])
    return (
        f"argument --strategy: {strategy} runs on 2 or more ranks, and this is one process "
        f"started without a launcher; start it with:\n  {command}\n(or --strategy none for "
        "one process)"
    )


def _check_out(p: argparse.ArgumentParser, out: Path) -> None:
    """--out must be a directory, or a path whose nearest existing ancestor is a writable
    directory (the run creates the rest): found now, not after training at the first save."""
    if out.exists() and not out.is_dir():
        p.error(f"argument --out: {str(out)!r} exists and is not a directory")
    base = out.absolute()
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        p.error(
            f"argument --out: {str(out)!r} cannot be created: {str(base)!r} is a file, "
            "not a directory"
        )
    if not os.access(base, os.W_OK | os.X_OK):
        p.error(f"argument --out: {str(out)!r} cannot be created: {str(base)!r} is not writable")


def _check_onnx(p: argparse.ArgumentParser, path: Path, precision: str) -> None:
    """--export PATH.onnx in bf16 (fp8 exports in bf16): ONNX Runtime cannot load it, which
    would surface as its traceback after training; refused before."""
    try:
        require_runnable("onnx", parse_precision(precision).compute_dtype or torch.float32)
    except ValueError:
        p.error(
            f"argument --export: {str(path)!r} is an ONNX model, and ONNX Runtime's CPU provider "
            f"cannot run a --precision {precision} program (no bf16 kernels); pass "
            f"{str(path.with_suffix('.pt2'))!r}, or --precision fp16 or fp32 for ONNX"
        )


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
        p.error(
            f"argument --data: {str(path)!r} holds {size} bytes; this run needs at least "
            f"{needed} (batch size x ranks + context + 1)"
        )


def _check_comm_hook(p: argparse.ArgumentParser, args: argparse.Namespace, world: int) -> None:
    """--comm-hook against --strategy (the engine's own rule) and the world, before any rank
    starts: a usage error, not a traceback from every rank."""
    if args.comm_hook is None:
        return
    if world < 2:
        p.error(
            f"argument --comm-hook: {args.comm_hook} exchanges gradients between ranks; "
            "launch 2 or more (distamp launch --nproc-per-node N ...)"
        )
    try:
        check_settings(args.precision, strategy=args.strategy, comm_hook=args.comm_hook)
    except ValueError as exc:
        p.error(f"argument --comm-hook: {exc}")


def weights_of(args: argparse.Namespace) -> WeightPrecision | None:
    """--weights and --states as the engine's ``weights`` (``None`` for fp32 weights)."""
    if args.weights == "fp32":
        return None
    dtype = parse_precision(args.precision).compute_dtype
    name = "fp16" if dtype == torch.float16 else "bf16"
    return WeightPrecision(name, master=args.weights, states=args.states)


def _check_weights(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--weights/--states against --precision and --strategy (the engine's own rule), before
    any rank starts."""
    if args.weights == "fp32":
        if args.states != "fp32":
            p.error("argument --states: the optimizer's states are 16-bit with 16-bit --weights")
        return
    try:
        check_settings(
            args.precision,
            strategy=args.strategy,
            comm_hook=args.comm_hook,
            weights=weights_of(args),
        )
    except ValueError as exc:
        p.error(f"argument --weights: {exc}")
