"""DistAMP: one object that runs mixed-precision training under any data-parallel strategy.

It owns the order of operations that is easy to get wrong by hand: wrap the model before the
optimizer exists (FSDP), scale before backward, divide by the accumulation count, suppress gradient
sync on all but the last micro-batch, unscale once before clipping, clip with the wrapper's own
method, step and update the scaler, and step the LR scheduler only when the optimizer really
stepped. This module owns that order (setup's steps, then autocast -> backward -> step); the
rest lives beside it: how the model arrives and is wrapped, the optimizer fitted to the wrapper
(:mod:`distamp.engine.wrapping`, over :mod:`distamp.parallel.strategies`), the numerics and
diagnostics instruments (:mod:`distamp.engine.instruments`), the process group's lifecycle
(:mod:`distamp.engine.lifecycle`), ``state_dict``/``save_state``/``load_state``
(:mod:`distamp.engine.persistence`, files in :mod:`distamp.engine.checkpoint`), counters in
:mod:`distamp.observe.metrics`, the accumulation cycle and skip reports in
:mod:`distamp.engine.accounting`, the run loop (:meth:`DistAMP.fit`) and the pipeline-schedule
entry points in :mod:`distamp.engine.loop`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.agreement.replicas import QuorumSchedule
from distamp.agreement.traffic import grad_traffic
from distamp.cluster import is_distributed, named_collective
from distamp.engine.accounting import MicroBatchCycle, SkipReports, release_grads
from distamp.engine.config import AMPConfig, make_config, make_scaler, training_device
from distamp.engine.guards import SpikeGuard, StepGuards
from distamp.engine.instruments import attach_tracer, build_adaptive, detach_instruments
from distamp.engine.lifecycle import join_group, leave_group
from distamp.engine.loop import RunLoop
from distamp.engine.persistence import EnginePersistence
from distamp.engine.setup_checks import OptimizerArg, SchedulerArg, check_setup, checked_scheduler
from distamp.engine.step_ownership import StepOwnership
from distamp.engine.weights import cast_weights, master_optimizer
from distamp.engine.wrapping import (
    connect_scaler,
    fit_optimizer,
    model_arrival,
    prepare_precision,
    wrap_model,
)
from distamp.model_names import model_name
from distamp.observe.diagnostics import NonFiniteTracer
from distamp.observe.metrics import Metrics, StepResult
from distamp.observe.numerics import NumericStats
from distamp.observe.run_settings import write_settings
from distamp.observe.telemetry import Telemetry
from distamp.optim import MasterWeightOptimizer, WeightPrecision
from distamp.optim.accounting import bytes_held
from distamp.parallel.strategies import gradient_sync_disabled
from distamp.parallel.unused_params import UnusedParameterCheck
from distamp.precision.adaptive_run import AdaptiveRun
from distamp.precision.fp8 import Float8Training
from distamp.precision.patterns import gather_modules
from distamp.precision.policy import (
    AutocastPolicy,
    MPOwner,
    Precision,
    PrecisionLike,
    select_mp_owner,
)
from distamp.scaler import DistributedGradScaler

__all__ = ["AMPConfig", "DistAMP", "StepResult"]


class DistAMP(EnginePersistence, RunLoop):
    """Mixed-precision training engine. The settings that must be identical on every rank are
    compared once, at :meth:`setup`.

    Args:
        precision: any spelling :func:`~distamp.precision.policy.parse_precision` accepts
            ("bf16", "fp16", "16-mixed", torch.float16...). fp16 gets a loss-scaling
            :class:`~distamp.DistributedGradScaler`; bf16 and fp32 a check-only one (non-finite
            steps still skipped on every rank); "fp8": the policy's selected Linear layers as
            torchao float8 layers, the rest bf16, check-only (:mod:`distamp.precision.fp8`).
        strategy: "ddp", "fsdp" (FSDP1), "fsdp2" (``fully_shard``), "hsdp" (FSDP2 sharded within
            groups of ``hsdp_shard_size`` ranks, replicated across them), "none", or "auto" (ddp
            when more than one rank, else none).
        policy: an :class:`~distamp.AutocastPolicy` (its precision must be ``precision``), or
            ``"default"`` for ``AutocastPolicy(precision)``: fp32 modules and ops, the same on CPU
            and CUDA; under FSDP also the per-unit gather/reduce dtypes. ``None``: plain autocast.
        comm_hook: gradient exchange aware of loss scaling (:mod:`~.parallel.comm_hooks`): for
            DDP "fp16", "bf16", "fp8", "fp8-ef", "powersgd" or "fp32" (DDP's all-reduce, counted);
            for FSDP2 "fp8"/"fp8-ef". ``None``: no hook, the wrapper's own uncompressed exchange
            (DDP's all-reduce, FSDP's reduce-scatter); ``grad_bytes`` then comes from the sizes.
        hsdp_shard_size: ranks per shard group for ``strategy="hsdp"`` (default: one node).
        mesh: the job's ``DeviceMesh`` when you parallelised the model yourself, torchtitan
            style (``parallelize_module`` for TP, ``fully_shard`` over dp, pipeline stages): the
            engine then wraps nothing and adds precision, scaling, clipping and checkpoints (the
            skip and the clipping norm agreed over the whole job). A model already parallelised
            (DDP, FSDP, DTensor parameters) is detected and left as it is even without ``mesh``.
        grad_accum_steps: micro-batches per optimizer step; each loss is divided by it.
        max_grad_norm: clip the total gradient norm to this after unscaling; ``None``: no clip.
        scaler: a scaler to use instead of the default one (e.g. ``sync_free=True``).
        timeout: seconds for the rendezvous when :meth:`setup` has to initialize the group.
        device: the training device; ``None``: this rank's CUDA device if any, else CPU.
        trace_nonfinite: forward hooks that find the first module whose output went inf/NaN
            (:mod:`distamp.observe.diagnostics`; ~4% of the main job's step on CPU).
        numerics_interval: run the numeric monitor (:mod:`distamp.observe.numerics`) with a report
            every this many steps, read by :meth:`numerics`; an adaptive policy runs it anyway.
        trust_ddp_sync: skip the skip-flag collective when DDP's all-reduce spans the job (it
            spread any inf); only if nothing edits one rank's gradients between backward and step.
        ft_manager: this replica group's ``torchft.Manager``: the model is wrapped in torchft's
            DDP across replicas (unless wrapped or sharded by you), the scaler agrees, votes and
            heals through it, and each step's quorum starts as its first forward enters
            :meth:`autocast` (do not call ``start_quorum``; :mod:`distamp.agreement.replicas`).
        ddp_kwargs: options for the ``DistributedDataParallel`` the engine builds (strategy
            "ddp", or "auto" on several ranks), e.g. ``{"find_unused_parameters": True}`` for a
            model whose forward skips parameters; the keys: ``distamp.parallel.ddp.DDP_KWARGS``.
        telemetry: a :class:`~distamp.Telemetry` that keeps every numeric-monitor report per
            rank (``DIR/telemetry/rank<r>.jsonl``, plus its writers), the monitor then running
            every ``telemetry.interval`` steps unless ``numerics_interval`` says otherwise; what
            ``distamp report DIR`` draws (:mod:`distamp.observe.telemetry`).
        spike_guard: a :class:`~distamp.SpikeGuard`: skip a step whose loss (or, with
            ``max_grad_norm``, gradient norm) lies far above the recent taken steps', on every
            rank alike; one small all-reduce and one host sync per step (see there).
        max_consecutive_skips: after this many skipped steps in a row (overflow and spike
            alike) raise :class:`~distamp.ConsecutiveSkipsError` on every rank, with the
            overflow report, instead of spinning at the scale's floor; ``None``: no limit. The
            count stays on the device and is read where the step reads anyway (a scheduler
            attached, the spike guard on), else every 8 steps, so the limit may be noticed up
            to 7 steps late and the step stays free of host syncs in between.
        weights: keep the parameters and gradients themselves 16-bit, with an exact master
            (:class:`~distamp.WeightPrecision`; or a master kind as a string: ``"exact"``,
            ``"sharded"``, ``"stochastic"``, ``"kahan"``): 14 bytes per parameter with AdamW
            instead of 16, down to 8; the weights are the compute dtype ("bf16", or "fp16" with
            loss scaling); the policy's fp32 modules keep fp32 weights; strategies "none",
            "ddp" and "fsdp2". Checkpoints hold the fp32 masters (they load into fp32 runs and
            back). ``None`` (default): fp32 weights, cast per op by autocast.

    Raises:
        ValueError: a bad setting; the message names the field and echoes the value.
        TypeError: a flag that is not a bool (``ddp_kwargs``' too), ``ddp_kwargs`` not a
            mapping, ``ft_manager`` not a ``torchft.Manager``.
    """

    # What the engine holds, set in __init__ and completed by setup().
    config: AMPConfig  # the validated settings
    strategy: str  # resolved at setup(): "none", "ddp", "fsdp", "fsdp2" or "hsdp"
    mp_owner: MPOwner  # who casts: "autocast", "fsdp" or "none" (policy.select_mp_owner)
    device: torch.device
    """The training device, resolved at :meth:`setup` (this rank's CUDA device if any, else the
    CPU, unless ``device=`` said): put each batch there."""
    scaler: DistributedGradScaler
    """The rank-agreed scaler, built at :meth:`setup`: loss scaling for fp16, check-only for
    bf16, fp32 and fp8 (a non-finite step is still skipped on every rank). Read it, e.g.
    ``amp.scaler.get_scale()`` or ``amp.scaler.skipped_steps``; the engine drives it."""
    scheduler: Any
    """The LR scheduler given to :meth:`setup` (``None`` without one). The engine steps it only
    after a real optimizer step, so a skipped step does not advance the learning rate; do not
    step it yourself."""
    metrics: Metrics  # on-device window counters, reduced at logging steps
    settings: dict[str, Any]
    """The settings every rank agreed on at :meth:`setup` (empty before): ``max_grad_norm``,
    the precision, the strategy, the scaler's... What the run records of itself: with
    ``telemetry`` they are written to ``DIR/settings.json`` for ``distamp report``, and a hand
    loop passes them to :class:`~distamp.MetricsRecorder`."""
    tracer: NonFiniteTracer | None  # forward non-finite tracing (trace_nonfinite=True)
    fp8: Float8Training | None  # torchao float8 layers and their FSDP2 weight scales
    adaptive: AdaptiveRun | None  # numeric monitor + adaptive precision (precision/adaptive_run.py)
    quorum: QuorumSchedule | None  # with ft_manager: when each step's torchft quorum starts
    comm_hook_state: Any  # the DDP comm hook's state, when one is registered
    unused: UnusedParameterCheck | None  # DDP: parameters the first backward gave no gradient
    step_count: int
    """Optimizer steps completed, skipped ones included: where :meth:`fit` starts from, and
    what :meth:`load_state` restores with the rest of the checkpoint."""
    cycle: MicroBatchCycle  # backward() calls since the last step(), and their call order
    skips: SkipReports  # skipped steps reported at logging steps; the scale-health warning
    guards: StepGuards  # the spike guard and the consecutive-skip limit (either may be off)
    ownership: StepOwnership  # steps of the optimizer or scheduler outside the engine: refused
    _model: nn.Module | None  # the wrapped model (None before setup and after close)
    _optimizer: torch.optim.Optimizer | None
    _owns_group: bool  # setup() created the process group, so close() destroys it

    def __init__(
        self,
        precision: PrecisionLike = "bf16",
        strategy: str = "auto",
        policy: AutocastPolicy | str | None = None,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        scaler: DistributedGradScaler | None = None,
        timeout: float | timedelta = 300.0,
        device: str | torch.device | None = None,
        trace_nonfinite: bool = False,
        comm_hook: str | None = None,
        hsdp_shard_size: int | None = None,
        mesh: Any = None,
        numerics_interval: int | None = None,
        trust_ddp_sync: bool = False,
        ft_manager: Any = None,
        ddp_kwargs: Mapping[str, Any] | None = None,
        telemetry: Telemetry | None = None,
        spike_guard: SpikeGuard | None = None,
        max_consecutive_skips: int | None = 100,
        weights: WeightPrecision | str | None = None,
    ) -> None:
        self.config = make_config(
            precision,
            policy=policy,
            timeout=timeout,
            device=device,
            strategy=strategy,
            comm_hook=comm_hook,
            hsdp_shard_size=hsdp_shard_size,
            mesh=mesh,
            grad_accum_steps=grad_accum_steps,
            max_grad_norm=max_grad_norm,
            scaler=scaler,
            trust_ddp_sync=trust_ddp_sync,
            ft_manager=ft_manager,
            trace_nonfinite=trace_nonfinite,
            numerics_interval=numerics_interval,
            ddp_kwargs=ddp_kwargs,
            telemetry=telemetry,
            spike_guard=spike_guard,
            max_consecutive_skips=max_consecutive_skips,
            weights=weights,
        )
        self.strategy, self.mp_owner, self.device = strategy, "none", torch.device("cpu")
        self.scaler = scaler if scaler is not None else DistributedGradScaler("cpu", enabled=False)
        self.scheduler, self.metrics, self.settings = None, Metrics(self.device), {}
        self.tracer, self.fp8, self.comm_hook_state, self.quorum = None, None, None, None
        self.adaptive, self.skips, self.unused = None, SkipReports(), None
        self.guards = StepGuards(self.config.spike_guard, self.config.max_consecutive_skips)
        self.step_count, self.cycle = 0, MicroBatchCycle(self.config.grad_accum_steps)
        self.ownership = StepOwnership()
        self._model, self._optimizer, self._owns_group = None, None, False

    @property
    def precision(self) -> Precision:
        return self.config.precision

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if is_distributed() else 1

    @property
    def model(self) -> nn.Module:
        """The wrapped model :meth:`setup` returned (DDP, FSDP or as given), for the forward;
        ``RuntimeError`` before setup and after :meth:`close`, which release it."""
        if self._model is None:
            raise RuntimeError("DistAMP: call setup(model, optimizer) first")
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer :meth:`setup` returned, over the wrapped model's parameters; the engine
        steps and zeroes it. ``RuntimeError`` before setup and after :meth:`close`."""
        if self._optimizer is None:
            raise RuntimeError("DistAMP: call setup(model, optimizer) first")
        return self._optimizer

    # ------------------------------------------------------------------ setup
    def setup(
        self, model: nn.Module | Any, optimizer: OptimizerArg, scheduler: SchedulerArg = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move ``model`` to the device, wrap it for the strategy, and build what depends on it.

        ``model`` may be already parallelised (DDP, FSDP, DTensor parameters; see ``mesh``), a
        ``torch.distributed.pipelining`` stage, whose module is then trained, or the list of
        stages this rank holds (interleaved and looped schedules: several per rank), trained as
        one ``nn.ModuleDict`` keyed ``"stage{stage_index}"`` (the global index, so checkpoint keys
        do not depend on which rank holds a stage). Drive the schedule with :meth:`pipeline_step`.

        The optimizer: one over this model's parameters, or a factory ``lambda params: ...``
        (built over the wrapped ones). FSDP replaces parameters, so a built one is *rebuilt* for
        "fsdp"/"fsdp2" (same class, groups matched by name, hyper-parameters; a warning): use
        the returned one; one that has stepped raises ``ValueError``. The scheduler (instance
        driving that optimizer, or factory ``lambda opt: ...``) ends up in :attr:`scheduler`.
        The engine steps both: an ``optimizer.step()`` outside it raises before anything is
        applied, and a scheduler stepped by hand is refused at the next engine call
        (:mod:`distamp.engine.step_ownership`).
        Then the ranks' settings are compared (one collective; see :mod:`distamp.engine.config`).

        Returns:
            ``(wrapped_model, optimizer)``.
        """
        if self._model is not None:
            raise RuntimeError("DistAMP.setup() was already called: use one DistAMP per model")
        self._owns_group = join_group(self.config.timeout)
        given = optimizer  # an instance stepped by hand is refused too, even once rebuilt
        cfg, ft = self.config, self.config.ft_manager
        self.device = training_device(cfg)
        # A stage or stages, a model already parallelised, torchft replicas: the strategy.
        arrival = model_arrival(model, cfg, self.world_size)
        model, stages, self.strategy = arrival.model, arrival.stages, arrival.strategy
        self.mp_owner = select_mp_owner(cfg.precision, self.strategy, self.device.type)
        # Before wrapping, whose collectives would hang or diverge on ranks built differently.
        self.settings = check_setup(cfg, self.strategy, self.device, model, optimizer, scheduler)
        if cfg.telemetry is not None:  # the report states the run's settings, never guesses
            write_settings(cfg.telemetry.directory, self.settings)
        names = {id(p): model_name(n, model) for n, p in model.named_parameters()}
        model = model.to(self.device)
        # 16-bit weights before any wrapper sees them (DDP's buckets take the parameters' dtype)
        low = (
            None
            if cfg.weights is None
            else cast_weights(
                model,
                cfg.weights,
                cfg.policy,
                parallelised=arrival.parallelised,
                optimizer=optimizer,
            )
        )
        job = gather_modules(model) if stages else None  # patterns match across the stages
        self.fp8 = prepare_precision(model, cfg, arrival=arrival, device=self.device, job=job)
        wrapped = wrap_model(
            model, cfg, strategy=self.strategy, device=self.device, mp_owner=self.mp_owner
        )
        optimizer = fit_optimizer(
            optimizer, cfg, names=names, wrapped=wrapped, strategy=self.strategy
        )
        if cfg.weights is not None and low is not None:  # the masters, cut to the shards
            optimizer = master_optimizer(optimizer, cfg.weights, low, wrapped, self.strategy)
        scheduler = checked_scheduler(scheduler, optimizer)
        self.scaler = (
            cfg.scaler
            if cfg.scaler is not None
            else make_scaler(self.device.type, cfg.precision.needs_scaler, ft)
        )
        if self.fp8 is not None:  # over the ranks whose decisions agree: one all-reduce a step
            self.fp8.after_wrap(
                wrapped, strategy=self.strategy, device=self.device, reducer=self.scaler.agreement
            )
        self.skips.arm(self.scaler.min_scale)  # its "at floor" warning
        self.comm_hook_state = connect_scaler(self.scaler, wrapped, stages, cfg)
        self.unused = UnusedParameterCheck.arm(wrapped)  # refused before the first step
        if cfg.trace_nonfinite:
            self.tracer = attach_tracer(model, self.scaler)  # the unwrapped model: its names
        self.adaptive = build_adaptive(
            model, cfg, scaler=self.scaler, step=self.step_count, job=job, stages=stages
        )
        rules = None if self.adaptive is None else self.adaptive.adaptive
        if rules is not None and isinstance(optimizer, MasterWeightOptimizer):
            rules.exact_weights = optimizer.exact_weight  # promoted islands read the masters
        self._model, self._optimizer, self.scheduler = wrapped, optimizer, scheduler
        self.ownership.arm(optimizer, given, scheduler)
        traffic = grad_traffic(wrapped, self.strategy, self.comm_hook_state, ft is not None)
        weights = "fp32" if cfg.weights is None else cfg.weights.short()
        # float8 runs aside: torchao's weight wrappers are counted by no storage of theirs
        memory = None if self.fp8 else lambda: bytes_held(wrapped.parameters(), optimizer)
        self.metrics = Metrics(self.device, traffic, memory=memory, weights=weights)
        self.quorum = None if ft is None else QuorumSchedule(ft)
        return wrapped, optimizer

    # ------------------------------------------------------------------ the step
    def autocast(self) -> AbstractContextManager[Any]:
        """The forward-pass context: ``torch.autocast`` on the model's device type with the
        compute dtype (fp16 included on CPU), or nothing when fp32 or when FSDP's policy casts.
        With a policy: the policy's context (autocast plus its fp32 ops), also under FSDP's
        casting, so that fp32 units and ops mix with low-precision ones. With ``ft_manager``,
        the first call of a step starts the step's torchft quorum."""
        self.cycle.require_setup("autocast", set_up=self._model is not None)
        if self.quorum is not None:
            self.quorum.begin()
        if self.config.policy is not None:
            return self.config.policy.autocast(
                self.device.type, enabled=self.precision.compute_dtype is not None
            )
        if self.mp_owner != "autocast":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.compute_dtype)

    @property
    def is_last_micro_step(self) -> bool:
        """Whether the next ``backward`` completes an accumulation cycle (then ``step`` is due)."""
        return self.cycle.is_last

    def accumulate(self) -> AbstractContextManager[None]:
        """Wrap forward and backward of one micro-batch: all but the last micro-batch of a cycle
        skip gradient communication (DDP/FSDP1 ``no_sync``, FSDP2's gradient sync flag)."""
        self.cycle.require_setup("accumulate", set_up=self._model is not None)
        if self.is_last_micro_step or self.strategy == "none":
            return nullcontext()
        return gradient_sync_disabled(self.model, first=self.cycle.first)

    def backward(self, loss: torch.Tensor, *, tokens: int = 0) -> None:
        """Scale ``loss``, divide it by ``grad_accum_steps`` and backpropagate. No host sync,
        except once under DDP: the first backward that synchronises checks that every parameter
        received a gradient (one small all-reduce; :mod:`distamp.parallel.unused_params`).

        Args:
            loss: this micro-batch's mean loss, as computed (unscaled, undivided).
            tokens: tokens in the micro-batch, for the throughput figure.

        Raises:
            ValueError: on every rank, before any optimizer step, when DDP (without
                ``find_unused_parameters`` or ``static_graph``) would wait for a parameter the
                forward did not use on some rank; names the parameters and the fix.
        """
        tokens = self.cycle.check_backward(loss, tokens, set_up=self._model is not None)
        self.ownership.check("backward")
        if self.quorum is not None:  # the forward ran outside autocast(): the quorum is due
            self.quorum.begin()
        self.metrics.record(loss, tokens)
        if self.tracer is not None:
            self.tracer.record_loss(loss)
        n = self.config.grad_accum_steps
        scaled = loss / n if n > 1 else loss
        watch = nullcontext() if self.unused is None else self.unused.watch(self.cycle.is_last)
        what = "backward (the wrapper's gradient all-reduce)"
        collective = named_collective(what, self.config.timeout)
        with collective, watch:
            self.scaler.scale(scaled).backward()
        self.cycle.backward_done()

    def step(self) -> StepResult:
        """Unscale, clip, step the optimizer (unless gradients are non-finite on any rank, or the
        spike guard finds a spike), update the scale, step the scheduler if the optimizer
        stepped, and zero the gradients.

        Host syncs: those of the scaler's ``step`` (none for fused optimizers or ``sync_free``),
        plus one to read the skip decision when a scheduler is attached (a Python scheduler cannot
        be stepped conditionally on device), plus one for the spike guard's decision when it is
        on; the consecutive-skip count is read with those, else every 8 steps (a sync-free loop
        that must never wait on the device passes ``max_consecutive_skips=None``).

        Raises:
            ConsecutiveSkipsError: ``max_consecutive_skips`` steps in a row were skipped.
        """
        opt, scaler, norm = self.optimizer, self.scaler, None
        self.cycle.check_step()
        self.ownership.check("step")
        # An adaptive run watches the scaler: it reads and decides inside the scaler's calls.
        with named_collective("step (overflow flag and norm agreement)", self.config.timeout):
            # 1. clip: unscale + overflow check + norm in one pass and the step's one
            #    collective; the clip factor is applied once (inside a fused optimizer's step)
            if self.config.max_grad_norm is not None:
                norm = scaler.clip_grad_norm_(opt, self.config.max_grad_norm)
            # 2. the spike guard: the step's loss agreed (one all-reduce) and read with the norm
            spike = self.guards.before_step(self.metrics.step_loss, norm, scaler, self.step_count)
            # 3. step, or skip on every rank alike; 4. update the scale. A spike skips the
            #    optimizer; the update still ends the scaler's iteration (not backed off unless
            #    the gradients also overflowed), after a measuring clip that reads the flags.
            if not spike:
                with self.ownership.engine_steps():  # the optimizer's step hook lets it pass
                    scaler.step(opt)
            elif norm is None:  # the flags read without dividing 16-bit gradients in place
                scaler.clip_grad_norm_(opt, math.inf)
            scaler.update()
            spike = spike and self.guards.confirm(scaler)  # an overflow as well: it wins
            # 5. fp8 under FSDP2: the next step's float8 weight scales, one all-reduce
            if self.fp8 is not None:
                self.fp8.after_step(self.model)
        result = StepResult.capture(scaler, norm, spike)
        # 6. the scheduler, only after a real optimizer step (host sync, see docstring)
        if self.scheduler is not None and result.stepped:
            self.scheduler.step()
            self.ownership.resync()
        # 7. next cycle: gradients released, metrics counted, the skip streak checked
        release_grads(opt)
        if self.quorum is not None:  # torchft: the next forward asks for the next quorum
            self.quorum.end()
        self.metrics.end_step(norm, scaler, spike)
        self.guards.after_step(scaler, decided=self.scheduler is not None)
        self.cycle.reset()
        self.step_count += 1
        return result

    def backward_and_step(self, loss: torch.Tensor, *, tokens: int = 0) -> StepResult | None:
        """``backward(loss)``, then ``step()`` if that completed an accumulation cycle: the
        :class:`StepResult`, or ``None`` after a micro-batch that did not step."""
        self.ownership.check("backward_and_step")
        self.backward(loss, tokens=tokens)
        return self.step() if self.cycle.complete else None

    # ------------------------------------------------------------------ reports and close
    def numerics(self) -> NumericStats | None:
        """The numeric monitor's latest agreed report (identical on every rank; no sync), or
        ``None`` before the first report or without a monitor."""
        return None if self.adaptive is None else self.adaptive.latest

    def close(self) -> None:
        """Finish the job cleanly on every rank (collective; idempotent; no training after).

        A barrier; model, optimizer and hooks released (DDP's reducer and group die now, in
        order, not at exit where gloo's threads can abort); the group destroyed if setup made it."""
        if is_distributed():
            dist.barrier()
        detach_instruments(self.scaler, self.tracer, self.adaptive)
        self.ownership.release()
        self._model = self._optimizer = self.scheduler = self.tracer = self.quorum = None
        self.comm_hook_state = self.unused = None
        if self.fp8 is not None:  # its weight scales hold the model's float8 layers
            self.fp8.scales = None
        self.scaler = DistributedGradScaler("cpu", enabled=False)  # it held group handles
        leave_group(owned=self._owns_group)  # the group destroyed only if setup made it
        self._owns_group = False
