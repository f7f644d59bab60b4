"""Rank-wide agreement on found_inf: every flag of a step (and a norm term) in ONE collective.

The skip decision is only safe if every rank takes it from the same number. *Which* ranks must
agree is :mod:`distamp.agreement.topology`'s question; this module owns *how* their flags are
combined:
packed into one tensor in a fixed order, reduced with MAX — never SUM, because fused optimizers
skip only when found_inf is exactly 1 — or, when a norm term rides along, SUM-reduced and folded
back to {0, 1}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["ExternalGroup", "FlagReducer", "GroupSpec", "Rider", "reduce_flags", "ride_along"]

GroupSpec = Any  # ProcessGroup (or alike) | DeviceMesh | torchft Manager | None; kept loose


class ExternalGroup:
    """A set of ranks reached by something other than a ``torch.distributed`` group (the replicas
    of a torchft quorum, :mod:`distamp.agreement.replicas`): it reduces a tensor in place itself.
    Its ranks hold replicas of what the groups before it hold, so they add no element copies."""

    def all_reduce_(self, tensor: torch.Tensor, op: Any) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class FlagReducer:
    """A resolved reduction target: zero, one or (for a partial N-D mesh) several groups.

    ``groups`` is empty when there is nothing to agree with (no process group, world of one).
    A partial N-D mesh is reduced dimension by dimension: MAX is associative, so the result is the
    mesh-wide maximum; it is the only case that costs more than one collective. ``ranks`` are the
    global ranks reached, ``None`` meaning every rank of the job. ``span`` is how many ranks a
    group reaches whose global ranks ``torch.distributed`` cannot name (an object that only
    behaves like a process group, as torch's own FSDP tests pass one); ``None`` otherwise.
    """

    groups: tuple[Any, ...]
    backend: str | None
    ranks: frozenset[int] | None = None
    span: int | None = None

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
        if self.is_noop:
            return 1
        if self.span is not None:
            return self.span
        if self.ranks is not None:
            return len(self.ranks)
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def all_reduce_max_(self, flags: torch.Tensor) -> None:
        """MAX-reduce ``flags`` in place across the group (asynchronous on CUDA: no host sync)."""
        self.all_reduce_(flags, dist.ReduceOp.MAX)

    def all_reduce_(self, tensor: torch.Tensor, op: Any) -> None:
        """Reduce ``tensor`` in place with ``op`` (MAX or SUM), dimension by dimension of a mesh:
        both are associative, so the result is the reduction over every rank."""
        for group in self.groups:
            if isinstance(group, ExternalGroup):
                group.all_reduce_(tensor, op)
            else:
                dist.all_reduce(tensor, op=op, group=group)


def reduce_flags(
    reducer: FlagReducer,
    flags: Sequence[torch.Tensor],
    extra: torch.Tensor | None = None,
    extra_op: str = "max",
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Reduce several 0-dim float32 flags (and optionally one more tensor) in ONE collective.

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
    # A 1-D extra (numeric statistics riding along, see distamp.observe.numerics) is flattened
    # into the same pack: still one collective.
    packed = torch.cat(
        [t.to(device, dtype=torch.float32, non_blocking=True).reshape(-1) for t in items]
    )
    if extra is not None and extra_op == "sum":
        reducer.all_reduce_(packed, dist.ReduceOp.SUM)
        agreed = (packed[: len(flags)] > 0).float()
    else:
        reducer.all_reduce_max_(packed)
        agreed = packed[: len(flags)]
    out = [agreed[i].to(f.device, non_blocking=True) for i, f in enumerate(flags)]
    if extra is None:
        return out, None
    rest = packed[len(flags) :].reshape(extra.shape)
    return out, rest.to(extra.device, non_blocking=True)


class Rider(Protocol):
    """Statistics that travel in the step's one flag collective instead of a collective of
    their own (:class:`distamp.observe.numerics.NumericMonitor`)."""

    def payload(self) -> torch.Tensor | None:
        """This step's local 1-D float32 statistics, or ``None`` (nothing due, or already sent)."""

    def deliver(self, reduced: torch.Tensor, op: str, ranks: int) -> None:
        """The payload reduced with ``op`` ("max" or "sum") over ``ranks`` ranks."""


def ride_along(
    rider: Rider | None, extra: torch.Tensor | None, extra_op: str
) -> tuple[torch.Tensor | None, str, Any]:
    """Append ``rider``'s payload to the step's ``extra`` (a 0-dim norm term or ``None``).

    Returns the combined extra, its op, and a function that takes the reduced combined extra,
    hands the rider its part, and returns the caller's part (``None`` when it had none).
    """
    payload = rider.payload() if rider is not None else None
    if payload is None or rider is None:
        return extra, extra_op, lambda reduced, _ranks: reduced
    head = 0 if extra is None else 1
    parts = [payload] if extra is None else [extra.reshape(1).to(payload.device), payload]
    combined = torch.cat(parts)

    def split(reduced: torch.Tensor | None, ranks: int) -> torch.Tensor | None:
        if reduced is None:  # nothing to agree with: the local numbers are the job's
            reduced = combined
        rider.deliver(reduced[head:], extra_op, ranks)
        return None if extra is None else reduced[0].reshape(extra.shape)

    return combined, extra_op, split
