"""The training engine: :class:`DistAMP` and what it is made of.

- :mod:`~distamp.engine.core`: :class:`DistAMP` (setup, autocast, backward, step, clip, state);
- :mod:`~distamp.engine.config`: its settings, checked once;
- :mod:`~distamp.engine.loop`: the run loop (``fit``) and pipeline glue, a base of
  :class:`DistAMP` written against the engine's public face (:class:`~distamp.engine.loop.Engine`);
- :mod:`~distamp.engine.accounting`: the accumulation cycle's call order and the skip reports;
- :mod:`~distamp.engine.checkpoint`: atomic checkpoints, DCP for sharded state, every rank
  saving or loading or none (:mod:`~distamp.engine.checkpoint_layout`: the directory's layout
  and its errors; :mod:`~distamp.engine.integrity`: each file's size and CRC-32, recorded at
  save time and verified before a load applies anything; :mod:`~distamp.engine.resume`: the
  trainer state checked against the engine).
"""

from __future__ import annotations

from distamp.engine.core import AMPConfig, DistAMP, StepResult

__all__ = ["AMPConfig", "DistAMP", "StepResult"]
