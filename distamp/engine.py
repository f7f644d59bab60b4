"""DistAMP: one object that runs mixed-precision training under any data-parallel strategy.

It owns the order of operations that is easy to get wrong by hand: wrap the model before the
optimizer exists (FSDP), scale before backward, divide by the accumulation count, suppress gradient
sync on all but the last micro-batch, unscale once before clipping, clip with the wrapper's own
method, step and update the scaler, and step the LR scheduler only when the optimizer really
stepped. Wrapping lives in :mod:`distamp.strategies`, saving in :mod:`distamp.checkpoint`,
counters in :mod:`distamp.metrics`.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distamp.checkpoint import load_checkpoint, save_checkpoint
from distamp.cluster import init_distributed, is_distributed, named_collective
from distamp.diagnostics import NonFiniteTracer, ScaleHealth
from distamp.fp8 import Float8Training
from distamp.metrics import Metrics, StepResult, WindowStats
from distamp.policy import (
    AutocastPolicy,
    MPOwner,
    Precision,
    PrecisionLike,
    parse_precision,
    select_mp_owner,
)
from distamp.scaler import DistributedGradScaler
from distamp.strategies import (
    COMM_HOOKS,
    SHARDED,
    STRATEGIES,
    apply_strategy,
    gradient_sync_disabled,
    is_parallelised,
    rebuild_optimizer,
    register_comm_hook,
    resolve_strategy,
)
from distamp.topology import is_pipeline_stage

__all__ = ["AMPConfig", "DistAMP", "StepResult"]

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerArg = Any  # an LRScheduler-like object (has .step), a factory `opt -> scheduler`, or None


def make_scaler(device_type: str, enabled: bool) -> DistributedGradScaler:
    """The engine's default scaler: rank-consistent skips (see :mod:`distamp.scaler`). When the
    precision needs no loss scaling (bf16, fp32) it only checks: nothing is scaled, yet a step
    with an inf/NaN gradient (a NaN loss, a diverging batch) is skipped on every rank instead of
    writing NaN into the parameters. ``enabled=False`` is used only as a placeholder."""
    return DistributedGradScaler(device=device_type, check_only=not enabled)


@dataclass(frozen=True, kw_only=True)
class AMPConfig:
    """Validated settings of :class:`DistAMP` (see there for each field)."""

    precision: Precision
    strategy: str = "auto"
    policy: AutocastPolicy | None = None
    comm_hook: str | None = None
    hsdp_shard_size: int | None = None
    mesh: Any = None
    grad_accum_steps: int = 1
    max_grad_norm: float | None = None
    scaler: DistributedGradScaler | None = None
    timeout: float = 300.0
    device: torch.device | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.policy is not None:
            if not isinstance(self.policy, AutocastPolicy):
                raise ValueError(
                    f"policy={self.policy!r} must be a distamp.AutocastPolicy, 'default' or None"
                )
            if self.policy.precision != self.precision:
                raise ValueError(
                    f"policy={self.policy!r} is for {self.policy.precision}, but "
                    f"precision={self.precision.name!r}: pass the same precision to both"
                )
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={self.comm_hook!r} is not one of {COMM_HOOKS} or None")
        if self.comm_hook is not None and self.strategy not in ("auto", "ddp"):
            raise ValueError(
                f"comm_hook={self.comm_hook!r} with strategy={self.strategy!r}: comm hooks are "
                "DDP's; use strategy='ddp' (or 'auto') or comm_hook=None"
            )
        n = self.grad_accum_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"grad_accum_steps={n!r} must be an int >= 1")
        g = self.max_grad_norm
        if g is not None and (
            isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0
        ):
            raise ValueError(f"max_grad_norm={g!r} must be a finite number > 0, or None")
        if self.scaler is not None and not isinstance(self.scaler, DistributedGradScaler):
            raise ValueError(
                f"scaler={self.scaler!r} must be a distamp.DistributedGradScaler (or None): the "
                "engine reads its rank-agreed skip decision, which torch's scalers do not provide"
            )
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
        ):
            raise ValueError(f"timeout={self.timeout!r} must be a number of seconds > 0")
        h = self.hsdp_shard_size
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            # Checked here, not when the mesh is built: a bad value must fail before any rank
            # joins a process group, not inside DeviceMesh on some ranks.
            raise ValueError(f"hsdp_shard_size={h!r} must be an int >= 1, or None")
        if self.mesh is not None:
            from torch.distributed.device_mesh import DeviceMesh

            if not isinstance(self.mesh, DeviceMesh):
                raise ValueError(f"mesh={self.mesh!r} must be a torch DeviceMesh or None")
            if self.strategy not in ("auto", "none"):
                raise ValueError(
                    f"mesh= with strategy={self.strategy!r}: a mesh means you parallelised the "
                    "model yourself (parallelize_module, fully_shard, pipeline stages) and the "
                    "engine wraps nothing; use strategy='auto' or 'none'"
                )


class DistAMP:
    """Mixed-precision training engine.

    Args:
        precision: any spelling :func:`distamp.policy.parse_precision` accepts ("bf16", "fp16",
            "16-mixed", torch.float16...). fp16 gets a :class:`~distamp.DistributedGradScaler`;
            bf16 and fp32 need no loss scaling and get a check-only one (non-finite steps are
            still skipped on every rank). "fp8": the policy's selected Linear layers run as
            torchao float8 layers, the rest as bf16, check-only scaler (see :mod:`distamp.fp8`).
        strategy: "ddp", "fsdp" (FSDP1), "fsdp2" (``fully_shard``), "none", or "auto" (ddp when
            more than one rank, else none).
        policy: an :class:`~distamp.AutocastPolicy` (its precision must be ``precision``), or
            ``"default"`` for ``AutocastPolicy(precision)``: fp32 modules and ops, identical on
            CPU and CUDA; under FSDP also the per-unit gather/reduce dtypes. ``None``: plain
            autocast.
        comm_hook: DDP gradient compression aware of loss scaling: ``"fp16"``, ``"bf16"``,
            ``"powersgd"`` (see :mod:`distamp.strategies.comm_hooks`), or ``None``.
        hsdp_shard_size: ranks per shard group for ``strategy="hsdp"`` (default: one node).
        mesh: the job's ``DeviceMesh`` when you parallelised the model yourself, torchtitan
            style (``parallelize_module`` for TP, ``fully_shard`` over dp, pipeline stages): the
            engine then wraps nothing and adds precision, scaling, clipping and checkpoints.
            The skip and the clipping norm are agreed over the whole job whatever the mesh.
            A model that is already parallelised (DDP, FSDP, DTensor parameters) is detected and
            left as it is even without ``mesh``.
        grad_accum_steps: micro-batches per optimizer step; each loss is divided by it.
        max_grad_norm: clip the total gradient norm to this after unscaling; ``None``: no clip.
        scaler: a scaler to use instead of the default one (e.g. ``sync_free=True``).
        timeout: seconds for the rendezvous when :meth:`setup` has to initialize the group.
        device: the training device; ``None``: this rank's CUDA device if any, else CPU.
        trace_nonfinite: forward hooks that find the first module whose output went inf/NaN,
            for the overflow report (see :mod:`distamp.diagnostics`; costs one reduction per
            module output, ~4% of the main job's step on CPU).

    Raises:
        ValueError: a bad setting; the message names the field and echoes the value.
    """

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
    ) -> None:
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        parsed = parse_precision(precision)
        if policy == "default":
            policy = AutocastPolicy(parsed)
        elif isinstance(policy, str):
            raise ValueError(f"policy={policy!r}: pass an AutocastPolicy, 'default' or None")
        self.config = AMPConfig(
            precision=parsed,
            strategy=strategy,
            policy=policy,
            comm_hook=comm_hook,
            hsdp_shard_size=hsdp_shard_size,
            mesh=mesh,
            grad_accum_steps=grad_accum_steps,
            max_grad_norm=max_grad_norm,
            scaler=scaler,
            timeout=timeout,
            device=_parse_device(device),
        )
        self.step_count = 0
        self._micro = 0
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.scaler: DistributedGradScaler = (
            scaler if scaler is not None else DistributedGradScaler("cpu", enabled=False)
        )
        self.strategy = strategy
        self.mp_owner: MPOwner = "none"
        self.device = torch.device("cpu")
        self.metrics = Metrics(self.device)
        self._owns_group = False
        self.trace_nonfinite = bool(trace_nonfinite)
        self.tracer: NonFiniteTracer | None = None
        self._health = ScaleHealth()
        self._skips_seen = 0
        self.comm_hook_state: Any = None
        self.fp8: Float8Training | None = None

    @property
    def precision(self) -> Precision:
        return self.config.precision

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if is_distributed() else 1

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("DistAMP: call setup(model, optimizer) first")
        return self._model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            raise RuntimeError("DistAMP: call setup(model, optimizer) first")
        return self._optimizer

    # ------------------------------------------------------------------ setup
    def setup(
        self, model: nn.Module | Any, optimizer: OptimizerArg, scheduler: SchedulerArg = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move ``model`` to the device, wrap it for the strategy, and build what depends on it.

        ``model`` may be already parallelised (DDP, FSDP, DTensor parameters; see ``mesh``) or a
        ``torch.distributed.pipelining`` stage, whose module is then trained: drive its schedule
        with :meth:`pipeline_step`.

        Pass the optimizer as a factory (``lambda params: AdamW(params, lr=...)``) to have it built
        over the wrapped parameters. FSDP replaces the parameters, so an optimizer that was already
        built is *rebuilt* for "fsdp"/"fsdp2": same class, same parameter groups (matched by
        parameter name) and hyper-parameters, with a warning; use the returned one. One that has
        already stepped (it holds state) cannot be carried over and raises ``ValueError``. The
        scheduler may likewise be an instance or a factory ``lambda opt: ...``; an instance bound
        to an optimizer that had to be rebuilt raises ``ValueError``. The scheduler ends up in
        :attr:`scheduler`.

        Returns:
            ``(wrapped_model, optimizer)``.
        """
        if self._model is not None:
            raise RuntimeError("DistAMP.setup() was already called: use one DistAMP per model")
        if not is_distributed():
            init_distributed(timeout=self.config.timeout)  # a no-op for a single process
            self._owns_group = is_distributed()
        cfg = self.config
        self.device = cfg.device or (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        stage = None
        if is_pipeline_stage(model):  # a torch.distributed.pipelining stage: train its module
            stage, model = model, model.submod
        parallelised = cfg.mesh is not None or stage is not None or is_parallelised(model)
        self.strategy = resolve_strategy(cfg.strategy, self.world_size, parallelised=parallelised)
        self.mp_owner = select_mp_owner(cfg.precision, self.strategy, self.device.type)
        built = isinstance(optimizer, torch.optim.Optimizer)
        if built and self.strategy in SHARDED and hasattr(scheduler, "step"):
            raise ValueError(
                f"scheduler: strategy={self.strategy!r} must rebuild the optimizer you passed, "
                "so a scheduler bound to it would drive a stale one; pass factories instead: "
                f"`lambda params: ...` and `lambda opt: {type(scheduler).__name__}(opt, ...)`"
            )
        names = {id(p): n for n, p in model.named_parameters()}
        model = model.to(self.device)
        fsdp_dtype = cfg.precision.compute_dtype if self.mp_owner == "fsdp" else None
        if cfg.comm_hook is not None and self.strategy != "ddp":
            raise ValueError(
                f"comm_hook={cfg.comm_hook!r}: strategy resolved to {self.strategy!r}, which has "
                "no DDP comm hooks (one process resolves 'auto' to 'none'); use comm_hook=None"
            )
        if cfg.precision.float8_linears:  # before wrapping: FSDP2 must see the float8 weights
            policy = cfg.policy or AutocastPolicy(cfg.precision)
            self.fp8 = Float8Training.convert(
                model, policy, strategy=self.strategy, device=self.device
            )
        if cfg.policy is not None:
            cfg.policy.apply(model)  # before wrapping: the hooks stay on FSDP's units
        wrapped = apply_strategy(
            model,
            strategy=self.strategy,
            device=self.device,
            fsdp_dtype=fsdp_dtype,
            policy=cfg.policy if self.strategy in SHARDED else None,
            hsdp_shard_size=cfg.hsdp_shard_size,
        )
        if self.fp8 is not None:
            self.fp8.after_wrap(wrapped, strategy=self.strategy, device=self.device)
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = optimizer(list(wrapped.parameters()))
        elif self.strategy in SHARDED:
            optimizer = rebuild_optimizer(optimizer, names, wrapped, self.strategy)
        if scheduler is not None and not hasattr(scheduler, "step"):
            scheduler = scheduler(optimizer)
        self.scaler = (
            cfg.scaler
            if cfg.scaler is not None
            else make_scaler(self.device.type, cfg.precision.needs_scaler)
        )
        # Names for reports; DDP: no extra collective; FSDP1: which parameters are shards;
        # a pipeline stage: how many ranks run the same stage.
        self.scaler.register_module(wrapped if stage is None else stage)
        if cfg.comm_hook is not None:
            assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            self.comm_hook_state = register_comm_hook(wrapped, cfg.comm_hook, scaler=self.scaler)
        if self.trace_nonfinite:
            self.tracer = NonFiniteTracer(model)  # the unwrapped model: its module names
            self.scaler.attach_tracer(self.tracer)
        self._model, self._optimizer, self.scheduler = wrapped, optimizer, scheduler
        self.metrics = Metrics(self.device)
        return wrapped, optimizer

    # ------------------------------------------------------------------ the step
    def autocast(self) -> AbstractContextManager[Any]:
        """The forward-pass context: ``torch.autocast`` on the model's device type with the
        compute dtype (fp16 included on CPU), or nothing when fp32 or when FSDP's policy casts.
        With a policy: the policy's context (autocast plus its fp32 ops), also under FSDP's
        casting, so that fp32 units and ops mix with low-precision ones."""
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
        return self._micro + 1 >= self.config.grad_accum_steps

    def accumulate(self) -> AbstractContextManager[None]:
        """Wrap forward and backward of one micro-batch: all but the last micro-batch of a cycle
        skip gradient communication (DDP/FSDP1 ``no_sync``, FSDP2's gradient sync flag)."""
        if self.is_last_micro_step or self.strategy == "none":
            return nullcontext()
        return gradient_sync_disabled(self.model)

    def backward(self, loss: torch.Tensor, *, tokens: int = 0) -> None:
        """Scale ``loss``, divide it by ``grad_accum_steps`` and backpropagate. No host sync.

        Args:
            loss: this micro-batch's mean loss, as computed (unscaled, undivided).
            tokens: tokens in the micro-batch, for the throughput figure.
        """
        n = self.config.grad_accum_steps
        if self._micro >= n:
            raise RuntimeError(
                f"backward() called {self._micro + 1} times since the last step() with "
                f"grad_accum_steps={n}: call step() after every {n} backward() calls"
            )
        self.metrics.record(loss, tokens)
        if self.tracer is not None:
            self.tracer.record_loss(loss)
        scaled = loss / n if n > 1 else loss
        with named_collective("backward (the wrapper's gradient all-reduce)", self.config.timeout):
            self.scaler.scale(scaled).backward()
        self._micro += 1

    def step(self) -> StepResult:
        """Unscale, clip, step the optimizer (unless gradients are non-finite on any rank), update
        the scale, step the scheduler if the optimizer stepped, and zero the gradients.

        Host syncs: those of the scaler's ``step`` (none for fused optimizers or ``sync_free``),
        plus one to read the skip decision when a scheduler is attached (a Python scheduler cannot
        be stepped conditionally on device).
        """
        opt, scaler, n = self.optimizer, self.scaler, self.config.grad_accum_steps
        if self._micro != n:
            raise RuntimeError(
                f"step() after {self._micro} of grad_accum_steps={n} backward() calls: call "
                "backward() once per micro-batch, then step() once per cycle"
            )
        norm = None
        with named_collective("step (overflow flag and norm agreement)", self.config.timeout):
            if self.config.max_grad_norm is not None:
                # Unscale + overflow check + norm in one pass and one collective, clip factor
                # applied once (inside a fused optimizer's step).
                norm = scaler.clip_grad_norm_(opt, self.config.max_grad_norm)
            scaler.step(opt)
            scaler.update()
            if self.fp8 is not None:  # FSDP2 float8 all-gather: next step's weight scales
                self.fp8.after_step(self.model)
        result = StepResult.capture(scaler, norm)
        if self.scheduler is not None and result.stepped:  # host sync (see docstring)
            self.scheduler.step()
        opt.zero_grad(set_to_none=True)
        self.metrics.end_step(norm, scaler)
        self._micro = 0
        self.step_count += 1
        return result

    def backward_and_step(self, loss: torch.Tensor, *, tokens: int = 0) -> StepResult | None:
        """``backward(loss)``, then ``step()`` if that completed an accumulation cycle.

        Returns:
            The :class:`StepResult`, or ``None`` after a micro-batch that did not step.
        """
        self.backward(loss, tokens=tokens)
        return self.step() if self._micro == self.config.grad_accum_steps else None

    # ------------------------------------------------------------------ pipeline parallelism
    def scaled_loss_fn(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The ``loss_fn`` to build a ``torch.distributed.pipelining`` schedule with.

        Each micro-batch loss (on the last stage) is recorded for the metrics, unscaled, then
        multiplied by the loss scale, so the schedule's backward yields scaled gradients on every
        stage; the schedule keeps its own micro-batch averaging. Call on every rank (the scale
        is created on stages that compute no loss, so that they can step).
        """
        if self.config.grad_accum_steps != 1:
            raise ValueError(
                f"grad_accum_steps={self.config.grad_accum_steps}: under a pipeline schedule the "
                "schedule's micro-batches are the accumulation; use grad_accum_steps=1 and "
                "n_microbatches in the schedule"
            )

        def recorded(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(*args, **kwargs)
            self.metrics.record(loss)
            return loss

        return self.scaler.scaled_loss_fn(recorded)

    def pipeline_step(self, schedule: Any, *args: Any, **kwargs: Any) -> StepResult:
        """Run one pipeline-schedule iteration (forward and backward of every micro-batch, under
        this engine's autocast), then :meth:`step`: clip with the whole model's norm, step or
        skip on every stage alike, update the scale. ``args``/``kwargs`` go to
        ``schedule.step`` (inputs on the first stage, ``target=`` on the last).
        """
        if self._micro:
            raise RuntimeError(
                "pipeline_step() after backward(): a pipeline schedule runs its own backward"
            )
        with (
            self.autocast(),
            named_collective("pipeline schedule (stage send/recv)", self.config.timeout),
        ):
            schedule.step(*args, **kwargs)
        self._micro = self.config.grad_accum_steps
        return self.step()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The small, rank-identical state: step counter, scaler, scheduler (syncs: the scaler)."""
        sched = self.scheduler.state_dict() if self.scheduler is not None else None
        return {"step": self.step_count, "scaler": self.scaler.state_dict(), "scheduler": sched}

    def save_state(self, directory: str | Path, *, keep: int = 2) -> Path:
        """Save model, optimizer, scheduler, scaler, step counter and RNG streams atomically
        (see :mod:`distamp.checkpoint`). Collective: call on every rank."""
        if self._micro:
            raise RuntimeError(
                "save_state() in the middle of an accumulation cycle: call it after step()"
            )
        # A peer that stalls mid-save fails this rank with the save named, not a bare "recv".
        with named_collective("save_state (checkpoint write)", self.config.timeout):
            return save_checkpoint(
                directory,
                step=self.step_count,
                model=self.model,
                optimizer=self.optimizer,
                trainer_state=self.state_dict(),
                keep=keep,
            )

    def load_state(self, directory: str | Path) -> bool:
        """Load the latest checkpoint of ``directory``, if any. Collective: call on every rank.

        Returns:
            True if a checkpoint was loaded, False if the directory holds none.

        Raises:
            CheckpointError: a checkpoint file is truncated or corrupted (the message names it);
                the directory is left as it was, so the good checkpoints in it survive.
        """
        with named_collective("load_state (checkpoint read)", self.config.timeout):
            state = load_checkpoint(directory, model=self.model, optimizer=self.optimizer)
            if state is not None and self.fp8 is not None:
                self.fp8.after_step(self.model)  # the loaded weights' float8 scales
        if state is None:
            return False
        self.step_count = int(state["step"])
        if state["scaler"]:  # {} when it was saved disabled (bf16/fp32)
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        return True

    def _diagnose(self, stats: WindowStats) -> WindowStats:
        """At a logging step whose window skipped: the overflow report (collective; every rank
        takes this branch, the stats being identical) and, on rank 0, the scale-health warning."""
        if stats.skipped_steps == self._skips_seen or not self.scaler.is_enabled():
            self._health.check(skipped_in_a_row=0, scale=stats.loss_scale, report=None)
            return stats
        self._skips_seen = stats.skipped_steps
        report = self.scaler.overflow_report()
        if self.fp8 is not None:  # names the fp8 layers among the report's
            report = self.fp8.annotate(report)
        streak = self.scaler.skip_streak
        text = self._health.check(skipped_in_a_row=streak, scale=stats.loss_scale, report=report)
        if text is not None and (not is_distributed() or dist.get_rank() == 0):
            warnings.warn(text, RuntimeWarning, stacklevel=3)
        return replace(stats, overflow=None if report is None else report.one_line())

    def close(self) -> None:
        """Finish the job cleanly on every rank. Collective: call on every rank.

        A barrier first, so that no rank tears down its communication while a peer is still
        sending; then the wrapped model, optimizer and hooks are released, so that DDP's reducer
        and the process group it references are destroyed now, in order, rather than during
        interpreter shutdown (where gloo's threads can abort the process: "terminate called
        without an active exception"); then the process group is destroyed if :meth:`setup`
        created it. The engine cannot train after this. Idempotent.
        """
        if is_distributed():
            dist.barrier()
        if self.tracer is not None:
            self.tracer.remove()
            self.scaler.attach_tracer(None)
        self._model = self._optimizer = self.scheduler = self.tracer = None
        self.comm_hook_state = None
        self.scaler = DistributedGradScaler("cpu", enabled=False)  # it held group handles
        gc.collect()
        if self._owns_group and is_distributed():
            dist.destroy_process_group()
        self._owns_group = False

    # ------------------------------------------------------------------ the loop
    def fit(
        self,
        batch: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor],
        *,
        steps: int,
        tokens_per_batch: int = 0,
        log_interval: int = 10,
        on_log: Callable[[WindowStats], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        stop_requested: Callable[[], bool] | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval: int = 0,
    ) -> WindowStats | None:
        """Train from :attr:`step_count` up to ``steps`` optimizer steps.

        Args:
            batch: ``batch(k)`` returns this rank's micro-batch number ``k`` (counted over the
                whole run). An index rather than an iterator makes a resumed run draw exactly the
                batches an uninterrupted one would, with no loader state to save.
            loss_fn: ``loss_fn(model, batch)`` returns the mean loss; it runs under autocast.
            steps: the optimizer step to stop at.
            tokens_per_batch: tokens in one micro-batch, for the throughput figure.
            log_interval: collect metrics (one collective, a few host syncs) every this many
                steps and at the end.
            on_log: called on every rank with each collected window.
            on_step: called after every step with the step count (e.g. a progress bar).
            stop_requested: polled at each logging step (e.g. a signal flag); if it is true on
                any rank, every rank stops there, saves (with ``checkpoint_dir``) and returns.
            checkpoint_dir: where to save every ``checkpoint_interval`` steps and at the end.
            checkpoint_interval: steps between saves; 0: only at the end.

        Returns:
            The last collected window (``None`` if there was nothing to do).
        """
        n, stats, model = self.config.grad_accum_steps, None, self.model
        cfg_timeout = self.config.timeout
        saved_at = self.step_count  # a resumed run that has nothing left to do saves nothing
        while self.step_count < steps:
            for micro in range(n):
                with self.accumulate():
                    with self.autocast():
                        loss = loss_fn(model, batch(self.step_count * n + micro))
                    self.backward(loss, tokens=tokens_per_batch)
            self.step()
            done = self.step_count
            if on_step is not None:
                on_step(done)
            if done % log_interval == 0 or done == steps:
                stop = bool(stop_requested()) if stop_requested is not None else False
                with named_collective("metrics collection at a logging step", cfg_timeout):
                    stats = self._diagnose(
                        self.metrics.collect(step=done, scaler=self.scaler, stop=stop)
                    )
                if on_log is not None:
                    on_log(stats)
                if stats.stop:
                    break
            if (
                checkpoint_dir is not None
                and checkpoint_interval
                and done % checkpoint_interval == 0
            ):
                self.save_state(checkpoint_dir)
                saved_at = done
        if checkpoint_dir is not None and saved_at != self.step_count:
            self.save_state(checkpoint_dir)
        return stats


def _parse_device(device: str | torch.device | None) -> torch.device | None:
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None
