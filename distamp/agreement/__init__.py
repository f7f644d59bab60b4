"""Who must agree across ranks, and how: the primitives below the scaler and the wrappers.

A skip decision, a clipping norm or a byte count means the same on every rank only if every rank
knows which ranks take part and combines their values the same way. Those answers live here, one
layer above the cluster (process groups, collectives) and below everything that uses them (the
monitors, the scaler, the precision policies, the wrappers):

- :mod:`~distamp.agreement.topology`: the agreement group and the copies of every gradient
  element (DDP, FSDP1, FSDP2/HSDP, tensor, expert and pipeline parallelism);
- :mod:`~distamp.agreement.reduction`: packed MAX/SUM reductions, one collective;
- :mod:`~distamp.agreement.replicas`: torchft's ``Manager`` as a group, and its commit protocol;
- :mod:`~distamp.agreement.traffic`: the bytes each rank sends for gradients;
- :mod:`~distamp.agreement.scale_reads`: the one way to read a scaler's scale (and skip flag)
  as device tensors, without a host sync.

Settings compared across ranks once at setup are :mod:`distamp.cluster.agreement` (the cluster
layer's, since :mod:`distamp.cluster` re-exports them), and the plug-ins' own comparison, which
reads policies and scalers, is :mod:`distamp.integrations.agreement`.

Nothing is imported here, so that importing one of these modules loads only what it needs.
"""
