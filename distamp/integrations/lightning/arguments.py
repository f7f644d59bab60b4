"""The Trainer plug-ins' argument checks, shared so that both refuse the same things alike.

:class:`~distamp.integrations.lightning.trainer.DistAMPTrainerPrecision` and
:class:`~distamp.integrations.lightning.fsdp.DistAMPFSDPPrecision` take the same arguments and
put them in front of different Lightning classes; each validates them here before calling its
Lightning base's ``__init__``, so that a refused call builds nothing.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from distamp.precision.policy import Precision as ParsedPrecision
from distamp.precision.policy import parse_precision
from distamp.precision.requirements import check_policy_precision
from distamp.scaler import DistributedGradScaler

__all__ = [
    "LIGHTNING_PRECISIONS",
    "WEIGHT_PRECISIONS",
    "UnscaleWhen",
    "check_plugin_args",
    "check_precision",
    "lightning_precision_name",
]

UnscaleWhen = Literal["auto", "before_hooks", "at_clip"]
"""When the Trainer plug-ins unscale gradients (their ``unscale`` argument)."""


LIGHTNING_PRECISIONS = ("16-mixed", "bf16-mixed")
"""What Lightning's own ``MixedPrecision`` plug-ins (Fabric's and the Trainer's) accept."""

WEIGHT_PRECISIONS = {"bf16-true": "bf16-mixed", "16-true": "16-mixed"}
"""Lightning's spellings of 16-bit weights (its ``HalfPrecision``: no master), which
:class:`~distamp.integrations.lightning.trainer.DistAMPTrainerPrecision` takes as 16-bit
weights with an exact master, and the mixed precision each computes in."""


def check_precision(owner: str, precision: Any, *, weights: bool = False) -> ParsedPrecision:
    """The precision of a Lightning plug-in, accepted as Lightning's ``MixedPrecision`` accepts
    it: ``"16-mixed"`` or ``"bf16-mixed"`` exactly, so that swapping Lightning's plug-in for
    distamp's (or back) never changes which spellings a configuration may use. Lightning's
    connector maps ``Trainer(precision=16)`` to ``"16-mixed"``; its plug-ins take only the
    canonical names. With ``weights`` (the Trainer plug-in) also ``"bf16-true"`` and
    ``"16-true"``, Lightning's spellings of 16-bit weights, parsed as the mixed precision they
    compute in. Shared by the Fabric and the Trainer plug-ins.

    Raises:
        ValueError: any other value, in Lightning's words, naming the valid ones.
    """
    valid = LIGHTNING_PRECISIONS + (tuple(WEIGHT_PRECISIONS) if weights else ())
    if not (isinstance(precision, str) and precision in valid):
        if weights:
            also = ", or '16-true' or 'bf16-true' for 16-bit weights with an exact master"
        elif isinstance(precision, str) and precision in WEIGHT_PRECISIONS:
            also = (
                f"; {precision!r} (16-bit weights with an exact master) is taken by "
                f"DistAMPTrainerPrecision (Trainer, DDP or one device), not by {owner} yet"
            )
        else:
            also = ""
        raise ValueError(
            f"Passed `{owner}(precision={precision!r})`. Precision must be '16-mixed' or "
            f"'bf16-mixed'{also} (for fp32 keep Lightning's default precision; for fp8 train "
            "with distamp.DistAMP)."
        )
    return parse_precision(WEIGHT_PRECISIONS.get(precision, precision))


def check_plugin_args(
    owner: str,
    precision: Any,
    device: str | None,
    scaler: Any,
    policy: Any,
    unscale: Any,
    gate_schedulers: Any,
    *,
    weights: bool = False,
) -> tuple[ParsedPrecision, str, DistributedGradScaler | None]:
    """Validate a Trainer plugin's arguments (``owner`` is the plugin's class name, for the
    messages) and return ``(precision, device, scaler)``, the scaler created for fp16 when
    none was given. Shared by both plugins so that they refuse the same things alike.
    ``weights``: the plug-in takes ``"bf16-true"``/``"16-true"`` too (see
    :func:`check_precision`).

    Raises:
        ValueError: a precision other than ``"16-mixed"``/``"bf16-mixed"`` (and, with
            ``weights``, ``"16-true"``/``"bf16-true"``), a scaler with bf16, a policy for
            another precision, or a bad ``unscale``/``gate_schedulers``.
        TypeError: a scaler that is not a :class:`~distamp.DistributedGradScaler`.
    """
    parsed = check_precision(owner, precision, weights=weights)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if scaler is not None and not isinstance(scaler, DistributedGradScaler):
        raise TypeError(
            f"{owner}(scaler={scaler!r}): pass a distamp.DistributedGradScaler (or None to get "
            "one); another scaler would let ranks disagree on skips"
        )
    if scaler is not None and not parsed.needs_scaler:
        raise ValueError(
            f"{owner}(precision={precision!r}, scaler=...): {parsed.name} needs no loss "
            "scaling; leave scaler=None"
        )
    if scaler is None and parsed.needs_scaler:
        scaler = DistributedGradScaler(device=device)
    elif scaler is None and getattr(policy, "adaptive", None) is not None:
        scaler = DistributedGradScaler(device=device, check_only=True)  # drives the rules
    check_policy_precision(policy, parsed, given=f"{owner}(precision={precision!r})")
    if unscale not in ("auto", "before_hooks", "at_clip"):
        raise ValueError(f"{owner}(unscale={unscale!r}): use 'auto', 'before_hooks' or 'at_clip'")
    if not isinstance(gate_schedulers, bool):
        raise ValueError(f"{owner}(gate_schedulers={gate_schedulers!r}) must be a bool")
    return parsed, device, scaler


def lightning_precision_name(parsed: ParsedPrecision) -> Literal["16-mixed", "bf16-mixed"]:
    """The precision string Lightning's own plugin classes take for ``parsed``."""
    return "16-mixed" if parsed.needs_scaler else "bf16-mixed"
