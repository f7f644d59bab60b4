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
``spike_guard``               None, or a :class:`~distamp.SpikeGuard` (else ``TypeError``)
``max_consecutive_skips``     None, or an integer in [1, 2**31 - 1]
============================  ===========================================

With ``ft_manager`` the engine wraps the model in torchft's DDP across replica groups and agrees
through the Manager, so what cannot combine with that is refused (``ValueError``): a sharded
``strategy`` (shard inside a replica group yourself, then pass the model), a ``comm_hook``
(torchft's DDP owns the gradient all-reduce), ``trust_ddp_sync=True`` (the flag must cross the
replicas through the Manager), ``ddp_kwargs`` (torchft's DDP takes none), a ``scaler`` built
over anything but that Manager, and a ``spike_guard`` (its skip would bypass the Manager's commit
vote, which rides in the scaler's step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from distamp.agreement.replicas import is_ft_manager
from distamp.arguments import INT32_MAX, ArgumentTypeError, as_integer, as_real
from distamp.engine.guards import SpikeGuard, check_guards
from distamp.engine.weights import check_weights
from distamp.observe.telemetry import Telemetry
from distamp.optim import WeightPrecision
from distamp.parallel.ddp import ddp_options
from distamp.parallel.strategies import COMM_HOOKS, SHARDED, STRATEGIES
from distamp.precision.policy import AutocastPolicy, Precision, PrecisionLike, parse_precision
from distamp.precision.requirements import check_policy_precision
from distamp.scaler import DistributedGradScaler

__all__ = [
    "AMPConfig",
    "check_settings",
    "make_config",
    "make_scaler",
    "parse_device",
    "training_device",
]


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
    telemetry: Telemetry | None = None
    spike_guard: SpikeGuard | None = None
    max_consecutive_skips: int | None = 100
    weights: WeightPrecision | None = None

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
        if self.telemetry is not None:
            if not isinstance(self.telemetry, Telemetry):
                raise ValueError(
                    f"telemetry={self.telemetry!r:.80} must be a distamp.Telemetry (or None)"
                )
            if self.precision.compute_dtype is None:
                raise ValueError(
                    f"telemetry with precision={self.precision.name!r}: it samples fp16, bf16 "
                    "or fp8 training (fp32 has no format limit to watch); drop it for fp32"
                )
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
        weights = check_weights(
            self.weights,
            self.precision,
            strategy=self.strategy,
            comm_hook=self.comm_hook,
            mesh=self.mesh,
            ft_manager=self.ft_manager,
        )
        object.__setattr__(self, "weights", weights)
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
        self._check_guards()
        if self.ft_manager is not None:
            self._check_ft_manager()
        if self.ddp_kwargs is not None:
            object.__setattr__(self, "ddp_kwargs", self._checked_ddp_kwargs(self.ddp_kwargs))

    def _check_guards(self) -> None:
        """``spike_guard`` and ``max_consecutive_skips`` (:func:`~distamp.engine.guards.
        check_guards`, which the plug-ins call as well)."""
        limit = check_guards(self.spike_guard, self.max_consecutive_skips)
        object.__setattr__(self, "max_consecutive_skips", limit)

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
        if self.spike_guard is not None:
            raise ValueError(
                "ft_manager with spike_guard: a spike skip would bypass the Manager's commit "
                "vote, which rides in the scaler's step; drop spike_guard under torchft"
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


def check_settings(
    precision: PrecisionLike = "bf16",
    *,
    policy: AutocastPolicy | str | None = None,
    timeout: float | timedelta = 300.0,
    device: str | torch.device | None = None,
    **fields: Any,
) -> None:
    """Check :class:`~distamp.DistAMP`'s arguments without building anything: the same errors
    ``DistAMP(...)`` raises, before any rank joins a process group or touches a device (an
    argument parser's check, say: ``check_settings(precision="bf16", strategy="fsdp2",
    comm_hook="fp8")``). ``fields`` are the other keyword arguments of ``DistAMP``.

    Raises:
        ValueError: a bad value or combination, naming the argument and the fix.
        TypeError: an argument of the wrong kind.
    """
    make_config(precision, policy=policy, timeout=timeout, device=device, **fields)
