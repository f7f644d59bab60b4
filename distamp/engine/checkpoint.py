"""Rank-consistent, atomic checkpoints: sharded state through DCP, the rest from rank 0.

Layout of a checkpoint directory ``DIR``::

    DIR/latest.json             the manifest: which step directory is complete (written last)
    DIR/step_00000120/state/    model + optimizer, torch.distributed.checkpoint (every rank writes
                                its shards; replicated tensors are written once)
    DIR/step_00000120/trainer.pt  step counter, scaler, scheduler (rank 0; identical on all ranks)
    DIR/step_00000120/rng_<r>.pt  rank r's RNG streams (they differ between ranks)
    DIR/step_00000120/rank_<r>.pt rank r's own state when it has some (a comm hook's
                                error-feedback residuals)

A save goes to a hidden temporary directory first; every file is fsynced, the directory is
renamed into place, and only then is the manifest replaced (itself written to a temporary file,
fsynced and renamed). A crash at any point leaves the previous manifest pointing at a complete
checkpoint, so a loader never sees half a save. ``DIR`` must be one filesystem shared by all
ranks (as DCP requires).

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.cluster import is_distributed
from distamp.engine.rng import capture_rng, restore_rng

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

MANIFEST = "latest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or from an incompatible format.

    The message names the file. Loading raises before anything is modified: neither the model
    nor the checkpoint directory is touched, so the good checkpoints that may be there (the
    previous step's is kept) survive for a fix by hand.
    """


def _state_dict_options() -> Any:
    """Flattened optimizer state: every entry, hyper-parameters included, is keyed by its
    parameter's name. Unflattened, the ``param_groups`` entry has the same key on every pipeline
    stage, DCP keeps one copy of it, and a stage loads another stage's learning rate, momentum
    and weight decay (then fails on a missing key at its next step)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _cause(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> (exc, tb)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {_cause(e[0])}" for r, e in sorted(failures.items()))
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _unreadable(path: Path, exc: BaseException, root: Path) -> CheckpointError:
    cause = _cause(exc)
    older = sorted(p.name for p in root.glob("step_*") if p.is_dir() and p not in path.parents)
    hint = (
        f"; older complete checkpoints in {root}: {', '.join(older)} (point {MANIFEST} at one "
        "of them to resume from it)"
        if older
        else ""
    )
    return CheckpointError(
        f"checkpoint {'directory' if path.is_dir() else 'file'} {path} is unreadable "
        f"(truncated or corrupted?): {cause}{hint}"
    )


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


def _barrier() -> None:
    if _dist()[1] > 1:
        dist.barrier()


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


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint the manifest of ``directory`` names, or ``None`` if none.

    Raises:
        CheckpointError: the manifest is unreadable or names a directory that is not there.
    """
    root = Path(directory)
    manifest = root / MANIFEST
    if not manifest.is_file():
        return None
    try:
        info = json.loads(manifest.read_text())
        name = info["path"]
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"'path' must be a step directory's name, got {name!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _unreadable(manifest, exc, root) from exc
    path = root / name
    if not path.is_dir():
        raise CheckpointError(
            f"{manifest} names {name!r}, which does not exist: the checkpoint directory "
            "was modified by hand; delete the manifest to start over"
        )
    return path


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

    Args:
        directory: the checkpoint directory (created if needed), shared by all ranks.
        step: the number of completed optimizer steps; names the step directory.
        model, optimizer: as returned by ``DistAMP.setup`` (any strategy).
        trainer_state: small, rank-identical state (step, scaler, scheduler...) that rank 0
            writes alone; tensors and plain Python values only.
        keep: how many complete checkpoints to keep (the newest ones); at least 1.
        rank_state: this rank's own state (it differs between ranks), or ``None``.

    Returns:
        The committed step directory.
    """
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = _dist()
    root = Path(directory)
    name = f"step_{step:08d}"
    tmp, final = root / f".{name}.tmp", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that crashed
        tmp.mkdir()
    _barrier()
    msd, osd = get_state_dict(model, optimizer, options=_state_dict_options())
    with _single_process_quiet():  # DCP fsyncs the files it writes
        dcp_save(
            {"model": msd, "optim": osd}, checkpoint_id=tmp / "state", no_dist=not is_distributed()
        )
    _save_synced(capture_rng(), tmp / f"rng_{rank}.pt")
    if rank_state is not None:
        _save_synced(rank_state, tmp / f"rank_{rank}.pt")
    if rank == 0:
        meta = {"format": FORMAT_VERSION, "step": step, "world_size": world}
        _save_synced({**trainer_state, "meta": meta}, tmp / "trainer.pt")
    _barrier()
    error = None
    if rank == 0:
        try:
            final = _commit(root, tmp, final, step=step, world=world, keep=keep)
        except OSError as exc:
            error = f"rank 0 could not commit the checkpoint {final}: {exc}"
    if world > 1:
        # Rank 0's outcome for everyone: a failed commit must fail every rank, not only rank 0.
        box: list[str | None] = [error, str(final)]
        dist.broadcast_object_list(box, src=0)
        error, final = box[0], Path(str(box[1]))
    if error is not None:
        raise RuntimeError(error)
    return final


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
    for path in old[: max(0, len(old) - max(1, keep) + 1)]:
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


def read_checkpoint(
    directory: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> CheckpointRead | None:
    """Read everything of the latest checkpoint of ``directory`` that can be checked before the
    model is touched, and check that it fits ``model`` and ``optimizer``; modifies nothing.

    Collective: call on every rank. The check against the model reads DCP's metadata: every
    model entry of the checkpoint must exist in this model and the reverse (a checkpoint of a
    larger or another model is an error, not a silently loaded subset), with the same shapes.
    What :func:`apply_checkpoint` then reads in place is only the tensor data.

    Returns:
        ``None`` when ``directory`` holds no checkpoint (it does not exist, or holds neither a
        manifest nor anything a checkpoint is made of: metrics files and the like are fine).

    Raises:
        CheckpointError: a file is missing, truncated, corrupted or of another format; the path
            is a file, a step directory or a bare DCP checkpoint rather than a checkpoint
            directory (the message says which directory to pass); the checkpoint does not fit
            this model. Names the file and, for a mismatch, the entries.
    """
    path = latest_checkpoint(directory)
    if path is None:
        _refuse_foreign(Path(directory))
        return None
    root = Path(directory)
    rank, world = _dist()
    trainer = _load_file(path / "trainer.pt", root)
    meta = trainer.get("meta") if isinstance(trainer, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint file {path / 'trainer.pt'} has format "
            f"{None if not isinstance(meta, dict) else meta.get('format')!r}; this distamp reads "
            f"format {FORMAT_VERSION}: load it with the distamp version that wrote it"
        )
    assert isinstance(trainer, dict)
    saved_world = meta.get("world_size")
    rng, error = None, None
    own = None
    if saved_world == world:
        try:
            rng = _load_file(path / f"rng_{rank}.pt", root)
            if (path / f"rank_{rank}.pt").exists():
                own = _load_file(path / f"rank_{rank}.pt", root)
        except CheckpointError as exc:
            error = str(exc)
    mismatch = _mismatch(path / "state", root, model)  # collective: on every rank
    error = mismatch if error is None else error
    if world > 1:
        # Per-rank files fail on one rank only: agree, so that no rank trains on while a peer
        # has raised (it would wait in its first collective until the timeout).
        errors: list[str | None] = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise CheckpointError(error)
    world_saved = saved_world if isinstance(saved_world, int) else None
    return CheckpointRead(path, trainer, rng, world_saved, own)


def _refuse_foreign(root: Path) -> None:
    """No manifest: nothing to resume, unless ``root`` is something a user may have mistaken
    for a checkpoint directory (then say what to pass instead of starting from scratch)."""
    if not root.exists():
        return
    if not root.is_dir():
        raise CheckpointError(
            f"{root} is a file, not a checkpoint directory: pass the directory given to "
            "save_state()"
        )
    if (root / "trainer.pt").exists() or (root / "state").is_dir():
        raise CheckpointError(
            f"{root} is one step of a checkpoint directory, not the directory itself: pass "
            f"its parent {root.parent} (its {MANIFEST} says which step is complete)"
        )
    if (root / ".metadata").exists():
        raise CheckpointError(
            f"{root} is a bare torch.distributed.checkpoint directory, not one written by "
            "save_state() (no trainer state: step, scaler, scheduler); load it with "
            "torch.distributed.checkpoint.load, or pass a directory save_state() wrote"
        )
    steps = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    if steps:
        raise CheckpointError(
            f"{root} holds step directories ({', '.join(steps)}) but no {MANIFEST}, so none "
            f'is known to be complete: write {{"path": "<step directory>"}} to {root / MANIFEST}'
            " to resume from one, or move them away to start over"
        )


def _mismatch(state_dir: Path, root: Path, model: nn.Module) -> str | None:
    """Why the checkpoint in ``state_dir`` does not fit ``model``, or ``None``. Collective when
    distributed, on every rank whatever happened before (pipeline stages each hold part of the
    model: an entry is foreign only when no rank of the job has it, so the ranks' names are
    gathered once). The model's entries only: the optimizer's would have to be materialised
    first (torch builds a fresh optimizer's state with a step of zeros to list them), which a
    refused load must not do; its entries follow the parameters, and DCP refuses a missing one
    before reading."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    mine = get_model_state_dict(model, options=_state_dict_options())
    job = set(mine)
    if _dist()[1] > 1:
        everyone: list[Any] = [None] * _dist()[1]
        dist.all_gather_object(everyone, sorted(mine))
        job = {k for keys in everyone for k in keys}
    try:
        saved = FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    except Exception as exc:  # a missing or corrupted .metadata
        return str(_unreadable(state_dir, exc, root))
    theirs = {k.split(".", 1)[1]: v for k, v in saved.items() if k.startswith("model.")}
    problems = []
    for what, keys in (
        ("entries this model does not have", set(theirs) - job),
        ("model entries missing from the checkpoint", set(mine) - set(theirs)),
    ):
        if keys:
            shown = ", ".join(sorted(keys)[:5])
            more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
            problems.append(f"{len(keys)} {what} ({shown}{more})")
    for key in sorted(set(theirs) & set(mine)):
        meta, value = theirs[key], mine[key]
        if (
            isinstance(meta, TensorStorageMetadata)
            and isinstance(value, torch.Tensor)
            and tuple(meta.size) != tuple(value.shape)
        ):
            problems.append(
                f"{key}: shape {tuple(meta.size)} in the checkpoint, {tuple(value.shape)} here"
            )
    if not problems:
        return None
    return (
        f"checkpoint {state_dir.parent} does not fit this model: {'; '.join(problems[:6])}. "
        "It was saved from another model; nothing was loaded"
    )


def apply_checkpoint(
    read: CheckpointRead, *, model: nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Load the tensors of a checkpoint :func:`read_checkpoint` accepted into ``model`` and
    ``optimizer``, and restore this rank's RNG streams. Collective: call on every rank.

    Raises:
        CheckpointError: a DCP shard is corrupted. DCP reads into the model's own tensors, so
            they may then hold part of it: do not train on after the error.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = read.path
    msd, osd = get_state_dict(model, optimizer, options=_state_dict_options())
    state: dict[str, Any] = {"model": msd, "optim": osd}
    try:
        with _single_process_quiet():
            dcp_load(state, checkpoint_id=path / "state", no_dist=not is_distributed())
    except (Exception, CheckpointException) as exc:  # the latter is a BaseException
        # DCP has already agreed on the failure across ranks (it gathers every rank's
        # exception), so every rank raises here and none is left waiting in a collective.
        raise _unreadable(path / "state", exc, path.parent) from exc
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_state_dict_options(),
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


def _load_file(path: Path, root: Path) -> Any:
    """``torch.load`` with ``weights_only``; any failure becomes a :class:`CheckpointError`."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # zip errors, unpickling errors, EOF, missing file...
        raise _unreadable(path, exc, root) from exc
