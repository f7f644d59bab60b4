"""The Lightning version check shared by the Fabric and Trainer adapters.

Its own module so that :mod:`distamp.integrations.lightning` (Fabric, and the lazy re-exports of
the Trainer plugins) and the Trainer plugins' modules all import the check from here, not from
one another.
"""

from __future__ import annotations

from distamp.integrations import check_version

__all__ = ["LIGHTNING_VERSION", "SUPPORTED"]

SUPPORTED = ("2.6.0", "2.7")
"""Lightning versions the adapters were tested with: ``>= SUPPORTED[0], < SUPPORTED[1]``."""

LIGHTNING_VERSION = check_version("lightning", *SUPPORTED, extra="lightning")
