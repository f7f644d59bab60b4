"""Launcher detection from plain dicts (fuzzed too), SLURM node lists, real gloo rendezvous and
its failures, ``init_distributed`` refusing bad variables before any group and saying when it
made none, and settings that must agree across ranks (:func:`distamp.cluster.agree_settings`)."""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import free_port, run_ranks
from hypothesis import event, example, given
from hypothesis import strategies as st
from torch import nn

from distamp import DistAMP
from distamp.cluster import (
    LAUNCHERS,
    DistEnv,
    RendezvousError,
    SettingsMismatchError,
    detect_environment,
    expand_nodelist,
    init_distributed,
)
from distamp.cluster.rendezvous import _describe_live_group

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "allreduce.py"
# Variables of any launcher, removed from the environment the subprocesses of these tests inherit.
LAUNCHER_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK)$"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI_COMM_WORLD|PMI|PMIX|MPI_LOCAL|MV2_COMM_WORLD|DISTAMP)_"
)

OMPI = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",  # rank within the node, NOT the node index
}
SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_NODELIST": "gpu[007-008]",
}
# A step whose environment lost the tasks-per-node variable srun sets (a hand-copied environment).
SRUN_NO_TASKS = {k: v for k, v in SRUN.items() if k != "SLURM_TASKS_PER_NODE"}
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "abc",
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}

# What Ray Train 2.60's torch backend sets in a worker (plus Ray's own process variables).
RAY_TRAIN = {
    "RAY_RAYLET_PID": "5683",
    "RAY_JOB_ID": "01000000",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "1",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "51519",
}

# (id, environment, expected DistEnv fields: launcher, rank, world, local rank, local world,
#  node rank, main address, main port)
DETECT_CASES = [
    ("empty", {}, ("single", 0, 1, 0, 1, 0, None, None)),
    ("torchrun", TORCHRUN, ("torchrun", 3, 8, 1, 2, 1, "node0", 29500)),
    (
        "env-contract-minimal",  # hand-made env:// setup: one node implied
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"},
        ("torchrun", 1, 2, 1, 2, 0, "h", 1234),
    ),
    ("torchrun-inside-srun", {**SRUN, **TORCHRUN}, ("torchrun", 3, 8, 1, 2, 1, "node0", 29500)),
    ("ray-train", RAY_TRAIN, ("ray", 3, 4, 1, 2, 1, "10.0.0.5", 51519)),
    (  # a plain Ray task or actor has Ray's variables but no rank
        "ray-task-without-rank",
        {"RAY_RAYLET_PID": "5683", "RAY_JOB_ID": "01000000"},
        ("single", 0, 1, 0, 1, 0, None, None),
    ),
    (  # torchrun started inside a Ray worker: torchrun describes its workers
        "torchrun-inside-ray",
        {**RAY_TRAIN, **TORCHRUN},
        ("torchrun", 3, 8, 1, 2, 1, "node0", 29500),
    ),
    ("srun", SRUN, ("slurm", 5, 8, 1, 4, 1, "gpu007", 10000 + 123456 % 20000)),
    (
        "srun-step-nodelist-first",
        {**SRUN, "SLURM_STEP_NODELIST": "gpu[010-011]", "SLURM_NODELIST": "x"},
        ("slurm", 5, 8, 1, 4, 1, "gpu010", 13456),
    ),
    (
        "srun-uneven-nodes",
        {
            **SRUN,
            "SLURM_NTASKS": "5",
            "SLURM_PROCID": "4",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "2",
            "SLURM_TASKS_PER_NODE": "2(x2),1",
            "SLURM_JOB_NODELIST": "n[1-3]",
        },
        ("slurm", 4, 5, 0, 1, 2, "n1", 13456),
    ),
    (
        "srun-step-variables-win",
        {
            **SRUN,
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        },
        ("slurm", 1, 2, 0, 1, 1, "gpu007", 13456),
    ),
    (
        "srun-ntasks-per-node-fallback",  # srun sets it with --ntasks-per-node
        {**SRUN_NO_TASKS, "SLURM_NTASKS_PER_NODE": "4"},
        ("slurm", 5, 8, 1, 4, 1, "gpu007", 13456),
    ),
    (
        "srun-mpi-pmi2",
        {**SRUN, "PMI_RANK": "5", "PMI_SIZE": "8"},
        ("slurm", 5, 8, 1, 4, 1, "gpu007", 13456),
    ),
    (
        "salloc-shell-is-single",
        {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "4"},
        ("single", 0, 1, 0, 1, 0, None, None),
    ),
    (
        "sbatch-shell-is-single",  # the batch step sets SLURM_PROCID but has no SLURM_STEP_ID
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
        ("single", 0, 1, 0, 1, 0, None, None),
    ),
    (
        "mpirun-inside-allocation",  # orted started by srun: SLURM counts 2 daemons, MPI 4 ranks
        {**SRUN, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", **OMPI},
        ("openmpi", 1, 4, 1, 2, 0, None, None),
    ),
    ("openmpi-node-rank-trap", OMPI, ("openmpi", 1, 4, 1, 2, 0, None, None)),
    (
        "openmpi-block-second-node",
        {**OMPI, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_NODE_RANK": "1"},
        ("openmpi", 3, 4, 1, 2, 1, None, None),
    ),
    (
        "openmpi-map-by-node-unknown-node",  # rank 1 is local rank 0 of the second node
        {**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_NODE_RANK": "0"},
        ("openmpi", 1, 4, 0, 2, None, None, None),
    ),
    (
        "openmpi-uneven-unknown-node",
        {**OMPI, "OMPI_COMM_WORLD_SIZE": "3"},
        ("openmpi", 1, 3, 1, 2, None, None, None),
    ),
    (
        "openmpi-master-override",
        {**OMPI, "MASTER_ADDR": "head", "MASTER_PORT": "2222"},
        ("openmpi", 1, 4, 1, 2, 0, "head", 2222),
    ),
    (
        "mpich",
        {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"},
        ("mpich", 2, 4, 0, 2, 1, None, None),
    ),
    (
        "mvapich",
        {
            "MV2_COMM_WORLD_RANK": "0",
            "MV2_COMM_WORLD_SIZE": "2",
            "MV2_COMM_WORLD_LOCAL_RANK": "0",
            "MV2_COMM_WORLD_LOCAL_SIZE": "2",
            "PMI_RANK": "0",
            "PMI_SIZE": "2",
        },
        ("mvapich", 0, 2, 0, 2, 0, None, None),
    ),
    (
        "slurm-master-override",
        {**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"},
        ("slurm", 5, 8, 1, 4, 1, "10.0.0.1", 4000),
    ),
    ("single-with-master", {"MASTER_PORT": "1234"}, ("single", 0, 1, 0, 1, 0, None, 1234)),
    (
        "forced-single",
        {**OMPI, "DISTAMP_LAUNCHER": "single"},
        ("single", 0, 1, 0, 1, 0, None, None),
    ),
    (
        "forced-openmpi-over-torchrun",
        {**TORCHRUN, **OMPI, "DISTAMP_LAUNCHER": " OpenMPI "},
        ("openmpi", 1, 4, 1, 2, 0, "node0", 29500),
    ),
    ("forced-auto", {**OMPI, "DISTAMP_LAUNCHER": "auto"}, ("openmpi", 1, 4, 1, 2, 0, None, None)),
]


@pytest.mark.parametrize(
    ("env", "expected"), [c[1:] for c in DETECT_CASES], ids=[c[0] for c in DETECT_CASES]
)
def test_detect(env: dict[str, str], expected: tuple[Any, ...]) -> None:
    assert detect_environment(env) == DistEnv(*expected)


ERROR_CASES = [
    (
        "unknown-forced",
        {"DISTAMP_LAUNCHER": "pbs"},
        r"DISTAMP_LAUNCHER='pbs'.*torchrun.*slurm.*openmpi",
    ),
    ("rank-too-big", {"RANK": "4", "WORLD_SIZE": "4"}, r"RANK=4 is out of range for WORLD_SIZE=4"),
    ("rank-not-int", {"RANK": "one", "WORLD_SIZE": "4"}, r"RANK='one' is not an integer"),
    ("torchelastic-no-rank", {"TORCHELASTIC_RUN_ID": "x"}, r"RANK is not set"),
    (
        "local-rank-too-big",
        {**OMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
        r"OMPI_COMM_WORLD_LOCAL_RANK=2 is out of range for OMPI_COMM_WORLD_LOCAL_SIZE=2",
    ),
    (
        "local-size-too-big",
        {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "5"},
        r"OMPI_COMM_WORLD_LOCAL_SIZE=5",
    ),
    (
        "zero-world",
        {"PMI_RANK": "0", "PMI_SIZE": "0", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
        r"PMI_SIZE=0 must be at least 1",
    ),
    ("mpich-no-local", {"PMI_RANK": "0", "PMI_SIZE": "2"}, r"MPI_LOCALRANKID is not set"),
    ("slurm-job-id", {**SRUN, "SLURM_JOB_ID": "12_3"}, r"SLURM_JOB_ID='12_3' is not an integer"),
    ("slurm-tasks-format", {**SRUN, "SLURM_TASKS_PER_NODE": "4x2"}, r"SLURM_TASKS_PER_NODE='4x2'"),
    ("slurm-node-id", {**SRUN, "SLURM_NODEID": "2"}, r"SLURM_NODEID=2 is out of range"),
    (
        "slurm-no-tasks-per-node",  # names what is read, in order, and the fix
        SRUN_NO_TASKS,
        r"^none of SLURM_STEP_TASKS_PER_NODE, SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE is "
        r"set .*start the tasks with srun, set SLURM_TASKS_PER_NODE",
    ),
    (
        "slurm-no-tasks-per-node-rank-first",  # a broken rank variable is still reported first
        {**SRUN_NO_TASKS, "SLURM_PROCID": "five"},
        r"SLURM_PROCID='five' is not an integer",
    ),
    (
        "slurm-ntasks-per-node-format",  # the fallback holds one count, not the list form
        {**SRUN_NO_TASKS, "SLURM_NTASKS_PER_NODE": "4(x2)"},
        r"SLURM_NTASKS_PER_NODE='4\(x2\)' is not an integer",
    ),
    ("slurm-bad-nodelist", {**SRUN, "SLURM_JOB_NODELIST": "n[1-"}, r"node list 'n\[1-'"),
    (
        "forced-slurm-missing",
        {"DISTAMP_LAUNCHER": "slurm", "SLURM_NTASKS": "2"},
        r"SLURM_PROCID is not set",
    ),
    ("port-not-int", {"MASTER_PORT": "http"}, r"MASTER_PORT='http' is not an integer"),
    ("port-out-of-range", {"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
]


@pytest.mark.parametrize(
    ("env", "match"), [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES]
)
def test_detect_rejects(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        detect_environment(env)


def test_launchers_are_the_documented_names() -> None:
    assert set(LAUNCHERS) == {"ray", "torchrun", "slurm", "openmpi", "mpich", "mvapich", "single"}


def test_detect_is_pure() -> None:
    before = dict(os.environ)
    env = MappingProxyType(dict(OMPI))  # read-only: any write would raise
    assert detect_environment(env).launcher == "openmpi"
    assert dict(os.environ) == before
    # Detection must not load an MPI runtime (importing mpi4py initializes MPI).
    code = "import sys; from distamp.cluster import detect_environment as d; d(%r); print(sorted(m for m in sys.modules if m.startswith('mpi4py')))"  # noqa: E501
    out = subprocess.run(
        [sys.executable, "-c", code % dict(OMPI)],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
        cwd=REPO,
        check=True,
    )
    assert out.stdout.strip() == "[]"


def test_detect_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if LAUNCHER_VARS.match(key):
            monkeypatch.delenv(key)
    monkeypatch.setenv("DISTAMP_LAUNCHER", "single")
    assert detect_environment().launcher == "single"


NODELISTS = [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a-[1-2]-b[3,4]", ["a-1-b3", "a-1-b4", "a-2-b3", "a-2-b4"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("host1,host2", ["host1", "host2"]),
    ("localhost", ["localhost"]),
    ("gpu[1,3-4]x", ["gpu1x", "gpu3x", "gpu4x"]),
    ("rack[1-2]-n[01-02],login", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02", "login"]),
    ("", []),
]


@pytest.mark.parametrize(("nodelist", "hosts"), NODELISTS)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist", ["n[01-", "n]1[", "n[3-1]", "n[a-b]", "n[[1]]", "n[]", "n[1]]"]
)
def test_expand_nodelist_rejects(nodelist: str) -> None:
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(nodelist)


def test_dist_env_properties_and_validation() -> None:
    env = DistEnv("slurm", 5, 8, 1, 4, 1, "n1", 1234)
    assert env.is_distributed and not env.is_main_process and env.num_nodes == 2
    assert not DistEnv("single", 0, 1, 0, 1, 0, None, None).is_distributed
    assert DistEnv("openmpi", 0, 3, 0, 2, None, None, None).num_nodes is None
    with pytest.raises(ValueError, match="rank=2 < world_size=2"):
        DistEnv("torchrun", 2, 2, 0, 1, 0, None, None)
    with pytest.raises(ValueError, match="local_rank=1 < local_world_size=1"):
        DistEnv("torchrun", 0, 2, 1, 1, 0, None, None)
    with pytest.raises(ValueError, match="main_port=0"):
        DistEnv("torchrun", 0, 2, 0, 1, 0, "h", 0)


# ---- init_distributed ----------------------------------------------------------------------


def test_single_process_gets_no_group() -> None:
    env = DistEnv("single", 0, 1, 0, 1, 0, None, None)
    assert init_distributed(env) is env
    assert not dist.is_initialized()


def test_world_of_one_and_idempotence() -> None:
    env = DistEnv("torchrun", 0, 1, 0, 1, 0, "127.0.0.1", free_port())
    try:
        assert init_distributed(env, timeout=30) == env
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert dist.get_backend() == ("nccl" if torch.cuda.is_available() else "gloo")
        assert init_distributed(env) == env  # no second init
        with pytest.raises(RuntimeError, match=r"already initialized as rank 0 of 1.*rank 1 of 2"):
            init_distributed(DistEnv("torchrun", 1, 2, 0, 1, 0, "127.0.0.1", 1))
    finally:
        dist.destroy_process_group()


def test_live_group_without_launcher_variables_is_described() -> None:
    single = DistEnv("single", 0, 1, 0, 1, 0, None, None)
    assert _describe_live_group(single, 3, 4) == DistEnv("external", 3, 4, 3, 4, 0, None, None)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, "ALLREDUCE_BACKEND": "gloo", **extra}  # gloo: ranks may share one GPU


def _run_pair(envs: list[dict[str, str]], timeout: float = 90) -> list[str]:
    """Start one process per env and return their stdouts; fail (after killing them) on timeout."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT)],
            env=e,
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for e in envs
    ]
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"exit {p.returncode}\n{out}\n{err}"
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_real_two_process_rendezvous(launcher: str) -> None:
    port = str(free_port())
    if launcher == "torchrun":
        envs = [
            _clean_env(
                RANK=str(r),
                WORLD_SIZE="2",
                LOCAL_RANK=str(r),
                LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            for r in range(2)
        ]
    else:  # what srun would set for 2 tasks on one node (the address comes from the node list)
        envs = [
            _clean_env(
                SLURM_JOB_ID="42",
                SLURM_STEP_ID="0",
                SLURM_PROCID=str(r),
                SLURM_NTASKS="2",
                SLURM_LOCALID=str(r),
                SLURM_NODEID="0",
                SLURM_TASKS_PER_NODE="2",
                SLURM_JOB_NODELIST="localhost",
                MASTER_PORT=port,
            )
            for r in range(2)
        ]
    outs = _run_pair(envs)
    for rank, out in enumerate(outs):
        assert f"rank={rank} world_size=2 launcher={launcher}" in out
        assert "sum=3 expected=3" in out


def test_rendezvous_timeout_when_peer_never_starts() -> None:
    port = free_port()
    env = DistEnv("torchrun", 0, 2, 0, 2, 0, "127.0.0.1", port)  # rank 1 never comes
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        init_distributed(env, timeout=5)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "'torchrun'" in message
    assert "MASTER_ADDR" in message and "timeout" in message
    assert not dist.is_initialized()


def test_rendezvous_timeout_when_main_process_is_absent() -> None:
    # The client side: nobody listens at the main address, so only the connect can time out.
    env = DistEnv("slurm", 1, 2, 1, 2, 0, "127.0.0.1", free_port())
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"rank 1 of 2 \(launcher 'slurm'\)"):
        init_distributed(env, timeout=2)
    assert time.monotonic() - start < 30


def test_watchdog_ends_a_hang() -> None:
    code = (
        "import time; from distamp.cluster.rendezvous import _watchdog\n"
        "with _watchdog(0.5, 'rendezvous at h:1 stuck'):\n    time.sleep(60)\n"
    )
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_clean_env()
    )
    assert out.returncode == 1
    assert "rendezvous at h:1 stuck" in out.stderr
    assert time.monotonic() - start < 30


def test_mpi_without_address_needs_mpi4py(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` fail
    env = DistEnv("openmpi", 0, 2, 0, 2, 0, None, None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[mpi\]'.*MASTER_ADDR"):
        init_distributed(env)


def test_non_mpi_launcher_without_address_is_an_error() -> None:
    env = DistEnv("torchrun", 0, 2, 0, 2, 0, None, None)
    with pytest.raises(ValueError, match="set MASTER_ADDR and MASTER_PORT"):
        init_distributed(env)


def _world_sum(rank: int, world: int) -> float:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t.item())


def test_run_ranks_retries_a_port_taken_before_rank_0_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The harness picks a free port and releases it before rank 0 binds it; another process
    can take it in between. Here one is already listening on the first port offered: rank 0's
    rendezvous fails with EADDRINUSE, and the ranks are started again on a new port."""
    import socket

    import distamp.cluster.spawn as spawn

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("", 0))
        busy.listen()
        offered = iter([busy.getsockname()[1]])
        real = spawn.free_port
        monkeypatch.setattr(spawn, "free_port", lambda: next(offered, None) or real())
        assert spawn.run_ranks(_world_sum, 2, timeout=60) == [3.0, 3.0]
        assert next(offered, None) is None  # the taken port was offered (and refused) first


def _what_the_rank_sees(rank: int, world: int, name: str) -> dict[str, Any]:
    """The rank's view: ``name`` in its environment, the marker an earlier call may have left
    in this module, then the marker set, and its process id."""
    seen = {"env": os.environ.get(name), "marker": globals().get("_MARKER"), "pid": os.getpid()}
    globals()["_MARKER"] = rank
    return seen


def test_run_ranks_gives_each_call_fresh_ranks_with_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ranks are forked from a server that started before this test: they still see the
    environment as the caller has it at each call (a variable set, then removed), and nothing
    one call leaves in a module reaches the next call's ranks."""
    name = "DISTAMP_TEST_SPAWN_VARIABLE"
    monkeypatch.setenv(name, "first")
    first = run_ranks(_what_the_rank_sees, 2, name, timeout=60)
    assert [r["env"] for r in first] == ["first", "first"]
    monkeypatch.delenv(name)
    second = run_ranks(_what_the_rank_sees, 2, name, timeout=60)
    assert [r["env"] for r in second] == [None, None]
    assert [r["marker"] for r in first + second] == [None] * 4  # fresh processes every call
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5


def test_rank_pool_keeps_its_ranks_between_calls_and_sees_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool's ranks live across calls (what a property test's many examples need): the
    second call finds what the first left, in the same processes."""
    from distamp.cluster.spawn import RankPool

    name = "DISTAMP_TEST_SPAWN_VARIABLE"
    monkeypatch.setenv(name, "pool")
    with RankPool(2, timeout=60) as pool:
        first = pool.run(_what_the_rank_sees, name)
        second = pool.run(_what_the_rank_sees, name)
    assert [r["env"] for r in first] == ["pool", "pool"]
    assert [r["marker"] for r in second] == [0, 1]
    assert [r["pid"] for r in first] == [r["pid"] for r in second]


# ------------------------------------------------------------------ bad launcher variables, fuzzed
LAUNCHER_NAMES = st.sampled_from(
    [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_PORT",
        "GROUP_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_STEP_ID",
        "SLURM_LOCALID",
        "SLURM_NODEID",
        "SLURM_TASKS_PER_NODE",
        "SLURM_JOB_ID",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "DISTAMP_LAUNCHER",
    ]
)


ENV_VALUES = st.one_of(
    st.integers(-3, 5).map(str),
    st.sampled_from(["abc", "99999", "-1", "1e3", " 2 ", "1_0", "", "9" * 40, "torchrun"]),
    st.text(max_size=5),
)


@given(st.dictionaries(LAUNCHER_NAMES, ENV_VALUES, max_size=6))
@example({"RANK": "0", "WORLD_SIZE": "abc"})
@example({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"})
@example({"MASTER_PORT": "99999"})
@example({"RANK": "0", "WORLD_SIZE": "0\x1f"})
@example({"RANK": "0", "WORLD_SIZE": "9" * 5000})
@example(
    {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "-1",
        "SLURM_TASKS_PER_NODE": "2",
        "SLURM_LOCALID": "0",
    }
)
def test_fuzzed_launcher_environment(env: dict[str, str]) -> None:
    try:
        found = detect_environment(env)
    except ValueError as exc:
        # It names a variable: one given, or one its launcher needs and that is missing.
        assert re.search(r"\b[A-Z][A-Z_]+_?[A-Z]+\b", str(exc)), f"unnamed variable: {exc}"
        event("rejected with ValueError")
        return
    event("detected")
    assert 0 <= found.rank < found.world_size < 2**31
    assert found.main_port is None or 0 < found.main_port < 65536


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, r"WORLD_SIZE='abc' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, r"LOCAL_RANK=-1 is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, r"MASTER_PORT=99999 .*1-65535"),
    ],
)
def test_init_distributed_refuses_bad_variables_before_any_group(
    env: dict[str, str], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        init_distributed(timeout=5)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="timeout"):
        init_distributed(timeout=math.nan)


# ----------------------------------------------------------- init_distributed() without a launcher
def _engine(precision: str = "bf16", model: nn.Module | None = None) -> tuple[DistAMP, nn.Module]:
    amp = DistAMP(precision, device="cpu")
    model = model if model is not None else nn.Linear(4, 2)
    wrapped, _ = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, wrapped


def test_init_distributed_without_a_launcher_says_so(caplog: pytest.LogCaptureFixture) -> None:
    alone = detect_environment({})
    with caplog.at_level(logging.WARNING, logger="distamp.cluster"):
        assert init_distributed(alone) is alone
    assert not torch.distributed.is_initialized()
    text = caplog.text
    assert "no launcher started this process" in text and "no process group" in text, text
    for way in ("distamp launch --nproc-per-node N script.py", "torchrun", "mpirun", "srun"):
        assert way in text, way
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distamp.cluster"):
        init_distributed(alone, warn_if_single=False)
        _engine()  # one process is a complete job for the engine: no warning
    assert not caplog.records, caplog.text


# ------------------------------------------------------------------------- ranks agree on settings
def _agreeing_rank(rank: int, world: int) -> int:
    from distamp.cluster.agreement import agree_settings

    agree_settings({"a": 1, "b": (2, "x")}, what="test")  # equal: no error
    return 0


@pytest.mark.timeout(60)
def test_equal_settings_pass() -> None:
    assert run_ranks(_agreeing_rank, 2, timeout=45) == [0, 0]


def _settings_cases(n: int, seed: int) -> list[tuple[dict[str, Any], str | None, Any]]:
    """``n`` settings dicts, each with at most one field that rank 1 changes (``None``: none)."""
    import random

    rng = random.Random(seed)
    pool: list[Any] = [
        0,
        1,
        2**31,
        -1,
        0.5,
        1e-30,
        float("inf"),
        "fp16",
        "bf16",
        None,
        True,
        False,
        (1, 2),
        ("a",),
        torch.float16,
        torch.bfloat16,
    ]
    cases = []
    for _ in range(n):
        fields = {f"f{i}": rng.choice(pool) for i in range(rng.randint(1, 12))}
        changed = rng.choice([None, *fields])
        other = rng.choice([v for v in pool if repr(v) != repr(fields.get(changed))])
        cases.append((fields, changed, other))
    return cases


def _settings_rank(rank: int, world: int, cases: list[Any]) -> list[str]:
    from distamp.cluster import agree_settings, init_distributed, shutdown_distributed

    init_distributed(timeout=60)
    out = []
    for fields, changed, other in cases:
        mine = dict(fields)
        if rank == 1 and changed is not None:
            mine[changed] = other
        try:
            agree_settings(mine, what="case")
            out.append("agreed")
        except SettingsMismatchError as exc:
            out.append(str(exc))
    shutdown_distributed()
    return out


@pytest.mark.timeout(90)
def test_randomised_settings_disagree_exactly_when_a_field_differs() -> None:
    cases = _settings_cases(40, seed=7)
    per_rank = run_ranks(_settings_rank, 2, cases, timeout=60)
    for i, (fields, changed, other) in enumerate(cases):
        got = [r[i] for r in per_rank]
        assert got[0] == got[1], (fields, changed, got)
        if changed is None:
            assert got[0] == "agreed", (fields, got)
        else:
            assert f"{changed}: ranks 0: {fields[changed]!r}"[:60] in got[0], (changed, got)
            assert f"ranks 1: {other!r}"[:40] in got[0], (changed, other, got)
