"""Whether a checkpoint's optimizer state fits this job's optimizer, told before anything loads.

DCP loads the optimizer by its flattened entries (``state.<param>.<name>``,
``param_groups.<param>.<hyper-parameter>``). Resumed with another optimizer (AdamW saved, SGD
with momentum here), DCP finds an entry missing half-way through its load and says only
"Missing key", which read as a damaged file. Resumed with the parameters grouped otherwise, it
loads silently and each group takes the hyper-parameters of its first parameter's old group. So
a save records the optimizer's class and each rank's group layout (how many parameters, which
hyper-parameter names) in the checkpoint's metadata (:func:`optimizer_layout`), and a load
compares them, and the hyper-parameter names DCP's metadata lists for checkpoints written before
the layout was recorded, with this job's optimizer before any tensor is read
(:func:`optimizer_mismatch`). What only a materialised state shows (its entry names) is checked
on the templates the load reads into, before DCP reads (:func:`missing_entries`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from distamp.cluster import is_distributed
from distamp.optim import MasterWeightOptimizer

__all__ = ["missing_entries", "optimizer_kind", "optimizer_layout", "optimizer_mismatch"]


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class name as a checkpoint records it: a master-weight optimizer's
    inner one (its checkpoint loads into the plain torch optimizer of that class)."""
    if isinstance(optimizer, MasterWeightOptimizer):
        return type(optimizer.inner).__name__
    return type(optimizer).__name__


def _groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {"params": len(group["params"]), "hyper": sorted(k for k in group if k != "params")}
        for group in optimizer.param_groups
    ]


def optimizer_layout(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a save records of the optimizer: ``{"class": name, "ranks": [groups of rank 0,
    ...]}``, each group ``{"params": count, "hyper": [names]}``. Collective when distributed
    (one ``all_gather_object`` per save: pipeline stages hold different groups)."""
    mine = _groups(optimizer)
    ranks: list[Any] = [mine]
    if is_distributed() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    return {"class": optimizer_kind(optimizer), "ranks": ranks}


def _describe(groups: list[dict[str, Any]]) -> str:
    sizes = ", ".join(str(g["params"]) for g in groups)
    return f"{len(groups)} parameter group{'s' * (len(groups) != 1)} ({sizes} parameters)"


def _names(keys: Iterable[str], prefix: str) -> set[str]:
    """The last components of the flattened entries under ``prefix`` (names hold no dots)."""
    return {k.rsplit(".", 1)[1] for k in keys if k.startswith(prefix)}


def optimizer_mismatch(
    saved: Any,
    entries: Iterable[str],
    optimizer: torch.optim.Optimizer,
    *,
    checkpoint: str,
    rank: int,
    world: int,
) -> str | None:
    """Why the checkpoint's optimizer state does not fit ``optimizer``, or ``None``.

    Args:
        saved: the ``"optimizer"`` entry of the checkpoint's metadata (:func:`optimizer_layout`),
            or ``None`` for a checkpoint written before it was recorded.
        entries: the optimizer's flattened entry names in DCP's metadata (``"optim."`` off).
        optimizer: this job's optimizer (not materialised: nothing of it is changed).
        checkpoint: the step directory, for the message.
        rank, world: this rank and the world size (a layout is compared rank by rank, only
            when the world size is the saved one).
    """
    entries = list(entries)
    here = optimizer_kind(optimizer)
    theirs = _names(entries, "state.")
    state = f" (its state: {', '.join(sorted(theirs))})" if theirs else ""
    redo = "resume with the optimizer and parameter groups that were saved"
    if isinstance(saved, Mapping) and saved.get("class") not in (None, here):
        return (
            f"checkpoint {checkpoint} was saved with optimizer {saved['class']}{state}, and "
            f"this job's optimizer is {here}: {redo}; nothing was loaded"
        )
    hyper_saved = _names(entries, "param_groups.")
    hyper_here = {k for g in optimizer.param_groups for k in g if k != "params"}
    missing = hyper_here - hyper_saved
    if hyper_saved and missing:
        return (
            f"checkpoint {checkpoint} holds no hyper-parameter {', '.join(sorted(missing))} of "
            f"this job's {here}: it was saved with another optimizer (its hyper-parameters: "
            f"{', '.join(sorted(hyper_saved))}){state}; {redo}; nothing was loaded"
        )
    ranks = saved.get("ranks") if isinstance(saved, Mapping) else None
    if isinstance(ranks, list) and len(ranks) == world and isinstance(ranks[rank], list):
        layout, mine = ranks[rank], _groups(optimizer)
        if [g.get("params") for g in layout] != [g["params"] for g in mine]:
            return (
                f"checkpoint {checkpoint}: its {saved.get('class', here)} had "
                f"{_describe(layout)}, this job's {here} has {_describe(mine)}: each group's "
                f"hyper-parameters would go to other parameters; {redo}; nothing was loaded"
            )
    return None


def missing_entries(
    optimizer_template: Mapping[str, Any], entries: Iterable[str], optimizer: Any, checkpoint: str
) -> str | None:
    """Why DCP would not find every entry of the load's optimizer template (materialised from
    this job's optimizer) in the checkpoint, or ``None``: the state of another optimizer (a
    checkpoint written before the layout was recorded, or an optimizer of the same class built
    with other options, e.g. SGD with and without momentum)."""
    saved = set(entries)
    missing = sorted(k for k in optimizer_template if k not in saved)
    if not missing:
        return None
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    theirs = _names(saved, "state.")
    state = ", ".join(sorted(theirs)) if theirs else "none"
    return (
        f"checkpoint {checkpoint} does not hold the optimizer state this job's "
        f"{optimizer_kind(optimizer)} needs ({shown}; the checkpoint's state: {state}): it was "
        "saved with another optimizer or other optimizer options; resume with the optimizer "
        "that was saved; nothing was loaded"
    )
