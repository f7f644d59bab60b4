"""One iteration's per-optimizer records, and how their flags become ONE agreed flag.

torch's GradScaler keeps a dict per optimizer whose keys appear along the way (``"stage"``,
``"found_inf_per_device"``); here each optimizer gets a typed :class:`OptimizerStep`, created on
first use by :class:`StepRecords` and dropped at ``update()``. :func:`agree_pending` packs the
local flags of every record still waiting into one tensor, reduces it in one collective
(:mod:`distamp.agreement.reduction`) and hands every record the same agreed flag.

:class:`StepAgreement` owns all of that bookkeeping for one scaler: the topology (who agrees,
who holds which elements), the cached gradient plans, this iteration's records and the count of
collectives. The scaler's state machine and the one-pass clip both drive it through its public
methods, so neither reaches into the other.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from distamp.agreement import reduction
from distamp.agreement.topology import Topology
from distamp.cluster.agreement import agree_settings
from distamp.observe.diagnostics import OverflowRecorder
from distamp.scaler.grad_groups import GradPlan, GradPlans, check_groups_
from distamp.scaler.master_dtypes import MasterRule
from distamp.torch_compat import OptState

__all__ = [
    "HostFlag",
    "OptimizerStep",
    "ScalerStateError",
    "StepAgreement",
    "StepRecords",
    "StepWatcher",
    "agree_pending",
    "reciprocal",
]


class ScalerStateError(RuntimeError, AssertionError):
    """A scaler method was called out of order.

    Subclasses ``AssertionError`` too, because torch's GradScaler raises that type for the same
    misuse (e.g. ``step()`` before ``scale()``) and drop-in code may catch it.
    """


@dataclass(eq=False)
class OptimizerStep:
    """One optimizer's progress through the current iteration (READY -> UNSCALED -> STEPPED).

    ``local_flags`` are this rank's non-finite flags, one per device, not yet agreed;
    ``found_inf`` is the rank-agreed flag once the step's one collective ran. ``grad_scale`` is
    what a fused optimizer must divide by after clipping (the clip divisor, times the scale when
    unscaling was deferred into its step). Subscripting with torch's keys (``"stage"``,
    ``"found_inf_per_device"``) works as on torch's per-optimizer dict, so code written against
    torch's scaler internals keeps working; reading ``found_inf_per_device`` returns the agreed
    flag, running the step's collective first if it has not run yet.
    """

    stage: OptState = OptState.READY
    local_flags: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    found_inf: torch.Tensor | None = None
    grad_scale: torch.Tensor | None = None
    clipped: bool = False
    ddp_covered: bool = False
    agree: Callable[[], Any] | None = None
    host_flag: HostFlag | None = None  # found_inf copied to the host (StepAgreement)

    @property
    def pending(self) -> bool:
        """Whether local flags wait for the collective."""
        return bool(self.local_flags) and self.found_inf is None

    @property
    def found_inf_per_device(self) -> dict[torch.device, torch.Tensor]:
        if self.pending and self.agree is not None:
            self.agree()  # the step's one collective, for every optimizer unscaled so far
        if self.found_inf is not None:
            return {self.found_inf.device: self.found_inf}
        return self.local_flags

    def __getitem__(self, key: str) -> Any:
        if key == "stage":
            return self.stage
        if key == "found_inf_per_device":
            return self.found_inf_per_device
        raise KeyError(key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "stage":
            self.stage = value
        elif key == "found_inf_per_device":
            self.local_flags, self.found_inf = dict(value), None
        else:
            raise KeyError(key)


class StepWatcher(Protocol):
    """Told where a step begins and ends, whoever drives the scaler (the engine, a framework
    plug-in or a hand-written loop): :class:`distamp.precision.adaptive_run.AdaptiveRun`
    reads gradient underflow before unscaling and runs its rules on the agreed report after
    ``update()``, so every way of training applies them at the same points."""

    def before_unscale(self) -> None:
        """Before the iteration's first gradient is read or unscaled (once an iteration)."""

    def after_update(self, skipped: torch.Tensor) -> None:
        """After ``update()`` ended the iteration; ``skipped``: its agreed 0-dim bool flag."""


class StepRecords(dict):  # type: ignore[type-arg]
    """``id(optimizer) -> OptimizerStep``, creating records on first access (as torch's
    defaultdict) that call their owner's :meth:`StepAgreement.reduce_pending` for the lazy
    agreement. The dict holds its owner weakly; each record's bound method is a cycle the
    collector frees."""

    def __init__(self, owner: StepAgreement) -> None:
        super().__init__()
        self._owner = weakref.ref(owner)
        self.started = False  # the watcher heard of this iteration's first gradient read

    def __missing__(self, key: int) -> OptimizerStep:
        owner = self._owner()
        record = OptimizerStep(agree=None if owner is None else owner.reduce_pending)
        self[key] = record
        return record


class HostFlag:
    """An agreed flag copied to pinned host memory as soon as it is agreed: reading it later
    waits for that copy only, not for the work queued after it (the optimizer's step). On the
    CPU it is the flag itself."""

    def __init__(self, flag: torch.Tensor) -> None:
        self.event: Any = None
        if flag.device.type != "cuda":
            self.host = flag
            return
        self.host = torch.empty((), dtype=flag.dtype, pin_memory=True)
        self.host.copy_(flag, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def read(self) -> bool:
        """The flag on the host (waits for its copy, no more)."""
        if self.event is not None:
            self.event.synchronize()  # host wait: until the flag's copy has landed
        return bool(self.host.item())


class StepAgreement:
    """One scaler's per-step bookkeeping and its single agreement across ranks.

    Owns the :class:`~distamp.agreement.topology.Topology` (the ranks that agree, the copies of
    each gradient element, what DDP already synchronised), the cached
    :class:`~distamp.scaler.grad_groups.GradPlan` of each optimizer, this iteration's
    :class:`StepRecords`, the device the flags are agreed on (``home``: the scale's device, set
    by the scaler when it creates the scale) and ``collectives_issued``. The scaler keeps torch's
    state machine; the one-pass clip (:mod:`distamp.scaler.clipping`) works through the same
    methods, so both see one set of records and issue one collective per step between them.

    Args:
        process_group: the ranks that must agree (see :class:`DistributedGradScaler`).
        host_decisions: copy each agreed flag to the host as it is agreed (:class:`HostFlag`):
            a scaler whose overflow flags are computed lazily reads the step's decision at
            ``update()`` from there (:meth:`skipped_on_host`).
    """

    def __init__(
        self, process_group: reduction.GroupSpec = None, host_decisions: bool = False
    ) -> None:
        self.topology = Topology(process_group)
        self.plans = GradPlans(
            MasterRule(names=self.topology.param_names, registered=self.topology.param_dtypes)
        )
        self.records = StepRecords(self)
        self.home: torch.device | None = None
        self.collectives_issued = 0  # how many found_inf collectives were issued
        # Statistics riding the step's one collective (the numeric monitor), or None.
        self.rider: reduction.Rider | None = None
        # Told where each step begins and ends (the adaptive run), or None.
        self.watcher: StepWatcher | None = None
        # The owner's settings, compared across the agreeing ranks once, before the first
        # collective: a scaler used without the engine has no other setup step to do it in.
        self.settings: Callable[[], Mapping[str, Any]] | None = None
        self.settings_agreed = False
        self.host_decisions = host_decisions

    def start_reading(self) -> None:
        """Before a gradient of this iteration is read or unscaled: the watcher's
        ``before_unscale``, once an iteration."""
        if not self.records.started:
            self.records.started = True
            if self.watcher is not None:
                self.watcher.before_unscale()

    def end_iteration(self, skipped: torch.Tensor) -> None:
        """``update()`` ended the iteration (``skipped``: its agreed flag): the watcher's
        ``after_update``."""
        if self.watcher is not None:
            self.watcher.after_update(skipped)

    def record(self, optimizer: torch.optim.Optimizer) -> OptimizerStep:
        """The optimizer's record for this iteration (created READY on first use)."""
        return self.records[id(optimizer)]  # type: ignore[no-any-return]

    def prepare(self, optimizer: torch.optim.Optimizer, record: OptimizerStep) -> GradPlan:
        """The optimizer's gradient plan for this step; notes in ``record`` whether DDP covers
        its parameters (then its flag needs no collective)."""
        plan = self.plans.for_optimizer(optimizer)
        record.ddp_covered = self.topology.synchronised_by_ddp(plan.params, plan.key)
        return plan

    def check_(
        self,
        optimizer: torch.optim.Optimizer,
        record: OptimizerStep,
        home: torch.device,
        inv_scale: torch.Tensor | None,
        *,
        allow_fp16: bool,
        recorder: OverflowRecorder | None,
    ) -> None:
        """Check the optimizer's gradients for inf/NaN and, with ``inv_scale``, unscale them in
        place, in one pass per group (:func:`~distamp.scaler.grad_groups.check_groups_`); the
        local flags (``home``'s among them) wait in ``record`` for the step's collective."""
        self.start_reading()
        plan = self.prepare(optimizer, record)
        found_inf = torch.zeros((), dtype=torch.float32, device=home)
        with torch.no_grad():
            groups = plan.groups(allow_fp16=allow_fp16, by_factor=inv_scale is not None)
            record.local_flags = check_groups_(groups, found_inf, inv_scale, recorder)
        record.found_inf = None

    def factored(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether some of the optimizer's gradients carry a backward-scale exponent."""
        return self.plans.for_optimizer(optimizer).factored

    def pending(self) -> list[OptimizerStep]:
        """The records whose local flags wait for the collective, in the order of first use."""
        return [r for r in self.records.values() if r.pending]

    def agreed_found_inf(self, device: torch.device) -> torch.Tensor | None:
        """The MAX of every record's agreed flag, on ``device``; ``None`` when no record has
        one (no optimizer was checked this iteration)."""
        flags = [r.found_inf for r in self.records.values() if r.found_inf is not None]
        if len(flags) <= 1:
            return flags[0] if flags else None
        return torch.stack([f.to(device) for f in flags]).amax()

    def copies(self, param: torch.Tensor) -> int:
        """How many ranks of the agreement group hold ``param``'s elements (for norm weights)."""
        return self.topology.copies(param)

    def reducer_for(self, records: Iterable[OptimizerStep]) -> reduction.FlagReducer:
        """The job's agreement group; a no-op when DDP already synchronised every optimizer
        (unless a rider's statistics must be agreed: DDP spreads infs, not statistics)."""
        if self.rider is None and all(r.ddp_covered for r in records):
            return reduction.FlagReducer((), None)
        return self.topology.agreement

    def reduce_pending(
        self,
        extra: torch.Tensor | None = None,
        extra_op: str = "max",
        reducer: reduction.FlagReducer | None = None,
    ) -> torch.Tensor | None:
        """Agree on every unreduced flag of this step (and ``extra``, a norm term) with ONE
        collective (:func:`agree_pending`) over ``reducer`` (default: :meth:`reducer_for` the
        pending records); return the reduced ``extra``. No host sync."""
        pending = self.pending()
        if not pending and extra is None:
            return None
        if reducer is None:
            reducer = self.reducer_for(pending)
        home = self.home
        if home is None:  # no scale yet (a disabled scaler never creates one)
            home = extra.device if extra is not None else torch.device("cpu")
        extra, extra_op, split = reduction.ride_along(self.rider, extra, extra_op)
        if not reducer.is_noop:
            if not self.settings_agreed:
                self.agree_settings(reducer)
            self.collectives_issued += len(reducer.groups)
        agreed = agree_pending(pending, reducer, home, extra, extra_op)
        if pending and self.host_decisions and pending[0].found_inf is not None:
            copy = HostFlag(pending[0].found_inf)  # one flag for all: see agree_pending
            for record in pending:
                record.host_flag = copy
        return split(agreed, reducer.size)  # type: ignore[no-any-return]

    def agree_settings(self, reducer: reduction.FlagReducer) -> None:
        """Once: compare :attr:`settings` over ``reducer``'s group, when it is one real process
        group (the default group, or one the user passed); a mismatch raises
        :class:`~distamp.cluster.SettingsMismatchError` on every rank of it. One collective,
        not counted in ``collectives_issued`` (the per-step count)."""
        self.settings_agreed = True
        group = reducer.groups[0] if len(reducer.groups) == 1 else None
        if self.settings is not None and isinstance(group, dist.ProcessGroup):
            agree_settings(self.settings(), what="DistributedGradScaler", group=group)

    def decision(self, found_inf: torch.Tensor) -> bool:
        """The iteration's agreed decision (``found_inf``: its flag) on the host: from the copies
        made as the flags were agreed (:meth:`skipped_on_host`), else read from ``found_inf``
        (on a device a host sync, which waits for the work queued after it)."""
        skipped = self.skipped_on_host()
        return bool(found_inf.item()) if skipped is None else skipped

    def skipped_on_host(self) -> bool | None:
        """This iteration's agreed decision read from :class:`HostFlag` copies (no wait for
        the optimizer's step), or ``None`` when some agreed flag has no copy."""
        agreed = [r for r in self.records.values() if r.found_inf is not None]
        if not agreed or any(r.host_flag is None for r in agreed):
            return None
        copies = {id(r.host_flag): r.host_flag for r in agreed}
        return any([c.read() for c in copies.values() if c is not None])

    def discard(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget the optimizer's record (a disabled scaler keeps no per-step state)."""
        self.records.pop(id(optimizer), None)

    def current_records(self) -> StepRecords:
        """This iteration's records (a new mapping every iteration: callers that outlive one
        iteration, such as the torchft commit vote, ask for it each time)."""
        return self.records

    def new_iteration(self) -> None:
        """Drop every record: the next use of an optimizer starts READY."""
        self.records = StepRecords(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Process groups, module hooks and cached plans do not survive pickling: a copy agrees
        # over the default group, re-resolved lazily, and keeps only its collective count.
        state = {"collectives_issued": self.collectives_issued}
        return (StepAgreement, (), {**state, "host_decisions": self.host_decisions})


def agree_pending(
    pending: list[OptimizerStep],
    reducer: reduction.FlagReducer,
    home: torch.device,
    extra: torch.Tensor | None = None,
    extra_op: str = "max",
) -> torch.Tensor | None:
    """Reduce the local flags of ``pending`` (and ``extra``, a norm term) in ONE collective over
    ``reducer``; every record gets the same agreed flag, on ``home``. Returns the reduced
    ``extra``.

    The order of records is the order in which the optimizers were unscaled, the same on every
    rank in SPMD code, so the packed tensor lines up across ranks.
    """
    local = []
    for record in pending:
        flags = [f.to(home, non_blocking=True) for f in record.local_flags.values()]
        local.append(flags[0] if len(flags) == 1 else torch.stack(flags).amax())
    agreed, extra = reduction.reduce_flags(reducer, local, extra, extra_op)
    if agreed:
        # Optimizers unscaled together are skipped together: whatever ran between unscale_ and
        # step (typically one clip_grad_norm_ over all parameters) mixed their gradients, so an
        # inf in one made the others' gradients rank-dependent (clip coefficient 0 on one rank).
        flag = agreed[0] if len(agreed) == 1 else torch.stack(agreed).amax()
        for record in pending:
            record.found_inf = flag
    return extra


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as fp32. FP32 division can be imprecise for some scales: the reciprocal is
    taken in FP64 (as torch does)."""
    return scale.double().reciprocal().float() if scale.device.type != "mps" else scale.reciprocal()
