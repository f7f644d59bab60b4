"""The Lightning version check shared by the Fabric and Trainer adapters.

Its own module so that :mod:`distamp.integrations.lightning` (Fabric, and the lazy re-exports of
the Trainer plugins) and the Trainer plugins' modules all import the check from here, not from
one another.
"""

from __future__ import annotations

from distamp.versions import WINDOWS, check_version

__all__ = ["LIGHTNING_VERSION", "SUPPORTED"]

SUPPORTED = WINDOWS["lightning"]
"""The Lightning releases the adapters were verified with (see :mod:`distamp.versions`)."""

LIGHTNING_VERSION = check_version("lightning")
