"""Who must agree, how many copies of each gradient element exist, and the wrappers.

- :mod:`~distamp.parallel.topology`: the agreement group and the copies of every gradient element
  (DDP, FSDP1, FSDP2/HSDP, tensor, expert and pipeline parallelism);
- :mod:`~distamp.parallel.reduction`: packed MAX/SUM reductions, one collective;
- :mod:`~distamp.parallel.strategies`: picks and applies a wrapper (:mod:`~distamp.parallel.ddp`,
  :mod:`~distamp.parallel.fsdp`) and DDP communication hooks (:mod:`~distamp.parallel.comm_hooks`).

Nothing is imported here, so that importing one of these modules loads only what it needs.
"""
