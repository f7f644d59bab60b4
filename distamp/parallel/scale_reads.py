"""``distamp.parallel.scale_reads``: the old import path of :mod:`distamp.agreement.scale_reads`.

That module (the scaler's scale and skip flag read without a host sync) belongs to what ranks
must agree on, a layer below the wrappers, so it lives in :mod:`distamp.agreement`; its names
are re-exported here so that ``from distamp.parallel.scale_reads import ...`` keeps working.
"""

from distamp.agreement.scale_reads import (
    current_loss_scale,
    last_step_skipped,
)

__all__ = [
    "current_loss_scale",
    "last_step_skipped",
]
