"""The scaler's contract where torch leaves a door open.

Every way a setting enters is checked, and torch's own calling conventions keep working:

- torch's setters (``set_growth_factor``, ``set_backoff_factor``, ``set_growth_interval``) refuse
  what the constructor refuses, change nothing when they refuse, and the next ``update()`` uses
  what they accept; lowering the interval below the clean steps already counted grows the scale
  at the next clean step (torch's would never grow it again);
- a loaded state's trackers must fit the settings they count towards;
- ``clip_grad_norm_(..., math.inf)`` measures without clipping, as torch's does;
- a process group is anything with a process group's ``rank()`` and ``size()`` (torch's FSDP
  tests pass such a stand-in), and values that cannot be a group are refused.

The property tests run under the ``ci`` hypothesis profile (derandomized); before a release:
``pytest tests/test_scaler_contract.py -k fuzzed --hypothesis-profile=campaign
--hypothesis-show-statistics``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from hypothesis import event, example, given
from hypothesis import strategies as st
from scaler_scenarios import check_real_steps
from torch import nn

from distamp import DistributedGradScaler

F32 = torch.finfo(torch.float32)
SETTERS = {
    "set_growth_factor": ("new_factor", "growth_factor"),
    "set_backoff_factor": ("new_factor", "backoff_factor"),
    "set_growth_interval": ("new_interval", "growth_interval"),
}


def _step(scaler: Any, model: nn.Module, opt: torch.optim.Optimizer, overflow: bool) -> None:
    opt.zero_grad()
    loss = model(torch.ones(2, 3)).sum() * (math.inf if overflow else 1.0)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def _clean_steps(scaler: Any, n: int) -> list[float]:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    for _ in range(n):
        _step(scaler, model, opt, overflow=False)
        scales.append(scaler.get_scale())
    return scales


# ---------------------------------------------------------------------------- torch's setters
@pytest.mark.parametrize(
    ("setter", "value"),
    [
        ("set_growth_factor", 0.5),  # torch: halves the scale on clean steps
        ("set_growth_factor", 1.0),
        ("set_growth_factor", 1e39),
        ("set_growth_factor", math.inf),
        ("set_growth_factor", True),
        ("set_backoff_factor", 2.0),  # torch: doubles the scale on overflows, up to inf
        ("set_backoff_factor", 1.0),
        ("set_backoff_factor", 0.0),
        ("set_backoff_factor", -0.5),
        ("set_backoff_factor", math.nan),
        ("set_backoff_factor", "0.5"),
        ("set_growth_interval", 0),  # torch: the scale never grows
        ("set_growth_interval", -3),
        ("set_growth_interval", 2**31),
        ("set_growth_interval", 2.0),
        ("set_growth_interval", torch.tensor(2.0)),
        ("set_growth_interval", False),
    ],
)
def test_setters_refuse_what_the_constructor_refuses(setter: str, value: Any) -> None:
    scaler = DistributedGradScaler("cpu", init_scale=16.0, growth_interval=3)
    _clean_steps(scaler, 2)
    before = scaler.state_dict()
    arg = SETTERS[setter][0]
    with pytest.raises(ValueError, match=f"`{arg}`") as caught:
        getattr(scaler, setter)(value)
    shown = str(value.dtype) if isinstance(value, torch.Tensor) else str(value)
    assert shown in str(caught.value)  # the value (a tensor: its dtype) is echoed
    assert scaler.state_dict() == before


@pytest.mark.parametrize(
    ("setter", "value", "stored"),
    [
        ("set_growth_factor", np.float32(3.0), 3.0),
        ("set_growth_factor", torch.tensor(3.0), 3.0),
        ("set_growth_factor", 3, 3.0),
        ("set_backoff_factor", np.float64(0.25), 0.25),
        ("set_backoff_factor", torch.tensor(0.25, dtype=torch.float64), 0.25),
        ("set_growth_interval", np.int64(4), 4),
        ("set_growth_interval", torch.tensor(4), 4),
    ],
)
def test_setters_take_numbers_as_torch_does(setter: str, value: Any, stored: Any) -> None:
    scaler = DistributedGradScaler("cpu")
    getattr(scaler, setter)(value)
    kept = scaler.state_dict()[SETTERS[setter][1]]
    assert kept == stored and type(kept) is type(stored)  # plain numbers: weights_only loads
    check_real_steps(scaler)


def _setter_run(scaler: Any) -> list[float]:
    """Steps with a setter call between them; the scale after each update."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scales = []
    plan = [
        (None, False),
        (("set_growth_factor", 4.0), False),
        (None, False),
        (("set_backoff_factor", 0.125), True),
        (("set_growth_interval", 1), False),
        (("set_growth_factor", 1.5), False),
        (None, True),
        (None, False),
    ]
    for change, overflow in plan:
        if change is not None:
            getattr(scaler, change[0])(change[1])
        _step(scaler, model, opt, overflow)
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("kwargs", [{}, {"sync_free": True}])
def test_accepted_settings_reach_the_next_update_as_in_torch(kwargs: dict[str, Any]) -> None:
    """The update rule is cached until a setting changes: each setter call reaches the next
    update, on the host path of a CPU scaler and on the device path alike."""
    expected = _setter_run(torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2))
    ours = DistributedGradScaler("cpu", init_scale=8.0, growth_interval=2, **kwargs)
    assert _setter_run(ours) == expected
    assert expected == [8.0, 32.0, 32.0, 4.0, 16.0, 24.0, 3.0, 4.5]  # each setter took effect


def test_accepted_settings_reach_the_hysteresis_rule() -> None:
    scaler = DistributedGradScaler("cpu", init_scale=64.0, growth_interval=1, hysteresis=2)
    scaler.set_growth_factor(3.0)
    assert _clean_steps(scaler, 1) == [192.0]
    scaler.set_backoff_factor(0.25)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _step(scaler, model, opt, overflow=True)
    assert scaler.get_scale() == 192.0  # tolerated: hysteresis 2
    _step(scaler, model, opt, overflow=True)
    assert scaler.get_scale() == 48.0  # backed off by the new factor


@pytest.mark.parametrize("kwargs", [{}, {"sync_free": True}, {"hysteresis": 2}, {"min_scale": 1.0}])
def test_lowering_the_interval_below_the_count_grows_at_the_next_clean_step(
    kwargs: dict[str, Any],
) -> None:
    """Five clean steps counted towards an interval of 10, then the interval set to 3: those
    steps already make the scale due, so the next clean step grows it (torch's tracker would sit
    past the interval, and torch grows only when tracker + 1 equals it: never again)."""
    scaler = DistributedGradScaler("cpu", init_scale=4.0, growth_interval=10, **kwargs)
    assert _clean_steps(scaler, 5) == [4.0] * 5
    assert scaler.state_dict()["_growth_tracker"] == 5
    scaler.set_growth_interval(3)
    assert scaler.state_dict()["_growth_tracker"] == 2
    assert _clean_steps(scaler, 4) == [8.0, 8.0, 8.0, 16.0]


def test_lowering_the_interval_before_the_first_step_clamps_the_loaded_count() -> None:
    scaler = DistributedGradScaler("cpu")
    scaler.load_state_dict({**scaler.state_dict(), "growth_interval": 10, "_growth_tracker": 7})
    scaler.set_growth_interval(4)
    assert scaler.state_dict()["_growth_tracker"] == 3
    assert _clean_steps(scaler, 1) == [2.0**17]
    scaler.set_growth_interval(100)  # raising it keeps the count
    assert scaler.state_dict()["_growth_tracker"] == 0


def test_disabled_scaler_checks_its_setters_too() -> None:
    scaler = DistributedGradScaler("cpu", enabled=False)
    with pytest.raises(ValueError, match="new_factor"):
        scaler.set_backoff_factor(2.0)
    scaler.set_growth_interval(7)
    assert scaler.get_growth_interval() == 7


# ---------------------------------------------------------------------------- loaded trackers
@pytest.mark.parametrize(
    ("changes", "fields"),
    [
        ({"growth_interval": 5, "_growth_tracker": 5}, ("_growth_tracker", "growth_interval")),
        ({"growth_interval": 5, "_growth_tracker": 9}, ("_growth_tracker", "growth_interval")),
        ({"growth_interval": 1, "_growth_tracker": 1}, ("_growth_tracker", "growth_interval")),
        ({"hysteresis": 2, "_hysteresis_tracker": 3}, ("_hysteresis_tracker", "hysteresis")),
    ],
)
def test_trackers_beyond_their_settings_are_refused(
    changes: dict[str, Any], fields: tuple[str, str]
) -> None:
    scaler = DistributedGradScaler("cpu", init_scale=8.0, hysteresis=2)
    _clean_steps(scaler, 1)
    before = scaler.state_dict()
    with pytest.raises(ValueError) as caught:
        scaler.load_state_dict({**before, "scale": 2.0, **changes})
    assert all(f"state_dict['{f}']" in str(caught.value) for f in fields)
    assert scaler.state_dict() == before  # the valid scale was not applied either


def test_trackers_at_their_limits_load_and_count_on() -> None:
    scaler = DistributedGradScaler("cpu", init_scale=8.0, hysteresis=3)
    limits = {"growth_interval": 4, "_growth_tracker": 3, "_hysteresis_tracker": 0}
    scaler.load_state_dict({**scaler.state_dict(), **limits})
    assert _clean_steps(scaler, 1) == [16.0]  # due: the count had reached 3 of 4
    assert scaler.state_dict()["_hysteresis_tracker"] == 3  # refilled by the growth


# ---------------------------------------------------------------------------- clipping
def _clip_case(enabled: bool, fused: bool, max_norm: Any) -> tuple[float, float, bool]:
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), fused=fused or None, foreach=None)
    scaler = DistributedGradScaler("cpu", init_scale=8.0, enabled=enabled)
    x = torch.randn(5, 4)
    scaler.scale(model(x).sum()).backward()
    norm = scaler.clip_grad_norm_(opt, max_norm)
    ref(x).sum().backward()
    torch_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf)
    left = 8.0 if enabled and fused else 1.0  # a fused step divides by its grad_scale
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters(), strict=True)]
    same = all(
        g is not None and r is not None and torch.allclose(g / left, r, rtol=1e-6) for g, r in grads
    )
    scaler.step(opt)
    scaler.update()
    return float(norm), float(torch_norm), same


@pytest.mark.parametrize("max_norm", [math.inf, np.float64("inf"), torch.tensor(math.inf)])
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_infinite_max_norm_measures_without_clipping(
    max_norm: Any, enabled: bool, fused: bool
) -> None:
    """torch's ``clip_grad_norm_(params, inf)`` returns the norm and multiplies by 1 (the
    Hugging Face Trainer turns clipping off so); distamp's returns the same norm, unscales and
    clips nothing."""
    norm, torch_norm, unclipped = _clip_case(enabled, fused, max_norm)
    assert norm == pytest.approx(torch_norm, rel=1e-6) and norm > 1.0
    assert unclipped


@pytest.mark.parametrize("bad", [0.0, -1.0, -math.inf, math.nan, np.float32("nan")])
def test_max_norms_that_torch_turns_into_damage_are_refused(bad: Any) -> None:
    """torch zeroes the gradients at 0, flips their sign below 0 and makes them NaN at NaN."""
    scaler = DistributedGradScaler("cpu")
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    with pytest.raises(ValueError, match=r"`max_norm` must be a number > 0 \(math\.inf"):
        scaler.clip_grad_norm_(opt, bad)
    scaler.clip_grad_norm_(opt, 1.0)  # nothing was recorded by the refused call


# ---------------------------------------------------------------------------- process groups
class StandInGroup:
    """What torch's FSDP scaler tests pass as a process group: rank() and size(), and an
    allreduce that leaves the tensors as they are."""

    def __init__(self, rank: int, size: Any) -> None:
        self._rank, self._size, self.calls = rank, size, 0

    def rank(self) -> int:
        return self._rank

    def size(self) -> Any:
        return self._size

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self.calls += 1
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(tensors)
        return _Done(future)


class _Done:
    def __init__(self, future: torch.futures.Future[Any]) -> None:
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


def _inf_step(scaler: DistributedGradScaler) -> Any:
    """torch's FSDP test: a step whose gradient is inf returns None (skipped)."""
    t0 = torch.tensor([math.inf])
    t0.grad = t0.clone()
    opt = torch.optim.SGD([t0], lr=1.0)
    scaler.scale(torch.full((1,), 4.0))
    returned = scaler.step(opt)
    scaler.update()
    return returned


@pytest.mark.parametrize("size", [1, 2, np.int64(2)])
def test_group_like_objects_need_no_default_group(size: Any) -> None:
    group = StandInGroup(0, size)
    scaler = DistributedGradScaler("cpu", init_scale=2.0, process_group=group)
    assert _inf_step(scaler) is None
    assert scaler.get_scale() == 1.0
    assert scaler.collectives_issued == 0 and group.calls == 0  # nobody to agree with


@pytest.mark.parametrize(
    "bad",
    [2, 2.5, "world", [0, 1], object(), torch.ones(2), StandInGroup(0, 0),
     StandInGroup(0, "2"), StandInGroup(0, True)],
)  # fmt: skip
def test_values_that_cannot_be_a_group_are_refused(bad: Any) -> None:
    with pytest.raises(TypeError, match="process_group="):
        DistributedGradScaler("cpu", process_group=bad)


def test_a_group_of_several_ranks_needs_an_allreduce() -> None:
    class NoReduce:
        def rank(self) -> int:
            return 0

        def size(self) -> int:
            return 4

    with pytest.raises(TypeError, match=r"spans 4 ranks but has no allreduce\(\)"):
        DistributedGradScaler("cpu", process_group=NoReduce())
    DistributedGradScaler("cpu", process_group=StandInGroup(0, 1))  # alone: nothing to reduce


@pytest.fixture
def world_of_one() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize(("size", "calls"), [(1, 0), (2, 3)])
def test_group_like_objects_reduce_through_their_allreduce(size: int, calls: int) -> None:
    """As ShardedGradScaler does, the group goes to ``dist.all_reduce``, which calls its
    allreduce: once per step (the step's one collective), never for a group of one."""
    group = StandInGroup(0, size)
    scaler = DistributedGradScaler("cpu", init_scale=2.0, process_group=group)
    _clean_steps(scaler, 3)
    assert group.calls == calls and scaler.collectives_issued == calls
    assert _inf_step(scaler) is None  # the local flag, left as it is by the stand-in


class Delegate:
    """A wrapper that only behaves like a process group, forwarding to a real one."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def rank(self) -> int:
        return int(self.group.rank())

    def size(self) -> int:
        return int(self.group.size())

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self.group.allreduce(tensors, opts)


def _wrapped_group_worker(rank: int, world: int) -> tuple[list[float], list[bool], int]:
    group = Delegate(dist.group.WORLD)
    scaler = DistributedGradScaler("cpu", init_scale=8.0, growth_interval=1, process_group=group)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales, skipped = [], []
    for k in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.ones(2, 3)).sum()).backward()
        grad = model.weight.grad
        if k == 1 and rank == 1 and grad is not None:
            grad[0, 0] = math.inf  # one rank only
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(bool(scaler.last_step_skipped))
    return scales, skipped, scaler.collectives_issued


def test_a_wrapped_real_group_agrees_across_ranks() -> None:
    (s0, k0, c0), (s1, k1, c1) = run_ranks(_wrapped_group_worker, 2, timeout=120)
    assert s0 == s1 == [16.0, 8.0, 16.0]
    assert k0 == k1 == [False, True, False]
    assert c0 == c1 == 3


# ---------------------------------------------------------------------------- property tests
def _numeric(values: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Each number as Python, numpy and (0-d) tensor values, as torch takes them."""

    def kinds(v: Any) -> st.SearchStrategy[Any]:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return st.just(v)
        if isinstance(v, int):
            small = -(2**63) <= v < 2**63
            return st.sampled_from([v, np.int64(v), torch.tensor(v)] if small else [v])
        return st.sampled_from([v, np.float64(v), torch.tensor(v, dtype=torch.float64)])

    return values.flatmap(kinds)


JUNK = _numeric(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0, 1, 1.0, 2**31, 2**31 - 1, 3.5e38, 1e-50, "2", [2]]),
    )
)
SETTER_VALUES = {
    "set_growth_factor": _numeric(st.floats(1.0, 1e39)),
    "set_backoff_factor": _numeric(st.floats(-0.5, 1.5)),
    "set_growth_interval": _numeric(st.integers(-2, 2**32)),
}


@st.composite
def _setter_calls(draw: st.DrawFn) -> tuple[str, Any]:
    setter = draw(st.sampled_from(sorted(SETTERS)))
    return setter, draw(st.one_of(SETTER_VALUES[setter], SETTER_VALUES[setter], JUNK))


@given(
    _setter_calls(),
    st.sampled_from([{}, {"hysteresis": 2}, {"sync_free": True}, {"min_scale": 1e-30}]),
)
@example(("set_backoff_factor", 1e-45), {})
@example(("set_growth_factor", 3.4e38), {})
@example(("set_growth_interval", 1), {"hysteresis": 2})
@example(("set_backoff_factor", np.float32(0.5)), {"sync_free": True})
def test_fuzzed_setters(call: tuple[str, Any], kwargs: dict[str, Any]) -> None:
    setter, value = call
    scaler = DistributedGradScaler("cpu", init_scale=2.0**10, growth_interval=3, **kwargs)
    _clean_steps(scaler, 2)  # a tracker that counts, lazily created tensors
    before = scaler.state_dict()
    try:
        getattr(scaler, setter)(value)
    except ValueError as exc:
        assert f"`{SETTERS[setter][0]}`" in str(exc), f"unnamed argument: {exc}"
        assert scaler.state_dict() == before  # nothing changed
        event("refused with ValueError")
        return
    event("accepted, stepped")
    assert type(scaler.state_dict()[SETTERS[setter][1]]) in (int, float)
    check_real_steps(scaler)


@given(
    st.integers(1, 12),
    st.integers(0, 14),
    st.integers(1, 4),
    st.integers(0, 5),
    st.booleans(),
)
@example(4, 3, 1, 1, False)
@example(4, 4, 1, 1, False)
@example(1, 0, 2, 2, True)
@example(3, 1, 2, 3, False)
def test_fuzzed_tracker_states(
    interval: int, tracker: int, hysteresis: int, left: int, sync_free: bool
) -> None:
    """A state is loaded iff each tracker fits its setting; a loaded one grows the scale after
    exactly ``interval - tracker`` clean steps (never "never")."""
    scaler = DistributedGradScaler("cpu", init_scale=2.0**10, sync_free=sync_free)
    before = scaler.state_dict()
    state = {
        **before,
        "growth_interval": interval,
        "_growth_tracker": tracker,
        "hysteresis": hysteresis,
        "_hysteresis_tracker": left,
    }
    consistent = tracker < interval and left <= hysteresis
    try:
        scaler.load_state_dict(state)
    except ValueError as exc:
        assert not consistent, f"refused a consistent state: {exc}"
        assert scaler.state_dict() == before
        event("refused with ValueError")
        return
    assert consistent, "loaded an inconsistent state"
    event("loaded, stepped")
    due = interval - tracker
    assert _clean_steps(scaler, due) == [2.0**10] * (due - 1) + [2.0**11]
    check_real_steps(scaler)
