"""The adaptive parts' checkpoint state (distamp/precision/state_checks.py): checked whole
before any of it is applied.

- ``AdaptivePrecision`` and ``BackwardScales`` state round-trips; each bad entry is refused,
  named, and the object is as it was.
- Property tests: fuzzed state dicts are either refused with nothing changed or loaded and used.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from precision_scenarios import BLOCKS, NAMES, TYPOS, Tiny, batch, maybe, refused

from distamp.observe.numerics import NumericStats
from distamp.precision.adaptive import AdaptivePrecision, AdaptiveRules
from distamp.precision.backward_scales import BackwardScaleRules, BackwardScales

pytestmark = pytest.mark.usefixtures("one_thread")


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
    refused(
        lambda: BackwardScales(BackwardScaleRules(), "fp16").validate_state_dict(good),
        RuntimeError,
        "bind",
    )


def _state_of(draw: Any, valid: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> Any:
    """``valid`` with some entries redrawn from ``fields`` (plausible or junk), maybe one key
    dropped or one added."""
    state = {
        k: draw(maybe(s)) if draw(st.booleans()) else copy.deepcopy(valid[k])
        for k, s in fields.items()
    }
    shape = draw(st.sampled_from(["same", "same", "same", "drop", "add"]))
    if shape == "drop":
        state.pop(draw(st.sampled_from(sorted(state))))
    elif shape == "add":
        state["extra"] = 0
    return state


MODULE = st.sampled_from([*NAMES, *TYPOS])


FORMAT = st.sampled_from(["fp16", "fp32", "bf16", "fp8"])


CHANGE = st.fixed_dictionaries(
    {
        "step": maybe(st.integers(0, 99)),
        "module": maybe(MODULE),
        "before": maybe(FORMAT),
        "after": maybe(FORMAT),
        "reason": maybe(st.just("hot")),
    }
)


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
