"""Replica groups that come and go: agreement and commit across a torchft ``Manager``'s quorum.

torchft (PyTorch's fault-tolerant training) runs several *replica groups*, each a complete copy of
the model (DDP or FSDP inside the group, over its own default process group). A ``Manager``
decides at every step which replicas take part (the quorum), all-reduces gradients across them,
and lets the optimizer step only when ``should_commit()`` says so; a replica that restarts is
healed from a healthy one with whatever state was registered with the manager.

A skip decision that must hold on every replica therefore needs three things the default process
group cannot give:

- **One agreed flag across the quorum.** The replicas share no default group: the flags travel
  through ``Manager.allreduce`` (MAX; a replica that is healing this step contributes zero and
  receives the quorum's answer). :class:`ManagerGroup` is that collective, one member of a
  :class:`~distamp.agreement.reduction.FlagReducer` after the replica group's own default group.
- **A commit vote on every replica, whatever the decision.** ``should_commit()`` waits for every
  replica; a replica that skips without voting leaves the others waiting until the timeout.
  :class:`ReplicaCommit` votes exactly once per iteration, on every rank, and turns a step torchft
  does not commit into a no-op that changes neither the weights nor the scale.
- **The scaler's state in what heals.** ``ReplicaCommit`` registers the scaler's ``state_dict``
  with the manager, so a restarted replica receives the scale, growth tracker, hysteresis and skip
  counters with the weights, and the gradients averaged across replicas share one scale.

torchft is imported by whoever builds the ``Manager``; this module only recognises one and never
imports torchft, so ``import distamp`` works without it. Wrapping a model in torchft's DDP is the
wrappers' job (:func:`distamp.parallel.strategies.wrap_replicas`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from distamp.agreement.reduction import ExternalGroup
from distamp.torch_compat import OptState
from distamp.versions import WINDOWS, check_version

__all__ = [
    "SUPPORTED_TORCHFT",
    "ManagerGroup",
    "QuorumSchedule",
    "ReplicaCommit",
    "StateOwner",
    "is_ft_ddp",
    "is_ft_manager",
    "unwrap_ft_optimizer",
]

SUPPORTED_TORCHFT = WINDOWS["torchft"]  # the releases this module was verified with
STATE_KEY = "distamp_scaler"  # the key of the scaler's state among the manager's state dicts


def is_ft_manager(obj: Any) -> bool:
    """Whether ``obj`` is a ``torchft.Manager`` (without importing torchft: a Manager exists only
    once the user imported it)."""
    module = sys.modules.get("torchft.manager")
    manager_type = getattr(module, "Manager", None)
    return isinstance(manager_type, type) and isinstance(obj, manager_type)


def is_ft_ddp(obj: Any) -> bool:
    """Whether ``obj`` is torchft's ``DistributedDataParallel`` (gradients averaged across the
    quorum's replicas by its Manager), recognised without importing torchft."""
    module = sys.modules.get("torchft.ddp")
    ddp_type = getattr(module, "DistributedDataParallel", None)
    return isinstance(ddp_type, type) and isinstance(obj, ddp_type)


def unwrap_ft_optimizer(optimizer: Any, manager: Any) -> Any:
    """The optimizer inside a ``torchft.optim.OptimizerWrapper`` of ``manager``; any other as it
    is. The wrapper's ``step()`` asks ``should_commit()`` and its ``zero_grad()`` starts a quorum:
    whoever already votes (the scaler) and starts quorums (the engine) steps the inner one, so
    that neither happens twice in one iteration."""
    inner = getattr(optimizer, "optim", None)
    if inner is not None and getattr(optimizer, "manager", None) is manager:
        return inner
    return optimizer


class QuorumSchedule:
    """When the engine asks torchft for a step's quorum: once per optimizer step, as the step's
    first forward begins (:meth:`begin`, called again by backward in case the forward ran
    outside the engine's autocast), never between steps.

    Between steps is where a replica dies most harmlessly: one that had already joined the next
    quorum would be waited for in the gradient all-reduce, where torchft 0.2's DDP hook fails on
    the survivors (an ``AssertionError`` in ``torchft/ddp.py``); one that had not is left out
    of the quorum once its heartbeat stops. Before the forward is also where torchft's
    synchronous quorum (``use_async_quorum=False``) must heal, so the forward sees the healed
    weights."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.due = True  # no quorum started for the coming step yet

    def begin(self) -> None:
        """Start the coming step's quorum, unless already started."""
        if self.due:
            self.due = False
            self.manager.start_quorum()

    def end(self) -> None:
        """The step is over (committed or not): the next forward starts the next quorum."""
        self.due = True


def check_torchft_version() -> str:
    """The installed torchft release, judged by :data:`SUPPORTED_TORCHFT`'s rule
    (:func:`distamp.versions.check_version`): ``ImportError`` naming the window if older or a
    known break, a warning if newer than verified."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchft")
    except PackageNotFoundError:  # a Manager exists: a source checkout without metadata, trust it
        return "unknown"
    return check_version("torchft", installed=found)


class ManagerGroup(ExternalGroup):
    """The replicas of a torchft quorum as one member of a reduction.

    MAX (skip flags) is reduced as MAX. SUM (a clipping sum of squares, which rides with the flags)
    is reduced as torchft's AVG: every participating replica holds the same averaged gradients, so
    the mean over the replicas is one replica's sum, and the element counts of
    :mod:`distamp.agreement.topology` stay those of the replica group. A replica that is healing
    this step contributes zeros (torchft zeroes its tensor) and receives the quorum's value.

    When the collective fails (a replica died in it), torchft records the error, the manager's
    ``should_commit()`` then returns False on this replica, and the tensor may hold garbage: it is
    set to 1 (skip) so that nothing downstream acts on a half-reduced value.
    """

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def all_reduce_(self, tensor: torch.Tensor, op: Any) -> None:
        from torch.distributed import ReduceOp

        reduce_op = ReduceOp.MAX if op == dist.ReduceOp.MAX else ReduceOp.AVG
        self.manager.allreduce(tensor, reduce_op=reduce_op).wait()
        if self.manager.errored() is not None:
            tensor.fill_(1.0)


class StateOwner(Protocol):
    """What :class:`ReplicaCommit` needs of the scaler (its public state API)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def get_scale(self) -> float: ...


@dataclass
class _Iteration:
    committed: bool | None = None  # None: not voted yet this iteration
    heal_factor: float | None = None  # old scale / healed scale, when healed mid-iteration
    stale: frozenset[int] = frozenset()  # ids of the records unscaled with the old scale


class ReplicaCommit:
    """torchft's commit protocol, run by the scaler on every replica (see module doc).

    Args:
        manager: the ``torchft.Manager`` of this replica group.
        owner: the scaler whose state heals with the weights; registered with the manager under
            ``"distamp_scaler"`` (one scaler per manager).
        records: the scaler's per-optimizer records of the current iteration
            (``id(optimizer)`` -> record with a ``stage``).
    """

    def __init__(
        self, manager: Any, owner: StateOwner, records: Callable[[], Mapping[int, Any]]
    ) -> None:
        check_torchft_version()
        self.manager = manager
        self._owner = owner
        self._records = records
        self._iteration = _Iteration()
        self._voting = False
        self.heals = 0  # how many times this replica received the scaler's state
        try:
            manager.register_state_dict_fn(STATE_KEY, self._load, owner.state_dict)
        except AssertionError:  # torchft's duplicate-key check
            raise ValueError(
                f"process_group={manager!r}: a scaler is already registered with this torchft "
                "Manager; use one DistributedGradScaler per Manager (several optimizers can "
                "share it)."
            ) from None

    def _load(self, state_dict: dict[str, Any]) -> None:
        """torchft's heal: load the healthy replica's scaler state. Mid-iteration (torchft's
        asynchronous quorum heals inside ``should_commit``, after this replica's unscale) the
        gradients were unscaled with the old scale: remember by how much, for :meth:`gate`."""
        before = self._owner.get_scale()
        self._owner.load_state_dict(state_dict)
        self.heals += 1
        if self._voting:
            self._iteration.heal_factor = before / self._owner.get_scale()

    @property
    def voted(self) -> bool:
        """Whether this iteration's commit vote already ran."""
        return self._iteration.committed is not None

    def _vote(self) -> bool:
        """Ask torchft whether this iteration commits (once per iteration, on every rank).

        The records already unscaled hold gradients divided by the scale of before a heal that
        arrives during the vote (torchft's asynchronous quorum heals inside ``should_commit``).
        """
        if self._iteration.committed is None:
            stale = frozenset(k for k, r in self._records().items() if r.stage is OptState.UNSCALED)
            self._voting = True
            try:
                committed = bool(self.manager.should_commit())
            finally:
                self._voting = False
            self._iteration.committed = committed
            self._iteration.stale = stale
        return bool(self._iteration.committed)

    def gate(self, optimizer: Any, found_inf: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The scaler's ``step()`` hook, after the agreed flag: vote on the commit (the first
        optimizer of the iteration does), correct gradients unscaled with a scale this replica
        held before healing, and skip an uncommitted step. Returns the flag to step with and the
        optimizer to step."""
        committed = self._vote()
        self._rescale_stale(id(optimizer), optimizer)
        if not committed:
            found_inf = torch.ones_like(found_inf)
        return found_inf, self.step_target(optimizer)

    def _rescale_stale(self, key: int, optimizer: Any) -> None:
        """Multiply gradients unscaled with the pre-heal scale by ``old / healed``, once."""
        it = self._iteration
        if it.heal_factor is None or key not in it.stale:
            return
        with torch.no_grad():  # once per heal: a plain loop is enough
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(it.heal_factor)
        it.stale = it.stale - {key}

    def end_iteration(self) -> bool:
        """The scaler's ``update()`` hook: vote if no ``step()`` did (every replica votes once
        per iteration), close the iteration, and return whether it committed."""
        committed = self._vote()
        self._iteration = _Iteration()
        return committed

    def step_target(self, optimizer: Any) -> Any:
        """The optimizer to step: a ``torchft.optim.OptimizerWrapper`` of this manager is
        unwrapped (its ``step()`` would ask ``should_commit()`` a second time)."""
        return unwrap_ft_optimizer(optimizer, self.manager)
