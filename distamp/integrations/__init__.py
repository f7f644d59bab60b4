"""Adapters that put distamp's scaler, policy and metrics inside other trainers.

Each submodule imports its framework when it is itself imported, never from here, so that
``import distamp`` (and ``import distamp.integrations``) works without Accelerate or Lightning:

- :mod:`distamp.integrations.accelerate`: ``DistAMPAccelerator``, an ``accelerate.Accelerator``.
- :mod:`distamp.integrations.lightning`: ``DistAMPPrecision`` (Fabric precision plugin) and
  ``DistAMPEnvironment`` (a ``ClusterEnvironment`` over :func:`distamp.detect_environment`);
  re-exports the Trainer plugins (``DistAMPTrainerPrecision`` of
  :mod:`distamp.integrations.lightning_trainer`, ``DistAMPFSDPPrecision`` of
  :mod:`distamp.integrations.lightning_fsdp`) and the scheduler gate of
  :mod:`distamp.integrations.lightning_scheduler` (``SkipAwareScheduler``). The Fabric module
  and the Trainer plugins' modules take the Lightning version check from
  :mod:`distamp.integrations.lightning_version`, so the re-exporting module is imported by none.
"""

from __future__ import annotations

from distamp.versions import check_version

# Kept importable from here for the adapters written against it; the windows live in
# :mod:`distamp.versions`.
__all__ = ["check_version"]
