"""Which launcher started this process, and joining the process group it implies.

:func:`detect_environment` is a pure function of an environment mapping: it reads, never writes,
and never loads an MPI runtime, so every launcher can be tested with a plain dict.
:func:`init_distributed` turns the result into a process group whose rendezvous always ends, in
success or in a :class:`RendezvousError` naming the address, the port, the launcher and the fix.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import os
import re
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

__all__ = [
    "LAUNCHERS",
    "DistEnv",
    "CollectiveTimeoutError",
    "RendezvousError",
    "detect_environment",
    "expand_nodelist",
    "init_distributed",
    "named_collective",
    "shutdown_distributed",
]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a distributed job, as its launcher described it.

    ``node_rank`` is ``None`` when the launcher does not say and it cannot be derived safely
    (see :func:`_block_node_rank`); ``main_address``/``main_port`` are ``None`` when no address is
    known yet (MPI without ``MASTER_ADDR``: :func:`init_distributed` then asks rank 0 over MPI).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int | None
    main_address: str | None
    main_port: int | None

    def __post_init__(self) -> None:
        # A backstop for hand-built values; detection already names the offending variable.
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"DistEnv: need 0 <= rank={self.rank} < world_size={self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size <= self.world_size:
            raise ValueError(
                f"DistEnv: need 0 <= local_rank={self.local_rank} < local_world_size="
                f"{self.local_world_size} <= world_size={self.world_size}"
            )
        if self.main_port is not None and not 0 < self.main_port < 65536:
            raise ValueError(f"DistEnv(main_port={self.main_port}): not a TCP port")

    @property
    def is_distributed(self) -> bool:
        """True when a launcher started this process (even a world of one): a group is due."""
        return self.launcher != "single"

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0, the rank that logs and writes shared files."""
        return self.rank == 0

    @property
    def num_nodes(self) -> int | None:
        """Number of nodes when every node runs the same number of processes, else ``None``."""
        if self.world_size % self.local_world_size:
            return None
        return self.world_size // self.local_world_size


class RendezvousError(RuntimeError):
    """The ranks did not meet within the timeout (or could not reach the main address)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete: a peer rank stopped participating (hung, crashed, slow)."""


# What the backends say when a peer does not take part: gloo "Timed out waiting 5000ms for recv
# operation", NCCL's watchdog "collective operation timeout", and a peer that died mid-collective.
_PEER_GONE = re.compile(
    r"timed out|timeout|connection closed by peer|connection reset|broken pipe", re.IGNORECASE
)


@contextmanager
def named_collective(what: str, timeout: float) -> Iterator[None]:
    """Turn a backend's timeout inside the body into a :class:`CollectiveTimeoutError` naming
    ``what`` and ``timeout``.

    The backends' own messages name a transport operation ("recv", a sequence number), not the
    training step that was waiting, so "which collective, after how long, and what to do" is
    added here. Other errors pass through unchanged.

    Args:
        what: the collective in the words of the caller (e.g. "save_state: checkpoint barrier").
        timeout: the process group's timeout in seconds, for the message.
    """
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).strip()
        if isinstance(exc, CollectiveTimeoutError) or not _PEER_GONE.search(text):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        cause = text.splitlines()[0] if text else type(exc).__name__
        raise CollectiveTimeoutError(
            f"{what} did not complete on rank {rank} within the {timeout:g} s timeout: another "
            "rank stopped participating (hung, crashed or far slower); its log names the cause. "
            "Raise the timeout (DistAMP(timeout=...), init_distributed(timeout=...)) only if "
            f"that rank is merely slow (cause: {cause})"
        ) from exc


# Parsing helpers: every error names the variable and echoes its value.


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise ValueError(
            f"{name} is not set, though other variables of its launcher are: set it, or name the "
            "launcher with DISTAMP_LAUNCHER"
        )
    if not re.fullmatch(r"\s*-?[0-9]+\s*", value):  # stricter than int(), which takes "1_0"
        raise ValueError(f"{name}={value!r} is not an integer")
    return int(value)


def _first(env: Mapping[str, str], *names: str) -> str:
    """The first of ``names`` that is set, else the preferred one (for the error message)."""
    return next((n for n in names if n in env), names[0])


def _world(
    env: Mapping[str, str], rank: str, size: str, local_rank: str, local_size: str
) -> tuple[int, int, int, int]:
    r, w, lr, lw = (_int(env, n) for n in (rank, size, local_rank, local_size))
    if w < 1:
        raise ValueError(f"{size}={w} must be at least 1")
    if not 0 <= r < w:
        raise ValueError(f"{rank}={r} is out of range for {size}={w}")
    if not 1 <= lw <= w:
        raise ValueError(f"{local_size}={lw} is out of range for {size}={w}")
    if not 0 <= lr < lw:
        raise ValueError(f"{local_rank}={lr} is out of range for {local_size}={lw}")
    return r, w, lr, lw


def _block_node_rank(rank: int, world: int, local_rank: int, local_world: int) -> int | None:
    """``rank // local_world`` when this rank fits a block layout (equal nodes, consecutive ranks).

    MPI launchers map ranks to nodes by slot (consecutive) by default, but ``--map-by node`` or a
    rankfile interleave them, and the environment of one rank cannot prove which: a layout that
    contradicts the block formula for this rank gives ``None`` rather than a wrong node index.
    """
    if world % local_world or rank % local_world != local_rank:
        return None
    return rank // local_world


_BRACKETS = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> node01 node02 node03 node07 gpu5.

    Zero padding follows the lower bound (``[08-10]`` -> 08 09 10); several bracket groups in one
    name give their cartesian product (``"a-[1-2]-b[3,4]"`` -> a-1-b3 a-1-b4 a-2-b3 a-2-b4). Pure
    Python, so no ``scontrol`` is needed on the node.
    """
    hosts: list[str] = []
    # Split on the commas outside brackets: re.split can't tell, so scan the depth.
    depth, start = 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            item = nodelist[start:i].strip()
            start = i + 1
            if item:
                hosts.extend(_expand_host(item, nodelist))
    if depth:
        raise ValueError(f"SLURM node list {nodelist!r}: unbalanced brackets")
    return hosts


def _expand_host(item: str, nodelist: str) -> list[str]:
    literals = _BRACKETS.split(item)[::2]  # text between the groups, then the groups themselves
    groups = [_expand_range(g, nodelist) for g in _BRACKETS.findall(item)]
    if any("[" in s or "]" in s for s in literals):
        raise ValueError(f"SLURM node list {nodelist!r}: malformed bracket in {item!r}")
    tails = literals[1:]
    return [
        literals[0] + "".join(n + t for n, t in zip(combo, tails, strict=True))
        for combo in itertools.product(*groups)
    ]


def _expand_range(group: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        lo, _, hi = part.strip().partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"SLURM node list {nodelist!r}: bad range {part!r} in [{group}]")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _tasks_per_node(value: str, name: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` form: ``"2(x3),1"`` -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise ValueError(f"{name}={value!r} is not of the form '2(x3),1'")
        out += [int(m[1])] * int(m[2] or 1)
    return out


# One class per launcher: `detect` says whether it started this process, `read` parses its vars.


class _Environment:
    name: ClassVar[str]
    mpi: ClassVar[bool] = False  # no address in the environment: rank 0 shares one over MPI

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        raise NotImplementedError

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        raise NotImplementedError


class _TorchElastic(_Environment):
    """torchrun (torchelastic) and the ``env://`` contract: RANK, WORLD_SIZE, MASTER_ADDR/PORT.

    MASTER_ADDR/MASTER_PORT alone do not select it: they are also the override for SLURM and MPI.
    """

    name = "torchrun"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return "TORCHELASTIC_RUN_ID" in env or {"RANK", "WORLD_SIZE"} <= env.keys()

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        # Hand-made env:// setups often give only RANK/WORLD_SIZE: that means one node.
        local = {**{"LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world)}, **env}
        r, w, lr, lw = _world(local, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        node = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else _block_node_rank(r, w, lr, lw)
        return DistEnv(cls.name, r, w, lr, lw, node, None, None)


class _Slurm(_Environment):
    """A task of an ``srun`` step; not a bare ``salloc``/``sbatch`` shell (no SLURM_STEP_ID there).

    ``mpirun`` inside an allocation starts its daemons with ``srun``, so its ranks inherit step
    variables that count daemons (one per node), not ranks. When an MPI launcher's world size is
    present and disagrees with SLURM's, SLURM declines and the MPI environment describes the rank.
    """

    name = "slurm"
    _MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE")

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        in_step = ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) and "SLURM_PROCID" in env
        ntasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"))
        if not in_step or ntasks is None:
            return False
        return all(env[v].strip() == ntasks.strip() for v in cls._MPI_SIZES if v in env)

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        size_var = _first(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        tasks_var = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        if tasks_var in env:
            per_node = _tasks_per_node(env[tasks_var], tasks_var)
            if node >= len(per_node):
                raise ValueError(
                    f"SLURM_NODEID={node} is out of range for {tasks_var}={env[tasks_var]!r}"
                )
            env = {**env, tasks_var: str(per_node[node])}
        else:
            tasks_var = "SLURM_NTASKS_PER_NODE"
        r, w, lr, lw = _world(env, "SLURM_PROCID", size_var, "SLURM_LOCALID", tasks_var)
        # The step's node list first: a step may run on a subset of the job's nodes, and rank 0 runs
        # on the first node of its step.
        list_var = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        hosts = expand_nodelist(env[list_var]) if list_var in env else []
        address = hosts[0] if hosts else None
        # Every task derives the same port from the job id, so no communication is needed; two
        # steps of one job sharing a node at the same time must set MASTER_PORT.
        port = 10000 + _int(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else None
        return DistEnv(cls.name, r, w, lr, lw, node, address, port)


class _OpenMPI(_Environment):
    """``mpirun``/``mpiexec`` of Open MPI.

    OMPI_COMM_WORLD_NODE_RANK is this process's rank among the processes of its node, NOT the node's
    index; the node index is derived with :func:`_block_node_rank` or left unknown.
    """

    name = "openmpi"
    mpi = True
    _VARS = tuple(f"OMPI_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return cls._VARS[0] in env and cls._VARS[1] in env

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        r, w, lr, lw = _world(env, *cls._VARS)
        return DistEnv(cls.name, r, w, lr, lw, _block_node_rank(r, w, lr, lw), None, None)


class _MVAPICH(_OpenMPI):
    name = "mvapich"
    _VARS = tuple(f"MV2_COMM_WORLD_{v}" for v in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE"))


class _MPICH(_OpenMPI):
    """MPICH and Intel MPI (Hydra's ``mpiexec``)."""

    name = "mpich"
    _VARS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


class _Single(_Environment):
    name = "single"

    @classmethod
    def detect(cls, env: Mapping[str, str]) -> bool:
        return True

    @classmethod
    def read(cls, env: Mapping[str, str]) -> DistEnv:
        return DistEnv(cls.name, 0, 1, 0, 1, 0, None, None)


# The one place that orders launchers; the first whose `detect` matches wins.
_ENVIRONMENTS: tuple[type[_Environment], ...] = (
    # torchrun first: it also runs inside SLURM steps and MPI jobs (one agent per node), and then
    # its variables describe the workers it started while the outer launcher's describe the agents.
    _TorchElastic,
    # srun next: an srun-launched MPI program (--mpi=pmi2) also carries PMI_* variables, and SLURM
    # knows the main address; _Slurm.detect declines inside an mpirun (see its docstring).
    _Slurm,
    _OpenMPI,
    # MVAPICH before MPICH: its Hydra launcher may set PMI_* too, and the MV2_* names are specific.
    _MVAPICH,
    _MPICH,
    _Single,
)
LAUNCHERS: tuple[str, ...] = tuple(e.name for e in _ENVIRONMENTS)
"""Launcher names :func:`detect_environment` returns and ``DISTAMP_LAUNCHER`` accepts."""


def detect_environment(env: Mapping[str, str] | None = None) -> DistEnv:
    """Describe this process from its launcher's environment variables.

    A pure function of ``env`` (default ``os.environ``): nothing is written and no MPI runtime is
    loaded. ``DISTAMP_LAUNCHER`` forces a launcher; explicit ``MASTER_ADDR``/``MASTER_PORT`` always
    win over the address a launcher implies.

    Raises:
        ValueError: unknown ``DISTAMP_LAUNCHER``, or a launcher variable that is missing, not an
            integer or inconsistent (e.g. rank >= world size); the message names the variable.
    """
    env = os.environ if env is None else env
    forced = env.get("DISTAMP_LAUNCHER", "").strip().lower()
    if forced in ("", "auto"):
        chosen = next(e for e in _ENVIRONMENTS if e.detect(env))
    else:
        matches = [e for e in _ENVIRONMENTS if e.name == forced]
        if not matches:
            valid = ", ".join((*LAUNCHERS, "auto"))
            raise ValueError(f"DISTAMP_LAUNCHER={env['DISTAMP_LAUNCHER']!r} is not one of {valid}")
        chosen = matches[0]
    found = chosen.read(env)
    address = env.get("MASTER_ADDR", "").strip() or found.main_address
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT", "").strip() else found.main_port
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return dataclasses.replace(found, main_address=address, main_port=port)


def init_distributed(
    env: DistEnv | None = None,
    backend: str | None = None,
    timeout: timedelta | float = 300.0,
) -> DistEnv:
    """Join the default process group that ``env`` (default: :func:`detect_environment`) describes.

    NCCL when CUDA is available, else gloo; on CUDA the device is set from ``local_rank`` first, so
    NCCL and every later ``.cuda()`` use this process's GPU. A single process (launcher
    ``"single"``) gets NO process group: distamp then behaves exactly like plain torch and no port
    is opened (a world of one with a real group is what ``torchrun --nproc-per-node 1`` gives).

    Idempotent: when a group already exists nothing is initialized again and the environment is
    returned (or, if it does not describe that group, a description of the live group).

    Args:
        env: where this process sits; detected from ``os.environ`` when ``None``.
        backend: a ``torch.distributed`` backend string, to override the choice above.
        timeout: bound on the rendezvous (and torch's default for collectives), seconds or
            timedelta.

    Returns:
        The environment, with the main address and port filled in when MPI had to provide them.

    Raises:
        RendezvousError: the ranks did not meet within ``timeout``.
        ImportError: an MPI launcher gave no main address and mpi4py is not installed.
    """
    import torch
    import torch.distributed as dist

    env = detect_environment() if env is None else env
    if dist.is_initialized():
        return _describe_live_group(env, dist.get_rank(), dist.get_world_size())
    if not env.is_distributed:
        return env
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a build with it")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if env.local_rank < count:
            torch.cuda.set_device(env.local_rank)
        elif count == 1:  # one visible GPU per process (SLURM --gpus-per-task): it is this rank's
            torch.cuda.set_device(0)
        elif "nccl" in backend:
            raise ValueError(
                f"local rank {env.local_rank} has no GPU: only {count} are visible on this node; "
                "start at most one process per GPU"
            )
    if env.main_address is None or env.main_port is None:
        env = _share_main_address(env)
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    host = f"[{env.main_address}]" if ":" in str(env.main_address) else env.main_address
    message = _rendezvous_message(env, seconds)
    # torch 2.13 bounds both sides of the TCPStore rendezvous (measured with timeout=5: rank 0 alone
    # fails after 6 s, a client with no server after 10 s as it retries once). The watchdog is the
    # last resort where torch does not (an older torch, a stuck name lookup): a process that exits
    # can be restarted by its launcher, one that hangs holds the whole job.
    with _watchdog(2 * seconds + 60, message):
        try:
            store = _elastic_round_store(env, seconds)
            if store is None:
                dist.init_process_group(
                    backend,
                    init_method=f"tcp://{host}:{env.main_port}",  # not env://: rereads os.environ
                    rank=env.rank,
                    world_size=env.world_size,
                    timeout=timedelta(seconds=seconds),
                )
            else:
                dist.init_process_group(
                    backend,
                    store=store,
                    rank=env.rank,
                    world_size=env.world_size,
                    timeout=timedelta(seconds=seconds),
                )
        except (dist.DistError, RuntimeError, TimeoutError) as exc:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RendezvousError(f"{message} (cause: {cause})") from exc
    return env


def _elastic_round_store(env: DistEnv, seconds: float) -> Any:
    """Under torchrun's shared agent store: a client of it, private to this restart round.

    torchrun (checked on torch 2.13) keeps ONE TCPStore for the whole job and hands every round's
    workers the same address, without a per-round key prefix. After a restart, the new workers
    then find the keys the killed round wrote (gloo peer addresses, barrier counters) and read
    them as their own: "connectFullMesh ... Connection refused" against a dead peer's port, or a
    hang on a counter that is already past. A prefix with the run id and the restart count gives
    every round fresh keys. ``None`` when the agent store is not in use (plain tcp:// then).
    Reads ``os.environ`` (never writes it): these variables are torchrun's, not the launcher
    description :class:`DistEnv` holds.
    """
    if env.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    assert env.main_address is not None and env.main_port is not None
    client = dist.TCPStore(
        env.main_address,
        env.main_port,
        env.world_size,
        is_master=False,
        timeout=timedelta(seconds=seconds),
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"distamp/{run_id}/attempt_{attempt}/", client)


def _rendezvous_message(env: DistEnv, seconds: float) -> str:
    return (
        f"distributed rendezvous failed: rank {env.rank} of {env.world_size} (launcher "
        f"{env.launcher!r}) did not meet the others at {env.main_address}:{env.main_port} within "
        f"{seconds:g} s. Check that all {env.world_size} processes started (see the launcher's "
        "log), that MASTER_ADDR/MASTER_PORT name a host reachable from every node and a free port, "
        "or raise init_distributed(timeout=...)"
    )


@contextmanager
def _watchdog(seconds: float, message: str) -> Iterator[None]:
    """Exit the process with ``message`` if the body is still running after ``seconds``."""

    def expire() -> None:
        # A thread can't interrupt the main thread's C++ call, but it can end the process: torch's
        # rendezvous releases the GIL while it waits, so this runs.
        os.write(2, f"distamp: {message} (watchdog after {seconds:g} s)\n".encode())
        os._exit(1)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _share_main_address(env: DistEnv) -> DistEnv:
    """Fill in the missing main address/port with rank 0's, broadcast over MPI.

    mpi4py is imported here only: importing it initializes MPI, which detection must never do.
    """
    if env.launcher not in {e.name for e in _ENVIRONMENTS if e.mpi}:
        raise ValueError(
            f"launcher {env.launcher!r} gave no main address/port (got {env.main_address}:"
            f"{env.main_port}): set MASTER_ADDR and MASTER_PORT for every process"
        )
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"launcher {env.launcher!r} does not say where rank 0 listens, and mpi4py (used to ask "
            "rank 0) is not installed: `pip install distamp[mpi]`, or set MASTER_ADDR and "
            "MASTER_PORT for every rank (mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=...)"
        ) from exc
    comm = MPI.COMM_WORLD
    if (comm.Get_rank(), comm.Get_size()) != (env.rank, env.world_size):
        raise RuntimeError(
            f"mpi4py sees rank {comm.Get_rank()} of {comm.Get_size()} but {env.launcher!r} says "
            f"rank {env.rank} of {env.world_size}: mpi4py uses another MPI than the launcher; "
            "reinstall it against that MPI, or set MASTER_ADDR and MASTER_PORT"
        )
    mine = None
    if env.rank == 0:
        # All ranks on one node: loopback needs no name lookup (container hostnames may not resolve)
        address = env.main_address or (
            "127.0.0.1" if env.local_world_size == env.world_size else socket.gethostname()
        )
        mine = (address, env.main_port or _free_port())
    address, port = comm.bcast(mine, root=0)
    return dataclasses.replace(env, main_address=address, main_port=port)


def _free_port() -> int:
    # Released before the store binds it, so another process could take it in between: rare enough
    # on one node to be worth not needing a second round of communication.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _describe_live_group(env: DistEnv, rank: int, world_size: int) -> DistEnv:
    """``env`` if it describes the group that is already initialized; see init_distributed."""
    if (env.rank, env.world_size) == (rank, world_size):
        return env
    if env.is_distributed:
        raise RuntimeError(
            f"a process group is already initialized as rank {rank} of {world_size}, but launcher "
            f"{env.launcher!r} says rank {env.rank} of {env.world_size}: initialize it once, from "
            "the launcher's environment (call init_distributed() before anything else does)"
        )
    # The user built the group themselves (e.g. mp.spawn + init_process_group) without launcher
    # variables: describe it as one node, the only layout such a setup can imply.
    return DistEnv("external", rank, world_size, rank, world_size, 0, None, None)


def shutdown_distributed() -> None:
    """End the job's process group cleanly. Collective: call on every rank, last.

    A barrier (no rank tears down while a peer still sends), a garbage collection, then the group
    is destroyed. Drop your references to DDP/FSDP-wrapped models and their optimizers first:
    they hold the group, and a group that is only freed during interpreter shutdown can abort
    the process with "terminate called without an active exception" (gloo's threads, seen with
    torch 2.13 on CPU). A no-op when no group is initialized.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
