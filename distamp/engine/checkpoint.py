"""Rank-consistent, atomic checkpoints: sharded state through DCP, the rest from rank 0.

Layout of a checkpoint directory ``DIR``::

    DIR/latest.json             the manifest: which step directory is complete (written last)
    DIR/step_00000120/state/    model + optimizer, torch.distributed.checkpoint (every rank writes
                                its shards; replicated tensors are written once)
    DIR/step_00000120/trainer.pt  step counter, scaler, scheduler (rank 0; identical on all ranks)
    DIR/step_00000120/rng_<r>.pt  rank r's RNG streams (they differ between ranks)
    DIR/step_00000120/rank_<r>.pt rank r's own state when it has some (a comm hook's
                                error-feedback residuals)
    DIR/step_00000120/files.json  every other file's size and CRC-32 (:mod:`.integrity`)

A save goes to a hidden temporary directory first; every file is fsynced, the directory is
renamed into place, and only then is the manifest replaced (itself written to a temporary file,
fsynced and renamed). A crash at any point leaves the previous manifest pointing at a complete
checkpoint, so a loader never sees half a save. ``DIR`` must be one filesystem shared by all
ranks (as DCP requires).

Every rank raises, or none does: where a rank can fail alone (creating the directory, its
writes, reading back what it wrote; its files at load) the ranks agree on the outcome in one
small all-reduce (:func:`~distamp.cluster.agreement.agree_failures`), so a refusal reaches every
rank at once with the failing rank's reason instead of leaving its peers in a collective until
the timeout. A load verifies every file it will read (present, the size and CRC-32 recorded at
save time, the expected structure) and checks the state against the job before anything is
applied: a refused load changes nothing.

Model and optimizer go through ``get_state_dict``/``set_state_dict``, which give the same
parameter names whatever wrapper (none, DDP, FSDP1, FSDP2) holds the model: a checkpoint saved
under one strategy loads under another. The optimizer state is flattened (keyed by parameter
name), so pipeline stages that each hold part of the model keep their own hyper-parameters.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from distamp.arguments import ArgumentTypeError, as_integer
from distamp.cluster import is_distributed
from distamp.cluster.agreement import agree_failures
from distamp.engine.checkpoint_layout import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    cause_of,
    latest_checkpoint,
    load_file,
    model_mismatch,
    refuse_foreign,
    state_dict_options,
    unreadable,
)
from distamp.engine.integrity import (
    LISTING,
    file_digest,
    listed_files,
    read_listing,
    share,
    verify_files,
    write_listing,
)
from distamp.engine.rng import capture_rng, check_rng, restore_rng

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "CheckpointRead",
    "apply_checkpoint",
    "capture_rng",
    "latest_checkpoint",
    "load_checkpoint",
    "read_checkpoint",
    "restore_rng",
    "save_checkpoint",
]


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    # Without a process group DCP warns that it "assumes a single process" even when told so
    # with no_dist=True; for distamp that case is intended (one-process runs), not a hazard.
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to", category=UserWarning
            )
        yield


def _dist() -> tuple[int, int]:
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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
    rank, world = _dist()
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
    try:
        with _single_process_quiet():  # DCP fsyncs the files it writes
            dcp_save(
                {"model": msd, "optim": osd},
                checkpoint_id=tmp / "state",
                no_dist=not is_distributed(),
            )
        _save_synced(capture_rng(), tmp / f"rng_{rank}.pt")
        if rank_state is not None:
            _save_synced(rank_state, tmp / f"rank_{rank}.pt")
        if rank == 0:
            meta = {"format": FORMAT_VERSION, "step": step, "world_size": world}
            _save_synced({**trainer_state, "meta": meta}, tmp / "trainer.pt")
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
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
    if _dist()[0] == 0:
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


@dataclass(frozen=True)
class CheckpointRead:
    """A checkpoint read and checked, not yet applied (:func:`read_checkpoint`)."""

    path: Path  # the step directory
    trainer: dict[str, Any]  # the ``trainer_state`` given to save_checkpoint, with "meta"
    rng: dict[str, Any] | None  # this rank's streams; None when saved by another world size
    saved_world: int | None  # the world size that saved it
    rank_state: dict[str, Any] | None = None  # this rank's own state, when it saved some
    checked: Any = None  # what read_checkpoint's ``check`` returned (e.g. a resume plan)


def read_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    check: Callable[[CheckpointRead], Any] | None = None,
) -> CheckpointRead | None:
    """Read everything of the latest checkpoint of ``directory`` that can be checked before the
    model is touched, and check that it fits ``model`` and ``optimizer``; modifies nothing.

    Collective: call on every rank; every rank returns, or every rank raises. Checked, in
    order: the manifest; every file the load will read against the step directory's listing
    (present, the size and CRC-32 recorded at save time: a DCP shard cut short is found here,
    not half-way through loading it; checkpoints written before listings skip this); the
    trainer state's format, this rank's RNG streams and own state (their structure); the model
    against DCP's metadata (every model entry of the checkpoint must exist in this model and the
    reverse, same shapes: a checkpoint of a larger or another model is an error, not a silently
    loaded subset); and ``check``. What :func:`apply_checkpoint` then reads in place is only
    tensor data already verified.

    Args:
        check: called with the read checkpoint on every rank before the verdict; what it
            returns is kept as ``checked``. A ``ValueError`` it raises refuses the load on every
            rank (as ``ValueError``; a :class:`CheckpointError` as itself).

    Returns:
        ``None`` when ``directory`` holds no checkpoint (it does not exist, or holds neither a
        manifest nor anything a checkpoint is made of: metrics files and the like are fine).

    Raises:
        CheckpointError: a file is missing, truncated, corrupted or of another format; the path
            is a file, a step directory or a bare DCP checkpoint rather than a checkpoint
            directory (the message says which directory to pass); the checkpoint does not fit
            this model. Names the file (and the rank whose file it is) and, for a mismatch,
            the entries. Raised on every rank.
    """
    root = Path(directory)
    read, error = None, None
    try:
        read = _read_files(root)
    except CheckpointError as exc:
        error = str(exc)
    failures, (some_read, some_none) = agree_failures(
        error, flags=(read is not None, read is None and error is None)
    )
    if failures:
        raise CheckpointError("; ".join(failures))
    if some_read and some_none:
        raise CheckpointError(
            f"some ranks find a checkpoint in {root} and others none: the directory must be "
            "one filesystem shared by all ranks"
        )
    if read is None:
        return None
    error = model_mismatch(read.path / "state", root, model)  # collective: on every rank
    refused = False
    if error is None and check is not None:
        try:
            read = replace(read, checked=check(read))
        except CheckpointError as exc:
            error = str(exc)
        except (ValueError, TypeError, KeyError) as exc:
            error, refused = str(exc), True
    failures, (a_file,) = agree_failures(error, flags=(error is not None and not refused,))
    if failures:
        # A field the check refused stays a ValueError on every rank; a file, a CheckpointError.
        raise (CheckpointError if a_file else ValueError)("; ".join(failures))
    return read


def _read_files(root: Path) -> CheckpointRead | None:
    """This rank's part of :func:`read_checkpoint`, before any collective."""
    path = latest_checkpoint(root)
    if path is None:
        refuse_foreign(root)
        return None
    rank, world = _dist()
    try:
        listing = read_listing(path)
    except (OSError, ValueError) as exc:
        raise unreadable(path / LISTING, exc, root) from exc
    if listing is not None:
        problem = verify_files(path, listing, rank=rank, world=world)
        if problem is not None:
            raise unreadable(problem[0], problem[1], root)
    trainer = load_file(path / "trainer.pt", root)
    meta = trainer.get("meta") if isinstance(trainer, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint file {path / 'trainer.pt'} has format "
            f"{None if not isinstance(meta, dict) else meta.get('format')!r}; this distamp reads "
            f"format {FORMAT_VERSION}: load it with the distamp version that wrote it"
        )
    assert isinstance(trainer, dict)
    saved_world = meta.get("world_size")
    rng, own = None, None
    if saved_world == world:
        rng = _load_checked(path / f"rng_{rank}.pt", root, check_rng)
        own_file = path / f"rank_{rank}.pt"
        if (own_file.name in listing) if listing is not None else own_file.exists():
            own = _load_checked(own_file, root, _check_dict)
    world_saved = saved_world if isinstance(saved_world, int) else None
    return CheckpointRead(path, trainer, rng, world_saved, own)


def _check_dict(state: Any) -> None:
    if not isinstance(state, dict):
        raise ValueError(f"expected a dict, got {type(state).__name__}")


def _load_checked(path: Path, root: Path, check: Callable[[Any], None]) -> Any:
    """:func:`load_file`, then ``check`` of its structure (a refusal names the file)."""
    state = load_file(path, root)
    try:
        check(state)
    except ValueError as exc:
        raise unreadable(path, f"not what distamp writes there ({exc})", root) from None
    return state


def apply_checkpoint(
    read: CheckpointRead, *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load the tensors of a checkpoint :func:`read_checkpoint` accepted into ``model`` and
    ``optimizer``, and restore this rank's RNG streams. Collective: call on every rank.

    Raises:
        CheckpointError: DCP could not read a shard that :func:`read_checkpoint` verified (a
            file changed in between, a read error; checkpoints without a listing: a corrupted
            shard). DCP reads into the model's own tensors, so they may then hold part of it:
            do not train on after the error.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = read.path
    msd, osd = get_state_dict(model, optimizer, options=state_dict_options())
    state: dict[str, Any] = {"model": msd, "optim": osd}
    try:
        with _single_process_quiet():
            dcp_load(state, checkpoint_id=path / "state", no_dist=not is_distributed())
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        # DCP has already agreed on the failure across ranks (it gathers every rank's
        # exception), so every rank raises here and none is left waiting in a collective.
        raise unreadable(path / "state", exc, path.parent) from exc
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=state_dict_options(),
    )
    if read.rng is not None:
        restore_rng(read.rng)
    else:
        warnings.warn(
            f"checkpoint {path} was saved by {read.saved_world} ranks and is loaded by "
            f"{_dist()[1]}: model, optimizer, scaler and scheduler are restored, the per-rank "
            "RNG streams are not (the run continues, but not bitwise as an uninterrupted one "
            "would)",
            stacklevel=3,
        )


def load_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> dict[str, Any] | None:
    """:func:`read_checkpoint`, then :func:`apply_checkpoint`: load the latest complete
    checkpoint of ``directory`` into ``model`` and ``optimizer``. Collective.

    This rank's RNG streams are restored too when the world size is the one that saved (with
    another world size the model and optimizer still load, resharded by DCP, but per-rank streams
    have no counterpart, so they are left alone with a warning).

    Returns:
        The ``trainer_state`` given to :func:`save_checkpoint` (with a ``"meta"`` entry), or
        ``None`` when the directory holds no checkpoint. Callers that must check the trainer
        state before the model changes use the two halves instead (as ``DistAMP.load_state``).
    """
    read = read_checkpoint(directory, model=model, optimizer=optimizer)
    if read is None:
        return None
    apply_checkpoint(read, model=model, optimizer=optimizer)
    return read.trainer
