"""Real Open MPI runs: ``mpirun -np 2`` of a script that calls init_distributed and all-reduces.

Skipped without ``mpirun`` on PATH (CI installs ``openmpi-bin``). Three ways to find rank 0: an
explicit MASTER_ADDR/MASTER_PORT, rank 0's address broadcast over mpi4py, and ``distamp launch``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import free_port

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "tests/scripts/allreduce.py"
LAUNCHER_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK)$"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI_COMM_WORLD|PMI|PMIX|MPI_LOCAL|MV2_COMM_WORLD|DISTAMP)_"
)
MPIRUN = shutil.which("mpirun")

pytestmark = pytest.mark.skipif(
    MPIRUN is None, reason="mpirun is not on PATH (apt-get install openmpi-bin)"
)


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run with a hard timeout that kills mpirun and its ranks (one session) if it hangs."""
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["ALLREDUCE_BACKEND"] = "gloo"  # the launch is under test, not NCCL: ranks may share a GPU
    if not (shutil.which("ssh") or shutil.which("rsh")):
        # Open MPI 4 refuses to start, even on one node, without a remote shell to point at
        # (Debian's openmpi-bin depends on openssh-client; some images lack it). Local ranks never
        # use it, so any program will do.
        env.setdefault("OMPI_MCA_plm_rsh_agent", "false")
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=REPO,
        text=True,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{shlex.join(cmd)} ran over {timeout}s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _assert_two_ranks_summed(out: subprocess.CompletedProcess[str]) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    found = sorted(re.findall(r"rank=(\d) world_size=2 launcher=(\w+) \S+ sum=(\S+) ", out.stdout))
    assert found == [("0", "openmpi", "3"), ("1", "openmpi", "3")], out.stdout + out.stderr


# Root in containers and CI needs --allow-run-as-root; --oversubscribe lets 2 ranks run on 1 core.
MPIRUN_2 = ["mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe"]


def test_mpirun_with_explicit_master_address() -> None:
    port = free_port()
    cmd = [*MPIRUN_2, "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}"]
    _assert_two_ranks_summed(_run([*cmd, sys.executable, SCRIPT]))


@pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py is not installed")
def test_mpirun_address_from_rank0_over_mpi4py() -> None:
    _assert_two_ranks_summed(_run([*MPIRUN_2, sys.executable, SCRIPT]))


def test_distamp_launch_mpirun() -> None:
    cmd = [sys.executable, "-m", "distamp.cli", "launch", "--launcher", "mpirun"]
    _assert_two_ranks_summed(_run([*cmd, "--nproc-per-node", "2", SCRIPT]))
