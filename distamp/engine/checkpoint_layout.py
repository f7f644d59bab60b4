"""A checkpoint directory's layout: its manifest, which step directory it names, and the errors
that say which file is wrong (see :mod:`distamp.engine.checkpoint` for the whole layout).

Kept apart from reading and writing so that both sides, and the checks of what a load will read
(:mod:`distamp.engine.integrity`), name files and older good checkpoints in the same words; the
DCP part's keys (:func:`state_dict_options`) and its fit to a model (:func:`model_mismatch`)
belong to the layout too.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.cluster import is_distributed

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "cause_of",
    "failures_of_a_save_or_load",
    "latest_checkpoint",
    "load_file",
    "model_mismatch",
    "rank_and_world",
    "refuse_foreign",
    "single_process_quiet",
    "state_dict_options",
    "unreadable",
]

MANIFEST = "latest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or from an incompatible format, or a
    save could not be completed on some rank.

    The message names the file (and the rank, when one rank alone failed); every rank raises it.
    Loading raises before anything is modified: neither the model nor the checkpoint directory
    is touched, so the good checkpoints that may be there (the previous step's is kept) survive
    for a fix by hand. A failed save commits nothing: the previous checkpoint stays in force.
    """


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; ``(0, 1)`` without a process group."""
    if is_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP calls made quiet about running without a process group.

    Without a process group DCP warns that it "assumes a single process" even when told so
    with no_dist=True; for distamp that case is intended (one-process runs), not a hazard.
    """
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to", category=UserWarning
            )
        yield


def failures_of_a_save_or_load() -> tuple[type[BaseException], ...]:
    """What a DCP save or load can raise: any ``Exception`` and DCP's ``CheckpointException``
    (a ``BaseException``). For an ``except`` clause, which evaluates it only when something was
    raised: importing DCP costs most of ``import distamp`` (it brings DTensor and sympy), and a
    process that never checkpoints need not pay it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def cause_of(exc: BaseException) -> str:
    """The first line of ``exc`` with its type; each rank's, for DCP's gathered exceptions."""
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> (exc, tb)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {r}: {cause_of(e[0])}" for r, e in sorted(failures.items()))
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def unreadable(path: Path, why: BaseException | str, root: Path) -> CheckpointError:
    """The error for ``path`` of the checkpoint directory ``root``: ``why`` is the exception
    that reading it raised, or what is wrong with its bytes; older complete checkpoints of
    ``root`` are pointed out as the way to resume."""
    older = sorted(p.name for p in root.glob("step_*") if p.is_dir() and p not in path.parents)
    hint = (
        f"; older complete checkpoints in {root}: {', '.join(older)} (point {MANIFEST} at one "
        "of them to resume from it)"
        if older
        else ""
    )
    what = "directory" if path.is_dir() else "file"
    if isinstance(why, str):
        return CheckpointError(f"checkpoint {what} {path} is damaged: {why}{hint}")
    return CheckpointError(
        f"checkpoint {what} {path} is unreadable (truncated or corrupted?): {cause_of(why)}{hint}"
    )


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
        raise unreadable(manifest, exc, root) from exc
    path = root / name
    if not path.is_dir():
        raise CheckpointError(
            f"{manifest} names {name!r}, which does not exist: the checkpoint directory "
            "was modified by hand; delete the manifest to start over"
        )
    return path


def refuse_foreign(root: Path) -> None:
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


def load_file(path: Path, root: Path) -> Any:
    """``torch.load`` with ``weights_only``; any failure becomes a :class:`CheckpointError`."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # zip errors, unpickling errors, EOF, missing file...
        raise unreadable(path, exc, root) from exc


def state_dict_options() -> Any:
    """Flattened optimizer state: every entry, hyper-parameters included, is keyed by its
    parameter's name. Unflattened, the ``param_groups`` entry has the same key on every pipeline
    stage, DCP keeps one copy of it, and a stage loads another stage's learning rate, momentum
    and weight decay (then fails on a missing key at its next step)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def model_mismatch(state_dir: Path, root: Path, model: nn.Module) -> str | None:
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

    mine = get_model_state_dict(model, options=state_dict_options())
    job = set(mine)
    world = dist.get_world_size() if is_distributed() else 1
    if world > 1:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, sorted(mine))
        job = {k for keys in everyone for k in keys}
    try:
        saved = FileSystemReader(str(state_dir)).read_metadata().state_dict_metadata
    except Exception as exc:  # a missing or corrupted .metadata
        return str(unreadable(state_dir, exc, root))
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
