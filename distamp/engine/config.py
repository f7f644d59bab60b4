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
============================  ===========================================

With ``ft_manager`` the engine wraps the model in torchft's DDP across replica groups and agrees
through the Manager, so what cannot combine with that is refused (``ValueError``): a sharded
``strategy`` (shard inside a replica group yourself, then pass the model), a ``comm_hook``
(torchft's DDP owns the gradient all-reduce), ``trust_ddp_sync=True`` (the flag must cross the
replicas through the Manager) and a ``scaler`` built over anything but that Manager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distamp.arguments import INT32_MAX, as_integer, as_real
from distamp.cluster import is_distributed
from distamp.parallel.replicas import is_ft_ddp, is_ft_manager
from distamp.parallel.strategies import COMM_HOOKS, SHARDED, STRATEGIES
from distamp.precision.policy import AutocastPolicy, Precision
from distamp.scaler import DistributedGradScaler

__all__ = [
    "AMPConfig",
    "OptimizerArg",
    "SchedulerArg",
    "check_ft_setup",
    "check_setup",
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

    def __post_init__(self) -> None:
        if not isinstance(self.trust_ddp_sync, bool):
            raise ValueError(f"trust_ddp_sync={self.trust_ddp_sync!r} must be a bool")
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
        if self.comm_hook is not None:
            raise ValueError(
                f"ft_manager with comm_hook={self.comm_hook!r}: torchft's DDP all-reduces the "
                "gradients through the Manager with its own hook; use comm_hook=None"
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


def parse_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``); ``ValueError`` if unknown."""
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:  # 2**63: ValueError
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None


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


def check_setup(cfg: AMPConfig, strategy: str, optimizer: Any, scheduler: Any) -> None:
    """What can only be checked once the strategy is resolved (``ValueError``)."""
    built = isinstance(optimizer, torch.optim.Optimizer)
    if built and strategy in SHARDED and hasattr(scheduler, "step"):
        raise ValueError(
            f"scheduler: strategy={strategy!r} must rebuild the optimizer you passed, "
            "so a scheduler bound to it would drive a stale one; pass factories instead: "
            f"`lambda params: ...` and `lambda opt: {type(scheduler).__name__}(opt, ...)`"
        )
    if cfg.comm_hook is not None and strategy != "ddp":
        raise ValueError(
            f"comm_hook={cfg.comm_hook!r}: strategy resolved to {strategy!r}, which has "
            "no DDP comm hooks (one process resolves 'auto' to 'none'); use comm_hook=None"
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
