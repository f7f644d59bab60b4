"""The main job across two simulated hosts (network namespaces joined by a veth pair).

torchrun with one agent per host and Open MPI's mpirun spanning both must end with the same loss
as two ranks on one host, and their traffic must cross the veth pair. The harness must leave no
namespace behind: not after a failure, not after a timeout, not after a crashed earlier run.

Needs root and iproute2 (``ip netns``); the mpirun test also needs Open MPI. Without them the
tests skip with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # multinode/ is a directory of the repository, not of the package
    sys.path.insert(0, str(REPO))
from multinode import netns_cluster as nc  # noqa: E402

JOB = "launch/train.py"
# One CPU thread per rank everywhere: the job's default divides the cores among the ranks of a
# host, so one rank per host would run two threads where two ranks on one host run one, and a
# different thread count may sum in another order (a different last digit of the loss).
JOB_ARGS = ["--steps", "10", "--threads", "1"]
TIMEOUT_S = 120.0
LAUNCHER_VARS = re.compile(
    r"(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK)$"
    r"|(MASTER|TORCHELASTIC|SLURM|OMPI|PMI|PMIX|MPI_LOCAL|MV2|DISTAMP|PET|GLOO|NCCL)_"
)

_REASON = nc.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"  # the same threads everywhere: the same sums, the same loss
    return env


def _ours() -> set[str]:
    return {n for n in _list_netns() if n.startswith(nc.PREFIX)}


def _list_netns() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _veth_bytes(host: nc.Host) -> int:
    stats = Path(f"/sys/class/net/{nc.IFACE}/statistics")
    cmd = [
        "ip",
        "netns",
        "exec",
        host.netns,
        "cat",
        str(stats / "rx_bytes"),
        str(stats / "tx_bytes"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    return sum(int(v) for v in out.stdout.split())


def _job_summary(results: list[nc.Result]) -> dict[str, Any]:
    for r in results:
        assert r.returncode == 0, f"host {r.host.index} exited {r.returncode}:\n{r.stderr[-3000:]}"
    # Rank 0 prints the summary; with c10d rendezvous either host may hold it.
    return nc.last_json("\n".join(r.stdout for r in results))


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two ranks on one host, over loopback: the loss both two-host runs must reproduce."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(
        [*cmd, JOB, *JOB_ARGS, "--out", str(tmp_path_factory.mktemp("one_host"))],
        env=_env(), cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return nc.last_json(out.stdout)


@pytest.fixture(scope="module")
def cluster() -> Iterator[nc.NetnsCluster]:
    with nc.NetnsCluster() as c:
        yield c


def test_torchrun_across_two_hosts(
    cluster: nc.NetnsCluster, one_host: dict[str, Any], tmp_path: Path
) -> None:
    before = [_veth_bytes(h) for h in cluster.hosts]
    args = [*JOB_ARGS, "--out", str(tmp_path / "run")]
    results = cluster.torchrun(
        sys.executable, JOB, args, env=_env(), timeout=TIMEOUT_S, port=29400, cwd=REPO
    )
    summary = _job_summary(results)
    assert (summary["world_size"], summary["launcher"]) == (2, "torchrun")
    assert summary["steps"] == one_host["steps"]
    assert summary["final_loss"] == one_host["final_loss"], (summary, one_host)
    # The gradients went over the veth pair.
    assert all(_veth_bytes(h) - b > 100_000 for h, b in zip(cluster.hosts, before, strict=True))


@pytest.mark.skipif(
    shutil.which("mpirun") is None, reason="mpirun is not on PATH (apt-get install openmpi-bin)"
)
def test_mpirun_across_two_hosts(
    cluster: nc.NetnsCluster, one_host: dict[str, Any], tmp_path: Path
) -> None:
    before = [_veth_bytes(h) for h in cluster.hosts]
    args = [*JOB_ARGS, "--out", str(tmp_path / "run")]
    result = cluster.mpirun(
        sys.executable, JOB, args, env=_env(), timeout=TIMEOUT_S, port=29500, cwd=REPO
    )
    summary = _job_summary([result])
    assert (summary["world_size"], summary["launcher"]) == (2, "openmpi")
    assert summary["final_loss"] == one_host["final_loss"], (summary, one_host)
    assert all(_veth_bytes(h) - b > 100_000 for h, b in zip(cluster.hosts, before, strict=True))


def test_node_local_out_is_refused_before_training(
    cluster: nc.NetnsCluster, tmp_path: Path
) -> None:
    """--out on node-local disks: the same path on each host, a different disk behind it (a
    tmpfs mounted in each host's own mount namespace, which ``ip netns exec`` gives it). The
    job must refuse it before the first step, not train and then fail every save."""
    out = tmp_path / "out"
    out.mkdir()
    local = tmp_path / "node-local-python"
    local.write_text(  # the agent and the worker it starts see this host's tmpfs only
        '#!/bin/sh\nmount -t tmpfs node-local "$NODE_LOCAL" || exit 97\nexec "$REAL_PYTHON" "$@"\n'
    )
    local.chmod(0o755)
    env = {**_env(), "NODE_LOCAL": str(out), "REAL_PYTHON": sys.executable}
    args = [*JOB_ARGS, "--out", str(out)]
    results = cluster.torchrun(
        str(local), JOB, args, env=env, timeout=TIMEOUT_S, port=29401, cwd=REPO
    )
    stderr = "\n".join(r.stderr for r in results)
    assert all(r.returncode not in (0, 97) for r in results), stderr[-3000:]
    assert "error: argument --out: directory" in stderr, stderr[-3000:]
    assert "rank 0 does not see the files rank(s) 1 wrote there" in stderr, stderr[-3000:]
    assert "steps on 2 rank(s)" not in stderr, stderr[-3000:]  # training never started
    assert not list(out.iterdir())  # the shared path itself was never written


def test_hosts_are_isolated_from_the_machine(cluster: nc.NetnsCluster) -> None:
    first, second = cluster.hosts
    # Each test address exists only inside its namespace...
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=20)
    assert first.address not in out.stdout and second.address not in out.stdout
    # ... and a host's only routes are its loopback and the veth pair's /24.
    cmd = ["ip", "-n", first.netns, "-o", "route"]
    routes = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    assert "default" not in routes and nc.IFACE in routes


def test_teardown_after_failure_and_timeout() -> None:
    with pytest.raises(nc.ClusterTimeout) as timed_out, nc.NetnsCluster() as c:
        names = {h.netns for h in c.hosts}
        assert names <= _ours()
        sleeper = ["sleep", "60"]
        c.run([(h, sleeper) for h in c.hosts], env=_env(), timeout=1.0)
    assert all(r.returncode == -9 for r in timed_out.value.results)
    assert not names & _ours()

    with pytest.raises(RuntimeError, match="boom"), nc.NetnsCluster() as c:
        names = {h.netns for h in c.hosts}
        raise RuntimeError("boom")
    assert not names & _ours()


def test_a_failed_host_stops_the_run_early(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nc, "FAILURE_GRACE_S", 0.5)
    with nc.NetnsCluster() as c:
        results = c.run(
            [(c.hosts[0], ["false"]), (c.hosts[1], ["sleep", "60"])], env=_env(), timeout=60
        )
    assert [r.returncode for r in results] == [1, -9]


def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)  # its pid now names no live process
    stale, live = f"{nc.PREFIX}-{dead.pid}-abc123-0", f"{nc.PREFIX}-{os.getpid()}-abc123-0"
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True, timeout=20)
    try:
        removed = nc.clean_stale()
        assert stale in removed and live not in removed
        assert live in _list_netns() and stale not in _list_netns()
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=20)


def test_names_are_unique_per_run() -> None:
    a, b = nc.NetnsCluster(), nc.NetnsCluster()
    assert {h.netns for h in a.hosts}.isdisjoint(h.netns for h in b.hosts)
