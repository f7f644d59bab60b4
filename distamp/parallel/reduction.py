"""``distamp.parallel.reduction``: the old import path of :mod:`distamp.agreement.reduction`.

That module (the skip flags packed and reduced in one collective) belongs to what ranks must
agree on, a layer below the wrappers, so it lives in :mod:`distamp.agreement`; its names are re-
exported here so that ``from distamp.parallel.reduction import ...`` keeps working.
"""

from distamp.agreement.reduction import (
    ExternalGroup,
    FlagReducer,
    GroupSpec,
    Rider,
    reduce_flags,
    ride_along,
)

__all__ = [
    "ExternalGroup",
    "FlagReducer",
    "GroupSpec",
    "Rider",
    "reduce_flags",
    "ride_along",
]
