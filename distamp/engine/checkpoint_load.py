"""Loading a checkpoint in two halves: :func:`read_checkpoint` reads and checks everything it can
before the model is touched (a refused load changes nothing), :func:`apply_checkpoint` then loads
the verified tensors; the layout is described in :mod:`distamp.engine.checkpoint`.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distamp.cluster import is_distributed
from distamp.cluster.agreement import agree_failures
from distamp.engine.checkpoint_layout import (
    FORMAT_VERSION,
    CheckpointError,
    failures_of_a_save_or_load,
    latest_checkpoint,
    load_file,
    model_mismatch,
    rank_and_world,
    refuse_foreign,
    single_process_quiet,
    state_dict_options,
    unreadable,
)
from distamp.engine.checkpoint_masters import apply_masters_, masters_for_load
from distamp.engine.checkpoint_optimizer import missing_entries, optimizer_mismatch
from distamp.engine.integrity import LISTING, read_listing, verify_files
from distamp.engine.rng import check_rng, restore_rng

__all__ = ["CheckpointRead", "apply_checkpoint", "load_checkpoint", "read_checkpoint"]


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
    if error is None:  # the optimizer's class and groups, from the metadata alone
        rank, world = rank_and_world()
        meta = read.trainer["meta"]
        error = optimizer_mismatch(
            meta.get("optimizer"),
            _optimizer_entries(read.path / "state"),
            optimizer,
            checkpoint=str(read.path),
            rank=rank,
            world=world,
        )
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
    rank, world = rank_and_world()
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


def _optimizer_entries(state_dir: Path) -> list[str]:
    """The optimizer's flattened entry names in DCP's metadata (``"optim."`` off); empty when
    the metadata cannot be read (:func:`model_mismatch` has refused such a checkpoint)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        saved = FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    except Exception:  # a missing or corrupted .metadata: refused by model_mismatch already
        return []
    return [k.removeprefix("optim.") for k in saved if k.startswith("optim.")]


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
    fresh = not optimizer.state  # torch materialises a fresh optimizer's state for the load
    msd, osd = get_state_dict(model, optimizer, options=state_dict_options())
    left_out = masters_for_load(model, optimizer, msd, osd)  # fp32 masters read as such
    state: dict[str, Any] = {"model": msd, "optim": osd}
    # Another optimizer's state (what only the materialised template shows): refused on every
    # rank before DCP reads, with the materialised state dropped again.
    error = missing_entries(osd, _optimizer_entries(path / "state"), optimizer, str(path))
    failures, _ = agree_failures(error)
    if failures:
        if fresh:
            optimizer.state.clear()
        raise CheckpointError("; ".join(failures))
    try:
        with single_process_quiet():
            dcp_load(state, checkpoint_id=path / "state", no_dist=not is_distributed())
    except failures_of_a_save_or_load() as exc:
        # DCP has already agreed on the failure across ranks (it gathers every rank's
        # exception), so every rank raises here and none is left waiting in a collective.
        if fresh:
            optimizer.state.clear()
        raise unreadable(path / "state", exc, path.parent) from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict={**state["model"], **left_out},
        optim_state_dict=state["optim"],
        options=state_dict_options(),
    )
    apply_masters_(model, optimizer, state["model"])
    if read.rng is not None:
        restore_rng(read.rng)
    else:
        world = rank_and_world()[1]
        warnings.warn(
            f"checkpoint {path} was saved by {read.saved_world} ranks and is loaded by "
            f"{world}: model, optimizer, scaler and scheduler are restored, the per-rank "
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
