"""Adapters that put distamp's scaler, policy and metrics inside other trainers.

Each submodule imports its framework when it is itself imported, never from here, so that
``import distamp`` (and ``import distamp.integrations``) works without Accelerate or Lightning:

- :mod:`distamp.integrations.accelerate`: ``DistAMPAccelerator``, an ``accelerate.Accelerator``.
- :mod:`distamp.integrations.lightning`: a package, one module per plug-in: ``DistAMPPrecision``
  (Fabric precision plugin), ``DistAMPEnvironment`` (a ``ClusterEnvironment`` over
  :func:`distamp.detect_environment`), the Trainer plugins ``DistAMPTrainerPrecision`` and
  ``DistAMPFSDPPrecision`` on one base class, the scheduler gate ``SkipAwareScheduler`` and the
  ``DistAMPResumeCheck`` callback, all importable from the package. Its modules take the
  Lightning version check from :mod:`distamp.integrations.lightning.version`. The former modules
  ``lightning_trainer``, ``lightning_fsdp``, ``lightning_resume``, ``lightning_scheduler`` and
  ``lightning_version`` re-export from there.
"""

from __future__ import annotations

from distamp.versions import check_version

# Kept importable from here for the adapters written against it; the windows live in
# :mod:`distamp.versions`.
__all__ = ["check_version"]
