"""The former path of the Lightning version check, kept importable (re-exports only). The code
lives in :mod:`distamp.integrations.lightning.version`.
"""

from __future__ import annotations

from distamp.integrations.lightning.version import LIGHTNING_VERSION, SUPPORTED

__all__ = ["LIGHTNING_VERSION", "SUPPORTED"]
