"""The ``distamp`` command: ``launch`` starts a script on N processes, ``env`` reports the setup,
``export`` writes a trained checkpoint for inference (:mod:`distamp.deploy.command`).

The launcher -> command mapping (:func:`build_command`) and the ``auto`` rule
(:func:`resolve_launcher`) are pure functions; only :func:`main` looks at the machine and runs.

Every bad argument is an argparse usage error (exit code 2, the argument, the value and what is
allowed) found before anything starts: :func:`int_arg` and :func:`real_arg` are the argument
types, shared with ``launch/train.py``. Running the job (signals passed on, exit codes, no
process left behind) is :mod:`distamp.cluster.supervise`'s.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import shlex
import shutil
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from distamp.arguments import INT32_MAX  # process counts and ranks end up in torch int32 args
from distamp.cluster import detect_environment, free_port
from distamp.cluster.supervise import GRACE_S, run_command, run_torchrun
from distamp.deploy.targets import TARGETS
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

LAUNCHER_CHOICES = ("auto", "torchrun", "mpirun", "srun", "single")
TORCHRUN = ("-m", "torch.distributed.run")  # after the Python executable: how torchrun is started


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
    """``HOST:PORT`` with a non-empty host and a TCP port (1-65535)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(
            f"expected HOST:PORT with a TCP port in [1, 65535], got {text!r}"
        )
    return text


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to start and how; every machine-dependent value is resolved by the caller."""

    launcher: str  # "torchrun" | "mpirun" | "srun" | "single" (not "auto": see resolve_launcher)
    script: str
    script_args: tuple[str, ...] = ()
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None  # "host:port" of rank 0 / the rendezvous
    python: str = "python"
    as_root: bool = False  # Open MPI refuses root without --allow-run-as-root


def resolve_launcher(
    requested: str, *, nnodes: int, env: Mapping[str, str], srun_available: bool
) -> str:
    """Map ``auto`` to a launcher; other names pass through.

    ``auto`` is torchrun, which works on a laptop and, as one agent per node, inside srun steps and
    mpirun jobs. The exception: several nodes from inside a SLURM allocation that is not yet in a
    step (``salloc``/``sbatch`` shell), where only srun reaches the other nodes. Never mpirun: a
    nested mpirun inside an MPI job is not supported by the MPI implementations.
    """
    if requested != "auto":
        return requested
    in_allocation = "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env
    return "srun" if nnodes > 1 and in_allocation and srun_available else "torchrun"


def build_command(spec: LaunchSpec) -> list[str]:
    """The argv that starts ``spec.script`` under ``spec.launcher`` (pure: no I/O, no environment).

    Raises:
        ValueError: a process count below 1, an unknown launcher, or a multi-node torchrun without
            ``rdzv_endpoint``.
    """
    if spec.nnodes < 1 or spec.nproc_per_node < 1:
        raise ValueError(
            f"--nnodes={spec.nnodes} and --nproc-per-node={spec.nproc_per_node}: need >= 1"
        )
    program = [spec.python, spec.script, *spec.script_args]
    host, _, port = (spec.rdzv_endpoint or "").rpartition(":")
    if spec.launcher == "torchrun":
        cmd = [spec.python, *TORCHRUN, "--nnodes", str(spec.nnodes)]
        if spec.rdzv_endpoint is None and spec.nnodes == 1:
            cmd += ["--standalone"]  # a private rendezvous on a free local port
        elif spec.rdzv_endpoint is None:
            raise ValueError(
                "torchrun on several nodes needs --rdzv-endpoint HOST:PORT (a node of the job)"
            )
        else:
            cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint]
            cmd += [] if spec.node_rank is None else ["--node-rank", str(spec.node_rank)]
        return [*cmd, "--nproc-per-node", str(spec.nproc_per_node), spec.script, *spec.script_args]
    if spec.launcher == "mpirun":  # Open MPI's option names
        cmd = ["mpirun", "-np", str(spec.nnodes * spec.nproc_per_node)]
        cmd += ["--allow-run-as-root"] if spec.as_root else []
        # One node: allow more ranks than detected cores (small CI machines); several: fill by node.
        cmd += (
            ["--oversubscribe"]
            if spec.nnodes == 1
            else ["--map-by", f"ppr:{spec.nproc_per_node}:node"]
        )
        # Without an endpoint the ranks ask rank 0 for its address over MPI (needs mpi4py).
        cmd += (
            ["-x", f"MASTER_ADDR={host}", "-x", f"MASTER_PORT={port}"] if spec.rdzv_endpoint else []
        )
        return [*cmd, *program]
    if spec.launcher == "srun":
        cmd = ["srun", f"--nodes={spec.nnodes}", f"--ntasks-per-node={spec.nproc_per_node}"]
        cmd += ["--kill-on-bad-exit=1"]  # one failed rank ends the step instead of leaving a hang
        cmd += [f"--export=ALL,MASTER_ADDR={host},MASTER_PORT={port}"] if spec.rdzv_endpoint else []
        return [*cmd, *program]
    if spec.launcher == "single":
        if spec.nnodes * spec.nproc_per_node != 1:
            raise ValueError("--launcher single starts one process: drop --nnodes/--nproc-per-node")
        return program
    raise ValueError(f"launcher {spec.launcher!r} is not one of {', '.join(LAUNCHER_CHOICES[1:])}")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _autocast_supported(device: str, dtype: Any) -> bool:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.autocast(device, dtype=dtype)
        except (RuntimeError, ValueError):
            return False
    return not caught  # torch warns, then disables autocast, for a dtype the device cannot run


# What `distamp env` shows of the environment: launcher variables and the backends' knobs.
_SHOWN = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|CUDA_VISIBLE_DEVICES)$|MPI_LOCAL"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI_COMM_WORLD|PMI|MV2_COMM_WORLD|DISTAMP|NCCL|TORCH_NCCL|GLOO"
    r"|TORCH_DISTRIBUTED)_"
)


def environment_report(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Versions, detected launcher, CUDA/NCCL/MPI, autocast and fp8 support, launcher variables.

    Versions come from package metadata, so mpi4py, triton and torchao are reported without being
    imported (importing mpi4py would initialize MPI). fp8: see
    :func:`distamp.precision.fp8_torchao.fp8_support` (CUDA compute capability 8.9+, or the CPU
    through
    ``torch._scaled_mm``; torchao in range).
    """
    import torch
    import torch.distributed as dist

    from distamp.precision.fp8_torchao import fp8_support

    env = os.environ if env is None else env
    try:
        detected: dict[str, Any] = asdict(detect_environment(env))
    except ValueError as exc:
        detected = {"error": str(exc)}
    cuda = torch.cuda.is_available()
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    )
    nccl = dist.is_available() and dist.is_nccl_available()
    return {
        "versions": {
            "distamp": _version("distamp"),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "triton": _version("triton"),
            "mpi4py": _version("mpi4py"),
        },
        "environment": detected,
        "cuda": {
            "available": cuda,
            "version": torch.version.cuda,
            "devices": devices,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda and nccl else None,
        },
        "mpi": {
            "mpirun": shutil.which("mpirun"),
            "srun": shutil.which("srun"),
            "torch_mpi_backend": dist.is_mpi_available(),
        },
        "autocast": {
            f"{device}.{name}": _autocast_supported(device, dtype)
            for device in ("cpu", "cuda")
            for name, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16))
        },
        "fp8": fp8_support(),
        "variables": {k: v for k, v in sorted(env.items()) if _SHOWN.match(k)},
    }


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
        "--version", action="version", version=f"distamp {_version('distamp') or 'unknown'}"
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
        error(f"argument --node-rank: expected a node index in [0, {args.nnodes - 1}] for "
              f"--nnodes {args.nnodes}, got {args.node_rank}")  # fmt: skip
    if args.nnodes * args.nproc_per_node > INT32_MAX:
        error(f"--nnodes x --nproc-per-node = {args.nnodes * args.nproc_per_node} processes: "
              f"at most {INT32_MAX}")  # fmt: skip
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
    launcher = resolve_launcher(
        args.launcher, nnodes=args.nnodes, env=os.environ, srun_available=bool(shutil.which("srun"))
    )
    endpoint = args.rdzv_endpoint
    if endpoint is None and {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
        endpoint = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"  # explicit ones win
    if endpoint is None and launcher == "mpirun" and args.nnodes == 1:
        endpoint = f"127.0.0.1:{free_port()}"  # one node: no need for mpi4py to find rank 0
    spec = LaunchSpec(
        launcher=launcher,
        script=args.script,
        script_args=tuple(args.script_args),
        nnodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        node_rank=args.node_rank,
        rdzv_endpoint=endpoint,
        python=sys.executable,
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
    )
    try:
        cmd = build_command(spec)
    except ValueError as exc:
        args.usage_error(str(exc))
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    try:
        if launcher == "torchrun":
            # In this process, not as a child: see distamp.cluster.supervise for why.
            return run_torchrun(cmd[1 + len(TORCHRUN) :], grace_s=args.grace_period)
        return run_command(cmd, grace_s=args.grace_period)
    except FileNotFoundError:
        print(f"distamp launch: error: {cmd[0]!r} is not on PATH", file=sys.stderr)
        return 127


def _print_report(report: Mapping[str, Any]) -> None:
    for section, values in report.items():
        print(f"{section}:")
        for key, value in values.items():
            print(f"  {key:<20} {'-' if value is None else value}")


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
    except SystemExit as exc:  # --help, --version and usage errors: argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    report = environment_report()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
