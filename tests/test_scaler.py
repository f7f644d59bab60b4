"""DistributedGradScaler: parity with torch, misuse, bad input, state, and what it takes as a
process group (one process, but for one 2-rank run of a wrapped real group).

Every way a setting enters is checked, and torch's own calling conventions keep working:

- fuzzed constructor arguments: either a working scaler (real training steps run) or a
  ``ValueError`` that names the offending field; ``update(new_scale)`` and ``load_state_dict``
  are held to the same rules, and a refused call changes nothing;
- torch's setters (``set_growth_factor``, ``set_backoff_factor``, ``set_growth_interval``) refuse
  what the constructor refuses, change nothing when they refuse, and the next ``update()`` uses
  what they accept; lowering the interval below the clean steps already counted grows the scale
  at the next clean step (torch's would never grow it again);
- a loaded state's trackers must fit the settings they count towards;
- a process group is anything with a process group's ``rank()`` and ``size()`` (torch's FSDP
  tests pass such a stand-in), and values that cannot be a group are refused.

The property tests run under the ``ci`` hypothesis profile (derandomized); before a release:
``pytest tests/test_scaler.py -k fuzzed --hypothesis-profile=campaign
--hypothesis-show-statistics``.
"""

from __future__ import annotations

import copy
import logging
import math
import pickle
from typing import Any

import fuzz_scenarios as fuzz
import numpy as np
import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from hypothesis import event, example, given
from hypothesis import strategies as st
from scaler_scenarios import check_real_steps
from torch import nn

from distamp import DistributedGradScaler, ScalerStateError, ScaleUnderflowError
from distamp.engine import DistAMP

INF = float("inf")
NAN = float("nan")
F32 = torch.finfo(torch.float32)


def _model_and_opt(
    kind: str = "foreach", seed: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    kw = {"fused": True} if kind == "fused" else {"foreach": kind == "foreach"}
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, **kw)


def _run(
    scaler: torch.amp.GradScaler, schedule: list[float], kind: str = "foreach"
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train; ``schedule[i]`` overwrites one gradient element at step i (inf/nan: overflow)."""
    model, opt = _model_and_opt(kind)
    scales = []
    gen = torch.Generator().manual_seed(1)
    for poison in schedule:
        x = torch.randn(4, 8, generator=gen)
        opt.zero_grad()
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        if poison != 1.0:
            model[0].weight.grad[0, 0] = poison
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, {k: v.clone() for k, v in model.state_dict().items()}


SCHEDULE = [1.0, INF, 1.0, 1.0, 1.0, NAN, 1.0, 1.0, 1.0, 1.0, INF, INF, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind", ["foreach", "forloop", "fused"])
def test_scale_trajectory_and_params_match_torch(kind: str) -> None:
    kw = dict(device="cpu", init_scale=1024.0, growth_interval=3)
    ref_scales, ref_params = _run(torch.amp.GradScaler(**kw), SCHEDULE, kind)
    ours = DistributedGradScaler(**kw)
    scales, params = _run(ours, SCHEDULE, kind)
    assert scales == ref_scales
    for k in ref_params:
        assert torch.equal(params[k], ref_params[k]), k
    assert ours.skipped_steps == 4
    sd_ref = torch.amp.GradScaler(**kw)
    _run(sd_ref, SCHEDULE, kind)
    theirs = sd_ref.state_dict()
    mine = ours.state_dict()
    assert {k: mine[k] for k in theirs} == theirs


def test_hysteresis_backs_off_after_n_overflows_and_refills_on_growth() -> None:
    s = DistributedGradScaler("cpu", init_scale=1024.0, growth_interval=2, hysteresis=2)
    scales, _ = _run(s, [INF, INF, INF, 1.0, 1.0, INF, INF])
    # overflow 1 tolerated, overflow 2 backs off, overflow 3 backs off (tracker exhausted),
    # two clean steps grow and refill, then the next overflow is tolerated again.
    assert scales == [1024.0, 512.0, 256.0, 256.0, 512.0, 512.0, 256.0]
    assert s.state_dict()["_hysteresis_tracker"] == 0


def test_max_scale_caps_growth_and_min_scale_raises() -> None:
    s = DistributedGradScaler("cpu", init_scale=4.0, growth_interval=1, max_scale=8.0)
    scales, _ = _run(s, [1.0, 1.0, 1.0])
    assert scales == [8.0, 8.0, 8.0]
    s = DistributedGradScaler("cpu", init_scale=4.0, min_scale=2.0)
    with pytest.raises(ScaleUnderflowError, match="min_scale"):
        _run(s, [INF, INF, INF])
    assert s.get_scale() == 2.0


def test_last_step_skipped_is_a_device_tensor() -> None:
    s = DistributedGradScaler("cpu", init_scale=8.0)
    _run(s, [INF])
    flag = s.last_step_skipped
    assert isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.dim() == 0
    assert bool(flag)
    _run(s, [1.0])
    assert not bool(s.last_step_skipped)


def test_step_returns_optimizer_return_value_and_none_on_skip() -> None:
    class Opt(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[override]
            super().step()
            return "stepped"

    p = torch.nn.Parameter(torch.ones(3))
    opt = Opt([p], lr=0.1)
    s = DistributedGradScaler("cpu")
    s.scale(p.sum()).backward()
    assert s.step(opt) == "stepped"
    s.update()
    opt.zero_grad()
    s.scale(p.sum() * INF).backward()
    assert s.step(opt) is None
    s.update()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_grads_are_unscaled_and_checked(dtype: torch.dtype) -> None:
    p = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    opt = torch.optim.SGD([p], lr=1.0)
    s = DistributedGradScaler("cpu", init_scale=8.0)
    s.scale(p.float().sum()).backward()
    if dtype == torch.float16:  # an fp16 parameter with no master, under loss scaling
        # (bf16 ones of no registered model step as under torch's scaler)
        with pytest.raises(ValueError, match="16-bit parameter"):
            s.unscale_(opt)
        assert torch.equal(p.grad, torch.full((4,), 8.0, dtype=dtype))  # nothing unscaled
        return
    s.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(4, dtype=dtype))
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.zeros(4, dtype=dtype))


def test_misuse_errors_match_torch() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = DistributedGradScaler("cpu")
    with pytest.raises(AssertionError, match=r"before scale\(\)"):
        s.step(opt)
    with pytest.raises(ScalerStateError):
        s.update()
    s.scale(p.sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        s.unscale_(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        s.step(opt)
    with pytest.raises(RuntimeError, match="Closure"):
        s.step(opt, closure=lambda: None)
    s.update()


def test_disabled_scaler_is_a_pass_through() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    s = DistributedGradScaler("cpu", enabled=False)
    loss = p.sum()
    assert s.scale(loss) is loss
    loss.backward()
    s.unscale_(opt)
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.full((2,), 0.5))
    assert s.get_scale() == 1.0 and s.state_dict() == {} and not s.is_enabled()


def test_empty_optimizer_still_records_a_flag() -> None:
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    live = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([frozen], lr=0.1)
    s = DistributedGradScaler("cpu")
    s.scale(live.sum()).backward()
    s.step(opt)  # torch's GradScaler asserts "No inf checks were recorded" here
    s.update()
    assert s.get_scale() == 2.0**16


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"init_scale": math.inf}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"backoff_factor": 0.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, "min_scale"),
        ({"min_scale": -1.0}, "min_scale"),
        ({"device": "gpu"}, "device"),
        ({"device": 3}, "device"),
        ({"enabled": "yes"}, "enabled"),
        ({"init_scale": "big"}, "init_scale"),
    ],
)
def test_bad_constructor_values_name_the_argument(kwargs: dict, field: str) -> None:
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=field):
        DistributedGradScaler(**kwargs)


def test_state_dict_round_trip_before_first_scale_and_from_torch() -> None:
    src = DistributedGradScaler("cpu", init_scale=64.0, growth_interval=2, hysteresis=3)
    _run(src, [INF, 1.0, INF])
    sd = src.state_dict()
    assert sd["skipped_steps"] == 2 and sd["hysteresis"] == 3 and sd["_hysteresis_tracker"] == 1
    dst = DistributedGradScaler("cpu")
    dst.load_state_dict(copy.deepcopy(sd))  # before the first scale()
    assert dst.state_dict() == sd
    _run(dst, [1.0])
    assert dst.get_scale() == 64.0 and dst.skipped_steps == 2

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_interval=7)
    d = DistributedGradScaler("cpu")
    d.load_state_dict(torch_scaler.state_dict())
    assert d.get_scale() == 128.0 and d.get_growth_interval() == 7


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda sd: sd.pop("scale"), "missing"),
        (lambda sd: sd.update(scale=-2.0), "scale"),
        (lambda sd: sd.update(scale="x"), "scale"),
        (lambda sd: sd.update(growth_interval=0), "growth_interval"),
        (lambda sd: sd.update(hysteresis=0), "hysteresis"),
        (lambda sd: sd.update(_growth_tracker=-1), "_growth_tracker"),
    ],
)
def test_malformed_state_dict_is_rejected_and_changes_nothing(mutate, match: str) -> None:
    s = DistributedGradScaler("cpu", init_scale=32.0)
    sd = s.state_dict()
    mutate(sd)
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(sd)
    assert s.get_scale() == 32.0
    with pytest.raises(ValueError, match="dict"):
        s.load_state_dict([1, 2])  # type: ignore[arg-type]


def test_pickle_between_iterations() -> None:
    s = DistributedGradScaler("cpu", init_scale=16.0, hysteresis=2)
    _run(s, [INF, 1.0])
    t = pickle.loads(pickle.dumps(s))
    assert t.state_dict() == s.state_dict()


def test_pickled_copy_and_new_scale_start_clean_iterations() -> None:
    """Per-step records (torch's ``_per_optimizer_states``) never leak across a pickle or an
    ``update(new_scale)``, and torch's mid-iteration pickling guard still sees them."""
    s = DistributedGradScaler("cpu", init_scale=16.0)
    _run(s, [1.0])
    t = pickle.loads(pickle.dumps(s))
    assert len(t._per_optimizer_states) == 0
    assert _run(t, [INF, 1.0])[0] == [8.0, 8.0]
    model, opt = _model_and_opt("foreach")
    t.scale(model(torch.randn(4, 8)).square().mean()).backward()
    t.unscale_(opt)
    with pytest.raises(AssertionError, match="pickled"):
        pickle.dumps(t)
    t.update(4.0)  # a user-set scale ends the iteration as well
    assert len(t._per_optimizer_states) == 0 and t.get_scale() == 4.0
    t.unscale_(opt)  # READY again: no "already been called" error


def test_sync_free_masked_step_leaves_state_bitwise_unchanged_on_skip() -> None:
    model, opt = _model_and_opt("foreach")
    s = DistributedGradScaler("cpu", sync_free=True, init_scale=8.0)
    x = torch.randn(4, 8)
    for poison in (1.0, INF, NAN):
        opt.zero_grad()
        s.scale(model(x).square().mean()).backward()
        if poison != 1.0:
            model[0].weight.grad[0, 0] = poison
            before = copy.deepcopy((model.state_dict(), opt.state_dict()))
        s.step(opt)
        s.update()
        if poison != 1.0:
            after = (model.state_dict(), opt.state_dict())
            for k, v in before[0].items():
                assert torch.equal(v, after[0][k]), k
            for pid, st in before[1]["state"].items():
                for k, v in st.items():
                    assert torch.equal(v, after[1]["state"][pid][k]), (pid, k)
    assert s.skipped_steps == 2


class _SyncCounter:
    """Counts Tensor.item / __bool__ / tolist calls: each is a host sync on an accelerator."""

    METHODS = ("item", "__bool__", "tolist")

    def __init__(self, monkeypatch: pytest.MonkeyPatch, opt: torch.optim.Optimizer) -> None:
        self.count = 0
        self.paused = False
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def wrapped(t: torch.Tensor, *a, _orig=original, **k):  # type: ignore[no-untyped-def]
                self.count += not self.paused
                return _orig(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)
        # The optimizer's own reads of its CPU-resident step counters are not device syncs and
        # not the scaler's doing: they are not counted.
        inner = opt.step

        def step(*a, **k):  # type: ignore[no-untyped-def]
            self.paused = True
            try:
                return inner(*a, **k)
            finally:
                self.paused = False

        monkeypatch.setattr(opt, "step", step)


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_sync_free_step_issues_no_host_sync(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_opt(kind)
    s = DistributedGradScaler("cpu", sync_free=True, init_scale=8.0, growth_interval=2)
    x = torch.randn(4, 8)
    counter = None
    for step, poison in enumerate([1.0, 1.0, INF, 1.0, NAN, 1.0]):
        if step == 1:  # the first step may create optimizer state (one sync for non-fused)
            counter = _SyncCounter(monkeypatch, opt)
        opt.zero_grad()
        loss = model(x).square().mean()
        s.scale(loss).backward()
        if poison != 1.0:
            model[0].weight.grad[0, 0] = poison
        s.step(opt)
        s.update()
    assert counter is not None and counter.count == 0
    monkeypatch.undo()
    assert s.skipped_steps == 2


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_check_only_scales_nothing_and_still_skips(kind: str) -> None:
    model, opt = _model_and_opt(kind)
    s = DistributedGradScaler("cpu", check_only=True)
    x = torch.randn(4, 8)
    for step, poison in enumerate([1.0, NAN, 1.0]):
        opt.zero_grad()
        loss = model(x).square().mean()
        assert s.scale(loss) is loss  # nothing to scale: no multiply either
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if poison != 1.0:
            model[0].weight.grad[0, 0] = poison
        before = [p.detach().clone() for p in model.parameters()]
        s.unscale_(opt)
        if poison == 1.0:  # a check only: the gradients are not rewritten
            pairs = zip(grads, model.parameters(), strict=True)
            assert all(torch.equal(g, p.grad) for g, p in pairs)
        s.step(opt)
        s.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
        assert unchanged == (step == 1) and s.get_scale() == 1.0
    assert s.skipped_steps == 1 and s.check_only


@pytest.mark.parametrize("kwargs", [{}, {"max_scale": 2.0**17}, {"hysteresis": 2}])
def test_cpu_host_bookkeeping_matches_the_device_bookkeeping(kwargs: dict) -> None:
    """A CPU scaler keeps its skip counters on the host (it reads the decision anyway); a
    sync-free one keeps them on device. Same steps, same answers: scale, skips, streak, last
    skip, and the overflow report's step and parameter."""
    scalers = {
        sync_free: DistributedGradScaler("cpu", init_scale=2.0**16, growth_interval=2, **kwargs)
        if not sync_free
        else DistributedGradScaler(
            "cpu", init_scale=2.0**16, growth_interval=2, sync_free=True, **kwargs
        )
        for sync_free in (False, True)
    }
    seen: dict[bool, list[tuple]] = {False: [], True: []}
    for sync_free, scaler in scalers.items():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(9):
            opt.zero_grad()
            loss = model(torch.randn(3, 4)).sum()
            if step in (2, 3, 4, 7):
                loss = loss * math.inf
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            report = scaler.overflow_report()
            seen[sync_free].append(
                (
                    scaler.get_scale(),
                    scaler.skipped_steps,
                    scaler.skip_streak,
                    bool(scaler.last_step_skipped),
                    None if report is None else (report.step, report.entries),
                )
            )
    assert seen[False] == seen[True]
    assert [s[1] for s in seen[False]] == [0, 0, 1, 2, 3, 3, 3, 4, 4]
    assert [s[2] for s in seen[False]] == [0, 0, 1, 2, 3, 0, 0, 1, 0]
    assert scalers[False].state_dict() == scalers[True].state_dict()


# ---------------------------------------------------------------------------- fuzzed input
SCALER_ARGS = st.fixed_dictionaries(
    {},
    optional={
        "init_scale": fuzz.maybe(fuzz.numeric(st.floats(1e-38, 3.4e38))),
        "growth_factor": fuzz.maybe(fuzz.numeric(st.floats(1.0, 1e40))),
        "backoff_factor": fuzz.maybe(fuzz.numeric(st.floats(0.0, 1.0))),
        "growth_interval": fuzz.maybe(fuzz.numeric(st.integers(1, 2**32))),
        "enabled": fuzz.maybe(st.booleans()),
        "hysteresis": fuzz.maybe(fuzz.numeric(st.integers(1, 2**32))),
        "min_scale": fuzz.maybe(st.one_of(st.none(), fuzz.numeric(st.floats(1e-40, 1.0)))),
        "max_scale": fuzz.maybe(st.one_of(st.none(), fuzz.numeric(st.floats(2.0**20, 1e39)))),
        "sync_free": fuzz.maybe(st.booleans()),
        "device": fuzz.maybe(st.sampled_from(["cpu", "cuda", "meta", "tpu", "cpu:0"])),
    },
)


@given(SCALER_ARGS)
@example({"init_scale": 3.5e38, "max_scale": 1e40})
@example({"hysteresis": 2**31})
@example({"growth_interval": 2**63})
@example({"init_scale": 1e-46})
@example({"init_scale": 1e-40})
@example({"backoff_factor": 1e-50})
@example({"backoff_factor": 1e-50, "hysteresis": 2})
@example({"backoff_factor": 1e-50, "min_scale": 1e-30, "init_scale": 1.0})
@example({"growth_interval": np.int64(5), "init_scale": np.float32(8.0)})
@example({"growth_interval": torch.tensor(5), "hysteresis": torch.tensor(2)})
@example({"init_scale": F32.max, "growth_factor": 1e38, "growth_interval": 1})
@example({"init_scale": F32.tiny, "sync_free": True})
@example({"enabled": False})
def test_fuzzed_scaler_arguments(kwargs: dict[str, Any]) -> None:
    kwargs = dict(kwargs)
    device = kwargs.pop("device", "cpu")
    try:
        scaler = DistributedGradScaler(device, **kwargs)
    except ValueError as exc:
        fields = [*kwargs, "device"]
        assert any(f"`{name}`" in str(exc) for name in fields), f"unnamed field: {exc}"
        event("rejected with ValueError")
        return
    event("constructed, stepped")
    if scaler.is_enabled() and torch.device(device).type != "cpu":
        return  # a valid device this machine lacks: nothing to step on
    check_real_steps(scaler)


def test_numpy_and_tensor_numbers_train_like_python_ones() -> None:
    """The issue's numpy rows: accepted like torch.amp.GradScaler, same trajectory."""
    kinds = [
        dict(growth_interval=np.int64(2), init_scale=np.float32(8.0)),
        dict(growth_interval=torch.tensor(2), init_scale=torch.tensor(8.0)),
    ]
    plain = DistributedGradScaler("cpu", growth_interval=2, init_scale=8.0)
    check_real_steps(plain, overflows=1)
    for kw in kinds:
        ours = DistributedGradScaler("cpu", **kw)
        check_real_steps(ours, overflows=1)
        assert ours.state_dict() == plain.state_dict()
    amp = DistAMP("fp16", strategy="none", grad_accum_steps=np.int64(2))
    amp2 = DistAMP("fp16", strategy="none", max_grad_norm=np.float32(1.0))
    assert type(amp.config.grad_accum_steps) is int and type(amp2.config.max_grad_norm) is float


def test_backoff_to_zero_stops_at_the_floor_and_raises() -> None:
    """torch's scaler goes to 0 (then NaN weights); ours stops at the smallest normal float32."""
    ref = torch.amp.GradScaler("cpu", backoff_factor=1e-50)
    ours = DistributedGradScaler("cpu", backoff_factor=1e-50)
    for scaler in (ref, ours):
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler.scale(model(torch.ones(1, 3)).sum() * math.inf).backward()
        scaler.step(opt)
        scaler.update()
    assert ref.get_scale() == 0.0  # what the issue reported, and why the floor exists
    assert ours.get_scale() == F32.tiny
    with pytest.raises(ScaleUnderflowError, match="smallest normal float32"):
        _overflow_twice()  # the second overflow arrives at the floor


def _overflow_twice() -> None:
    scaler = DistributedGradScaler("cpu", backoff_factor=1e-50)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum() * math.inf).backward()
        scaler.step(opt)
        scaler.update()
    scaler.get_scale()


def _stepped(scaler: DistributedGradScaler) -> DistributedGradScaler:
    model = nn.Linear(3, 1)
    scaler.scale(model(torch.ones(1, 3)).sum()).backward()
    scaler.step(torch.optim.SGD(model.parameters(), lr=0.1))
    return scaler


@pytest.mark.parametrize(
    ("new_scale", "match"),
    [
        (0.0, "normal float32"),
        (1e-46, "normal float32"),
        (1e-40, "normal float32"),
        (math.inf, "finite"),
        (math.nan, "finite"),
        (torch.tensor([0.0]), "normal float32"),
        (torch.ones(2), "1-element"),
        (2.0**30, "above `max_scale`"),
    ],
)
def test_update_new_scale_is_checked_like_every_other_scale(new_scale: Any, match: str) -> None:
    """torch's update(new_scale=0.0) leaves a dead scale; ours refuses it and keeps the old one."""
    scaler = _stepped(DistributedGradScaler("cpu", init_scale=8.0, max_scale=2.0**20))
    with pytest.raises(ValueError, match=match):
        scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 8.0


@pytest.mark.parametrize("new_scale", [4.0, np.float32(4.0), torch.tensor(4.0)])
def test_update_new_scale_accepts_what_torch_accepts(new_scale: Any) -> None:
    scaler = _stepped(DistributedGradScaler("cpu", init_scale=8.0))
    scaler.update(new_scale=new_scale)
    assert scaler.get_scale() == 4.0
    _stepped(scaler).update()  # a clean iteration follows
    assert scaler.get_scale() == 4.0


STATE_VALUES = fuzz.numeric(
    st.one_of(
        st.integers(-(2**64), 2**64),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([1e39, 1e-40, 0.0, 2**31, 2**40, 2**63, None, "x", True]),
    )
)


STATE_KEYS = st.sampled_from(
    [
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
        "hysteresis",
        "_hysteresis_tracker",
        "skipped_steps",
        "min_scale",
        "max_scale",
    ]
)


@given(st.dictionaries(STATE_KEYS, STATE_VALUES, min_size=1, max_size=3))
@example({"scale": 1e39})
@example({"_growth_tracker": 2**40})
@example({"_growth_tracker": 2**31 - 1})
@example({"_hysteresis_tracker": 2**31})
@example({"skipped_steps": 2**63})
@example({"scale": np.float32(8.0), "growth_interval": np.int64(3)})
def test_fuzzed_state_dict_contents(changes: dict[str, Any]) -> None:
    scaler = DistributedGradScaler("cpu", init_scale=32.0, hysteresis=2)
    check_real_steps(scaler, overflows=1)
    before = scaler.state_dict()
    try:
        scaler.load_state_dict({**before, **changes})
    except ValueError as exc:
        assert any(f"state_dict['{k}']" in str(exc) for k in changes), f"unnamed key: {exc}"
        assert scaler.state_dict() == before  # nothing changed
        event("rejected with ValueError")
        return
    event("loaded, stepped")
    check_real_steps(scaler)


def test_a_check_only_scaler_never_takes_a_loss_scale(caplog: pytest.LogCaptureFixture) -> None:
    fp16 = DistributedGradScaler("cpu", init_scale=2.0**16)
    check_only = DistributedGradScaler("cpu", check_only=True)
    with caplog.at_level(logging.WARNING, logger="distamp"):
        check_only.load_state_dict(fp16.state_dict())
    assert check_only.get_scale() == 1.0
    assert "the scale stays 1" in caplog.text


# ---------------------------------------------------------------------------- torch's setters
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
