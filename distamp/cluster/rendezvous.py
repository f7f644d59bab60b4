"""Joining the process group a :class:`DistEnv` describes, and leaving it.

:func:`init_distributed` turns a detected environment into a process group whose rendezvous
always ends, in success or in a :class:`RendezvousError` naming the address, the port, the
launcher and the fix.
"""

from __future__ import annotations

import gc
import logging
import math
import numbers
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distamp.cluster.collectives import is_distributed
from distamp.cluster.detection import detect_environment
from distamp.cluster.dist_env import DistEnv
from distamp.cluster.main_address import share_main_address

__all__ = ["NO_LAUNCHER", "RendezvousError", "init_distributed", "shutdown_distributed"]

_log = logging.getLogger("distamp.cluster")

NO_LAUNCHER = (
    "init_distributed(): no launcher started this process (no torchrun, srun, mpirun or Ray "
    "variables in its environment), so no process group was made: it trains alone, and a "
    "collective (torch.distributed.all_reduce, DDP) will ask for init_process_group. To start "
    "N processes: `distamp launch --nproc-per-node N script.py` (or torchrun "
    "--nproc-per-node N, mpirun -np N, srun --ntasks N); for one process on purpose, call "
    "init_distributed(warn_if_single=False)"
)
"""What :func:`init_distributed` logs (``distamp.cluster``, WARNING) when it makes no group."""


class RendezvousError(RuntimeError):
    """The ranks did not meet within the timeout (or could not reach the main address)."""


def init_distributed(
    env: DistEnv | None = None,
    backend: str | None = None,
    timeout: timedelta | float = 300.0,
    *,
    warn_if_single: bool = True,
) -> DistEnv:
    """Join the default process group that ``env`` (default: :func:`detect_environment`) describes.

    NCCL when CUDA is available, else gloo; on CUDA the device is set from ``local_rank`` first, so
    NCCL and every later ``.cuda()`` use this process's GPU. A single process (launcher
    ``"single"``) gets NO process group: distamp then behaves exactly like plain torch and no port
    is opened (a world of one with a real group is what ``torchrun --nproc-per-node 1`` gives); it
    logs :data:`NO_LAUNCHER` (``distamp.cluster``, WARNING): a script that meant to run on several
    processes learns here, not at its first collective, that it was started without a launcher.

    Idempotent: when a group already exists nothing is initialized again and the environment is
    returned (or, if it does not describe that group, a description of the live group).

    Args:
        env: where this process sits; detected from ``os.environ`` when ``None``.
        backend: a ``torch.distributed`` backend string, to override the choice above.
        timeout: bound on the rendezvous (and torch's default for collectives), seconds or
            timedelta.
        warn_if_single: log :data:`NO_LAUNCHER` when no launcher started this process; pass
            ``False`` where one process is a complete job (``DistAMP.setup`` does).

    Returns:
        The environment, with the main address and port filled in when MPI had to provide them.

    Raises:
        RendezvousError: the ranks did not meet within ``timeout``.
        ImportError: an MPI launcher gave no main address and mpi4py is not installed.
        ValueError: a bad ``timeout``, ``backend`` or ``env``, or a launcher variable that
            :func:`detect_environment` refuses (checked before any rendezvous starts).
    """
    seconds = _timeout_seconds(timeout)  # checked before anything is joined or detected
    if backend is not None and not isinstance(backend, str):
        raise ValueError(f"backend={backend!r} must be a torch.distributed backend name or None")
    env = detect_environment() if env is None else env
    if not isinstance(env, DistEnv):
        raise ValueError(f"env={env!r} must be a distamp DistEnv (from detect_environment) or None")
    if is_distributed():
        return _describe_live_group(env, dist.get_rank(), dist.get_world_size())
    if not env.is_distributed:
        if warn_if_single:
            _log.warning("%s", NO_LAUNCHER)
        return env
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; install a build with it")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if env.local_rank < count:
            torch.cuda.set_device(env.local_rank)
        elif count == 1 and os.environ.get("CUDA_VISIBLE_DEVICES"):
            # One visible GPU per process, chosen by the launcher (SLURM --gpus-per-task).
            torch.cuda.set_device(0)
        elif "nccl" in backend:
            # Without this, NCCL fails later and less clearly ("Duplicate GPU detected").
            raise ValueError(
                f"local rank {env.local_rank} has no GPU of its own: {count} visible on this node "
                f"for {env.local_world_size} processes, and NCCL needs one GPU per process; "
                f"start at most {count} per node (--nproc-per-node {count}), or train on the CPU "
                "(CUDA_VISIBLE_DEVICES= hides the GPUs; gloo is then the backend)"
            )
    if env.main_address is None or env.main_port is None:
        env = share_main_address(env)
    message = _rendezvous_message(env, seconds)
    # torch 2.13 bounds both sides of the TCPStore rendezvous (measured with timeout=5: rank 0 alone
    # fails after 6 s, a client with no server after 10 s as it retries once). The watchdog is the
    # last resort where torch does not (an older torch, a stuck name lookup): a process that exits
    # can be restarted by its launcher, one that hangs holds the whole job.
    with _watchdog(2 * seconds + 60, message):
        try:
            dist.init_process_group(
                backend,
                store=_round_store(env, seconds),  # not env://: it rereads os.environ
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=seconds),
            )
        except (dist.DistError, RuntimeError, TimeoutError) as exc:
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RendezvousError(f"{message} (cause: {cause})") from exc
    return env


def _timeout_seconds(timeout: Any) -> float:
    """``timeout`` (seconds as any real number, or a timedelta) as float seconds, or a
    ``ValueError``: it must be finite, > 0 and at most 2**31 - 1 (68 years), so that the
    rendezvous store, torch's collectives and the watchdog timer can all hold it."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, torch.Tensor) and seconds.ndim == 0 and not seconds.is_complex():
        seconds = seconds.item()
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ValueError(f"timeout={timeout!r} must be a number of seconds or a timedelta")
    value = float(seconds)
    if not (math.isfinite(value) and 0 < value <= 2**31 - 1):
        raise ValueError(f"timeout={timeout!r} must be a number of seconds in (0, 2147483647]")
    return value


def _round_store(env: DistEnv, seconds: float) -> Any:
    """The store this round's group meets in, under a key prefix that no earlier round used.

    Two ways the keys of an earlier group get read as this one's, checked on torch 2.13:

    - one process, a second group (``DistAMP.setup`` after ``close()``, or a group torch made
      and destroyed before): torch's ``tcp://`` and ``env://`` rendezvous share one store server
      per port within a process (multi-tenant) and name the default group's keys after a counter
      that restarts at 0 when the group is destroyed. The new group then reads the old gloo peer
      addresses and barrier counters, and its first collective waits for the timeout.
    - torchrun's shared agent store: ONE store for the whole job, the same address for every
      restart round; a restarted round finds the killed round's keys ("connectFullMesh ...
      Connection refused" against a dead peer's port, or a hang on a counter already past).

    The prefix is the launch (torchrun's run id and restart count) and the round's number,
    counted in the store itself (every rank adds 1), so every rank agrees on it whatever its
    own history. The store of a plain rendezvous is kept for the life of the process (see
    :data:`_STORES`). Reads ``os.environ`` (never writes it): these variables are torchrun's, not
    the launcher description :class:`DistEnv` holds.
    """
    assert env.main_address is not None and env.main_port is not None
    timeout = timedelta(seconds=seconds)
    base: Any
    if env.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(
            env.main_address, env.main_port, env.world_size, is_master=False, timeout=timeout
        )
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        launch = f"distamp/{run_id}/attempt_{attempt}/"
    else:
        key = (env.main_address, env.main_port, env.rank == 0)
        base = _STORES.get(key)
        if base is None:
            base = dist.TCPStore(
                env.main_address,
                env.main_port,
                env.world_size,
                is_master=env.rank == 0,
                timeout=timeout,
                multi_tenant=True,
            )
            _STORES[key] = base
        base.set_timeout(timeout)
        launch = "distamp/"
    launch += f"world_{env.world_size}/"  # the count below is of ranks of this world size
    joined = base.add(f"{launch}joined", 1)
    return dist.PrefixStore(f"{launch}round_{(joined - 1) // env.world_size}/", base)


_STORES: dict[tuple[str, int, bool], Any] = {}
"""The plain rendezvous' stores of this process, by (address, port, is main): kept, so that
rank 0's server outlives its group. Were it freed at ``close()``, a peer that starts the next
round first could still reach the old server, count itself there, and wait on a dead one."""


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
    if is_distributed():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
