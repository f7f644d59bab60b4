"""The test suite's multi-process harness: :func:`distamp.cluster.spawn.run_ranks` (see there)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch

from distamp.cluster import free_port
from distamp.cluster.spawn import run_ranks

__all__ = ["free_port", "launcher_free_env", "run_ranks", "run_torchrun", "script_env"]

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK)$"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI_COMM_WORLD|PMI|PMIX|MPI_LOCAL|MV2_COMM_WORLD|DISTAMP)_"
)


def launcher_free_env() -> dict[str, str]:
    """``os.environ`` without the variables a launcher sets: a job a test starts must not
    inherit them from whatever started pytest."""
    return {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}


def script_env() -> dict[str, str]:
    """:func:`launcher_free_env` with the repository on ``PYTHONPATH``, for commands that run
    the repository's scripts (``distamp launch``, ``launch/train.py``)."""
    env = launcher_free_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_torchrun(script: Path, *args: str, timeout: float = 120, nproc: int = 2) -> str:
    """``torchrun --standalone --nproc-per-node nproc script args`` from the repository root,
    with no launcher variables inherited; returns its stdout. The whole process group is killed
    if it outlives ``timeout`` (workers included, not just the launcher)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    env = launcher_free_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        # Fewer GPUs than ranks (NCCL refuses two ranks on one GPU): the ranks train on the CPU,
        # as they do on a machine without a GPU.
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(
        [*cmd, str(script), *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        raise TimeoutError(f"{script.name} did not finish in {timeout} s\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}\n{err[-3000:]}"
    return out
