"""The frozen description of where one process sits in a job, as its launcher said."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DistEnv"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a distributed job, as its launcher described it.

    ``node_rank`` is ``None`` when the launcher does not say and it cannot be derived safely
    (see :func:`distamp.cluster.environments.base.block_node_rank`); ``main_address``/
    ``main_port`` are ``None`` when no address is known yet (MPI without ``MASTER_ADDR``:
    :func:`~distamp.cluster.init_distributed` then asks rank 0 over MPI).
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
        for name in ("rank", "world_size", "local_rank", "local_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"DistEnv({name}={value!r}): must be an int")
        for name in ("node_rank", "main_port"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"DistEnv({name}={value!r}): must be an int or None")
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
