"""Saving a checkpoint: every rank's part written to a hidden temporary directory, read back
and digested, then committed by rank 0 (rename into place, manifest replaced last) and old
checkpoints pruned; the layout and the guarantees are described in :mod:`distamp.engine.checkpoint`.

Kept apart from loading (:mod:`distamp.engine.checkpoint_load`): the two share only the layout's
names (:mod:`distamp.engine.checkpoint_layout`) and the listing of digests
(:mod:`distamp.engine.integrity`), and a change to the commit protocol should not have to be read
around the checks a load makes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.arguments import ArgumentTypeError, as_integer
from distamp.cluster import is_distributed
from distamp.cluster.agreement import agree_failures
from distamp.engine.checkpoint_layout import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    cause_of,
    failures_of_a_save_or_load,
    rank_and_world,
    single_process_quiet,
    state_dict_options,
)
from distamp.engine.checkpoint_masters import masters_for_save
from distamp.engine.checkpoint_optimizer import optimizer_layout
from distamp.engine.integrity import file_digest, listed_files, share, write_listing
from distamp.engine.rng import capture_rng

__all__ = ["save_checkpoint"]


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    directory: str | os.PathLike[str],
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    keep: int = 2,
    rank_state: dict[str, Any] | None = None,
) -> Path:
    """Save a checkpoint of step ``step`` atomically; collective: call on every rank.

    A rank that fails alone (a directory it cannot create, a write error, a state that cannot be
    pickled) makes every rank raise at once (the ranks agree on the outcome after creating the
    directory and after writing), and nothing is committed: the previous checkpoint stays in
    force.

    Args:
        directory: the checkpoint directory (created if needed), shared by all ranks.
        step: the number of completed optimizer steps; names the step directory.
        model, optimizer: as returned by ``DistAMP.setup`` (any strategy).
        trainer_state: small, rank-identical state (step, scaler, scheduler...) that rank 0
            writes alone; tensors and plain Python values only.
        keep: how many complete checkpoints to keep (the newest ones); an int, at least 1.
        rank_state: this rank's own state (it differs between ranks), or ``None``.

    Returns:
        The committed step directory.

    Raises:
        ValueError: ``keep`` is not an int >= 1 (before anything is written).
        CheckpointError: on every rank, when any rank could not create or write its part,
            naming the rank and the cause.
    """
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    keep = _check_keep(keep)
    rank, world = rank_and_world()
    root = Path(directory)
    name = f"step_{step:08d}"
    tmp, final = root / f".{name}.tmp", root / name
    error = None
    try:  # every rank: one that cannot reach the directory says so now, not at its first write
        root.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that crashed
            tmp.mkdir()
    except OSError as exc:
        error = f"cannot create {tmp}: {exc}"
    # A rank that cannot create it may not share the filesystem: every rank must reach DIR.
    _agree_on_save(error, tmp, "could not create the checkpoint directory on every rank")
    msd, osd = get_state_dict(model, optimizer, options=state_dict_options())
    masters_for_save(model, optimizer, msd, osd)  # 16-bit weights: their fp32 masters instead
    layout = optimizer_layout(optimizer)  # collective: what a load compares its optimizer with
    try:
        with single_process_quiet():  # DCP fsyncs the files it writes
            dcp_save(
                {"model": msd, "optim": osd},
                checkpoint_id=tmp / "state",
                no_dist=not is_distributed(),
            )
        _save_synced(capture_rng(), tmp / f"rng_{rank}.pt")
        if rank_state is not None:
            _save_synced(rank_state, tmp / f"rank_{rank}.pt")
        if rank == 0:
            meta: dict[str, Any] = {"format": FORMAT_VERSION, "step": step, "world_size": world}
            meta["optimizer"] = layout  # what a load compares its optimizer with
            _save_synced({**trainer_state, "meta": meta}, tmp / "trainer.pt")
    except failures_of_a_save_or_load() as exc:
        error = f"could not write {tmp}: {cause_of(exc)}"
    _agree_on_save(error, tmp, "could not write every rank's part")
    digests = _digest_share(tmp, rank, world)
    final_or_error: list[Any] = [str(final)]
    if rank == 0:
        try:
            write_listing(tmp, digests)
            final_or_error = [str(_commit(root, tmp, final, step=step, world=world, keep=keep))]
        except OSError as exc:
            final_or_error = [None, f"rank 0 could not commit the checkpoint {final}: {exc}"]
    if world > 1:  # rank 0's outcome for everyone: a failed commit must fail every rank
        dist.broadcast_object_list(final_or_error, src=0)
    if final_or_error[0] is None:
        raise CheckpointError(str(final_or_error[-1]))
    return Path(str(final_or_error[0]))


def _check_keep(keep: Any) -> int:
    try:
        value = as_integer("keep", keep)
    except ValueError as exc:
        raise ArgumentTypeError(
            f"{exc}: `keep` is how many complete checkpoints save_state keeps (an int >= 1)"
        ) from None
    if value < 1:
        raise ValueError(f"`keep` must be at least 1 (the checkpoint just saved), got {keep!r}")
    return value


def _agree_on_save(error: str | None, tmp: Path, what: str) -> None:
    """Every rank raises when any rank failed (rank 0 removing the half-written directory)."""
    failures, _ = agree_failures(error)
    if not failures:
        return
    if rank_and_world()[0] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    raise CheckpointError(
        f"save_state {what} and committed nothing ({'; '.join(failures)}); any previous "
        f"checkpoint in {tmp.parent} is still in force"
    )


def _digest_share(tmp: Path, rank: int, world: int) -> dict[str, tuple[int, int]]:
    """Every file's size and CRC-32, gathered (each rank digests its share); every rank must
    see the same files, or the directory is not one shared filesystem."""
    error, names, digests = None, listed_files(tmp), {}
    try:
        digests = {n: file_digest(tmp / n) for n in share(names, rank, world)}
    except OSError as exc:
        error = f"cannot read back {exc.filename}: {exc.strerror}"
    if world == 1:
        _agree_on_save(error, tmp, "could not read back what it wrote")
        return digests
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (error, names, digests))
    errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(everyone) if e is not None]
    seen = set().union(*(set(n) for _, n, _ in everyone))
    for r, (_, theirs, _) in enumerate(everyone):
        if not errors and set(theirs) != seen:
            errors.append(f"rank {r} does not see {sorted(seen - set(theirs))[:3]}")
    if errors:  # the same list on every rank: every rank raises
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"save_state could not record {tmp} ({'; '.join(errors)}) and committed nothing; "
            "the directory must be one filesystem shared by all ranks"
        )
    return {n: d for _, _, part in everyone for n, d in part.items()}


def _commit(root: Path, tmp: Path, final: Path, *, step: int, world: int, keep: int) -> Path:
    """Move ``tmp`` into place and point the manifest at it; returns the committed directory."""
    _fsync_path(tmp)
    # The same step saved again (e.g. twice by hand): never delete what the manifest may still
    # name; the new copy gets a suffix and the old one leaves through the retention below.
    base, n = final, 0
    while final.exists():
        n += 1
        final = base.with_name(f"{base.name}.{n}")
    os.rename(tmp, final)
    _fsync_path(root)
    manifest = {"path": final.name, "step": step, "world_size": world, "format": FORMAT_VERSION}
    tmp_manifest = root / f".{MANIFEST}.tmp"
    with open(tmp_manifest, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_manifest, root / MANIFEST)  # the commit point
    _fsync_path(root)
    old = sorted(p for p in root.glob("step_*") if p.is_dir() and p != final)
    for path in old[: max(0, len(old) - keep + 1)]:
        shutil.rmtree(path, ignore_errors=True)
    return final
