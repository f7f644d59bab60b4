"""Single-process DistributedGradScaler: parity with torch, misuse, bad input, state."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch

from distamp import DistributedGradScaler, ScalerStateError, ScaleUnderflowError

INF = float("inf")
NAN = float("nan")


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
    if dtype == torch.float16:
        with pytest.raises(ValueError, match="FP16 gradients"):
            s.unscale_(opt)
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
