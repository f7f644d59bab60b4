"""The Lightning version check shared by every module of the Lightning adapter.

Its own module so that the package (Fabric, and the lazy re-exports of the Trainer plug-ins) and
the Trainer plug-ins' modules all import the check from here, not from one another. Importing it
raises ``ImportError`` (with the install command) when Lightning is missing or too old.
"""

from __future__ import annotations

from distamp.versions import WINDOWS, check_version

__all__ = ["LIGHTNING_VERSION", "SUPPORTED"]

SUPPORTED = WINDOWS["lightning"]
"""The Lightning releases the adapters were verified with (see :mod:`distamp.versions`)."""

LIGHTNING_VERSION = check_version("lightning")
