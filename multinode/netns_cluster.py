"""Two simulated hosts on one machine: Linux network namespaces joined by a veth pair.

Each host is a network namespace with its own loopback and one interface, ``veth0``, holding a
private test address (10.213.0.1 and 10.213.0.2 by default) that exists only inside the pair, so
nothing reaches or is reached from the real network. Everything else (files, Python, the repository)
is shared, so a job started in each namespace behaves like one started on each of two hosts: the
ranks meet over TCP across the veth pair and nothing can fall back to loopback unnoticed.

:class:`NetnsCluster` creates the pair, runs ``torchrun`` (one agent per host, c10d rendezvous
on the first) or Open MPI's ``mpirun`` (a hostfile of the two addresses and an rsh agent that
enters a namespace where ``ssh`` would log in), and always tears the namespaces down: on exit, on
error and on timeout, killing whatever still runs inside. Names are unique per run, and namespaces
left by a run that died (its process is gone) are removed when the next one starts.

Needs root and ``ip`` (iproute2); :func:`unavailable_reason` says why a machine cannot.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "IFACE",
    "PREFIX",
    "ClusterError",
    "ClusterTimeout",
    "Host",
    "NetnsCluster",
    "Result",
    "clean_stale",
    "last_json",
    "unavailable_reason",
]

PREFIX = "distamp-mn"
"""Namespace names start with this; :func:`clean_stale` removes dead runs' namespaces by it."""
IFACE = "veth0"
"""The interface of each host: the name is the same in both namespaces (they are separate)."""
IP_TIMEOUT_S = 20.0
"""Bound on each ``ip`` command: they return in milliseconds unless the kernel is stuck."""
FAILURE_GRACE_S = 10.0
"""After one process fails, how long the others may go on before they are killed (a peer left
waiting in a rendezvous would otherwise hold the run until its deadline)."""


class ClusterError(RuntimeError):
    """A namespace could not be created or removed; the message has the ``ip`` command's error."""


class ClusterTimeout(TimeoutError):
    """A run outlived its timeout; its processes were killed. ``results`` holds their output."""

    def __init__(self, message: str, results: list[Result]) -> None:
        super().__init__(message)
        self.results = results


@dataclass(frozen=True)
class Host:
    """One simulated host: the namespace it lives in and its address on the veth pair."""

    index: int
    netns: str
    address: str


@dataclass(frozen=True)
class Result:
    """One process of a run: where and what it ran, how it ended and what it printed."""

    host: Host
    argv: tuple[str, ...]
    returncode: int  # negative: killed by that signal (-9 when the run was cut off)
    stdout: str
    stderr: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
    )
    if check and proc.returncode != 0:
        raise ClusterError(
            f"ip {shlex.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def unavailable_reason() -> str | None:
    """``None`` when this machine can build a cluster, else why not (for a test's skip message)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command is missing (apt-get install iproute2)"
    # Each step a cluster needs, tried once: containers may allow one and refuse the next.
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    steps = [
        ("ip netns add", ["netns", "add", probe]),
        ("a veth pair", ["link", "add", "p0", "netns", probe, "type", "veth", "peer", "name", "p1",
                         "netns", probe]),
        ("ip netns exec", ["netns", "exec", probe, "ip", "link", "set", "lo", "up"]),
    ]  # fmt: skip
    try:
        for what, args in steps:
            proc = _ip(*args, check=False)
            if proc.returncode != 0:
                return f"{what} is not permitted here: {proc.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip failed: {exc}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _ip("netns", "delete", probe, check=False)
    return None


def _netns_pids(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_inside(name: str) -> None:
    """SIGKILL every process in namespace ``name`` (all started by the harness) and wait."""
    for pid in _netns_pids(name):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while _netns_pids(name) and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGKILL is asynchronous; a namespace with members lingers after delete


def _remove_netns(name: str) -> str | None:
    """Kill every process inside ``name``, then delete it; an error message, or None."""
    _kill_inside(name)
    proc = _ip("netns", "delete", name, check=False)
    if proc.returncode != 0 and name in _list_netns():
        return f"ip netns delete {name}: {proc.stderr.strip()}"
    return None


def _list_netns() -> list[str]:
    # `ip netns list` prints "name" or "name (id: N)" per line.
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale(prefix: str = PREFIX) -> list[str]:
    """Remove the namespaces of earlier runs whose process has died; returns their names.

    A name carries its creator's pid (``<prefix>-<pid>-<token>-<n>``), so the namespaces of a run
    going on in parallel are left alone.
    """
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-[0-9a-f]+-\w+")
    removed = []
    for name in _list_netns():
        m = pattern.fullmatch(name)
        if m and not _alive(int(m[1])):
            if (error := _remove_netns(name)) is not None:
                raise ClusterError(error)
            removed.append(name)
    return removed


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object (the main job's summary on rank 0)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError(f"no JSON object line in the output:\n{text[-2000:]}")


_AGENT = """#!/bin/sh
# rsh agent for mpirun: "log in" to a simulated host by entering its network namespace. Like ssh,
# it starts the remote command with a nearly empty environment, so whatever the ranks need must be
# passed with mpirun -x, as on real hosts.
while [ "${1#-}" != "$1" ]; do shift; done  # options ssh would take (none are meaningful here)
host=$1
shift
case "$host" in
@CASES@
*) echo "netns agent: unknown host $host" >&2; exit 255 ;;
esac
exec env -i PATH="$PATH" ip netns exec "$ns" sh -c "$*"
"""


class NetnsCluster:
    """Two simulated hosts; use as a context manager so they are always removed.

    Args:
        subnet: the first three octets of the hosts' /24 (host ``i`` gets ``.{i + 1}``).
        prefix: start of the namespace names (see :func:`clean_stale`).
    """

    def __init__(self, *, subnet: str = "10.213.0", prefix: str = PREFIX) -> None:
        if not re.fullmatch(r"(\d{1,3}\.){2}\d{1,3}", subnet):
            raise ValueError(f"NetnsCluster(subnet={subnet!r}): give three octets, e.g. 10.213.0")
        token = f"{os.getpid()}-{secrets.token_hex(3)}"
        # Two hosts: a veth pair joins exactly two namespaces; more would need a bridge.
        self.hosts = tuple(Host(i, f"{prefix}-{token}-{i}", f"{subnet}.{i + 1}") for i in (0, 1))
        self.prefix = prefix
        self.workdir: Path | None = None

    def __enter__(self) -> NetnsCluster:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        errors = self.destroy()
        if errors and exc is None:  # never mask the error that ended the body
            raise ClusterError("; ".join(errors))

    def create(self) -> None:
        """Create both namespaces, the veth pair and the addresses; undo everything on failure."""
        clean_stale(self.prefix)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        try:
            for host in self.hosts:
                _ip("netns", "add", host.netns)
            a, b = self.hosts
            # Both ends are created inside their namespaces, never in the real one: no name clash
            # with the machine's interfaces or with a parallel run.
            _ip("link", "add", IFACE, "netns", a.netns, "type", "veth", "peer", "name", IFACE,
                "netns", b.netns)  # fmt: skip
            for host in self.hosts:
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFACE)
                _ip("-n", host.netns, "link", "set", IFACE, "up")
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> list[str]:
        """Kill what runs inside, delete the namespaces and the work directory; idempotent.

        Returns:
            Error messages (empty on success); every step is tried even when one fails.
        """
        errors = []
        present = set(_list_netns())
        for host in self.hosts:
            if host.netns in present and (error := _remove_netns(host.netns)) is not None:
                errors.append(error)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        return errors

    # Running jobs.

    def run(
        self,
        commands: Sequence[tuple[Host, Sequence[str]]],
        *,
        env: Mapping[str, str],
        timeout: float,
        cwd: str | os.PathLike[str] | None = None,
    ) -> list[Result]:
        """Run each ``(host, argv)`` inside its host at once; wait for all, at most ``timeout`` s.

        Output goes to files, not pipes, so no process blocks on a full pipe while another is
        waited for. When one fails the others get :data:`FAILURE_GRACE_S` to finish; those still
        running then are killed and report ``-9``.

        Raises:
            ClusterTimeout: the deadline passed; every process was killed.
        """
        if self.workdir is None:
            raise RuntimeError("NetnsCluster.run() outside `with NetnsCluster() as cluster:`")
        procs = []
        for n, (host, argv) in enumerate(commands):
            out, err = (self.workdir / f"{n}.{host.index}.{s}" for s in ("out", "err"))
            with out.open("w") as fo, err.open("w") as fe:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", host.netns, *argv],
                    env=dict(env), cwd=cwd, stdout=fo, stderr=fe, start_new_session=True,
                )  # fmt: skip
            procs.append((host, tuple(argv), proc, out, err))
        deadline, failed_at, timed_out = time.monotonic() + timeout, None, False
        while any(p.poll() is None for _, _, p, _, _ in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for _, _, p, _, _ in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > FAILURE_GRACE_S:
                break  # the failure is the result; the others' exit codes will say -9
            if now > deadline:
                timed_out = True
                break
            time.sleep(0.05)
        if any(p.poll() is None for _, _, p, _, _ in procs):
            # Everything inside the namespaces: launchers, and workers torchrun started in
            # sessions of their own, which killing the launcher's process group would miss.
            for host in self.hosts:
                _kill_inside(host.netns)
        for _, _, proc, _, _ in procs:
            proc.wait(timeout=IP_TIMEOUT_S)
        results = [
            Result(host, argv, proc.returncode, out.read_text(), err.read_text())
            for host, argv, proc, out, err in procs
        ]
        if timed_out:
            tails = "\n".join(f"--- host {r.host.index}: {r.stderr[-1500:]}" for r in results)
            raise ClusterTimeout(f"run killed after {timeout:g} s\n{tails}", results)
        return results

    def torchrun(
        self,
        python: str,
        script: str,
        script_args: Sequence[str] = (),
        *,
        env: Mapping[str, str],
        timeout: float,
        nproc_per_node: int = 1,
        port: int = 29400,
        cwd: str | os.PathLike[str] | None = None,
    ) -> list[Result]:
        """One torchrun agent per host, c10d rendezvous on the first host's address.

        Inside a namespace the hostname still resolves to 127.0.0.1 (the machine's /etc/hosts),
        so what a real host learns from its name is given explicitly: ``is_host`` tells the
        first agent to serve the rendezvous store, ``--local-addr`` is the address each agent
        advertises, and ``GLOO_SOCKET_IFNAME`` makes gloo bind ``veth0``.
        """
        first = self.hosts[0]
        commands = []
        for host in self.hosts:
            argv = [
                python, "-m", "torch.distributed.run", "--nnodes", str(len(self.hosts)),
                "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{first.address}:{port}",
                "--rdzv-conf", f"is_host={int(host is first)}", "--node-rank", str(host.index),
                "--local-addr", host.address, script, *script_args,
            ]  # fmt: skip
            commands.append((host, argv))
        return self.run(
            commands, env={**env, "GLOO_SOCKET_IFNAME": IFACE}, timeout=timeout, cwd=cwd
        )

    def mpirun(
        self,
        python: str,
        script: str,
        script_args: Sequence[str] = (),
        *,
        env: Mapping[str, str],
        timeout: float,
        nproc_per_node: int = 1,
        port: int = 29500,
        forward: Sequence[str] = ("PYTHONPATH", "OMP_NUM_THREADS"),
        cwd: str | os.PathLike[str] | None = None,
    ) -> Result:
        """Open MPI's ``mpirun`` on the first host, spanning both through a hostfile.

        Open MPI's own traffic (daemons, TCP transport) is pinned to ``veth0``; the ranks get rank
        0's address as MASTER_ADDR/MASTER_PORT and the variables named in ``forward`` (when set in
        ``env``) with ``-x``, the only way anything reaches a remote rank.
        """
        if self.workdir is None:
            raise RuntimeError("NetnsCluster.mpirun() outside `with NetnsCluster() as cluster:`")
        hostfile = self.workdir / "hostfile"
        hostfile.write_text("".join(f"{h.address} slots={nproc_per_node}\n" for h in self.hosts))
        agent = self.workdir / "netns-agent.sh"
        cases = "\n".join(f"{h.address}) ns={h.netns} ;;" for h in self.hosts)
        agent.write_text(_AGENT.replace("@CASES@", cases))
        agent.chmod(0o755)
        first = self.hosts[0]
        exported = [
            f"MASTER_ADDR={first.address}",
            f"MASTER_PORT={port}",
            f"GLOO_SOCKET_IFNAME={IFACE}",
        ]
        exported += [f"{k}={env[k]}" for k in forward if k in env]
        argv = [
            "mpirun", "--allow-run-as-root", "-np", str(nproc_per_node * len(self.hosts)),
            "--hostfile", str(hostfile), "--map-by", f"ppr:{nproc_per_node}:node",
            "--mca", "plm_rsh_agent", str(agent),
            "--mca", "btl_tcp_if_include", IFACE, "--mca", "oob_tcp_if_include", IFACE,
            *(a for kv in exported for a in ("-x", kv)),
            python, script, *script_args,
        ]  # fmt: skip
        return self.run([(first, argv)], env=env, timeout=timeout, cwd=cwd)[0]
