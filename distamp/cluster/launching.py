"""What ``distamp launch`` starts and how: the launch spec, the ``auto`` rule and the
launcher -> command mapping, then the run.

:func:`build_command` and :func:`resolve_launcher` are pure functions of their arguments (tested
without a machine); :func:`resolve_spec` reads the environment and :func:`run_launch` starts the
processes. The ``distamp`` parser (:mod:`distamp.cli`) checks arguments and calls these; the
supervision of a started job (signals, exit codes) is :mod:`distamp.cluster.supervise`'s.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from distamp.cluster.main_address import free_port
from distamp.cluster.supervise import run_command, run_torchrun

__all__ = [
    "LAUNCHER_CHOICES",
    "TORCHRUN",
    "LaunchSpec",
    "build_command",
    "check_endpoint",
    "resolve_launcher",
    "resolve_spec",
    "run_launch",
]

LAUNCHER_CHOICES = ("auto", "torchrun", "mpirun", "srun", "single")
TORCHRUN = ("-m", "torch.distributed.run")  # after the Python executable: how torchrun is started


def check_endpoint(text: str) -> str:
    """``text`` when it is ``HOST:PORT`` with a non-empty host and a TCP port (1-65535).

    Raises:
        ValueError: saying what was expected and what came.
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT with a TCP port in [1, 65535], got {text!r}")
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


def resolve_spec(
    launcher: str,
    script: str,
    script_args: Sequence[str] = (),
    *,
    nnodes: int = 1,
    nproc_per_node: int = 1,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    env: Mapping[str, str] | None = None,
    srun_available: bool = False,
) -> LaunchSpec:
    """The spec for a requested launcher on this machine: ``auto`` resolved
    (:func:`resolve_launcher`), the endpoint taken from ``MASTER_ADDR``/``MASTER_PORT`` when none
    is given (explicit ones win), a free local port for a one-node mpirun (so that no mpi4py is
    needed to find rank 0), this Python, and whether Open MPI must be told that root runs it."""
    env = os.environ if env is None else env
    resolved = resolve_launcher(launcher, nnodes=nnodes, env=env, srun_available=srun_available)
    endpoint = rdzv_endpoint
    if endpoint is None and {"MASTER_ADDR", "MASTER_PORT"} <= env.keys():
        endpoint = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if endpoint is None and resolved == "mpirun" and nnodes == 1:
        endpoint = f"127.0.0.1:{free_port()}"
    return LaunchSpec(
        launcher=resolved,
        script=script,
        script_args=tuple(script_args),
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        node_rank=node_rank,
        rdzv_endpoint=endpoint,
        python=sys.executable,
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
    )


def run_launch(spec: LaunchSpec, cmd: Sequence[str], *, grace_s: float) -> int:
    """Start ``cmd`` (:func:`build_command` of ``spec``) and return the job's exit code.

    torchrun runs in this process, not as a child (see :mod:`distamp.cluster.supervise` for why);
    every other launcher is a supervised child. A launcher that is not on ``PATH`` is exit code
    127 with a message naming it, as a shell would give.
    """
    try:
        if spec.launcher == "torchrun":
            return run_torchrun(list(cmd[1 + len(TORCHRUN) :]), grace_s=grace_s)
        return run_command(list(cmd), grace_s=grace_s)
    except FileNotFoundError:
        print(f"distamp launch: error: {cmd[0]!r} is not on PATH", file=sys.stderr)
        return 127
