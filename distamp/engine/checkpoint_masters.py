"""A checkpoint of 16-bit weights holds their fp32 masters, in the model's own entries.

With ``DistAMP(weights=...)`` the model's parameters are 16-bit, but the truth is the master
(:mod:`distamp.optim`). A save writes each master where the parameter's entry would be, in fp32:
the checkpoint is the one an fp32-weight run writes, so it loads into an fp32 run, into any
weight precision, and into ``distamp export``, exactly. The optimizer's own ``"master"``
entries (what a loop of your own saves with ``optimizer.state_dict()``) are left out of it, not
written twice. A load reads the entries in fp32 and hands them to the masters, which round the
weights from them.

``master="sharded"``: a rank writes (and reads) the entries of the parameters whose master it
holds; after a load the 16-bit weights of the others are gathered from their owners.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from distamp.model_names import model_name
from distamp.optim import MasterWeightOptimizer
from distamp.optim.store import local_tensor, shaped_like

__all__ = ["apply_masters_", "masters_for_load", "masters_for_save"]

_MASTER = ".master"


def _entries(model: nn.Module, optimizer: MasterWeightOptimizer) -> list[tuple[str, nn.Parameter]]:
    """``(state-dict key, parameter)`` of every 16-bit parameter (model names: the wrappers'
    parts off, as DCP's keys have them)."""
    out = []
    for name, p in model.named_parameters():
        if p in optimizer.masters and optimizer.masters[p].kind != "fp32":
            out.append((model_name(name, model), p))
    return out


def masters_for_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, msd: dict[str, Any], osd: dict[str, Any]
) -> None:
    """Put the fp32 masters in ``msd`` (in place of the 16-bit weights; a sharded run's other
    ranks' entries out) and take the optimizer's ``"master"`` entries out of ``osd``."""
    if not isinstance(optimizer, MasterWeightOptimizer):
        return
    for key, p in _entries(model, optimizer):
        if not optimizer.holds_master(p):
            msd.pop(key, None)
            continue
        msd[key] = shaped_like(optimizer.masters[p].fp32().clone(), p)
    for key in [k for k in osd if k.startswith("state.") and k.endswith(_MASTER)]:
        del osd[key]


def masters_for_load(
    model: nn.Module, optimizer: torch.optim.Optimizer, msd: dict[str, Any], osd: dict[str, Any]
) -> dict[str, Any]:
    """Make ``msd``/``osd`` the templates a load reads into: fp32 tensors for the masters this
    rank holds (none for another rank's), no optimizer ``"master"`` entries. Returns what the
    templates left out of ``msd``, to be put back before the model's ``load_state_dict``."""
    if not isinstance(optimizer, MasterWeightOptimizer):
        return {}
    left_out = {}
    for key, p in _entries(model, optimizer):
        if not optimizer.holds_master(p):
            left_out[key] = msd.pop(key)
            continue
        msd[key] = shaped_like(torch.empty_like(local_tensor(p.detach()), dtype=torch.float32), p)
    for key in [k for k in osd if k.startswith("state.") and k.endswith(_MASTER)]:
        del osd[key]
    return left_out


def apply_masters_(model: nn.Module, optimizer: torch.optim.Optimizer, msd: dict[str, Any]) -> None:
    """After the load: the read fp32 entries become the masters (and the weights their
    rounding); a sharded run gathers the weights of the masters other ranks hold."""
    if not isinstance(optimizer, MasterWeightOptimizer):
        return
    with torch.no_grad():
        for key, p in _entries(model, optimizer):
            if optimizer.holds_master(p):
                optimizer.masters[p].load_(local_tensor(msd[key]).to(torch.float32))
    if optimizer.gather is not None:
        optimizer.gather.gather_()
