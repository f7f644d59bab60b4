"""The ``distamp`` command: launcher commands (pure), dry runs, ``env``, a real 2-process launch,
and fuzzed ``distamp launch`` arguments (a usage error with exit 2, or a command)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import LAUNCHER_VARS, script_env
from fuzz_scenarios import ARG_VALUES
from hypothesis import event, example, given
from hypothesis import strategies as st

from distamp.cli import LaunchSpec, build_command, environment_report, main, resolve_launcher
from distamp.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _clean_env() -> dict[str, str]:
    env = script_env()
    env["ALLREDUCE_BACKEND"] = "gloo"  # the launch is under test, not NCCL: ranks may share a GPU
    return env


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with a hard timeout that also kills its children (a launcher's workers)."""
    proc = subprocess.Popen(
        cmd,
        env=_clean_env(),
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


def _spec(launcher: str, **kw: Any) -> LaunchSpec:
    return LaunchSpec(
        launcher=launcher, script="train.py", script_args=("--lr", "0.1"), python=PY, **kw
    )


COMMANDS = [
    (
        "torchrun-one-node",
        _spec("torchrun", nproc_per_node=4),
        f"{PY} -m torch.distributed.run --nnodes 1 --standalone --nproc-per-node 4 "
        "train.py --lr 0.1",
    ),
    (
        "torchrun-one-node-endpoint",
        _spec("torchrun", rdzv_endpoint="127.0.0.1:29400"),
        f"{PY} -m torch.distributed.run --nnodes 1 --rdzv-backend c10d --rdzv-endpoint "
        "127.0.0.1:29400 --nproc-per-node 1 train.py --lr 0.1",
    ),
    (
        "torchrun-two-nodes",
        _spec("torchrun", nnodes=2, nproc_per_node=8, node_rank=1, rdzv_endpoint="n1:29400"),
        f"{PY} -m torch.distributed.run --nnodes 2 --rdzv-backend c10d --rdzv-endpoint n1:29400 "
        "--node-rank 1 --nproc-per-node 8 train.py --lr 0.1",
    ),
    (
        "mpirun-root-one-node",
        _spec("mpirun", nproc_per_node=2, as_root=True, rdzv_endpoint="127.0.0.1:5000"),
        "mpirun -np 2 --allow-run-as-root --oversubscribe -x MASTER_ADDR=127.0.0.1 "
        f"-x MASTER_PORT=5000 {PY} train.py --lr 0.1",
    ),
    (
        "mpirun-two-nodes-via-mpi4py",
        _spec("mpirun", nnodes=2, nproc_per_node=4),
        f"mpirun -np 8 --map-by ppr:4:node {PY} train.py --lr 0.1",
    ),
    (
        "srun",
        _spec("srun", nnodes=2, nproc_per_node=4),
        f"srun --nodes=2 --ntasks-per-node=4 --kill-on-bad-exit=1 {PY} train.py --lr 0.1",
    ),
    (
        "srun-endpoint",
        _spec("srun", rdzv_endpoint="n1:7000"),
        "srun --nodes=1 --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"--export=ALL,MASTER_ADDR=n1,MASTER_PORT=7000 {PY} train.py --lr 0.1",
    ),
    ("single", _spec("single"), f"{PY} train.py --lr 0.1"),
]


@pytest.mark.parametrize(
    ("spec", "expected"), [c[1:] for c in COMMANDS], ids=[c[0] for c in COMMANDS]
)
def test_build_command(spec: LaunchSpec, expected: str) -> None:
    assert build_command(spec) == shlex.split(expected)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (_spec("torchrun", nnodes=2), "--rdzv-endpoint"),
        (_spec("single", nproc_per_node=2), "one process"),
        (_spec("torchrun", nproc_per_node=0), "need >= 1"),
        (_spec("pbs"), "'pbs' is not one of torchrun, mpirun, srun, single"),
    ],
)
def test_build_command_rejects(spec: LaunchSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_command(spec)


@pytest.mark.parametrize(
    ("requested", "nnodes", "env", "srun", "expected"),
    [
        ("auto", 1, {}, False, "torchrun"),
        ("auto", 1, {"SLURM_JOB_ID": "1"}, True, "torchrun"),  # one node: no need for srun
        ("auto", 2, {"SLURM_JOB_ID": "1"}, True, "srun"),  # salloc/sbatch shell, several nodes
        ("auto", 2, {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}, True, "torchrun"),  # in a step
        ("auto", 2, {"SLURM_JOB_ID": "1"}, False, "torchrun"),
        ("auto", 1, {"OMPI_COMM_WORLD_SIZE": "2"}, False, "torchrun"),  # never a nested mpirun
        ("mpirun", 1, {}, False, "mpirun"),
    ],
)
def test_resolve_launcher(
    requested: str, nnodes: int, env: dict[str, str], srun: bool, expected: str
) -> None:
    assert resolve_launcher(requested, nnodes=nnodes, env=env, srun_available=srun) == expected


@pytest.fixture
def no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if LAUNCHER_VARS.match(key):
            monkeypatch.delenv(key)


@pytest.mark.usefixtures("no_launcher_env")
@pytest.mark.parametrize("launcher", ["auto", "torchrun", "mpirun", "srun", "single"])
def test_dry_run(launcher: str, capsys: pytest.CaptureFixture[str]) -> None:
    nproc = "1" if launcher == "single" else "2"
    argv = [
        "launch",
        "--launcher",
        launcher,
        "--nproc-per-node",
        nproc,
        "--dry-run",
        "t.py",
        "-x",
        "a b",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip()
    # mpirun on one node gets a free port chosen at run time: read it back from the output.
    port = re.search(r"MASTER_PORT=(\d+)", printed)
    expected = LaunchSpec(
        launcher="torchrun" if launcher == "auto" else launcher,
        script="t.py",
        script_args=("-x", "a b"),
        nproc_per_node=int(nproc),
        rdzv_endpoint=f"127.0.0.1:{port[1]}" if port else None,
        python=PY,
        as_root=os.geteuid() == 0,
    )
    assert printed == shlex.join(build_command(expected))  # shell-quoted: 'a b' stays one word
    assert (port is not None) == (launcher == "mpirun")


@pytest.mark.usefixtures("no_launcher_env")
def test_dry_run_uses_explicit_master(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "head")
    monkeypatch.setenv("MASTER_PORT", "4242")
    assert main(["launch", "--launcher", "mpirun", "--dry-run", "t.py"]) == 0
    assert "-x MASTER_ADDR=head -x MASTER_PORT=4242" in capsys.readouterr().out


def test_usage_errors_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == "distamp " + (_installed() or "unknown")
    assert main(["launch", "--launcher", "pbs", "t.py"]) == 2
    assert main(["launch", "--launcher", "single", "--nproc-per-node", "2", "t.py"]) == 2
    assert "argument script: 't.py' does not exist" in capsys.readouterr().err
    argv = ["launch", "--launcher", "single", "--nproc-per-node", "2", "--dry-run", "t.py"]
    assert main(argv) == 2
    assert "one process" in capsys.readouterr().err
    assert main([]) == 2


def test_abbreviated_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """``--nproc-per-nod 2`` is a typo, not ``--nproc-per-node 2``: an error, nothing started."""
    assert main(["launch", "--nproc-per-nod", "2", "--dry-run", "t.py"]) == 2
    assert "--nproc-per-nod" in capsys.readouterr().err
    assert main(["launch", "--dry", "t.py"]) == 2


def test_launch_help_explains_every_option_with_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["launch", "--help"]) == 0
    text = capsys.readouterr().out
    options = re.findall(r"^  (--[a-z-]+)", text, re.M)
    assert {"--launcher", "--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint"} <= set(
        options
    )
    for option in options:  # each option's line (or the next) carries a help text
        block = text.split(f"  {option}", 1)[1].split("\n  --", 1)[0]
        assert len(block.split()) > 2, f"{option} has no help text"
    assert "(default: auto" in text and "(default: 1)" in text and "(default: 30)" in text
    assert "examples:" in text and "distamp launch --nproc-per-node 2 launch/train.py" in text


def _installed() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("distamp")
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.usefixtures("no_launcher_env")
@pytest.mark.parametrize(
    ("body", "code"), [("sys.exit(3)", 3), ("os.kill(os.getpid(), 9)", 128 + 9)]
)
def test_launch_propagates_exit_code(tmp_path: Path, body: str, code: int) -> None:
    script = tmp_path / "exit.py"
    script.write_text(f"import os, sys\n{body}\n")
    assert main(["launch", "--launcher", "single", str(script)]) == code


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launch_forwards_signals(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "wait.py"
    script.write_text(
        "import signal, sys, time\n"
        "def stop(n, f):\n    print('got', n, flush=True); sys.exit(7)\n"
        "signal.signal(signal.SIGTERM, stop); signal.signal(signal.SIGINT, stop)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    cmd = [PY, "-m", "distamp.cli", "launch", "--launcher", "single", str(script)]
    proc = subprocess.Popen(
        cmd,
        env=_clean_env(),
        cwd=REPO,
        text=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"  # the child runs and has its handlers
        proc.send_signal(sig)  # to distamp only: it must pass the signal on
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 7, err
    assert f"got {int(sig)}" in out


def test_env_report_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "HOME": "/root",
        "NCCL_DEBUG": "INFO",
    }
    report = environment_report(env)
    assert report["environment"]["launcher"] == "openmpi"
    assert report["variables"] == {k: v for k, v in sorted(env.items()) if k != "HOME"}
    assert report["versions"]["torch"] == torch.__version__
    assert report["autocast"]["cpu.bfloat16"] is True
    assert report["cuda"]["available"] == torch.cuda.is_available()
    assert environment_report({"RANK": "9", "WORLD_SIZE": "2"})["environment"] == {
        "error": "RANK=9 is out of range for WORLD_SIZE=2"
    }
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for section in ("versions:", "environment:", "cuda:", "mpi:", "autocast:", "variables:"):
        assert section in text


def test_env_json_subprocess() -> None:
    out = _run([PY, "-m", "distamp.cli", "env", "--json"], timeout=60)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["environment"]["launcher"] == "single"
    assert report["versions"]["torch"] == torch.__version__
    assert report["versions"]["python"] == sys.version.split()[0]
    assert set(report["mpi"]) == {"mpirun", "srun", "torch_mpi_backend"}


def test_real_launch_with_torchrun() -> None:
    script = "tests/scripts/allreduce.py"
    start = time.monotonic()
    out = _run([PY, "-m", "distamp.cli", "launch", "--nproc-per-node", "2", script], timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    found = sorted(re.findall(r"rank=(\d) world_size=2 launcher=(\w+) \S+ sum=(\S+) ", out.stdout))
    assert found == [("0", "torchrun", "3"), ("1", "torchrun", "3")], out.stdout
    assert time.monotonic() - start < 120


# ---------------------------------------------------------------- distamp launch: fuzzed arguments
LAUNCH_FLAGS = st.sampled_from(["--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint"])


@given(st.lists(st.tuples(LAUNCH_FLAGS, ARG_VALUES), max_size=3), st.booleans())
@example([("--nproc-per-node", "1")], False)
@example([("--node-rank", "3"), ("--nnodes", "2")], True)
@example([("--rdzv-endpoint", "host:99999")], True)
def test_fuzzed_launcher_arguments(pairs: list[tuple[str, str]], dry_run: bool) -> None:
    """``distamp launch``: exit 2 with a usage error, or a command; the script missing.py does
    not exist, so only --dry-run may get past the checks."""
    argv = ["launch", *(f"{flag}={value}" for flag, value in pairs)]
    argv += ["--dry-run", "t.py"] if dry_run else ["missing.py"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    if code == 2:
        assert "distamp launch: error: " in err.getvalue()
        event("usage error")
        return
    event("command printed")
    assert code == 0 and dry_run and out.getvalue().strip()
