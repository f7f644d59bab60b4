"""What a run shows: metrics and diagnostics.

- :mod:`~distamp.observe.metrics`: the one metrics window reducer and :class:`StepResult`;
- :mod:`~distamp.observe.writers`: console, JSONL and TensorBoard writers;
- :mod:`~distamp.observe.recorder`: ``metrics.jsonl`` from a loop of one's own;
- :mod:`~distamp.observe.run_settings`: the settings a run recorded, for the report;
- :mod:`~distamp.observe.diagnostics`: which parameter or module went non-finite.
"""
