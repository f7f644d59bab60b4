"""Drop-in parity: the behaviours torch's own GradScaler tests rely on, run side by side.

Every scenario here runs twice in the same process, once with ``torch.amp.GradScaler`` and once
with ``DistributedGradScaler`` (no process group: distamp must then be torch, step by step), and
compares scales, parameters, return values, warnings and errors.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import OptState

from distamp import DistributedGradScaler

SCALERS = {"torch": torch.amp.GradScaler, "distamp": DistributedGradScaler}


def _both(run: Callable[[type], Any]) -> tuple[Any, Any]:
    return run(SCALERS["torch"]), run(SCALERS["distamp"])


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(n)]


# ---------------------------------------------------------------------------------- scale growth
def test_no_ceiling_by_default_follows_torch_past_2_to_the_24() -> None:
    def run(cls: type) -> list[float]:
        w = nn.Parameter(torch.ones(3))
        opt = torch.optim.SGD([w], lr=0.0)
        scaler = cls("cpu", init_scale=2.0**23, growth_interval=1)
        scales = []
        for _ in range(3):
            scaler.scale((w * 2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            scales.append(scaler.get_scale())
        return scales

    ours, theirs = run(DistributedGradScaler), run(torch.amp.GradScaler)
    assert ours == theirs == [2.0**24, 2.0**25, 2.0**26]


def test_huge_init_scale_is_accepted_and_growth_never_reaches_inf() -> None:
    def run(cls: type) -> list[float]:
        w = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.0)
        scaler = cls("cpu", init_scale=1e38, growth_interval=1)
        out = []
        for _ in range(3):
            scaler.scale(w.sum()).backward()  # grads 1e38: finite in fp32
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            out.append(scaler.get_scale())
        return out

    theirs, ours = _both(run)
    assert ours == theirs
    assert all(math.isfinite(s) for s in ours)


# ---------------------------------------------------------------------------------- scale()
def test_scale_accepts_nested_outputs_and_rejects_non_tensors() -> None:
    outputs = (torch.ones(2), [torch.full((3,), 2.0), (torch.zeros(1),)])

    def run(cls: type) -> list[torch.Tensor]:
        scaler = cls("cpu", init_scale=4.0)
        scaled = scaler.scale(outputs)
        flat = [scaled[0], scaled[1][0], scaled[1][1][0]]
        assert isinstance(scaled, tuple) and isinstance(scaled[1], list)
        assert list(scaler.scale(iter([torch.ones(1)]))) == [torch.full((1,), 4.0)]
        with pytest.raises(ValueError):
            scaler.scale(3)
        return flat

    _assert_same(*_both(run))


# ---------------------------------------------------------------------------------- fused step
def test_preset_grad_scale_multiplies_into_the_fused_step() -> None:
    def run(cls: type) -> tuple[torch.Tensor, bool]:
        weight = nn.Parameter(torch.ones(5, 5))
        weight.grad = torch.full_like(weight, 15.0)
        opt = torch.optim.SGD([weight], lr=0.1, fused=True)
        scaler = cls("cpu", init_scale=5.0)
        scaler.scale(torch.ones(5))  # creates the scale, as a loss would
        opt.grad_scale = torch.tensor([3.0])
        scaler.step(opt)
        return weight.grad.clone(), hasattr(opt, "grad_scale")

    theirs, ours = _both(run)
    _assert_same(theirs, ours)
    assert torch.equal(ours[0], torch.ones(5, 5))  # 15 / (5 * 3)
    assert ours[1] is False  # removed after the step, as torch does


class _PlaceHolder(torch.optim.Optimizer):
    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})


class _PassItself(_PlaceHolder):
    seen: ClassVar[list[Any]] = []

    def step(self, closure: Any = None, *, grad_scaler: Any = None) -> None:  # type: ignore[override]
        self.seen.append((grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf")))
        found = grad_scaler._check_inf_per_device(self)
        assert all(float(v) == 0.0 for v in found.values())


class _ReadsAttributes(_PlaceHolder):
    seen: ClassVar[list[Any]] = []

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.seen.append((self.grad_scale, self.found_inf))


def test_deprecated_grad_scaler_argument_warns_and_passes_the_scaler() -> None:
    for cls in SCALERS.values():
        _PassItself.seen.clear()
        _ReadsAttributes.seen.clear()
        model = nn.Linear(4, 1)
        o1, o2 = _PassItself(model.parameters()), _ReadsAttributes(model.parameters())
        scaler = cls("cpu", init_scale=2.0)
        scaler.scale(model(torch.randn(3, 4)).mean()).backward()
        with pytest.warns(FutureWarning):
            scaler.step(o1)
        scaler.step(o2)
        scaler.update()
        ((passed, has_scale, has_inf),) = _PassItself.seen
        assert passed is scaler and not has_scale and not has_inf, cls
        ((grad_scale, found_inf),) = _ReadsAttributes.seen
        assert isinstance(grad_scale, torch.Tensor) and float(grad_scale) == 2.0
        assert isinstance(found_inf, torch.Tensor) and float(found_inf) == 0.0


@pytest.mark.parametrize("optimizer", ["Adam", "AdamW", "SGD"])
def test_fused_and_foreach_optimizers_agree_under_autocast(optimizer: str) -> None:
    """Fused and foreach steps under the same scaler end at the same parameters (CPU autocast),
    and distamp's fused path at torch's, including a step that overflows."""

    def run(cls: type, fused: bool) -> list[torch.Tensor]:
        model = _model()
        kw = {"momentum": 0.9} if optimizer == "SGD" else {}
        opt = getattr(torch.optim, optimizer)(
            model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True, **kw
        )
        scaler = cls("cpu", init_scale=2.0**10, growth_interval=2)
        for i, (x, y) in enumerate(_batches(5)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if i == 2:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()] + [torch.tensor(scaler.get_scale())]

    torch_fused = run(torch.amp.GradScaler, True)
    ours_fused = run(DistributedGradScaler, True)
    ours_foreach = run(DistributedGradScaler, False)
    _assert_same(torch_fused, ours_fused)
    for a, b in zip(ours_fused, ours_foreach, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- loops
def _train(
    cls: type,
    *,
    steps: int = 6,
    inf_at: tuple[int, ...] = (2,),
    body: Callable[..., None],
    n_models: int = 1,
) -> list[Any]:
    models = [_model(seed) for seed in range(n_models)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.5) for m in models]
    scaler = cls("cpu", init_scale=2.0**8, growth_interval=3)
    out: list[Any] = []
    for i, (x, y) in enumerate(_batches(steps)):
        body(scaler, models, opts, x, y, inject=i in inf_at)
        scaler.update()
        for o in opts:
            o.zero_grad()
        out.append(torch.tensor(scaler.get_scale()))
    out.extend(p.detach().clone() for m in models for p in m.parameters())
    return out


def _inject(models: list[nn.Module]) -> None:
    models[-1][2].weight.grad[0, 0] = float("inf")


def test_clipping_after_explicit_unscale_matches_torch() -> None:
    def body(scaler, models, opts, x, y, inject) -> None:  # type: ignore[no-untyped-def]
        (m,), (o,) = models, opts
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        if inject:
            _inject(models)
        scaler.unscale_(o)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        assert scaler._per_optimizer_states[id(o)]["stage"] is OptState.UNSCALED
        scaler.step(o)

    _assert_same(*_both(lambda cls: _train(cls, body=body)))


def test_clipping_scaled_grads_with_a_scaled_threshold_matches_torch() -> None:
    def body(scaler, models, opts, x, y, inject) -> None:  # type: ignore[no-untyped-def]
        (m,), (o,) = models, opts
        scaler.scale(nn.functional.mse_loss(m(x), y)).backward()
        if inject:
            _inject(models)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05 * scaler.get_scale())
        scaler.step(o)

    _assert_same(*_both(lambda cls: _train(cls, body=body)))


def test_gradient_penalty_through_scaled_autograd_grad_matches_torch() -> None:
    def body(scaler, models, opts, x, y, inject) -> None:  # type: ignore[no-untyped-def]
        (m,), (o,) = models, opts
        loss = nn.functional.mse_loss(m(x), y)
        grads = torch.autograd.grad(scaler.scale(loss), list(m.parameters()), create_graph=True)
        inv = 1.0 / scaler.get_scale()
        penalty = sum((g * inv).pow(2).sum() for g in grads).sqrt()
        scaler.scale(loss + penalty).backward()
        if inject:
            _inject(models)
        scaler.step(o)

    _assert_same(*_both(lambda cls: _train(cls, body=body)))


def test_gradient_accumulation_matches_torch() -> None:
    def body(scaler, models, opts, x, y, inject) -> None:  # type: ignore[no-untyped-def]
        (m,), (o,) = models, opts
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True):
            scaler.scale(nn.functional.mse_loss(m(xs), ys) / 2).backward()
        if inject:
            _inject(models)
        scaler.step(o)

    _assert_same(*_both(lambda cls: _train(cls, body=body)))


def test_several_models_losses_and_optimizers_match_torch() -> None:
    def body(scaler, models, opts, x, y, inject) -> None:  # type: ignore[no-untyped-def]
        a, b = models
        out_a, out_b = a(x), b(x)
        loss0 = nn.functional.mse_loss(out_a + out_b, y)
        loss1 = nn.functional.mse_loss(out_a - out_b, y)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if inject:
            _inject(models)
        scaler.unscale_(opts[0])  # one explicitly, one implicitly
        for o in opts:
            scaler.step(o)

    _assert_same(*_both(lambda cls: _train(cls, body=body, n_models=2)))


def test_grads_replaced_between_unscale_and_step_are_what_steps() -> None:
    def run(cls: type) -> list[torch.Tensor]:
        w = nn.Parameter(torch.ones(4))
        opt = torch.optim.SGD([w], lr=1.0)
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale((w * 3).sum()).backward()
        scaler.unscale_(opt)
        w.grad = torch.full((4,), 0.5)  # the user replaces the gradient after unscaling
        scaler.step(opt)
        scaler.update()
        return [w.detach().clone(), torch.tensor(scaler.get_scale())]

    theirs, ours = _both(run)
    _assert_same(theirs, ours)
    assert torch.equal(ours[0], torch.full((4,), 0.5))


def test_sparse_gradients_are_unscaled_and_checked_like_torch() -> None:
    def run(cls: type) -> list[torch.Tensor]:
        scaler = cls("cpu", init_scale=4.0)
        scaler.scale(torch.ones(1))
        out = []
        for dtype, bad in ((torch.float32, False), (torch.float32, True), (torch.float16, False)):
            p = nn.Parameter(torch.zeros(3, 2, dtype=dtype))
            values = torch.tensor([8.0, float("inf") if bad else 4.0], dtype=dtype)
            i = torch.tensor([[0, 2], [1, 0]])
            p.grad = torch.sparse_coo_tensor(i, values, (3, 2))
            opt = torch.optim.SGD([p], lr=0.1)
            found = torch.zeros(())
            flags = scaler._unscale_grads_(opt, torch.tensor(0.25), found, True)
            out.append(sum(flags.values()).reshape(()))
            out.append(p.grad.coalesce().values().float())
        return out

    _assert_same(*_both(run))


def test_state_dict_keys_extend_torch_and_round_trip() -> None:
    theirs, ours = torch.amp.GradScaler("cpu"), DistributedGradScaler("cpu")
    assert set(theirs.state_dict()) <= set(ours.state_dict())
    for cls in SCALERS.values():
        src = cls("cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.25)
        dst = DistributedGradScaler("cpu")
        dst.load_state_dict(src.state_dict())
        assert dst.get_scale() == 8.0
        assert dst.get_growth_factor() == 3.0 and dst.get_backoff_factor() == 0.25
        assert dst.state_dict()["max_scale"] is None


def test_disabled_scalers_warn_and_pass_through_alike() -> None:
    for cls in SCALERS.values():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler = cls("cuda") if not torch.cuda.is_available() else cls("cpu", enabled=False)
        if not torch.cuda.is_available():
            assert any("CUDA is not available" in str(w.message) for w in caught), cls
        assert not scaler.is_enabled()
        loss = torch.ones(())
        assert scaler.scale(loss) is loss
        assert scaler.get_scale() == 1.0
        assert scaler.state_dict() == {}
