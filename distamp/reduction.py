"""Rank-wide agreement on found_inf: choosing the group and reducing every flag in ONE collective.

The skip decision is only safe if every rank takes it from the same number. This module owns the
two questions behind that number: *which ranks* must agree (the default group, an explicit
``ProcessGroup``, or the ``DeviceMesh`` that FSDP2's DTensor parameters live on), and *how* their
flags are combined (packed into one tensor, reduced with MAX — never SUM, because fused optimizers
skip only when found_inf is exactly 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["FlagReducer", "GroupSpec", "resolve_group"]

GroupSpec = Any  # ProcessGroup | DeviceMesh | None; torch types kept loose for older releases


def _device_mesh_type() -> type | None:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return DeviceMesh


@dataclass(frozen=True)
class FlagReducer:
    """A resolved reduction target: zero, one or (for a partial N-D mesh) several groups.

    ``groups`` is empty when there is nothing to agree with (no process group, world of one).
    A partial N-D mesh is reduced dimension by dimension: MAX is associative, so the result is the
    mesh-wide maximum; it is the only case that costs more than one collective.
    """

    groups: tuple[Any, ...]
    backend: str | None

    @property
    def is_noop(self) -> bool:
        return not self.groups

    def device_for(self, preferred: torch.device) -> torch.device:
        """The device the packed flags must live on for this backend."""
        if self.backend == "nccl" and preferred.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return preferred

    @property
    def size(self) -> int:
        """How many ranks the reduction spans (1 for a no-op)."""
        n = 1
        for group in self.groups:
            n *= dist.get_world_size(group)
        return n

    def all_reduce_max_(self, flags: torch.Tensor) -> None:
        """MAX-reduce ``flags`` in place across the group (asynchronous on CUDA: no host sync)."""
        self.all_reduce_(flags, dist.ReduceOp.MAX)

    def all_reduce_(self, tensor: torch.Tensor, op: Any) -> None:
        """Reduce ``tensor`` in place with ``op`` (MAX or SUM), dimension by dimension of a mesh:
        both are associative, so the result is the reduction over every rank."""
        for group in self.groups:
            dist.all_reduce(tensor, op=op, group=group)


def _from_mesh(mesh: Any) -> FlagReducer:
    world = dist.get_world_size()
    if mesh.size() == 1:
        return FlagReducer((), None)
    if mesh.size() == world:
        # The mesh spans every rank: the default group reaches exactly the same ranks with one call.
        return FlagReducer((dist.group.WORLD,), dist.get_backend())
    if mesh.ndim == 1:
        group = mesh.get_group()
        return FlagReducer((group,), dist.get_backend(group))
    groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
    return FlagReducer(groups, dist.get_backend(groups[0]))


def resolve_group(process_group: GroupSpec, params: Iterable[torch.Tensor]) -> FlagReducer:
    """Pick the ranks whose flags must agree for an optimizer over ``params``.

    Args:
        process_group: the scaler's ``process_group`` argument: a ``ProcessGroup``, a
            ``DeviceMesh``, or ``None`` for automatic choice.
        params: the optimizer's parameters. Parameters (not gradients) are inspected because a rank
            with an empty shard has no gradient yet must choose the same group as its peers.

    Returns:
        A :class:`FlagReducer`. With ``process_group=None``: the mesh of FSDP2's DTensor
        parameters if there are any, else the default group; a no-op when torch.distributed is not
        initialized or the world has one rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return FlagReducer((), None)
    mesh_type = _device_mesh_type()
    if process_group is not None:
        if mesh_type is not None and isinstance(process_group, mesh_type):
            return _from_mesh(process_group)
        if dist.get_world_size(process_group) == 1:
            return FlagReducer((), None)
        return FlagReducer((process_group,), dist.get_backend(process_group))
    # DTensor parameters (FSDP2) carry their mesh.
    meshes = {id(m): m for p in params if (m := getattr(p, "device_mesh", None)) is not None}
    if len(meshes) == 1:
        return _from_mesh(next(iter(meshes.values())))
    # Several meshes (or none): the default group is a superset of all of them, hence correct.
    if dist.get_world_size() == 1:
        return FlagReducer((), None)
    return FlagReducer((dist.group.WORLD,), dist.get_backend())


def reduce_flags(
    reducer: FlagReducer,
    flags: Sequence[torch.Tensor],
    extra: torch.Tensor | None = None,
    extra_op: str = "max",
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Reduce several 0-dim float32 flags (and optionally one more number) in ONE collective.

    The flags are packed into one tensor in a fixed order (the caller's), so every rank issues the
    same collective with the same shape whatever devices or dtypes its gradients had. ``extra``
    (a clipping norm term) rides in the same tensor: with ``extra_op="sum"`` the whole pack is
    SUM-reduced and the flags are folded back to {0, 1} (a sum of flags is > 0 exactly when their
    maximum is 1), so flags and norm still cost one collective.

    Returns:
        One 0-dim float32 tensor per input flag, on that flag's device, holding the group maximum;
        and the reduced ``extra`` (or ``None``).
    """
    if extra_op not in ("max", "sum"):
        raise ValueError(f"extra_op must be 'max' or 'sum', got {extra_op!r}")
    if reducer.is_noop or (not flags and extra is None):
        return list(flags), extra
    home = flags[0].device if flags else extra.device  # type: ignore[union-attr]
    device = reducer.device_for(home)
    items = [*flags, *(() if extra is None else (extra,))]
    packed = torch.stack([t.to(device, dtype=torch.float32, non_blocking=True) for t in items])
    if extra is not None and extra_op == "sum":
        reducer.all_reduce_(packed, dist.ReduceOp.SUM)
        agreed = (packed[: len(flags)] > 0).float()
    else:
        reducer.all_reduce_max_(packed)
        agreed = packed[: len(flags)]
    out = [agreed[i].to(f.device, non_blocking=True) for i, f in enumerate(flags)]
    return out, (None if extra is None else packed[-1].to(extra.device, non_blocking=True))
