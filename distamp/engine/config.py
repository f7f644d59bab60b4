"""The engine's settings, validated before anything is built: :class:`AMPConfig`.

Every bad value is rejected when ``DistAMP(...)`` is constructed, with a ``ValueError`` naming
the field, so that no rank discovers a typo after it joined a process group. Numbers are
accepted as the scaler accepts them (:func:`distamp.scaler.config.as_real`/``as_integer``): any
``numbers.Real``/``numbers.Integral``, numpy scalars and 0-d tensors included, ``bool`` refused,
and kept as plain Python numbers.

============================  ===========================================
field                         accepted
============================  ===========================================
``grad_accum_steps``          integer in [1, 2**31 - 1]
``max_grad_norm``             None, or a finite real > 0
``timeout``                   finite real > 0 seconds, at most 2**31 - 1 (or a ``timedelta``)
``hsdp_shard_size``           None, or an integer in [1, 2**31 - 1]
``ft_manager``                None, or a ``torchft.Manager`` (else ``TypeError``)
``ddp_kwargs``                None, or :data:`~distamp.parallel.ddp.DDP_KWARGS` (a mapping)
============================  ===========================================

With ``ft_manager`` the engine wraps the model in torchft's DDP across replica groups and agrees
through the Manager, so what cannot combine with that is refused (``ValueError``): a sharded
``strategy`` (shard inside a replica group yourself, then pass the model), a ``comm_hook``
(torchft's DDP owns the gradient all-reduce), ``trust_ddp_sync=True`` (the flag must cross the
replicas through the Manager), ``ddp_kwargs`` (torchft's DDP takes none) and a ``scaler`` built
over anything but that Manager.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from distamp.agreement.replicas import is_ft_ddp, is_ft_manager
from distamp.arguments import INT32_MAX, ArgumentTypeError, as_integer, as_real
from distamp.cluster import agree_settings, is_distributed
from distamp.parallel.ddp import check_sparse_gradients, ddp_options
from distamp.parallel.strategies import COMM_HOOKS, SHARDED, STRATEGIES
from distamp.precision.describe import describe_policy
from distamp.precision.policy import AutocastPolicy, Precision, PrecisionLike, parse_precision
from distamp.precision.requirements import check_parameter_dtypes, check_policy_precision
from distamp.scaler import DistributedGradScaler

__all__ = [
    "AMPConfig",
    "OptimizerArg",
    "SchedulerArg",
    "built_optimizer",
    "check_ft_setup",
    "check_model",
    "check_optimizer",
    "check_scaler",
    "check_setup",
    "checked_scheduler",
    "engine_settings",
    "make_config",
    "make_scaler",
    "parse_device",
    "training_device",
]

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerArg = Any  # an LRScheduler-like object (has .step), a factory `opt -> scheduler`, or None


def make_scaler(device_type: str, enabled: bool, ft_manager: Any = None) -> DistributedGradScaler:
    """The engine's default scaler: rank-consistent skips (see :mod:`distamp.scaler`). When the
    precision needs no loss scaling (bf16, fp32) it only checks: nothing is scaled, yet a step
    with an inf/NaN gradient (a NaN loss, a diverging batch) is skipped on every rank instead of
    writing NaN into the parameters. ``enabled=False`` is used only as a placeholder. With a
    torchft ``ft_manager`` it agrees, votes and heals through it."""
    return DistributedGradScaler(
        device=device_type, check_only=not enabled, process_group=ft_manager
    )


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
    trust_ddp_sync: bool = False
    ft_manager: Any = None
    trace_nonfinite: bool = False
    numerics_interval: int | None = None
    ddp_kwargs: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for flag in ("trust_ddp_sync", "trace_nonfinite"):
            if not isinstance(getattr(self, flag), bool):  # "no" would read as True
                raise ArgumentTypeError(
                    f"{flag}={getattr(self, flag)!r} must be a bool (True or False)"
                )
        if self.numerics_interval is not None:
            k = _integer("numerics_interval", self.numerics_interval)
            if not 1 <= k <= INT32_MAX:
                raise ValueError(f"numerics_interval={k!r} must be an int in [1, {INT32_MAX}]")
            object.__setattr__(self, "numerics_interval", k)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} is not one of {STRATEGIES}")
        if self.policy is not None:
            if not isinstance(self.policy, AutocastPolicy):
                raise ValueError(
                    f"policy={self.policy!r} must be a distamp.AutocastPolicy, 'default' or None"
                )
            given = f"precision={self.precision.name!r}"
            check_policy_precision(self.policy, self.precision, given=given)
        if self.comm_hook is not None and self.comm_hook not in COMM_HOOKS:
            raise ValueError(f"comm_hook={self.comm_hook!r} is not one of {COMM_HOOKS} or None")
        fsdp2_ok = self.comm_hook in ("fp8", "fp8-ef") and self.strategy == "fsdp2"
        if self.comm_hook is not None and self.strategy not in ("auto", "ddp") and not fsdp2_ok:
            raise ValueError(
                f"comm_hook={self.comm_hook!r} with strategy={self.strategy!r}: comm hooks are "
                "DDP's ('fp8' and 'fp8-ef' also FSDP2's); use strategy='ddp' (or 'auto') or "
                "comm_hook=None"
            )
        n = _integer("grad_accum_steps", self.grad_accum_steps)
        if not 1 <= n <= INT32_MAX:
            raise ValueError(f"grad_accum_steps={n!r} must be an int in [1, {INT32_MAX}]")
        object.__setattr__(self, "grad_accum_steps", n)  # a plain int whatever was passed
        g = self.max_grad_norm
        if g is not None:
            g = _real("max_grad_norm", g)
            if g <= 0:
                raise ValueError(f"max_grad_norm={g!r} must be a finite number > 0, or None")
            object.__setattr__(self, "max_grad_norm", g)
        if self.scaler is not None and not isinstance(self.scaler, DistributedGradScaler):
            raise ValueError(
                f"scaler={self.scaler!r} must be a distamp.DistributedGradScaler (or None): the "
                "engine reads its rank-agreed skip decision, which torch's scalers do not provide"
            )
        t = _real("timeout", self.timeout)
        # Bounded (68 years) so that timedelta, the store and the rendezvous watchdog all hold it.
        if not 0 < t <= INT32_MAX:
            raise ValueError(f"timeout={t!r} must be a number of seconds in (0, {INT32_MAX}]")
        object.__setattr__(self, "timeout", t)
        h = self.hsdp_shard_size
        # Checked here, not when the mesh is built: a bad value must fail before any rank joins
        # a process group, not inside DeviceMesh on some ranks.
        if h is not None:
            h = _integer("hsdp_shard_size", h)
            if not 1 <= h <= INT32_MAX:
                raise ValueError(
                    f"hsdp_shard_size={h!r} must be an int in [1, {INT32_MAX}], or None"
                )
            object.__setattr__(self, "hsdp_shard_size", h)
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
        if self.ft_manager is not None:
            self._check_ft_manager()
        if self.ddp_kwargs is not None:
            object.__setattr__(self, "ddp_kwargs", self._checked_ddp_kwargs(self.ddp_kwargs))

    def _checked_ddp_kwargs(self, given: Any) -> dict[str, Any] | None:
        """``ddp_kwargs`` checked (:func:`~distamp.parallel.ddp.ddp_options`), then refused
        where the engine builds no ``DistributedDataParallel`` to pass them to."""
        options = ddp_options(given)
        if not options:  # nothing to pass on: as None, whatever the strategy
            return None
        why = None
        if self.strategy not in ("auto", "ddp"):
            why = f"strategy={self.strategy!r} builds none: use strategy='ddp' (or 'auto')"
        elif self.mesh is not None:
            why = "with mesh= you parallelised the model and it wraps nothing: set them on your DDP"
        elif self.ft_manager is not None:
            why = "with ft_manager it builds torchft's DDP, which takes none of them"
        if why is not None:
            raise ValueError(
                f"ddp_kwargs={options!r}: options of the DistributedDataParallel the engine "
                f"builds, but {why}, or drop ddp_kwargs"
            )
        return options

    def _check_ft_manager(self) -> None:
        m = self.ft_manager
        if not is_ft_manager(m):
            raise TypeError(
                f"ft_manager={m!r} ({type(m).__name__}) is not supported: pass a "
                "torchft.Manager (this replica group's, built before DistAMP) or None"
            )
        if self.strategy in SHARDED:
            raise ValueError(
                f"ft_manager with strategy={self.strategy!r}: the engine wraps replica groups "
                "with torchft's DDP only; shard inside the replica group yourself (fully_shard) "
                "and pass the model with strategy='auto'"
            )
        if self.comm_hook not in (None, "fp8", "fp8-ef"):
            raise ValueError(
                f"ft_manager with comm_hook={self.comm_hook!r}: torchft's DDP all-reduces the "
                "gradients through the Manager with its own hook; use comm_hook=None, or 'fp8' "
                "/ 'fp8-ef' (8-bit gradients across the replicas)"
            )
        if self.trust_ddp_sync:
            raise ValueError(
                "ft_manager with trust_ddp_sync=True: the skip flag must cross the replicas "
                "through the Manager, whatever DDP did; use trust_ddp_sync=False"
            )
        if self.scaler is not None and self.scaler.ft_manager is not m:
            raise ValueError(
                f"ft_manager with scaler={self.scaler!r}: the scaler must agree, vote and heal "
                "through the same Manager; build it with DistributedGradScaler(..., "
                "process_group=ft_manager) or pass scaler=None"
            )


def make_config(
    precision: PrecisionLike,
    *,
    policy: AutocastPolicy | str | None,
    timeout: float | timedelta,
    device: str | torch.device | None,
    **fields: Any,
) -> AMPConfig:
    """:class:`AMPConfig` from ``DistAMP``'s arguments as users spell them: any precision
    spelling, ``policy="default"``, a ``timedelta``, a device string (``ValueError`` if bad);
    ``fields`` are the other fields, as they are."""
    parsed = parse_precision(precision)
    if policy == "default":
        policy = AutocastPolicy(parsed)
    elif isinstance(policy, str):
        raise ValueError(f"policy={policy!r}: pass an AutocastPolicy, 'default' or None")
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return AMPConfig(
        precision=parsed, policy=policy, timeout=timeout, device=parse_device(device), **fields
    )


def parse_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``); ``ValueError`` if unknown or
    absent here (torch would fail at setup with "Torch not compiled with CUDA enabled")."""
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:  # 2**63: ValueError
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None
    count = getattr(getattr(torch, parsed.type, None), "device_count", None)  # torch.cuda...
    if parsed.type != "cpu" and callable(count) and (parsed.index or 0) >= count():
        raise ValueError(
            f"device={device!r}: torch sees {count()} {parsed.type} device(s) on this machine; "
            "pass device='cpu', or None (this rank's GPU when there is one, else the CPU)"
        )
    return parsed


def _real(name: str, value: Any) -> float:
    """:func:`as_real`, its message led by ``name=value`` as the engine's other errors."""
    try:
        return as_real(name, value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r}: {exc}") from None


def _integer(name: str, value: Any) -> int:
    """:func:`as_integer`, its message led by ``name=value`` as the engine's other errors."""
    try:
        return as_integer(name, value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r}: {exc}") from None


def training_device(cfg: AMPConfig) -> torch.device:
    """The configured device, else this rank's CUDA device if any, else the CPU."""
    if cfg.device is not None:
        return cfg.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_model(model: Any) -> None:
    """``TypeError`` unless ``model`` (a stage's module already taken out) is an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"setup(model=...): expected a torch.nn.Module (or a torch.distributed.pipelining "
            f"stage, or a list of this rank's stages), got {type(model).__name__}: {model!r:.80}"
        )


def _check_optimizer_params(optimizer: torch.optim.Optimizer, params: Any, what: str) -> None:
    """``ValueError`` when ``optimizer`` updates a tensor that is not a parameter of the model:
    the model would silently never change."""
    mine = {id(p) for p in params}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    foreign = sum(1 for p in held if id(p) not in mine)
    if not held or foreign:
        raise ValueError(
            f"setup(optimizer=...): {foreign or 'no'} of the {len(held)} tensors the "
            f"{type(optimizer).__name__} updates {'are' if foreign else 'is'} not a parameter "
            f"of {what}: build the optimizer over model.parameters() of the model you pass "
            "(or pass a factory `lambda params: ...`)"
        )


def check_optimizer(optimizer: Any, model: nn.Module) -> None:
    """``optimizer`` is an optimizer over ``model``'s parameters or a factory (``TypeError``,
    ``ValueError``), checked before anything is wrapped."""
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer_params(optimizer, model.parameters(), "this model")
    elif not callable(optimizer):
        raise TypeError(
            "setup(optimizer=...): expected a torch.optim.Optimizer or a factory "
            f"`lambda params: Optimizer(params, ...)`, got {type(optimizer).__name__}"
        )


def built_optimizer(optimizer: Any, wrapped: nn.Module) -> torch.optim.Optimizer:
    """What an optimizer factory returned, checked (``TypeError``/``ValueError``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "setup(optimizer=<factory>): the factory must return a torch.optim.Optimizer, "
            f"returned {type(optimizer).__name__}"
        )
    _check_optimizer_params(optimizer, wrapped.parameters(), "the wrapped model")
    return optimizer


def checked_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The scheduler (built from a factory if one was given), driving ``optimizer``."""
    if scheduler is not None and not hasattr(scheduler, "step"):
        if not callable(scheduler):
            raise TypeError(
                "setup(scheduler=...): expected an LR scheduler (with .step()), a factory "
                f"`lambda opt: ...` or None, got {type(scheduler).__name__}"
            )
        scheduler = scheduler(optimizer)
        if not hasattr(scheduler, "step"):
            raise TypeError(
                "setup(scheduler=<factory>): the factory must return a scheduler (with "
                f".step()), returned {type(scheduler).__name__}"
            )
    bound = getattr(scheduler, "optimizer", optimizer)
    if bound is not optimizer:
        raise ValueError(
            f"setup(scheduler=...): this {type(scheduler).__name__} drives another optimizer "
            f"({type(bound).__name__} at {id(bound):#x}), not the one passed to setup(): its "
            "learning rates would never reach training; build it over that optimizer"
        )
    return scheduler


def engine_settings(cfg: AMPConfig, strategy: str, device: torch.device) -> dict[str, Any]:
    """Everything of ``cfg`` that must be identical on every rank (see
    :mod:`distamp.cluster.agreement`); the scaler's own settings when one was passed."""
    mesh = cfg.mesh
    settings: dict[str, Any] = {
        "precision": cfg.precision.name,
        "strategy": strategy,
        "device_type": device.type,
        "grad_accum_steps": cfg.grad_accum_steps,
        "max_grad_norm": cfg.max_grad_norm,
        "comm_hook": cfg.comm_hook,
        "hsdp_shard_size": cfg.hsdp_shard_size,
        "trust_ddp_sync": cfg.trust_ddp_sync,
        "trace_nonfinite": cfg.trace_nonfinite,
        "numerics_interval": cfg.numerics_interval,
        "ft_manager": cfg.ft_manager is not None,
        # Sorted: the text compared must not depend on the order the keys were written in.
        "ddp_kwargs": None if cfg.ddp_kwargs is None else sorted(cfg.ddp_kwargs.items()),
        "mesh": None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names),
        "scaler": "default" if cfg.scaler is None else type(cfg.scaler).__name__,
        **describe_policy(cfg.policy),
    }
    if cfg.scaler is not None:
        settings.update(cfg.scaler.settings())
    return settings


def check_scaler(cfg: AMPConfig, device: torch.device) -> None:
    """A scaler passed by the user is for the training device (``ValueError`` with the fix):
    torch disables a scaler built for a device that is not there with a mere warning, and an
    fp16 run would then train unscaled, with no inf check. (One disabled on purpose,
    ``enabled=False``, is the user's choice, as with torch.)"""
    scaler = cfg.scaler
    if scaler is None:
        return
    if scaler.device_type != device.type:
        raise ValueError(
            f"scaler: built for device {scaler.device_type!r}, but the engine trains on "
            f"{device.type!r}{' (not available here)' if not scaler.is_enabled() else ''}: build "
            f"it with DistributedGradScaler({device.type!r}, ...), or pass scaler=None"
        )


def check_setup(
    cfg: AMPConfig,
    strategy: str,
    device: torch.device,
    model: Any,
    optimizer: Any,
    scheduler: Any,
) -> None:
    """What can only be checked at setup, once the strategy and device are resolved (the
    model's type is checked before, by :func:`check_model`): the optimizer, scheduler and scaler
    passed (``TypeError``/``ValueError``), a sparse gradient under a hook that cannot carry it
    (:func:`~distamp.parallel.ddp.check_sparse_gradients`), then, in one collective, that every
    rank has the same settings (:class:`~distamp.cluster.SettingsMismatchError` on every rank)."""
    check_optimizer(optimizer, model)
    check_parameter_dtypes(model, cfg.precision, owner="DistAMP.setup(model=...)")
    check_scaler(cfg, device)
    _check_combinations(cfg, strategy, optimizer, scheduler)
    check_sparse_gradients(model, cfg.comm_hook)
    agree_settings(engine_settings(cfg, strategy, device), what="DistAMP")


def _check_combinations(cfg: AMPConfig, strategy: str, optimizer: Any, scheduler: Any) -> None:
    built = isinstance(optimizer, torch.optim.Optimizer)
    if built and strategy in SHARDED and hasattr(scheduler, "step"):
        raise ValueError(
            f"scheduler: strategy={strategy!r} must rebuild the optimizer you passed, "
            "so a scheduler bound to it would drive a stale one; pass factories instead: "
            f"`lambda params: ...` and `lambda opt: {type(scheduler).__name__}(opt, ...)`"
        )
    fsdp2_ok = cfg.comm_hook in ("fp8", "fp8-ef") and strategy == "fsdp2"
    if cfg.comm_hook is not None and strategy != "ddp" and not fsdp2_ok:
        raise ValueError(
            f"comm_hook={cfg.comm_hook!r}: strategy resolved to {strategy!r}, which has "
            "no DDP comm hooks (one process resolves 'auto' to 'none'); use comm_hook=None"
        )
    several = is_distributed() and torch.distributed.get_world_size() > 1
    if cfg.ddp_kwargs is not None and strategy != "ddp" and several:  # one process: moot
        raise ValueError(
            f"ddp_kwargs={cfg.ddp_kwargs!r}: the model is already parallelised (a DDP or FSDP "
            "wrapper, DTensor parameters or pipeline stages), so the engine builds no DDP to "
            "pass them to; set them on your own wrapper, or pass the bare model"
        )


def check_ft_setup(cfg: AMPConfig, model: nn.Module, *, parallelised: bool, stages: bool) -> str:
    """With ``cfg.ft_manager``: the strategy inside the replica group, ``"ddp"`` when the engine
    wraps ``model`` in torchft's DDP across replicas, ``"none"`` when the user already did (or
    sharded it); ``ValueError`` for what cannot train across replicas."""
    from torch.nn.parallel import DistributedDataParallel

    if stages:
        raise ValueError(
            "ft_manager with pipeline stages: torchft replicates whole models; train the "
            "stages without ft_manager"
        )
    if isinstance(model, DistributedDataParallel) and not is_ft_ddp(model):
        raise ValueError(
            "ft_manager with a torch DistributedDataParallel model: its gradients stay inside "
            "the replica group; pass the bare model (the engine wraps it in torchft's DDP) or "
            "one wrapped with torchft.DistributedDataParallel"
        )
    if (parallelised or cfg.strategy == "none") and cfg.comm_hook is not None:
        raise ValueError(
            f"ft_manager with comm_hook={cfg.comm_hook!r} and a model wrapped or sharded by "
            "hand: the hook goes in the torchft DDP the engine builds; pass the bare model"
        )
    if parallelised or cfg.strategy == "none":
        return "none"
    if is_distributed() and torch.distributed.get_world_size() > 1:
        raise ValueError(
            f"ft_manager with {torch.distributed.get_world_size()} ranks in the replica group: "
            "torchft's DDP averages each rank with its peers in the other replica groups only; "
            "parallelise the model inside the group yourself (e.g. fully_shard over the group "
            "with torchft's HSDP mesh) and pass it with strategy='auto'"
        )
    return "ddp"
