"""``distamp.parallel.topology``: the old import path of :mod:`distamp.agreement.topology`.

That module (who must agree, and how many ranks hold each gradient element) belongs to what
ranks must agree on, a layer below the wrappers, so it lives in :mod:`distamp.agreement`; its
names are re-exported here so that ``from distamp.parallel.topology import ...`` keeps working.
"""

from distamp.agreement.topology import (
    Topology,
    agreement_group,
    check_group_spec,
    grad_device,
    is_distributed,
    is_dtensor,
    is_group_like,
    local_grad,
    optimizer_params,
)

__all__ = [
    "Topology",
    "agreement_group",
    "check_group_spec",
    "grad_device",
    "is_distributed",
    "is_dtensor",
    "is_group_like",
    "local_grad",
    "optimizer_params",
]
