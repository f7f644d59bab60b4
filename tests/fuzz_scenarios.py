"""Values of every kind, valid or not, for the property tests of the entry points.

Each field gets its plausible values and the others, as Python, numpy and 0-d tensor numbers
(torch's GradScaler takes all three): :func:`numeric` turns a strategy's numbers into all three
kinds, :data:`JUNK` is what no field should take, :func:`maybe` mixes a field's valid values with
it, and :data:`ARG_VALUES` is what a command-line flag may be given (the main job's parser,
``distamp launch``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

__all__ = ["ARG_VALUES", "JUNK", "maybe", "numeric"]


def numeric(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    def wrap(v: Any) -> st.SearchStrategy[Any]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return st.just(v)
        kinds: list[Any] = [v]
        if isinstance(v, int) and -(2**63) <= v < 2**63:
            kinds += [np.int64(v), torch.tensor(v)]
        elif isinstance(v, float):
            kinds += [np.float64(v), np.float32(v)]
        return st.sampled_from(kinds)

    return values.flatmap(wrap)


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-46, 1e-40, 1e-38, 3.5e38, 1e39, 2**31, 2**63, np.bool_(True)]),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
    st.just(object()),
    st.just(torch.ones(2)),
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(valid, valid, numeric(JUNK))  # valid values twice as likely as junk


ARG_VALUES = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(
        ["fp16", "fp17", "ddp", "rowwise", "abc", "", "/nonexistent", "launch", "fp8", "medium"]
    ),
)
