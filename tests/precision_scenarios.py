"""A tiny model and value strategies shared by the precision settings' tests.

:class:`Tiny` has top-level blocks ``inp``, ``blocks.0``, ``blocks.1``, ``hot``, ``norm`` and
``lm_head`` (:data:`NAMES`, :data:`BLOCKS`), and :data:`TYPOS` near-misses of them, so that the
field checks (tests/test_precision_settings.py), the pattern checks (tests/test_patterns.py) and
the checkpoint-state checks (tests/test_state_checks.py) meet the same names. :func:`maybe` mixes
a field's valid values with :data:`JUNK`, every number also as numpy and 0-d tensor
(:func:`numeric`), as the rules take them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from torch import nn

import distamp
from distamp import AutocastPolicy

__all__ = [
    "BLOCKS",
    "JUNK",
    "NAMES",
    "TYPOS",
    "Tiny",
    "batch",
    "maybe",
    "numeric",
    "refused",
    "train",
]


class Tiny(nn.Module):
    """Top-level blocks ``inp``, ``blocks.0``, ``blocks.1``, ``out``; ``hot`` overflows in fp16
    for large inputs (its normalisation turns inf into NaN), so steps skip and rules decide."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.hot = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        y = self.hot(h * x.abs().amax(-1, keepdim=True))
        y = y / (1 + y.abs().amax(-1, keepdim=True))
        return self.lm_head(self.norm(y))


NAMES = ["inp", "blocks", "blocks.0", "blocks.1", "hot", "norm", "lm_head"]
BLOCKS = ["inp", "blocks.0", "blocks.1", "hot", "norm", "lm_head"]  # the default blocks
TYPOS = ["hott", "lm_haed", "blokcs.0", "nothing"]


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k)
    x = torch.randn(16, 4, generator=g)
    if k % 3 == 1:
        x[:2] *= 6e4  # hot's pre-activation overflows in fp16: a skipped step
    return x, torch.randn(16, 1, generator=g)


def train(policy: AutocastPolicy, steps: int = 4) -> nn.Module:
    torch.manual_seed(0)
    net = Tiny()
    amp = distamp.DistAMP("fp16", strategy="none", policy=policy)
    amp.setup(net, lambda p: torch.optim.SGD(p, lr=0.05))
    try:
        for k in range(steps):
            x, y = batch(k)
            with amp.autocast():
                loss = torch.nn.functional.mse_loss(amp.model(x).float(), y)
            amp.backward_and_step(loss)
    finally:
        amp.close()
    return net


def refused(call: Any, kind: type[Exception], *words: str) -> str:
    with pytest.raises(kind) as info:
        call()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return str(info.value)


def numeric(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Each number also as numpy and 0-d tensor, as torch takes them."""

    def kinds(v: Any) -> st.SearchStrategy[Any]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return st.just(v)
        if isinstance(v, int):
            return (
                st.sampled_from([v, np.int64(v), torch.tensor(v)]) if abs(v) < 2**62 else st.just(v)
            )
        if math.isfinite(v) and abs(v) > 3e38:  # beyond float32: numpy warns on the cast
            return st.sampled_from([v, np.float64(v)])
        return st.sampled_from([v, np.float64(v), np.float32(v), torch.tensor(v)])

    return values.flatmap(kinds)


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 25, 41, 2**31, 1.0, 1e-300, np.bool_(True), "0.5", "hot", b"x"]),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.just(torch.ones(2)),
)


def maybe(valid: st.SearchStrategy[Any], odds: int = 3) -> st.SearchStrategy[Any]:
    """``valid`` ``odds`` times as likely as junk."""
    junk = numeric(JUNK)
    return st.integers(0, odds).flatmap(lambda i: junk if i == odds else valid)
