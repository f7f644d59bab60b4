"""Whether a directory is one filesystem that every rank of the job sees.

Checkpoints need it: DCP writes each rank's shards into the same directory and the commit reads
them all back. A directory on node-local disks (``/tmp/run`` on each host) passes every
single-rank check, trains every step, and fails only at the first save, on every rank, losing the
run. :func:`check_shared_directory` finds it at setup instead, with one probe file per rank.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distamp.cluster.agreement import agree_failures
from distamp.cluster.collectives import is_distributed

__all__ = ["check_shared_directory"]

_PROBE_PREFIX = ".distamp-shared-probe-"
# How long rank 0 looks again for a probe it does not see yet: a shared filesystem may show
# another host's new file a moment late (NFS attribute caches); node-local disks never do.
_LOOK_AGAIN_S = (0.05, 0.2, 0.5, 1.0)


def check_shared_directory(
    directory: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None
) -> Path:
    """Check that ``directory`` is one filesystem shared by every rank of ``group``; creates it.

    Collective: call on every rank, each with its own spelling of the path. Each rank writes a
    probe file there, rank 0 looks for every rank's, then each removes its own. Cost: a gather
    of a few bytes per rank and one all-reduce of an int (host syncs both), plus up to ~2 s
    when rank 0 misses a probe (it looks again, in case the filesystem shows it late). Without
    a process group (or with one rank) it only creates the directory.

    Args:
        directory: the directory (a checkpoint directory, a run's output directory).
        group: the ranks that must share it (``None``: the default group).

    Returns:
        The directory, as this rank's ``Path``.

    Raises:
        ValueError: on every rank, naming the directory and the ranks whose files rank 0 does
            not see (or that could not create it or write there), with the fix: one filesystem
            shared by every rank (NFS, Lustre, ... mounted at the same path), given to every
            rank.
    """
    path = Path(directory)
    if not is_distributed() or dist.get_world_size(group) == 1:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission: refused as with several ranks
            raise ValueError(f"cannot create directory {str(directory)!r}: {exc}") from exc
        return path
    probe, error = _write_probe(path)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (str(path), probe.name, error), group=group)
    verdict = None
    if rank == 0:
        verdict = _rank0_verdict(path, everyone)
    failures, _ = agree_failures(verdict, group=group)  # also: rank 0 has looked
    probe.unlink(missing_ok=True)
    written = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(everyone) if e is not None]
    if written or failures:
        problems = "; ".join(written + failures)
        raise ValueError(
            f"directory {str(directory)!r} is not one filesystem shared by every rank "
            f"({problems}): checkpoints need every rank's files in one place. Give every rank "
            "the same directory on a filesystem all of them mount (NFS, Lustre, ... at the "
            "same path), not a node-local disk"
        )
    return path


def _write_probe(path: Path) -> tuple[Path, str | None]:
    """This rank's probe file (a name no other check and no other rank uses), or why not."""
    probe = path / f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as exc:
        return probe, f"cannot write in {path}: {exc.strerror or exc}"
    return probe, None


def _rank0_verdict(path: Path, everyone: list[Any]) -> str | None:
    """Which ranks' probes rank 0 does not see in its ``path`` (looking again a few times)."""
    wrote = {r: name for r, (_, name, error) in enumerate(everyone) if error is None}
    missing = [r for r, name in wrote.items() if not (path / name).exists()]
    for pause in _LOOK_AGAIN_S:
        if not missing:
            return None
        time.sleep(pause)
        missing = [r for r in missing if not (path / wrote[r]).exists()]
    if not missing:
        return None
    spelled = {r: p for r, (p, _, _) in enumerate(everyone) if p != str(path)}
    where = (
        f"; they were given {', '.join(f'rank {r}: {p!r}' for r, p in spelled.items())}"
        if spelled
        else ""
    )
    shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    return f"rank 0 does not see the files rank(s) {shown} wrote there (node-local disks?){where}"
