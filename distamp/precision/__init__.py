"""What runs in which precision.

- :mod:`~distamp.precision.policy`: precision parsing and :class:`AutocastPolicy` (fp32 islands,
  the FSDP mixed-precision mapping, who owns mixed precision);
- :mod:`~distamp.precision.adaptive`: promotions to fp32 driven by the numeric monitor;
- :mod:`~distamp.precision.backward_scales`: per-block power-of-two gradient scales (fp16);
- :mod:`~distamp.precision.audit`: the dtype audit of one forward;
- fp8 (torchao float8): :mod:`~distamp.precision.fp8_select` (which Linear layers),
  :mod:`~distamp.precision.fp8_torchao` (torchao's version range and import),
  :mod:`~distamp.precision.fp8` (conversion and per-step hooks),
  :mod:`~distamp.precision.fp8_parallel` (weight scales on any mesh, tensor-parallel plan).

Nothing is imported here: torchao is loaded only when fp8 is used.
"""
