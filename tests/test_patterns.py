"""Module name patterns (distamp/precision/patterns.py) meet the model: a pattern that matches
nothing is refused when it meets the model, naming the field, the pattern and the closest names,
and nothing is applied."""

from __future__ import annotations

import pytest
import torch
from precision_scenarios import Tiny, refused, train
from torch import nn

from distamp import AutocastPolicy
from distamp.precision.adaptive import AdaptiveRules
from distamp.precision.backward_scales import BackwardScaleRules

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_pattern_matching_nothing_is_refused_at_apply_and_nothing_is_applied() -> None:
    net = Tiny()
    policy = AutocastPolicy("fp16", fp32_modules=("norm", "lm_haed"))
    refused(lambda: policy.apply(net), ValueError, "fp32_modules", "'lm_haed'", "'lm_head'")
    with torch.autocast("cpu", dtype=torch.float16):
        assert net.norm(torch.randn(2, 8).half()).dtype == torch.float16  # no fp32 hooks added
    # Class names match too; classes and the default norms never refuse a model without them.
    AutocastPolicy("fp16", fp32_modules=("LayerNorm", "lm_*", nn.BatchNorm1d)).apply(Tiny())
    AutocastPolicy("fp16").apply(nn.Sequential(nn.Linear(2, 2)))
    fp8 = AutocastPolicy("fp8", fp8_exclude=("norm",))  # a module, not a Linear layer
    refused(lambda: fp8.check_patterns(net), ValueError, "fp8_exclude", "'norm'", "Linear")


def test_watch_and_blocks_patterns_are_checked_against_the_model() -> None:
    hott = AutocastPolicy("fp16", adaptive=AdaptiveRules(watch=("hot*", "hott")))
    refused(lambda: train(hott), ValueError, "watch", "'hott'", "closest: 'hot'")
    adaptive = hott.adaptive
    assert adaptive is not None
    refused(lambda: adaptive.bind(Tiny()), ValueError, "'hott'")
    refused(lambda: adaptive.validate_state_dict({}), RuntimeError, "bind")  # still unbound
    rules = BackwardScaleRules(blocks=("blocks.*", "blokcs.1"))
    scales = AutocastPolicy("fp16", backward_scales=rules)
    refused(lambda: train(scales), ValueError, "BackwardScaleRules(blocks=", "'blokcs.1'")
    assert scales.backward_scales is not None and scales.backward_scales.names == []
    train(AutocastPolicy("fp16", adaptive=AdaptiveRules(watch=("hot", "blocks.*"))), steps=2)
