"""``distamp.parallel.traffic``: the old import path of :mod:`distamp.agreement.traffic`.

That module (the bytes each rank sends for gradients) belongs to what ranks must agree on, a
layer below the wrappers, so it lives in :mod:`distamp.agreement`; its names are re-exported
here so that ``from distamp.parallel.traffic import ...`` keeps working.
"""

from distamp.agreement.traffic import (
    PlainTraffic,
    Traffic,
    WireBytes,
    grad_traffic,
    wire_bytes,
)

__all__ = [
    "PlainTraffic",
    "Traffic",
    "WireBytes",
    "grad_traffic",
    "wire_bytes",
]
