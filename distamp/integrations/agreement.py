"""The plug-ins' settings, compared across ranks once at setup (see
:mod:`distamp.cluster.agreement`): the same check :class:`~distamp.DistAMP` runs, over what a
plug-in owns (its precision, scaler and policy, plus the framework settings it is given)."""

from __future__ import annotations

from typing import Any

from distamp.cluster import agree_settings
from distamp.precision.describe import describe_policy
from distamp.scaler import DistributedGradScaler

__all__ = ["agree_plugin_settings"]


def agree_plugin_settings(
    what: str, *, precision: str, scaler: Any, policy: Any, **framework: Any
) -> None:
    """Raise :class:`~distamp.cluster.SettingsMismatchError` on every rank when a setting
    differs between ranks. Collective (one small all-reduce); a no-op without a process group.

    Args:
        what: the plug-in's name, for the message.
        precision: the precision it trains in.
        scaler: its scaler (a distamp scaler's settings are compared field by field).
        policy: its policy, or ``None``.
        framework: further settings that must match (plain values).
    """
    settings: dict[str, Any] = {"precision": precision, **framework, **describe_policy(policy)}
    if isinstance(scaler, DistributedGradScaler):
        settings.update(scaler.settings())
    else:
        settings["scaler"] = None if scaler is None else type(scaler).__name__
    agree_settings(settings, what=what)
