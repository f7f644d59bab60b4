"""The precision settings' contract: every way a setting enters is checked, and a refused call
changes nothing.

- The rules dataclasses (``AdaptiveRules``, ``BackwardScaleRules``, ``Float8Settings``) check
  every field at construction: a wrong kind is a ``TypeError``, a value out of range a
  ``ValueError``, both naming the field; numpy scalars and 0-d tensors are taken as plain numbers.
- Flags are ``bool``; one string where a sequence of patterns is expected is a ``TypeError``.
- A pattern that matches nothing in the model is refused when it meets the model, naming the
  field, the pattern and the closest names.
- Adaptive and backward-scale checkpoint state is checked whole before any of it is applied.
- Property tests: fuzzed rules either refused up front (or at setup, for a pattern) or train a
  tiny fp16 model with finite weights; fuzzed state dicts either refused with nothing changed or
  loaded and used.
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
from torch import nn

import distamp
from distamp import AutocastPolicy
from distamp.observe.numerics import NumericStats
from distamp.precision.adaptive import AdaptivePrecision, AdaptiveRules
from distamp.precision.backward_scales import BackwardScaleRules, BackwardScales
from distamp.precision.fp8_select import Float8Settings


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


pytestmark = pytest.mark.usefixtures("one_thread")


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


# ---------------------------------------------------------------------------- fields
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


# ---------------------------------------------------------------------------- patterns
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


# ---------------------------------------------------------------------------- state
def bound_adaptive(**rules: Any) -> tuple[AdaptivePrecision, Tiny]:
    net = Tiny()
    adaptive = AdaptivePrecision(
        AdaptiveRules(patience=1, max_promoted_fraction=1.0, **rules), "fp16"
    )
    adaptive.bind(net)
    return adaptive, net


def promoted_state() -> dict[str, Any]:
    adaptive, _ = bound_adaptive()
    adaptive.decide(NumericStats(10, headroom={"hot": 0.9, "inp": 0.01}))
    assert adaptive.promoted == ("hot",)
    return adaptive.state_dict()


def bound_scales(tied: bool = False) -> tuple[BackwardScales, Tiny]:
    net = Tiny()
    if tied:
        net.blocks[1].weight = net.blocks[0].weight
    scales = BackwardScales(BackwardScaleRules(max_exponent=12), "fp16")
    scales.bind(net)
    return scales, net


def scales_state(**exponents: int) -> dict[str, Any]:
    return {
        "exponents": {n: exponents.get(n.replace(".", "_"), 0) for n in BLOCKS},
        "changes": [{"step": 9, "block": "inp", "before": 0, "after": 3, "reason": "underflow"}],
        "forward_order": [0, 1, 2, 3, 4, 5],
        "window": [0.0] * 6 + [0.0, 1.0, 0.0, 0.0, 0.0, 0.0] + [1.5] * 6,
    }


def test_adaptive_state_round_trip_and_refusals_change_nothing() -> None:
    saved = promoted_state()
    fresh, _ = bound_adaptive()
    fresh.load_state_dict(copy.deepcopy(saved))
    assert fresh.promoted == ("hot",) and fresh.state_dict() == saved
    bad = [
        ({**saved, "pinned": ["hott"]}, "'hott'", "closest: 'hot'"),
        ({**saved, "hot": {"lm_haed": 1}}, "'lm_haed'", "'lm_head'"),
        ({**saved, "history": ["hot", 3]}, "history", "3"),
        ({**saved, "calm": {"hot": -1}}, "calm", "-1"),
        ({k: v for k, v in saved.items() if k != "refused"}, "missing ['refused']", ""),
        ({**saved, "changes": saved["changes"] * 2}, "changes'[1]", "while promoted"),
        ({**saved, "changes": [{**saved["changes"][0], "before": "bf16"}]}, "bf16", ""),
        ({**saved, "pinned": ["inp"]}, "'inp' is pinned", ""),
    ]
    for state, *words in bad:
        before = fresh.state_dict()
        refused(lambda s=state: fresh.validate_state_dict(s), ValueError, *words)
        refused(lambda s=state: fresh.load_state_dict(s), ValueError, *words)
        assert fresh.state_dict() == before and fresh.promoted == ("hot",)


def test_backward_scale_state_round_trip_and_refusals_change_nothing() -> None:
    scales, _ = bound_scales()
    assert scales.names == BLOCKS
    good = scales_state(inp=3, blocks_1=12)
    scales.load_state_dict(good)
    assert scales.exponents == [3, 0, 12, 0, 0, 0] and scales.state_dict() == good
    bad = [
        (scales_state(inp=13), "['inp']", "[0, 12]"),
        ({**good, "exponents": {**good["exponents"], "blokcs.0": 1}}, "'blokcs.0'", "'blocks.0'"),
        ({**good, "exponents": {n: 0 for n in BLOCKS[1:]}}, "no exponent for block 'inp'", ""),
        ({**good, "forward_order": [0, 0]}, "forward_order", "more than once"),
        ({**good, "forward_order": [6]}, "forward_order", "[0, 5]"),
        ({**good, "window": [0.0] * 17}, "window", "18"),
        ({**good, "window": [0.5] + [0.0] * 17}, "'window'[0]", "whole"),
        ({**good, "changes": [{**good["changes"][0], "after": 2000}]}, "'after'", "2000"),
        ({**good, "changes": [{**good["changes"][0], "block": "hott"}]}, "'hott'", "'hot'"),
        ({**good, "extra": 1}, "unknown ['extra']", ""),
    ]
    for state, *words in bad:
        before = scales.state_dict()
        refused(lambda s=state: scales.load_state_dict(s), ValueError, *words)
        assert scales.state_dict() == before
    tied, _ = bound_scales(tied=True)  # blocks.0 and blocks.1 share a weight: pinned
    refused(lambda: tied.load_state_dict(scales_state(blocks_0=1)), ValueError, "shares")
    refused(lambda: BackwardScales(BackwardScaleRules(), "fp16").validate_state_dict(good),
            RuntimeError, "bind")  # fmt: skip


# ---------------------------------------------------------------------------- property tests
def _numeric(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
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
    junk = _numeric(JUNK)
    return st.integers(0, odds).flatmap(lambda i: junk if i == odds else valid)


PATTERNS = st.lists(st.sampled_from([*NAMES, "blocks.*", "*", *TYPOS]), min_size=1, max_size=3)
ADAPTIVE_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "interval": maybe(_numeric(st.integers(1, 3)), 7),
        "window": maybe(_numeric(st.integers(1, 6)), 7),
        "skips": maybe(_numeric(st.integers(1, 3)), 7),
        "headroom_limit": maybe(_numeric(st.floats(0.01, 1.0)), 7),
        "patience": maybe(_numeric(st.integers(1, 2)), 7),
        "demote": maybe(st.booleans(), 7),
        "demote_below": maybe(_numeric(st.floats(0.0, 0.5)), 7),
        "calm_reports": maybe(_numeric(st.integers(1, 2)), 7),
        "max_promoted_fraction": maybe(_numeric(st.floats(0.01, 1.0)), 7),
        "watch": maybe(st.one_of(st.none(), PATTERNS.map(tuple), PATTERNS), 7),
        "fp8_flush_limit": maybe(_numeric(st.floats(0.01, 1.0)), 7),
    },
)
SCALE_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "blocks": maybe(st.one_of(st.none(), PATTERNS.map(tuple)), 7),
        "grow_above": maybe(_numeric(st.floats(0.0, 0.99)), 7),
        "headroom_bits": maybe(_numeric(st.integers(0, 40)), 7),
        "max_growth": maybe(_numeric(st.integers(1, 24)), 7),
        "max_exponent": maybe(_numeric(st.integers(1, 24)), 7),
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


def _state_of(draw: Any, valid: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> Any:
    """``valid`` with some entries redrawn from ``fields`` (plausible or junk), maybe one key
    dropped or one added."""
    state = {k: draw(maybe(s)) if draw(st.booleans()) else copy.deepcopy(valid[k])
             for k, s in fields.items()}  # fmt: skip
    shape = draw(st.sampled_from(["same", "same", "same", "drop", "add"]))
    if shape == "drop":
        state.pop(draw(st.sampled_from(sorted(state))))
    elif shape == "add":
        state["extra"] = 0
    return state


MODULE = st.sampled_from([*NAMES, *TYPOS])
FORMAT = st.sampled_from(["fp16", "fp32", "bf16", "fp8"])
CHANGE = st.fixed_dictionaries(
    {"step": maybe(st.integers(0, 99)), "module": maybe(MODULE), "before": maybe(FORMAT),
     "after": maybe(FORMAT), "reason": maybe(st.just("hot"))}
)  # fmt: skip
ADAPTIVE_STATE = {
    "changes": st.lists(CHANGE, max_size=3),
    "history": st.lists(st.one_of(st.none(), MODULE), max_size=4),
    "hot": st.dictionaries(MODULE, maybe(st.integers(0, 5)), max_size=2),
    "calm": st.dictionaries(MODULE, maybe(st.integers(0, 5)), max_size=2),
    "pinned": st.lists(MODULE, max_size=2),
    "refused": st.lists(MODULE, max_size=2),
}
BLOCK = st.sampled_from([*BLOCKS, "hott", "blokcs.0"])
SCALE_STATE = {
    "exponents": st.one_of(
        st.fixed_dictionaries({n: maybe(st.integers(0, 13)) for n in BLOCKS}),
        st.dictionaries(BLOCK, st.integers(0, 3), max_size=6),
    ),
    "changes": st.lists(
        st.fixed_dictionaries(
            {
                "step": maybe(st.integers(0, 9)),
                "block": maybe(BLOCK),
                "before": maybe(st.integers(0, 25)),
                "after": maybe(st.integers(0, 25)),
                "reason": st.just("r"),
            }
        ),
        max_size=2,
    ),
    "forward_order": st.lists(maybe(st.integers(0, 6)), max_size=6),
    "window": st.one_of(
        st.none(),
        st.lists(maybe(st.sampled_from([0.0, 1.0, 2.0, 0.5, 3e38])), min_size=18, max_size=18),
    ),
}


@given(st.data())
def test_fuzzed_adaptive_state_is_refused_unchanged_or_replayed(data: st.DataObject) -> None:
    adaptive, net = bound_adaptive(demote=True)
    adaptive.load_state_dict(promoted_state())
    state = data.draw(st.composite(lambda d: _state_of(d, promoted_state(), ADAPTIVE_STATE))())
    before, promoted = adaptive.state_dict(), adaptive.promoted
    try:
        adaptive.load_state_dict(state)
    except (TypeError, ValueError) as exc:
        assert "adaptive state" in str(exc), exc
        assert adaptive.state_dict() == before and adaptive.promoted == promoted
        event("refused, nothing changed")
        return
    event("loaded")
    saved = adaptive.state_dict()
    adaptive.load_state_dict(saved)  # what it saves, it loads back
    assert adaptive.state_dict() == saved and set(adaptive.promoted) <= set(NAMES)
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(batch(0)[0])
    assert torch.isfinite(out).all()
    adaptive.decide(NumericStats(20, headroom={"hot": 0.01}, skips=((19, "inp"),)))


@given(st.data())
def test_fuzzed_backward_scale_state_is_refused_unchanged_or_used(data: st.DataObject) -> None:
    scales, net = bound_scales()
    scales.load_state_dict(scales_state(inp=2))
    state = data.draw(st.composite(lambda d: _state_of(d, scales_state(), SCALE_STATE))())
    before = scales.state_dict()
    try:
        scales.load_state_dict(state)
    except (TypeError, ValueError) as exc:
        assert "backward-scale state" in str(exc), exc
        assert scales.state_dict() == before
        event("refused, nothing changed")
        return
    event("loaded")
    assert all(type(k) is int and 0 <= k <= 12 for k in scales.exponents)
    net.zero_grad()
    net(batch(0)[0]).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
