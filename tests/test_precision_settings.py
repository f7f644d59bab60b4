"""The rules' fields (distamp/precision/settings.py): every way a setting enters is checked.

- The rules dataclasses (``AdaptiveRules``, ``BackwardScaleRules``, ``Float8Settings``) and
  ``AutocastPolicy`` check every field at construction: a wrong kind is a ``TypeError``, a value
  out of range a ``ValueError``, both naming the field; numpy scalars and 0-d tensors are taken
  as plain numbers. Flags are ``bool``; one string where a sequence of patterns is expected is a
  ``TypeError``.
- Property test: fuzzed rules are either refused up front (or at setup, for a pattern that
  matches nothing) or train a tiny fp16 model with finite weights.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st
from precision_scenarios import NAMES, TYPOS, maybe, numeric, refused, train
from torch import nn

from distamp import AutocastPolicy
from distamp.precision.adaptive import AdaptiveRules
from distamp.precision.backward_scales import BackwardScaleRules
from distamp.precision.fp8_select import Float8Settings

pytestmark = pytest.mark.usefixtures("one_thread")

FP16, FP8 = functools.partial(AutocastPolicy, "fp16"), functools.partial(AutocastPolicy, "fp8")


@pytest.mark.parametrize(
    ("build", "kwargs", "kind", "words"),
    [
        (AdaptiveRules, {"headroom_limit": "0.5"}, TypeError, ["headroom_limit", "'0.5'"]),
        (AdaptiveRules, {"headroom_limit": 1.5}, ValueError, ["headroom_limit", "(0.0, 1.0]"]),
        (AdaptiveRules, {"interval": True}, TypeError, ["AdaptiveRules.interval"]),
        (AdaptiveRules, {"interval": 2**40}, ValueError, ["interval", "2**31 - 1"]),
        (AdaptiveRules, {"window": math.inf}, TypeError, ["AdaptiveRules.window"]),
        (AdaptiveRules, {"patience": torch.ones(2)}, TypeError, ["patience"]),
        (AdaptiveRules, {"demote_below": math.nan}, ValueError, ["demote_below"]),
        (AdaptiveRules, {"demote": "no"}, TypeError, ["AdaptiveRules.demote", "'no'"]),
        (AdaptiveRules, {"demote": np.bool_(True)}, TypeError, ["demote", "numpy"]),
        (AdaptiveRules, {"watch": "hot"}, TypeError, ["AdaptiveRules.watch", "('hot',)"]),
        (AdaptiveRules, {"watch": ("hot", 3)}, TypeError, ["AdaptiveRules.watch", "item 1"]),
        (AdaptiveRules, {"watch": ()}, ValueError, ["AdaptiveRules.watch"]),
        (BackwardScaleRules, {"max_exponent": 2000}, ValueError, ["max_exponent", "[1, 24]"]),
        (BackwardScaleRules, {"max_exponent": 25}, ValueError, ["max_exponent"]),
        (BackwardScaleRules, {"headroom_bits": 41}, ValueError, ["headroom_bits"]),
        (BackwardScaleRules, {"max_growth": "8"}, TypeError, ["max_growth"]),
        (BackwardScaleRules, {"grow_above": np.float64(1.0)}, ValueError, ["grow_above"]),
        (BackwardScaleRules, {"blocks": "layers.*"}, TypeError, ["blocks", "('layers.*',)"]),
        (BackwardScaleRules, {"blocks": ("",)}, ValueError, ["blocks", "empty"]),
        (Float8Settings, {"recipe": 1}, TypeError, ["recipe"]),
        (Float8Settings, {"min_features": -1}, ValueError, ["fp8_min_features"]),
        (Float8Settings, {"fsdp_float8_all_gather": 1}, TypeError, ["fp8_all_gather"]),
        (FP16, {"cast_inputs": "no"}, TypeError, ["cast_inputs", "'no'"]),
        (FP16, {"cast_inputs": np.bool_(1)}, TypeError, ["cast_inputs"]),
        (FP8, {"fp8_all_gather": "yes"}, TypeError, ["fp8_all_gather"]),
        (FP16, {"adaptive": np.bool_(1)}, TypeError, ["adaptive="]),
        (FP16, {"backward_scales": 1}, TypeError, ["backward_scales="]),
        (AutocastPolicy, {"reduce_dtype": "fp32"}, TypeError, ["reduce_dtype"]),
        (AutocastPolicy, {"reduce_dtype": torch.int8}, ValueError, ["reduce_dtype"]),
        (AutocastPolicy, {"fp32_modules": "lm_head"}, TypeError, ["('lm_head',)", "'l'"]),
        (AutocastPolicy, {"fp32_modules": nn.LayerNorm}, TypeError, ["(LayerNorm,)"]),
        (AutocastPolicy, {"fp32_modules": (3,)}, TypeError, ["fp32_modules"]),
        (AutocastPolicy, {"fp32_ops": "softmax"}, TypeError, ["fp32_ops", "('softmax',)"]),
        (FP8, {"fp8_exclude": "head"}, TypeError, ["('head',)"]),
    ],
)
def test_bad_fields_are_refused_naming_the_field(
    build: Any, kwargs: dict[str, Any], kind: type[Exception], words: list[str]
) -> None:
    refused(lambda: build(**kwargs), kind, *words)
    # A wrong kind is also a ValueError: callers that caught ValueError before still do.
    refused(lambda: build(**kwargs), ValueError)


def test_numbers_as_torch_takes_them_are_stored_plain() -> None:
    given: dict[str, Any] = dict(
        interval=np.int64(5), window=torch.tensor(8), headroom_limit=np.float32(0.5), watch=["hot"]
    )
    rules = AdaptiveRules(**given)
    assert rules == AdaptiveRules(interval=5, window=8, headroom_limit=0.5, watch=("hot",))
    assert type(rules.interval) is int and type(rules.window) is int
    assert type(rules.headroom_limit) is float and hash(rules) == hash(copy.copy(rules))
    scales = BackwardScaleRules(**{"max_exponent": np.int32(12), "grow_above": torch.tensor(0.1)})
    assert type(scales.max_exponent) is int and type(scales.grow_above) is float
    policy = AutocastPolicy("fp8", fp8_min_features=np.int64(64), fp8_exclude=["head"])
    assert policy.fp8 is not None and type(policy.fp8.min_features) is int
    assert policy.fp8.exclude == ("head",)


PATTERNS = st.lists(st.sampled_from([*NAMES, "blocks.*", "*", *TYPOS]), min_size=1, max_size=3)


ADAPTIVE_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "interval": maybe(numeric(st.integers(1, 3)), 7),
        "window": maybe(numeric(st.integers(1, 6)), 7),
        "skips": maybe(numeric(st.integers(1, 3)), 7),
        "headroom_limit": maybe(numeric(st.floats(0.01, 1.0)), 7),
        "patience": maybe(numeric(st.integers(1, 2)), 7),
        "demote": maybe(st.booleans(), 7),
        "demote_below": maybe(numeric(st.floats(0.0, 0.5)), 7),
        "calm_reports": maybe(numeric(st.integers(1, 2)), 7),
        "max_promoted_fraction": maybe(numeric(st.floats(0.01, 1.0)), 7),
        "watch": maybe(st.one_of(st.none(), PATTERNS.map(tuple), PATTERNS), 7),
        "fp8_flush_limit": maybe(numeric(st.floats(0.01, 1.0)), 7),
    },
)


SCALE_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "blocks": maybe(st.one_of(st.none(), PATTERNS.map(tuple)), 7),
        "grow_above": maybe(numeric(st.floats(0.0, 0.99)), 7),
        "headroom_bits": maybe(numeric(st.integers(0, 40)), 7),
        "max_growth": maybe(numeric(st.integers(1, 24)), 7),
        "max_exponent": maybe(numeric(st.integers(1, 24)), 7),
    },
)


def _rules(kind: type, fields: dict[str, Any]) -> Any:
    """The rules, or ``None`` when refused up front (the error must name a given field)."""
    try:
        return kind(**fields)
    except (TypeError, ValueError) as exc:
        # It names a given field (or, for a pair out of order, the other of the pair).
        assert any(re.search(rf"\b{f}\b", str(exc)) for f in fields), f"unnamed field: {exc}"
        return None


@pytest.mark.filterwarnings("ignore:adaptive precision. not promoting:RuntimeWarning")
@given(ADAPTIVE_FIELDS, st.one_of(st.none(), SCALE_FIELDS))
@example({"headroom_limit": "0.5"}, None)
@example({"interval": np.int64(1), "watch": ("hott",)}, None)
@example({"interval": 1, "patience": 1, "max_promoted_fraction": 1.0}, {"max_exponent": 24})
@example({"interval": 1}, {"max_exponent": 2000})
@example({"interval": 1}, {"blocks": ("blokcs.*",)})
@example({"demote": True, "interval": 1, "patience": 1, "calm_reports": 1}, {"grow_above": 0.0})
def test_fuzzed_rules_are_refused_up_front_or_train(
    adaptive: dict[str, Any], scales: dict[str, Any] | None
) -> None:
    rules = _rules(AdaptiveRules, adaptive)
    scale_rules = None if scales is None else _rules(BackwardScaleRules, scales)
    if rules is None or (scales is not None and scale_rules is None):
        event("refused up front")
        return
    for name in ("interval", "window", "skips", "patience", "calm_reports"):
        assert type(getattr(rules, name)) is int  # stored plain: hashable, picklable, comparable
    policy = AutocastPolicy("fp16", adaptive=rules, backward_scales=scale_rules or False)
    try:
        net = train(policy)
    except ValueError as exc:  # only a pattern that matches nothing is refused at setup
        found = re.search(r"(watch|blocks)=\.\.\.\): the pattern '([^']*)' matches no", str(exc))
        assert found is not None, exc
        given = rules.watch if found[1] == "watch" else scale_rules and scale_rules.blocks
        assert found[2] in (given or ()) and found[2] not in NAMES, exc
        event("refused at setup (a pattern that matches nothing)")
        return
    event("accepted, trained")
    assert all(torch.isfinite(p).all() for p in net.parameters()), "non-finite weights"
    if policy.backward_scales is not None:
        high = policy.backward_scales.rules.max_exponent
        assert all(0 <= k <= high for k in policy.backward_scales.exponents)
    for part in (policy.adaptive, policy.backward_scales):
        if part is not None:  # a real run's state passes its own checks and loads back
            saved = part.state_dict()
            part.load_state_dict(copy.deepcopy(saved))
            assert part.state_dict() == saved
