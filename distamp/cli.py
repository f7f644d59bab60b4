"""The ``distamp`` command's parser: ``launch`` starts a script on N processes, ``env`` reports
the setup, ``versions`` prints the verified releases, ``report`` draws a run's precision
(:mod:`distamp.observe.report`), ``export`` writes a trained checkpoint for
inference (:mod:`distamp.deploy.command`).

Only the parser and the argument checks live here. What a launch starts and how is
:mod:`distamp.cluster.launching` (the launch spec, the ``auto`` rule and the launcher -> command
mapping, pure functions); running the job (signals passed on, exit codes, no process left
behind) is :mod:`distamp.cluster.supervise`'s; the environment report is
:mod:`distamp.env_report`. Their public names stay importable from here.

Every bad argument is an argparse usage error (exit code 2, the argument, the value and what is
allowed) found before anything starts: :func:`int_arg` and :func:`real_arg` are the argument
types, shared with ``launch/train.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence

from distamp.arguments import INT32_MAX  # process counts and ranks end up in torch int32 args
from distamp.cluster.launching import (
    LAUNCHER_CHOICES,
    LaunchSpec,
    build_command,
    check_endpoint,
    resolve_launcher,
    resolve_spec,
    run_launch,
)
from distamp.cluster.supervise import GRACE_S
from distamp.deploy.targets import TARGETS
from distamp.env_report import environment_report, package_version, print_report
from distamp.versions import compatibility_table

__all__ = [
    "LaunchSpec",
    "build_command",
    "environment_report",
    "int_arg",
    "main",
    "real_arg",
    "resolve_launcher",
]


def int_arg(low: int, high: int = INT32_MAX) -> Callable[[str], int]:
    """An argparse ``type``: a whole number in ``[low, high]``, else a usage error saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"expected a whole number in [{low}, {high}], got {text!r}"
            )
        return value

    parse.__name__ = "int"
    return parse


def real_arg(low: float, high: float = math.inf, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number ``>= low`` (``> low`` when ``above``) and ``<= high``,
    else a usage error saying so (``nan``/``inf`` are refused)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        ok = math.isfinite(value) and (value > low if above else value >= low) and value <= high
        if not ok:
            bound = f"> {low:g}" if above else f">= {low:g}"
            top = "" if math.isinf(high) else f" and <= {high:.10g}"
            raise argparse.ArgumentTypeError(f"expected a finite number {bound}{top}, got {text!r}")
        return value

    parse.__name__ = "float"
    return parse


def _endpoint(text: str) -> str:
    """An argparse ``type``: :func:`distamp.cluster.launching.check_endpoint`, as a usage error."""
    try:
        return check_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_LAUNCH_EXAMPLES = """examples:
  distamp launch --nproc-per-node 2 launch/train.py          # 2 processes on this machine
  distamp launch --nproc-per-node 2 launch/train.py --precision bf16 --steps 50
  distamp launch --launcher mpirun --nproc-per-node 4 train.py
  distamp launch --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
      --rdzv-endpoint node0:29500 train.py                     # run once per node
  distamp launch --sbatch --launcher srun --nnodes 2 --nproc-per-node 8 train.py > job.sbatch
  distamp launch --dry-run --nproc-per-node 2 train.py       # print the command only

Everything after SCRIPT is passed to it unchanged."""


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a mistyped option (--nproc-per-nod) is an error, not silently expanded.
    parser = argparse.ArgumentParser(
        prog="distamp", description="distributed mixed precision", allow_abbrev=False
    )
    parser.add_argument(
        "--version", action="version", version=f"distamp {package_version('distamp') or 'unknown'}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser(
        "launch",
        help="start SCRIPT on several processes",
        description="Start SCRIPT on nnodes x nproc-per-node processes under a launcher, with\n"
        "the rank variables every launcher family sets (distamp.detect_environment reads them).",
        epilog=_LAUNCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    launch.add_argument(
        "--launcher",
        choices=LAUNCHER_CHOICES,
        default="auto",
        help="what starts the processes (default: auto = torchrun, or srun for several nodes "
        "from inside a SLURM allocation)",
    )
    launch.add_argument(
        "--nnodes", type=int_arg(1), default=1, metavar="N", help="machines in the job (default: 1)"
    )
    launch.add_argument(
        "--nproc-per-node",
        type=int_arg(1),
        default=1,
        metavar="N",
        help="processes per machine, usually one per GPU (default: 1)",
    )
    launch.add_argument(
        "--node-rank",
        type=int_arg(0),
        default=None,
        metavar="I",
        help="this machine's index in [0, nnodes), torchrun only (default: from the rendezvous)",
    )
    launch.add_argument(
        "--rdzv-endpoint",
        type=_endpoint,
        default=None,
        metavar="HOST:PORT",
        help="where rank 0 listens; needed by torchrun on several nodes (default: a free local "
        "port on one node)",
    )
    launch.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    launch.add_argument(
        "--grace-period",
        type=real_arg(0.0),
        default=GRACE_S,
        metavar="S",
        help=f"seconds the job has to end after SIGTERM/SIGINT before SIGKILL "
        f"(default: {GRACE_S:g})",
    )
    launch.add_argument(
        "--sbatch",
        action="store_true",
        help="print a SLURM batch script for --launcher torchrun|srun|mpirun, run nothing",
    )
    launch.add_argument("script", help="a Python file (checked to exist unless only printed)")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="SCRIPT's own arguments")
    launch.set_defaults(usage_error=launch.error)  # usage errors found after parsing
    report = sub.add_parser(
        "env", help="report versions, launcher and hardware support", allow_abbrev=False
    )
    report.add_argument("--json", action="store_true", help="one JSON object instead of text")
    sub.add_parser(
        "versions", help="print the verified releases of torch and each framework (Markdown)"
    )
    draw = sub.add_parser(
        "report",
        help="draw a run's precision (loss, scale, skips, per-module headroom and underflow, "
        "precision changes, fp8 layers, bytes) as one self-contained HTML page",
        allow_abbrev=False,
    )
    draw.add_argument("run", metavar="DIR", help="the run folder (the main job's --out DIR)")
    draw.add_argument(
        "-o", "--output", metavar="FILE.html", help="the page to write (default DIR/report.html)"
    )
    draw.add_argument("--png", metavar="DIR", help="also write each figure as DIR/<name>.png")
    export = sub.add_parser(
        "export",
        help="export a trained checkpoint for inference in its trained precision",
        description="Export the latest checkpoint of CHECKPOINT_DIR (launch/train.py --out DIR)"
        " with its fp32 islands and adaptive promotions as explicit casts (distamp.deploy).",
        allow_abbrev=False,
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="holds model.json")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="file to write")
    export.add_argument("--target", choices=TARGETS, default="pt2", help="default: pt2")
    export.add_argument(
        "--check",
        type=int_arg(0),
        default=0,
        metavar="N",
        help="compare with fp32 eager on N random inputs; refuse past the tolerance",
    )
    export.add_argument(
        "--auto-islands",
        action="store_true",
        help="with --check: make the first diverging module fp32 and check again",
    )
    export.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16"),
        default=None,
        help="export in this precision instead of the trained one (e.g. fp16 or fp32 for "
        "ONNX, whose CPU runtime has no bf16 kernels); default: the trained precision",
    )
    export.add_argument(
        "--max-batch",
        type=int_arg(2),
        default=1024,
        metavar="N",
        help="the largest batch the program takes (default: 1024)",
    )
    return parser


def _check_launch(args: argparse.Namespace) -> None:
    """What argparse cannot check one argument at a time: usage error (exit 2) if wrong."""
    error = args.usage_error
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        error(
            f"argument --node-rank: expected a node index in [0, {args.nnodes - 1}] for "
            f"--nnodes {args.nnodes}, got {args.node_rank}"
        )
    if args.nnodes * args.nproc_per_node > INT32_MAX:
        error(
            f"--nnodes x --nproc-per-node = {args.nnodes * args.nproc_per_node} processes: "
            f"at most {INT32_MAX}"
        )
    if args.dry_run or args.sbatch:
        return  # only printed: the script may live on the machine that will run it
    if not os.path.isfile(args.script):
        what = "is a directory" if os.path.isdir(args.script) else "does not exist"
        error(f"argument script: {args.script!r} {what}; expected a Python file to run")
    if not os.access(args.script, os.R_OK):
        error(f"argument script: {args.script!r} is not readable")
    if args.rdzv_endpoint is None and {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        try:
            _endpoint(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
        except argparse.ArgumentTypeError as exc:
            error(f"MASTER_ADDR/MASTER_PORT in the environment: {exc}")


def _launch(args: argparse.Namespace) -> int:
    _check_launch(args)
    if args.sbatch:  # the rendezvous endpoint comes from the allocation, at run time
        from distamp.cluster.recipes import render_sbatch

        try:
            script = render_sbatch(
                args.launcher,
                nodes=args.nnodes,
                gpus_per_node=args.nproc_per_node,
                script=args.script,
                script_args=args.script_args,
            )
        except ValueError as exc:
            args.usage_error(f"argument --sbatch: {exc}")
        print(script, end="")
        return 0
    spec = resolve_spec(
        args.launcher,
        args.script,
        args.script_args,
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        srun_available=bool(shutil.which("srun")),
    )
    try:
        cmd = build_command(spec)
    except ValueError as exc:
        args.usage_error(str(exc))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return run_launch(spec, cmd, grace_s=args.grace_period)


def _report(args: argparse.Namespace) -> int:
    """``distamp report``: the page written and its headline figures; a folder that is not a
    run is a usage error (exit 2) saying what it lacks. Without matplotlib (the ``report``
    extra, which ``pip install -e .`` does not bring), exit 1 with the install command rather
    than a traceback: the main job's last line sends every reader here."""
    from distamp.observe.report import ReportError, draw_report, load_run, summary

    try:
        run = load_run(args.run)
    except ReportError as exc:
        print(f"distamp report: {exc}", file=sys.stderr)
        return 2
    try:
        page = draw_report(run, args.run, args.output, png=args.png)
    except ImportError as exc:  # matplotlib missing: the message names the command already
        print(exc, file=sys.stderr)
        return 1
    headline = summary(run).items()
    figures = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in headline)
    print(f"wrote {page} ({figures})")
    if args.png:
        print(f"figures as PNG in {args.png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distamp`` console script; returns the process exit code."""
    try:
        args = _parser().parse_args(argv)
        if args.command == "launch":
            return _launch(args)
        if args.command == "versions":
            print(compatibility_table(), end="")
            return 0
        if args.command == "export":
            from distamp.deploy.command import run_export

            return run_export(args)
        if args.command == "report":
            return _report(args)
    except SystemExit as exc:  # --help, --version and usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
