"""The job's layout, as the scaler and clipping need it: who must agree, and who holds what.

Two questions, asked every step, have one owner here:

- **Which ranks must agree on the skip.** By default *every rank of the job* (the default group):
  a pipeline stage that steps while another skips is a diverged model even though no gradient
  crosses between the stages, and the meshes the parameters live on (a stage's data-parallel
  sub-mesh, an expert mesh) say nothing about which other ranks hold the rest of the model. An
  explicit ``ProcessGroup`` or ``DeviceMesh`` narrows the agreement, which is right only for
  independent models trained side by side in one job.
- **How many ranks of that group hold each gradient element**, so that a sum of squares
  SUM-reduced over the group counts every element exactly once (each rank weights a gradient
  by ``1 / copies``). The answer comes from what holds the parameter:

  ============================== ============================================================
  DTensor (FSDP2, HSDP, TP, EP)  ranks of its mesh whose coordinates match this rank's on every
                                 non-``Replicate`` dimension (Shard, strided shard, Partial),
                                 counted inside the agreement group; ranks outside the mesh hold
                                 other parameters (other pipeline stages)
  DDP module (registered)        the ranks of DDP's process group
  FSDP1 module (registered)      this rank alone for sharded strategies; the replicate group
                                 for hybrid ones; the whole process group for ``NO_SHARD``
  pipeline stage (registered)    ``group size / pipeline size``: a stage's plain parameters are
                                 replicated over every rank that runs the same stage
  anything else                  every rank of the agreement group (replicated by construction)
  ============================== ============================================================

It also records, when asked to trust it (``trust_ddp_sync=True``), what a wrapper has already
synchronised: a DDP module whose group spans the agreement group has spread any inf/NaN through
its all-reduce, so its optimizer needs no flag collective at all. Not trusted by default: a
gradient changed on one rank after that all-reduce (user code between backward and step, a
corrupted value) would then go unseen by the other ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.agreement.reduction import FlagReducer, GroupSpec
from distamp.agreement.replicas import ManagerGroup, is_ft_manager
from distamp.arguments import integer_or_none
from distamp.cluster import is_distributed
from distamp.model_names import model_name
from distamp.torch_compat import fsdp1_replica_group, is_pipeline_stage

__all__ = [
    "Topology",
    "agreement_group",
    "check_group_spec",
    "grad_device",
    "is_dtensor",
    "is_distributed",  # re-exported from distamp.cluster, where it is defined
    "is_group_like",
    "local_grad",
    "optimizer_params",
]

_NOOP = FlagReducer((), None)


def optimizer_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter of every group of ``optimizer``, in order."""
    for group in optimizer.param_groups:
        yield from group["params"]


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2, TP, EP parameters): it carries placements and a mesh."""
    return getattr(t, "placements", None) is not None and hasattr(t, "device_mesh")


def local_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: the local shard of a DTensor, the tensor itself otherwise.

    Each rank checks and sums only what it holds; :class:`Topology` says how often the same
    elements occur on other ranks.
    """
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def grad_device(params: Iterable[torch.Tensor]) -> torch.device:
    """The device of the first local gradient among ``params`` (CPU when none has one)."""
    for p in params:
        if p.grad is not None:
            return local_grad(p.grad).device
    return torch.device("cpu")


def _device_mesh_type() -> type | None:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch builds without distributed
        return None
    return DeviceMesh


def _mesh_reducer(mesh: Any) -> FlagReducer:
    world = dist.get_world_size()
    if mesh.size() == 1:
        return _NOOP
    ranks = frozenset(int(r) for r in mesh.mesh.flatten().tolist())
    if mesh.size() == world:
        # The mesh spans every rank: the default group reaches the same ranks with one call.
        return FlagReducer((dist.group.WORLD,), dist.get_backend(), None)
    if mesh.ndim == 1:
        group = mesh.get_group()
        return FlagReducer((group,), dist.get_backend(group), ranks)
    # A partial N-D mesh, reduced dimension by dimension (MAX and SUM are associative).
    groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
    return FlagReducer(groups, dist.get_backend(groups[0]), ranks)


def agreement_group(process_group: GroupSpec) -> FlagReducer:
    """The ranks whose flags must agree, as a :class:`FlagReducer`.

    ``None``: the whole job (one collective over the default group); a no-op without a process
    group or with a world of one. A ``DeviceMesh`` or ``ProcessGroup``: those ranks only; an
    object that only behaves like a group: see :func:`_group_like_reducer`.
    """
    if not is_distributed():
        return _NOOP
    if process_group is None:
        if dist.get_world_size() == 1:
            return _NOOP
        return FlagReducer((dist.group.WORLD,), dist.get_backend(), None)
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(process_group, mesh_type):
        return _mesh_reducer(process_group)
    if not isinstance(process_group, dist.ProcessGroup):
        return _group_like_reducer(process_group)
    if dist.get_world_size(process_group) == 1:
        return _NOOP
    ranks = frozenset(dist.get_process_group_ranks(process_group))
    if len(ranks) == dist.get_world_size():
        return FlagReducer((process_group,), dist.get_backend(process_group), None)
    return FlagReducer((process_group,), dist.get_backend(process_group), ranks)


def is_group_like(obj: Any) -> bool:
    """Whether ``obj`` behaves like a torch process group: callable ``rank()`` and ``size()``.

    torch's scalers never check a group's type (``ShardedGradScaler`` hands whatever it is given
    to ``dist.all_reduce``, and torch's FSDP tests pass a stand-in class with just these
    methods), so neither does distamp: a real ``ProcessGroup`` qualifies, and so does a wrapper or
    a test double. What cannot be a group (a number, a string, a list) does not.
    """
    return callable(getattr(obj, "rank", None)) and callable(getattr(obj, "size", None))


def _group_like_size(group: Any) -> int:
    """The size of a process-group-like object, checked where the scaler is built: an int >= 1,
    and above 1 an ``allreduce`` to agree through (``TypeError`` otherwise)."""
    given = group.size()
    size = integer_or_none(given)
    if size is None or size < 1:
        raise TypeError(
            f"process_group={group!r}: size() returned {given!r}; a process group's size() is "
            "the number of its ranks, an int >= 1"
        )
    if size > 1 and not callable(getattr(group, "allreduce", None)):
        raise TypeError(
            f"process_group={group!r} ({type(group).__name__}) spans {size} ranks but has no "
            "allreduce() to agree over them: pass a torch.distributed ProcessGroup (e.g. from "
            "dist.new_group) or a DeviceMesh"
        )
    return size


def _group_like_reducer(group: Any) -> FlagReducer:
    """A process-group-like object torch.distributed does not know (see :func:`is_group_like`).

    Of size 1 it has no one to agree with: a no-op, as for a real group. Larger, it is used as
    ``ShardedGradScaler`` uses it, through ``dist.all_reduce(..., group=group)``, which calls its
    ``allreduce``; whatever that does (a test double may do nothing) is the agreement. Its global
    ranks are unknown, so a norm counts its parameters as replicated on each of its ranks.
    """
    size = _group_like_size(group)
    if size == 1:
        return _NOOP
    return FlagReducer((group,), None, None, span=size)


def check_group_spec(process_group: GroupSpec) -> None:
    """``TypeError`` unless ``process_group`` is one of the kinds the scaler can agree over."""
    if process_group is None or is_ft_manager(process_group):
        return
    mesh_type = _device_mesh_type()
    if isinstance(process_group, dist.ProcessGroup) or (
        mesh_type is not None and isinstance(process_group, mesh_type)
    ):
        return
    if is_group_like(process_group):
        _group_like_size(process_group)
        return
    raise TypeError(
        f"process_group={process_group!r} ({type(process_group).__name__}) is not supported: "
        "pass None (every rank of the job), a torch.distributed ProcessGroup (or an object with "
        "its rank() and size() methods), a DeviceMesh, or a torchft.Manager (fault-tolerant "
        "replica groups)."
    )


def _within(ranks: Iterable[int], agreeing: frozenset[int] | None) -> int:
    return sum(1 for r in ranks if agreeing is None or r in agreeing)


def _dtensor_copies(param: Any, agreeing: frozenset[int] | None) -> int:
    """Ranks of the agreement group holding the same local elements as this rank's shard."""
    mesh = param.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:  # not part of the mesh: this rank holds nothing of it
        return 1
    grid = mesh.mesh
    index: list[Any] = [
        slice(None) if placement.is_replicate() else coord[dim]
        for dim, placement in enumerate(param.placements)
    ]
    holders = grid[tuple(index)].flatten()
    if agreeing is None:  # every rank agrees: a count, no loop over (up to world-size) ranks
        return max(1, holders.numel())
    return max(1, _within(holders.tolist(), agreeing))


@dataclass
class _ForwardSync:
    """Whether the last forward of a registered DDP wrapper will all-reduce its gradients
    (not under ``no_sync()``, grad enabled): set by the wrapper's forward pre-hook."""

    synced: bool = False


class Topology:
    """Who must agree and how many copies of each gradient element exist (see module doc).

    Args:
        process_group: the scaler's ``process_group``: ``None`` (the whole job), a
            ``ProcessGroup`` or a ``DeviceMesh``.
    """

    def __init__(self, process_group: GroupSpec = None) -> None:
        check_group_spec(process_group)
        # A torchft Manager: the agreement spans this replica group's default group, then the
        # quorum's replicas through the manager (distamp.agreement.replicas).
        self.ft_manager: Any = process_group if is_ft_manager(process_group) else None
        self.process_group = None if self.ft_manager is not None else process_group
        self._agreement: FlagReducer | None = None
        # What registered wrappers tell: parameter id -> the ranks holding its elements (None:
        # every rank of the agreement group), or a divisor of the group size (pipeline stages).
        self._holders: dict[int, tuple[int, ...]] = {}
        self._stage_divisor: dict[int, int] = {}
        self._ddp_params: dict[int, tuple[int, ...]] = {}  # synced by DDP over these ranks
        self._ddp_forward = _ForwardSync()  # written by the DDP wrapper's forward pre-hook
        self._ddp_cover: dict[tuple[int, ...], bool] = {}  # parameter ids -> all DDP-synced
        self._copies: dict[int, int] = {}
        self.param_names: dict[int, str] = {}
        # Each registered parameter's dtype when it was registered (at setup): a parameter cast
        # to 16 bits since is told from one that was 16-bit by the user's choice.
        self.param_dtypes: dict[int, torch.dtype] = {}

    # ------------------------------------------------------------------ agreement
    @property
    def agreement(self) -> FlagReducer:
        """The reducer every flag and norm collective of a step goes through (resolved once)."""
        if self._agreement is None:
            reducer = agreement_group(self.process_group)
            if self.ft_manager is not None:
                across = ManagerGroup(self.ft_manager)
                reducer = FlagReducer((*reducer.groups, across), reducer.backend, reducer.ranks)
            self._agreement = reducer
        return self._agreement

    def reset(self) -> None:
        """Forget what was resolved against live process groups (after unpickling)."""
        self.process_group = None
        self.ft_manager = None
        self._agreement = None
        self._holders.clear()
        self._stage_divisor.clear()
        self._ddp_params.clear()
        self._ddp_forward.synced = False
        self._ddp_cover.clear()
        self._copies.clear()
        self.param_names.clear()
        self.param_dtypes.clear()

    # ------------------------------------------------------------------ registration
    def register_module(self, module: Any, *, trust_ddp_sync: bool = False) -> None:
        """Record what ``module`` says about its parameters (see :class:`DistributedGradScaler`'s
        ``register_module``); a DDP module's all-reduce is relied on only with
        ``trust_ddp_sync=True``."""
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.nn.parallel import DistributedDataParallel

        stage_group = None
        if is_pipeline_stage(module):
            stage_group = module.group
            module = module.submod
        if not isinstance(module, nn.Module):
            raise TypeError(
                "register_module() takes an nn.Module (DDP, FSDP, a plain module) or a "
                f"torch.distributed.pipelining stage, got {type(module).__name__}"
            )
        inner = module.module if isinstance(module, DistributedDataParallel) else module
        for name, p in inner.named_parameters():  # model names: the same under any wrapper
            self.param_names[id(p)] = model_name(name, inner)
            self.param_dtypes[id(p)] = p.dtype
        self._copies.clear()
        self._ddp_cover.clear()
        if stage_group is not None and is_distributed():
            size = dist.get_world_size(stage_group)
            self._stage_divisor.update((id(p), size) for p in inner.parameters())
        if isinstance(module, FullyShardedDataParallel):
            self._register_fsdp1(module)
        elif isinstance(module, DistributedDataParallel) and _is_c10d_group(module.process_group):
            # torchft's DDP holds a placeholder group (its all-reduce runs through the Manager):
            # only the names are recorded, its parameters count as replicated.
            self._register_ddp(module, inner, trust_ddp_sync)

    def _register_fsdp1(self, module: Any) -> None:
        from torch.distributed.fsdp import ShardingStrategy

        strategy = getattr(module, "sharding_strategy", ShardingStrategy.FULL_SHARD)
        replicas = fsdp1_replica_group(module)
        if strategy == ShardingStrategy.NO_SHARD:
            holders = tuple(dist.get_process_group_ranks(module.process_group))
        elif replicas is not None:
            holders = tuple(dist.get_process_group_ranks(replicas))
        else:
            holders = (dist.get_rank(),)
        self._holders.update((id(p), holders) for p in module.parameters())

    def _register_ddp(self, module: Any, inner: nn.Module, trust_ddp_sync: bool) -> None:
        ranks = tuple(dist.get_process_group_ranks(module.process_group))
        ignored = set(getattr(module, "parameters_to_ignore", ()))
        for n, p in inner.named_parameters():
            self._holders[id(p)] = ranks  # copies for norms: needed whether trusted or not
            if trust_ddp_sync and p.requires_grad and n not in ignored:
                self._ddp_params[id(p)] = ranks
        if not trust_ddp_sync:
            return
        flag = self._ddp_forward  # the hook holds the flag only, not the topology

        def _record_sync(mod: nn.Module, _args: Any) -> None:
            flag.synced = bool(
                getattr(mod, "require_backward_grad_sync", False) and torch.is_grad_enabled()
            )

        module.register_forward_pre_hook(_record_sync)

    # ------------------------------------------------------------------ questions
    def synchronised_by_ddp(self, params: Sequence[torch.Tensor], key: tuple[int, ...]) -> bool:
        """Whether DDP's last all-reduce already carried any inf/NaN of ``params`` to every rank
        of the agreement group (then the flags need no collective of their own).

        ``key`` is the parameters' identities (``GradPlan.key``); the static part of the
        answer is cached under it. Re-checked every step: a forward under ``no_sync()`` or a
        parameter DDP does not synchronise (or a DDP group narrower than the agreement, as
        inside a pipeline stage)
        means the flags are reduced as usual.
        """
        if not (self._ddp_forward.synced and self._ddp_params):
            return False
        covered = self._ddp_cover.get(key)
        if covered is None:  # what the wrappers synchronise changes only at registration
            reducer = self.agreement
            need = reducer.size
            covered = all(
                (ranks := self._ddp_params.get(id(p))) is not None
                and _within(ranks, reducer.ranks) >= need
                for p in params
            )
            self._ddp_cover[key] = covered
        return covered

    def copies(self, param: torch.Tensor) -> int:
        """How many ranks of the agreement group hold ``param``'s local gradient elements
        (1 when no collective runs). Cached per parameter."""
        key = id(param)
        n = self._copies.get(key)
        if n is None:
            n = self._count(param)
            self._copies[key] = n
        return n

    def _count(self, param: torch.Tensor) -> int:
        reducer = self.agreement
        if reducer.is_noop:
            return 1
        if reducer.span is not None:  # a group-like object: its ranks cannot be told apart
            return reducer.span
        agreeing = reducer.ranks
        if is_dtensor(param):
            return _dtensor_copies(param, agreeing)
        holders = self._holders.get(id(param))
        if holders is not None:
            return max(1, _within(holders, agreeing))
        size = reducer.size
        divisor = self._stage_divisor.get(id(param), 1)
        return max(1, size // divisor)


def _is_c10d_group(group: Any) -> bool:
    """Whether ``group`` is a process group torch.distributed knows (has ranks to ask for)."""
    try:
        dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return False
    return True
