"""Where rank 0 listens when the launcher does not say: a free port, shared over MPI.

MPI launchers give no main address. Rather than require ``MASTER_ADDR``/``MASTER_PORT`` from every
``mpirun`` user, rank 0 picks its address and a free port and broadcasts them with mpi4py.
"""

from __future__ import annotations

import dataclasses
import socket

from distamp.cluster.detection import ENVIRONMENTS
from distamp.cluster.dist_env import DistEnv

__all__ = ["free_port", "share_main_address"]


def free_port() -> int:
    """A TCP port that is free on every interface of this host right now.

    Released before the caller binds it, so another process could take it in between: rare
    enough on one node to be worth not needing a second round of communication.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def share_main_address(env: DistEnv) -> DistEnv:
    """Fill in the missing main address/port with rank 0's, broadcast over MPI.

    mpi4py is imported here only: importing it initializes MPI, which detection must never do.
    """
    if env.launcher not in {e.name for e in ENVIRONMENTS if e.mpi}:
        raise ValueError(
            f"launcher {env.launcher!r} gave no main address/port (got {env.main_address}:"
            f"{env.main_port}): set MASTER_ADDR and MASTER_PORT for every process"
        )
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            f"launcher {env.launcher!r} does not say where rank 0 listens, and mpi4py (used to ask "
            "rank 0) is not installed: `pip install -e '.[mpi]'` (from a distamp checkout), or "
            "set MASTER_ADDR and MASTER_PORT for every rank (mpirun -x MASTER_ADDR=<host of "
            "rank 0> -x MASTER_PORT=...)"
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
        mine = (address, env.main_port or free_port())
    address, port = comm.bcast(mine, root=0)
    return dataclasses.replace(env, main_address=address, main_port=port)
