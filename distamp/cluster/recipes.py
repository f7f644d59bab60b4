"""SLURM batch scripts for the three ways distamp runs on several nodes.

The scripts live here, as text, rather than as files next to the package: an installed distamp
(a wheel, a container image) can then render them without the repository, and the copies in
``multinode/`` are the rendering for two nodes of eight GPUs, kept identical by a test.

Each script fails loudly instead of guessing (``set -euo pipefail``, no fallback to a single
node when an allocation variable is missing), reads the allocation from SLURM's variables rather
than constants, leaves network choices (``NCCL_SOCKET_IFNAME``) to the environment, and carries
the checkpoint-and-requeue protocol: SLURM signals the script, the script forwards SIGUSR1 to the
job, the job saves its state and exits, the script requeues the job.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

__all__ = ["SBATCH_KINDS", "render_sbatch"]

SBATCH_KINDS: tuple[str, ...] = ("torchrun", "srun", "mpirun")
"""Kinds :func:`render_sbatch` knows, named after the ``distamp launch --launcher`` they match."""

_TITLES: Mapping[str, str] = {
    "torchrun": "one torchrun agent per node (srun), c10d rendezvous on the first node",
    "srun": "one srun task per GPU; distamp reads its rank from SLURM's variables",
    "mpirun": "Open MPI mpirun over a hostfile of the allocation's nodes",
}

_HEADER = """\
#!/usr/bin/env bash
# distamp on SLURM: @TITLE@.
# Rendered by: @RENDER@
#
# Submit from the directory the job's paths are relative to (sbatch starts the script there):
#     sbatch THIS_FILE [EXTRA_ARGS...]
# EXTRA_ARGS are appended to the job's arguments on every start, requeued ones included: pass
# `--out DIR --resume` so that a requeued job continues from the state it saved.
#
# Size: edit the #SBATCH lines, or give the same options to sbatch (they win). The body reads the
# allocation from SLURM's variables, so it follows either.
#
# Runtime choices, taken from the environment sbatch was started in (nothing is hard-coded):
#   NCCL_SOCKET_IFNAME  interface(s) for NCCL's bootstrap and socket traffic, in NCCL's syntax
#                       (ib0, eth, ^docker0,lo). Unset: NCCL picks one; set it when nodes have
#                       several networks and the first one found does not connect them.
#   GLOO_SOCKET_IFNAME  the same for gloo (CPU collectives). Unset: the hostname's address.
#   PYTHON              the command that runs Python, split on spaces (default: python), e.g.
#                       "apptainer exec --nv distamp.sif python" to run the job in a container.
@VARIABLES@#
# Requeue: 90 s before the time limit SLURM sends SIGUSR1 to this script (the B: prefix), which
# forwards it to the job. The job must save its state and exit; this script then requeues the job,
# which keeps its SLURM_JOB_ID. A job that ignores SIGUSR1 is killed at the limit, not requeued.
#SBATCH --job-name=@JOB_NAME@
#SBATCH --nodes=@NODES@
#SBATCH --ntasks-per-node=@TASKS_PER_NODE@
#SBATCH --gpus-per-node=@GPUS_PER_NODE@
#SBATCH --time=@TIME@
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail

# require NAME HINT: stop with HINT when NAME is empty, rather than run a different job than asked.
require() {
    if [[ -z "${!1:-}" ]]; then
        echo "distamp: $1 is not set: $2" >&2
        exit 2
    fi
}
require SLURM_JOB_ID "submit this script with sbatch (it needs a SLURM allocation)"
require SLURM_JOB_NODELIST "submit this script with sbatch (it needs a SLURM allocation)"
require SLURM_NNODES "submit this script with sbatch (it needs a SLURM allocation)"

read -r -a python_cmd <<<"${PYTHON:-python}"
JOB=(@JOB@)

# The launcher runs in the background so that this shell can take SIGUSR1 while it waits.
requeue=0
launcher_pid=""
# shellcheck disable=SC2317  # only the trap calls it
on_usr1() {
    requeue=1
    echo "distamp: SIGUSR1 (time limit near): asking job $SLURM_JOB_ID to save and exit" >&2
    if [[ -n "$launcher_pid" ]]; then
        kill -USR1 "$launcher_pid" 2>/dev/null || true
    fi
}
trap on_usr1 USR1

# run_job COMMAND...: run the launcher; requeue the job if SIGUSR1 came, else exit with its status.
run_job() {
    "$@" &
    launcher_pid=$!
    if ((requeue)); then  # the signal came before the pid was known
        kill -USR1 "$launcher_pid" 2>/dev/null || true
    fi
    local status
    while true; do
        status=0
        wait "$launcher_pid" || status=$?
        # Above 128 with the launcher alive: the trap interrupted `wait`, the launcher goes on.
        if ((status > 128)) && kill -0 "$launcher_pid" 2>/dev/null; then
            continue
        fi
        break
    done
    if ((requeue)); then
        echo "distamp: job stopped (status $status) after SIGUSR1: requeueing $SLURM_JOB_ID" >&2
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    exit "$status"
}
"""

# The first node of the allocation, without `scontrol ... | head -n1`: head exits after one line,
# scontrol can then die of SIGPIPE on a long node list, and pipefail turns that into a failed job.
_FIRST_NODE = """
nodes="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
head_node="${nodes%%$'\\n'*}"
require head_node "scontrol show hostnames gave no node for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
"""

_SRUN_SETUP = """read -r -a srun_args <<<"${SRUN_ARGS:-}"
"""

_BODIES: Mapping[str, str] = {
    "torchrun": _FIRST_NODE
    + _SRUN_SETUP
    + """
NPROC_PER_NODE="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
require NPROC_PER_NODE "request GPUs (--gpus-per-node) or set NPROC_PER_NODE"
RDZV_PORT="${RDZV_PORT:-$((10000 + SLURM_JOB_ID % 20000))}"
# torchrun forwards only SIGTERM/INT/HUP/QUIT to its workers unless told (torch >= 2.10 reads
# this; older versions ignore it and die of SIGUSR1), and gives them this long to save.
export PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
export PET_SHUTDOWN_TIMEOUT="${PET_SHUTDOWN_TIMEOUT:-80}"

run_job srun --ntasks-per-node=1 --kill-on-bad-exit=1 "${srun_args[@]}" \\
    "${python_cmd[@]}" -m torch.distributed.run \\
    --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE" \\
    --rdzv-backend c10d --rdzv-endpoint "$head_node:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \\
    "${JOB[@]}" "$@"
""",
    "srun": "\n"
    + _SRUN_SETUP
    + """# Nothing to compute: each task's rank, local rank and world size come from SLURM_PROCID,
# SLURM_LOCALID and the step's task counts, rank 0's address from the step's first node, the port
# from SLURM_JOB_ID (distamp.cluster); MASTER_ADDR/MASTER_PORT, when exported, win.
run_job srun --kill-on-bad-exit=1 "${srun_args[@]}" "${python_cmd[@]}" "${JOB[@]}" "$@"
""",
    "mpirun": _FIRST_NODE
    + """
require SLURM_NTASKS_PER_NODE "request --ntasks-per-node (one rank per GPU)"
hostfile="$(mktemp "${TMPDIR:-/tmp}/distamp-hosts.XXXXXX")"
trap 'rm -f "$hostfile"' EXIT
while IFS= read -r host; do
    printf '%s slots=%s\\n' "$host" "$SLURM_NTASKS_PER_NODE"
done <<<"$nodes" >"$hostfile"

# Rank 0 runs on the first host of the hostfile; mpi4py is then not needed to find it.
export MASTER_ADDR="${MASTER_ADDR:-$head_node}"
export MASTER_PORT="${MASTER_PORT:-$((10000 + SLURM_JOB_ID % 20000))}"
# mpirun passes only what it is told to the remote ranks: the launcher's and the libraries' knobs
# (not CUDA_VISIBLE_DEVICES: this node's GPU list means nothing on the others).
mpi_env=(-x MASTER_ADDR -x MASTER_PORT)
while IFS= read -r var; do
    case "$var" in
        PATH | LD_LIBRARY_PATH | PYTHONPATH | VIRTUAL_ENV) mpi_env+=(-x "$var") ;;
        NCCL_* | GLOO_* | TORCH_* | OMP_* | DISTAMP_*) mpi_env+=(-x "$var") ;;
    esac
done < <(compgen -e)

run_job mpirun -np "$((SLURM_NNODES * SLURM_NTASKS_PER_NODE))" --hostfile "$hostfile" \\
    --map-by "ppr:$SLURM_NTASKS_PER_NODE:node" --bind-to none "${mpi_env[@]}" \\
    "${python_cmd[@]}" "${JOB[@]}" "$@"
""",
}

_SRUN_ARGS = (
    "#   SRUN_ARGS           more srun options, split on spaces, e.g. a container with pyxis:\n"
    '#                       "--container-image=REGISTRY#IMAGE --container-mounts=/data:/data".\n'
)
_VARIABLES: Mapping[str, str] = {
    "torchrun": _SRUN_ARGS
    + (
        "#   NPROC_PER_NODE      workers per node (default: SLURM_GPUS_ON_NODE, GPUs granted).\n"
        "#   RDZV_PORT           rendezvous port on the first node (default: from SLURM_JOB_ID).\n"
    ),
    "srun": _SRUN_ARGS
    + (
        "#   MASTER_ADDR/PORT    rank 0's address (default: first node of the step, port from\n"
        "#                       SLURM_JOB_ID); set MASTER_PORT when two steps share a node.\n"
    ),
    "mpirun": (
        "#   MASTER_ADDR/PORT    rank 0's address (default: first node, port from SLURM_JOB_ID).\n"
        "#   OMPI_MCA_*          Open MPI's own settings, e.g. OMPI_MCA_btl_tcp_if_include=ib0.\n"
    ),
}

_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
_TIME = re.compile(r"(\d+-)?\d+(:\d\d){0,2}")
_JOB_NAME = re.compile(r"[A-Za-z0-9_.+-]+")


def render_sbatch(
    kind: str,
    *,
    nodes: int,
    gpus_per_node: int,
    script: str,
    script_args: Sequence[str] = (),
    job_name: str = "distamp",
    time_limit: str = "02:00:00",
) -> str:
    """A complete ``sbatch`` script that runs ``script`` on ``nodes`` x ``gpus_per_node`` ranks.

    Pure: no I/O and no environment. ``script`` and ``script_args`` are shell-quoted, so any text
    arrives at the job unchanged; arguments that must differ between submissions (``--out``) go on
    the ``sbatch`` command line instead, which the script appends.

    Args:
        kind: ``"torchrun"`` (srun starts one torchrun per node), ``"srun"`` (one task per GPU)
            or ``"mpirun"`` (Open MPI over a hostfile of the allocation).
        nodes: ``#SBATCH --nodes``.
        gpus_per_node: ``#SBATCH --gpus-per-node``, and the ranks per node.
        script: the job's entry point, relative to the submission directory or absolute.
        script_args: its arguments.
        job_name: ``#SBATCH --job-name`` (also the log name, ``<name>-<jobid>.out``).
        time_limit: ``#SBATCH --time`` in SLURM's syntax (``MM``, ``HH:MM:SS``, ``D-HH:MM``...).

    Returns:
        The script, ending with a newline.

    Raises:
        ValueError: an unknown kind, a count below 1, or a job name or time limit SLURM would
            reject.
    """
    if kind not in SBATCH_KINDS:
        raise ValueError(
            f"render_sbatch(kind={kind!r}): name a launcher: {', '.join(SBATCH_KINDS)}"
        )
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(
            f"render_sbatch(nodes={nodes}, gpus_per_node={gpus_per_node}): need at least 1 of each"
        )
    if not _JOB_NAME.fullmatch(job_name):
        raise ValueError(f"render_sbatch(job_name={job_name!r}): use letters, digits and _.+-")
    if not _TIME.fullmatch(time_limit):
        raise ValueError(
            f"render_sbatch(time_limit={time_limit!r}): use SLURM's syntax, e.g. 90, 02:00:00 or "
            "1-12:00"
        )
    if not script:
        raise ValueError("render_sbatch(script=''): name the job's entry point")
    if any("\n" in a or "\r" in a for a in (script, *script_args)):
        raise ValueError(
            "render_sbatch: a line break in the script or its arguments would end the script's "
            "comments and commands early: give such arguments to sbatch when submitting"
        )
    render = [
        "distamp launch --launcher",
        kind,
        "--nnodes",
        str(nodes),
        "--nproc-per-node",
        str(gpus_per_node),
        "--sbatch --dry-run",
        shlex.join([script, *script_args]),
    ]
    values = {
        "TITLE": _TITLES[kind],
        "RENDER": " ".join(render),
        "VARIABLES": _VARIABLES[kind],
        "JOB_NAME": job_name,
        "NODES": str(nodes),
        # torchrun: one agent task per node, which starts the node's workers itself.
        "TASKS_PER_NODE": "1" if kind == "torchrun" else str(gpus_per_node),
        "GPUS_PER_NODE": str(gpus_per_node),
        "TIME": time_limit,
        "JOB": shlex.join([script, *script_args]),
    }
    # One pass: text that came in through the values (script arguments) is never substituted again.
    return _PLACEHOLDER.sub(lambda m: values[m[1]], _HEADER + _BODIES[kind])
