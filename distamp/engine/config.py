"""The engine's settings, validated before anything is built: :class:`AMPConfig`.

Every bad value is rejected when ``DistAMP(...)`` is constructed, with a ``ValueError`` naming
the field, so that no rank discovers a typo after it joined a process group. Number checks are
:func:`distamp.scaler.config.check_number`'s, the same as the scaler's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distamp.parallel.strategies import COMM_HOOKS, SHARDED, STRATEGIES
from distamp.precision.policy import AutocastPolicy, Precision
from distamp.scaler import DistributedGradScaler
from distamp.scaler.config import check_number

__all__ = [
    "AMPConfig",
    "OptimizerArg",
    "SchedulerArg",
    "check_setup",
    "make_scaler",
    "parse_device",
    "training_device",
]

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
    trust_ddp_sync: bool = False

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
        if _number("grad_accum_steps", self.grad_accum_steps, integer=True) < 1:
            raise ValueError(f"grad_accum_steps={self.grad_accum_steps!r} must be an int >= 1")
        g = self.max_grad_norm
        if g is not None and _number("max_grad_norm", g) <= 0:
            raise ValueError(f"max_grad_norm={g!r} must be a finite number > 0, or None")
        if self.scaler is not None and not isinstance(self.scaler, DistributedGradScaler):
            raise ValueError(
                f"scaler={self.scaler!r} must be a distamp.DistributedGradScaler (or None): the "
                "engine reads its rank-agreed skip decision, which torch's scalers do not provide"
            )
        if _number("timeout", self.timeout) <= 0:
            raise ValueError(f"timeout={self.timeout!r} must be a number of seconds > 0")
        h = self.hsdp_shard_size
        # Checked here, not when the mesh is built: a bad value must fail before any rank joins
        # a process group, not inside DeviceMesh on some ranks.
        if h is not None and _number("hsdp_shard_size", h, integer=True) < 1:
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


def parse_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device`` (``None`` stays ``None``); ``ValueError`` if unknown."""
    if device is None or isinstance(device, torch.device):
        return device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device: {exc}") from None


def _number(name: str, value: Any, *, integer: bool = False) -> float:
    """:func:`check_number`, its message led by ``name=value`` as the engine's other errors."""
    try:
        return check_number(name, value, integer=integer)
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
