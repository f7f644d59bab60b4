"""The wrappers: DDP, FSDP and torchft's DDP applied for a strategy, and their communication hooks.

- :mod:`~distamp.parallel.strategies`: picks and applies a wrapper (:mod:`~distamp.parallel.ddp`,
  :mod:`~distamp.parallel.fsdp`, torchft's DDP across replica groups) and DDP communication
  hooks (:mod:`~distamp.parallel.comm_hooks`, :mod:`~distamp.parallel.fp8_comm`,
  :mod:`~distamp.parallel.fp8_replicas`);
- :mod:`~distamp.parallel.recompute`: activation checkpointing and compiled blocks.

Who must agree and how (the agreement group, the packed reductions, torchft's quorum, the
gradient traffic, the scale reads) is :mod:`distamp.agreement`, a layer below; the modules
``topology``, ``reduction``, ``replicas``, ``traffic`` and ``scale_reads`` here re-export it
under their old import paths.

Nothing is imported here, so that importing one of these modules loads only what it needs.
"""
