"""The former path of the skip-aware learning-rate scheduler, kept importable (re-exports only).
The code lives in :mod:`distamp.integrations.lightning.scheduler`.
"""

from __future__ import annotations

from distamp.integrations.lightning.scheduler import SkipAwareScheduler

__all__ = ["SkipAwareScheduler"]
