"""The training engine: :class:`DistAMP` and what it is made of.

- :mod:`~distamp.engine.core`: :class:`DistAMP` (setup's order, autocast, backward, step, clip,
  close);
- :mod:`~distamp.engine.config`: its settings, checked once; :mod:`~distamp.engine.setup_checks`:
  what ``setup`` checks of what it is given;
- :mod:`~distamp.engine.wrapping`: how the model arrives (pipeline stages, already parallelised,
  torchft replicas), the precision set before wrapping, the wrapper, the optimizer fitted to it;
- :mod:`~distamp.engine.instruments`: the non-finite tracer and the numeric monitor / adaptive
  run, attached at setup and detached at close;
- :mod:`~distamp.engine.lifecycle`: the process group made at setup only when none exists, and
  destroyed at close only then;
- :mod:`~distamp.engine.persistence`: ``state_dict``, ``save_state`` and ``load_state``, a base
  of :class:`DistAMP` written against the engine's public face;
- :mod:`~distamp.engine.loop`: the run loop (``fit``) and pipeline glue, a base of
  :class:`DistAMP` written against the engine's public face (:class:`~distamp.engine.loop.Engine`);
- :mod:`~distamp.engine.accounting`: the accumulation cycle's call order and the skip reports;
- :mod:`~distamp.engine.guards`: the spike guard and the limit on consecutive skips;
- :mod:`~distamp.engine.checkpoint`: atomic checkpoints, DCP for sharded state, every rank
  saving or loading or none (:mod:`~distamp.engine.checkpoint_layout`: the directory's layout
  and its errors; :mod:`~distamp.engine.integrity`: each file's size and CRC-32, recorded at
  save time and verified before a load applies anything; :mod:`~distamp.engine.resume`: the
  trainer state checked against the engine).
"""

from __future__ import annotations

from distamp.engine.core import AMPConfig, DistAMP, StepResult

__all__ = ["AMPConfig", "DistAMP", "StepResult"]
