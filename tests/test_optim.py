"""The weight-and-optimizer precision (distamp.optim) in one process.

The remainder arithmetic bit for bit; an exact master following torch's fp32 optimizers bit for
bit (AdamW foreach and fused, SGD with Nesterov momentum, fp16 weights through the scaler); a
skipped step writing nothing; refusals changing nothing; checkpoints that round-trip into this
class and into (and from) torch's own optimizers; the policy's fp32 islands; and the lossy
modes (stochastic rounding, Kahan) training as the exact one does.
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distamp
from distamp.optim import MasterWeightOptimizer, WeightPrecision, master_weights
from distamp.optim import master as master_module
from distamp.optim.bits import (
    join_remainder,
    round_nearest_bf16,
    round_nearest_bf16_,
    round_stochastic,
    round_stochastic_,
    split_remainder,
    split_remainder_,
)
from distamp.optim.config import bytes_per_parameter
from distamp.optim.draws import Draws
from distamp.precision.policy import DEFAULT_FP32_MODULES

INF, NAN = float("inf"), float("nan")
Factory = Callable[[Any], torch.optim.Optimizer]


def _mlp(seed: int = 0, norm: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    middle: list[nn.Module] = [nn.LayerNorm(16)] if norm else []
    return nn.Sequential(nn.Linear(8, 16), *middle, nn.Tanh(), nn.Linear(16, 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern (so that -0.0 differs from 0.0 and NaN equals itself)."""
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _masters(opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    return [m.clone() for _, m in opt.master_tensors()]


def _snapshot(model: nn.Module, opt: MasterWeightOptimizer) -> list[torch.Tensor]:
    """Every bit a step could write: weights, what restores the masters, optimizer states."""
    out = [_bits(p) for p in model.parameters()]
    out += [_bits(m.low) for m in opt.masters.values() if m.low is not None]
    for state in opt.state.values():
        out += [_bits(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return len(before) == len(after) and all(
        torch.equal(a, b) for a, b in zip(before, after, strict=True)
    )


def _grads(params: list[nn.Parameter], step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Gradients that are ``dtype`` values (the ones a 16-bit backward writes), over many
    magnitudes, in fp32."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = []
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        g = g * torch.exp2(torch.randint(-6, 3, p.shape, generator=gen).float())
        out.append(g.to(dtype).float())
    return out


# ---------------------------------------------------------------------- bits


def _awkward_fp32(n: int = 200_000) -> torch.Tensor:
    """Finite fp32 values of every sign and magnitude: random bit patterns, zeros,
    subnormals, exact bf16 ties, and values around the largest finite one."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen)
    bits = bits.to(torch.int32)
    tie = torch.randint(-(2**15), 2**15, (2_000,), dtype=torch.int32, generator=gen) << 16
    special = torch.tensor(
        [0, -(2**31), 1, 0x7FFFFF, 0x8000, 0x18000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000],
        dtype=torch.int64,
    ).to(torch.int32)
    subnormal = torch.randint(1, 1 << 23, (2_000,), dtype=torch.int32, generator=gen)
    bits = torch.cat([bits, tie | 0x8000, special, subnormal, subnormal | -(2**31)])
    values = bits.view(torch.float32)
    return values[torch.isfinite(values)]


def test_split_and_join_restore_every_bit() -> None:
    x = _awkward_fp32()
    weight, remainder = split_remainder(x)
    assert weight.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    back = join_remainder(weight, remainder)
    mismatch = (_bits(back) != _bits(x)).nonzero()
    assert mismatch.numel() == 0, f"first mismatch at {mismatch[0].item()}: {x[mismatch[0]]}"


def _plain_split(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split as plain eager bit arithmetic, one new tensor per pass: the reference."""
    bits = master.view(torch.int32)
    high = torch.bitwise_right_shift(bits + 0x8000, 16).to(torch.int16)
    low = (bits - torch.bitwise_left_shift(high.to(torch.int32), 16)).to(torch.int16)
    return high, low


def _plain_join(high: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    joined = torch.bitwise_left_shift(high.to(torch.int32), 16) + low.to(torch.int32)
    return joined.view(torch.float32)


def _every_pattern(n: int = 200_000) -> torch.Tensor:
    """The awkward finite values, then random bit patterns of every kind (infinities and NaNs
    too: the arithmetic is on the bits, whatever they mean)."""
    gen = torch.Generator().manual_seed(7)
    anything = torch.randint(-(2**31), 2**31, (n,), dtype=torch.int64, generator=gen)
    x = torch.cat([_awkward_fp32(), anything.to(torch.int32).view(torch.float32)])
    return x[: x.numel() // 7 * 7]


def test_the_in_place_split_and_join_are_the_plain_bit_arithmetic() -> None:
    x = _every_pattern().reshape(-1, 7)  # shaped, as a parameter is
    high, low = _plain_split(x)
    assert not bool((low.to(torch.int32) - (_bits(x) & 0xFFFF)).remainder(65536).any())
    for work in ("none", "separate", "master"):
        master = x.clone()
        weight = torch.full_like(x, 3.0, dtype=torch.bfloat16)
        remainder = torch.full_like(x, 5, dtype=torch.int16)
        buffer = {"none": None, "separate": torch.empty(x.numel()), "master": master}[work]
        split_remainder_(master, weight, remainder, buffer)
        assert torch.equal(_bits(weight), high) and torch.equal(remainder, low), work
        if work != "master":
            assert torch.equal(_bits(master), _bits(x)), work  # left as it was
        nearest = torch.zeros_like(weight)
        round_nearest_bf16_(x, nearest, None if work == "master" else buffer)
        assert torch.equal(_bits(nearest), high), work
    weight, remainder = split_remainder(x)
    assert torch.equal(_bits(weight), high) and torch.equal(remainder, low)
    assert torch.equal(_bits(round_nearest_bf16(x)), high)
    # Outputs of any strides (a transposed parameter's weight and remainder).
    weight = torch.empty(x.shape[::-1], dtype=torch.bfloat16).t()
    remainder = torch.empty(x.shape[::-1], dtype=torch.int16).t()
    split_remainder_(x, weight, remainder)
    assert torch.equal(_bits(weight), high) and torch.equal(remainder, low)
    # The join: into a reused buffer (a view of a larger one) and into a new tensor.
    arena = torch.full((x.numel() + 11,), 9.0)
    out = arena[: x.numel()].view(x.shape)
    joined = join_remainder(high.view(torch.bfloat16), low, out)
    assert joined.data_ptr() == out.data_ptr()
    assert torch.equal(_bits(joined), _bits(_plain_join(high, low)))
    assert torch.equal(_bits(joined), _bits(x))  # and the round trip is the identity
    assert torch.equal(_bits(join_remainder(high.view(torch.bfloat16), low)), _bits(x))
    assert bool((arena[x.numel() :] == 9.0).all())  # nothing written past ``out``


def test_widening_a_bf16_is_the_shift_of_its_bits_for_every_pattern() -> None:
    """The join's first pass: torch's bf16-to-fp32 copy puts the 16 bits on top of 32, for
    all 65,536 patterns (subnormals and NaN payloads included), even flushing denormals."""
    bits16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    shifted = torch.bitwise_left_shift(bits16.to(torch.int32), 16)
    flush = torch.set_flush_denormal(False)  # whether this CPU can flush them at all
    try:
        for mode in (False, True):
            torch.set_flush_denormal(mode)
            out = torch.empty(bits16.shape).copy_(bits16.view(torch.bfloat16))
            assert torch.equal(out.view(torch.int32), shifted), mode
    finally:
        torch.set_flush_denormal(False)
    assert isinstance(flush, bool)


def test_the_in_place_stochastic_rounding_draws_the_same_stream() -> None:
    """Resumes and ranks depend on it: the numbers round_stochastic drew (torch.randint) are
    the ones round_stochastic_ draws, call after call from one generator."""
    x = _every_pattern().reshape(-1, 7)
    x = torch.where(torch.isfinite(x), x, 1.0)
    plain, fused = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    work = torch.empty(x.numel())
    for _ in range(2):
        expected = round_stochastic(x, plain)
        out = torch.empty_like(x, dtype=torch.bfloat16)
        round_stochastic_(x, out, fused, work)
        assert torch.equal(_bits(out), _bits(expected))
    assert torch.equal(plain.get_state(), fused.get_state())
    with pytest.raises(ValueError, match="cannot be the master"):
        round_stochastic_(x, out, fused, x)


@pytest.mark.parametrize("source", ["numpy", "torch"])
def test_the_chunk_stream_draws_torch_randint_numbers(source: str) -> None:
    """Draws (numpy's mt19937 on the CPU where it is torch's, else torch's generator): the
    numbers torch.randint(0, 65536) draws after the same seed, call after call, and the same
    roundings."""
    for seed in (3, (1 << 40) + 5, (1 << 62) - 1):
        draws = Draws(torch.Generator(), seed)
        if source == "torch":
            draws._numpy = None
        else:
            assert draws._numpy is not None  # numpy is a dependency, and its stream is torch's
        gen = torch.Generator().manual_seed(seed)
        for shape in (torch.Size([5, 7]), torch.Size([40_000]), torch.Size([1])):
            expected = torch.randint(0, 1 << 16, shape, dtype=torch.int32, generator=gen)
            work = torch.empty(shape.numel(), dtype=torch.int32)
            assert torch.equal(draws.int16_range(shape, work), expected), (seed, shape)
    x = _awkward_fp32().reshape(-1, 4)
    draws = Draws(torch.Generator(), 11)
    out = torch.empty_like(x, dtype=torch.bfloat16)
    round_stochastic_(x, out, draws)
    expected = round_stochastic(x, torch.Generator().manual_seed(11))
    assert torch.equal(_bits(out), _bits(expected))


def test_the_weight_is_within_half_a_bf16_step() -> None:
    x = _awkward_fp32()
    weight, _ = split_remainder(x)
    finite = torch.isfinite(weight) & (weight.float().abs() < torch.finfo(torch.bfloat16).max)
    x, weight = x[finite], weight[finite]
    # the neighbour of the weight on x's side: one bit pattern further from zero or nearer
    wbits = _bits(weight).to(torch.int32)
    further = x.double().abs() >= weight.double().abs()
    neighbour = (wbits + torch.where(further, 1, -1)).to(torch.int16).view(torch.bfloat16)
    half_step = (neighbour.double() - weight.double()).abs() / 2
    error = (x.double() - weight.double()).abs()
    assert bool((error <= half_step).all())
    # torch's round-to-nearest-even, but for exact ties, which go away from zero
    tie = (_bits(x) & 0xFFFF) == 0x8000
    rne = x.to(torch.bfloat16)
    assert torch.equal(_bits(weight)[~tie], _bits(rne)[~tie])
    assert bool((weight[tie].double().abs() > x[tie].double().abs()).all())


def test_a_master_that_is_a_bf16_splits_with_no_remainder() -> None:
    x = _awkward_fp32().to(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    weight, remainder = split_remainder(x)
    assert torch.equal(_bits(weight.float()), _bits(x)) and not bool(remainder.any())
    with pytest.raises(TypeError, match="float32"):
        split_remainder(x.double())


def test_stochastic_rounding_keeps_bf16_values_and_is_unbiased() -> None:
    x = _awkward_fp32().to(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    gen = torch.Generator().manual_seed(1)
    assert torch.equal(_bits(round_stochastic(x, gen).float()), _bits(x))
    # a quarter, a half and a tenth of a bf16 step above 1, and two fractions below -3
    values = torch.tensor([1 + 2**-9, 1 + 2**-8, 1 + 0.1 * 2**-7, -3 - 2**-8, -3 - 0.3 * 2**-6])
    n = 100_000
    draws = round_stochastic(values.repeat(n, 1), gen).double()
    for j, v in enumerate(values.double().tolist()):
        down, up = torch.unique(draws[:, j]).tolist()  # the two bf16 values around v
        assert down < v < up, (v, down, up)
        p = (v - down) / (up - down)
        sigma = (up - down) * math.sqrt(p * (1 - p) / n)
        assert abs(draws[:, j].mean().item() - v) < 5 * sigma, v


# ---------------------------------------------------------------------- exact masters

OPTIMIZERS: dict[str, Factory] = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-forloop": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.9), foreach=False),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(
        ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3
    ),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, fused=True),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=1e-3),
}


def _lockstep(
    make: Factory,
    precision: WeightPrecision,
    steps: int = 5,
    norm: bool = False,
    policy: Any = None,
) -> tuple[nn.Module, MasterWeightOptimizer, nn.Module, torch.optim.Optimizer]:
    """A 16-bit model under ``precision`` and its fp32 twin under torch's optimizer, fed the
    same 16-bit-valued gradients for ``steps`` steps."""
    ref, model = _mlp(norm=norm), _mlp(norm=norm)
    ref_opt = make(ref.parameters())
    opt = master_weights(model, make(model.parameters()), precision, policy=policy)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    for step in range(steps):
        for p, r, g in zip(
            params, ref_params, _grads(ref_params, step, precision.torch_dtype), strict=True
        ):
            p.grad, r.grad = g.to(p.dtype), g
        ref_opt.step()
        opt.step() if not precision.needs_scaler else _scaler_free_step(opt)
    return model, opt, ref, ref_opt


def _scaler_free_step(opt: MasterWeightOptimizer) -> None:
    """fp16 weights step only under loss scaling: the protocol's attributes, scale 1."""
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())  # type: ignore[attr-defined]
    try:
        opt.step()
    finally:
        del opt.grad_scale, opt.found_inf  # type: ignore[attr-defined]


def _assert_masters_are(opt: MasterWeightOptimizer, ref: nn.Module) -> None:
    ref_params = list(ref.parameters())
    masters = dict(opt.master_tensors())
    assert len(masters) == len(ref_params)
    for i, (p, r) in enumerate(zip(opt.masters, ref_params, strict=True)):
        m = masters[p]
        diff = (_bits(m) != _bits(r.detach())).nonzero()
        assert diff.numel() == 0, f"parameter {i}: first mismatch at {diff[0].tolist()}"
        # the weight is the master's rounding (ties away from zero for bf16)
        weight = split_remainder(m)[0] if p.dtype == torch.bfloat16 else m.to(p.dtype)
        assert _same_bits(p.detach(), weight)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bf16_exact_master_follows_torch_fp32_optimizer(name: str) -> None:
    precision = WeightPrecision("bf16", chunk_elements=100)  # several chunks a group
    model, opt, ref, ref_opt = _lockstep(OPTIMIZERS[name], precision)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(m.kind == "remainder" and m.low.dtype == torch.int16 for m in opt.masters.values())
    _assert_masters_are(opt, ref)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        for key, value in ref_opt.state[r].items():
            assert _same_bits(opt.state[p][key], value), (name, key)


@pytest.mark.parametrize("name", ["adamw-foreach", "sgd-nesterov"])
def test_fp16_and_sharded_masters_follow_torch_fp32_optimizer(name: str) -> None:
    for precision in (WeightPrecision("fp16"), WeightPrecision("bf16", master="sharded")):
        _, opt, ref, _ = _lockstep(OPTIMIZERS[name], precision)
        assert all(m.kind == "copy" for m in opt.masters.values())
        _assert_masters_are(opt, ref)


def test_sharded_master_rounds_its_weights_as_the_exact_one() -> None:
    """A master landing exactly between two bf16 values: both modes store the same weight."""
    weights = {}
    for master in ("exact", "sharded"):
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1 + 2**-8 + 2**-20)
        opt = master_weights(
            model, torch.optim.SGD(model.parameters(), lr=1.0), WeightPrecision(master=master)
        )
        model.weight.grad = torch.full((1, 1), 2**-20, dtype=torch.bfloat16)
        opt.step()
        assert _masters(opt)[0].item() == 1 + 2**-8  # a tie
        weights[master] = model.weight.item()
    assert weights == {"exact": 1 + 2**-7, "sharded": 1 + 2**-7}


@pytest.mark.parametrize(
    ("master", "states", "amsgrad"),
    [
        ("exact", "bf16", False),
        ("exact", "fp32", False),
        ("stochastic", "fp32", False),
        ("stochastic", "bf16", False),
        ("kahan", "bf16", True),
    ],
)
def test_stepping_a_chunk_in_blocks_changes_no_bit(
    master: str, states: str, amsgrad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks (the cache's grouping of a chunk) against the whole chunk at once: the same
    weights, masters and states, random draws included (a chunk that draws for two lists of
    tensors stays whole)."""

    def make(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, amsgrad=amsgrad, foreach=True)

    precision = WeightPrecision(master=master, states=states)  # type: ignore[arg-type]
    runs = []
    for block in (1 << 30, 20):  # one block per chunk; then about one per tensor
        monkeypatch.setattr(master_module, "BLOCK_ELEMENTS", block)
        model, opt, _, _ = _lockstep(make, precision, steps=4)
        runs.append(_snapshot(model, opt))
    assert _unchanged(*runs)


def test_bf16_states_stay_close_to_fp32_states() -> None:
    make = OPTIMIZERS["adamw-foreach"]
    model, opt, ref, ref_opt = _lockstep(make, WeightPrecision(states="bf16"), steps=8)
    exact_masters = _masters(opt)
    assert {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"} == {
        torch.bfloat16
    }
    ref_params = list(ref.parameters())
    assert not all(
        _same_bits(m, r.detach()) for m, r in zip(exact_masters, ref_params, strict=True)
    )
    for m, r in zip(exact_masters, ref_params, strict=True):
        torch.testing.assert_close(m, r.detach(), rtol=0, atol=2e-3)
    for p, r in zip(model.parameters(), ref_params, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            ours, torchs = opt.state[p][key].float(), ref_opt.state[r][key]
            assert (ours - torchs).norm() < 1e-2 * torchs.norm(), key


def test_fp16_master_through_the_scaler_follows_torch() -> None:
    """A loss-scaled fp16 model: the fp16 gradients, divided by the scale, step the masters
    exactly as torch's fp32 AdamW steps fp32 weights fed the same unscaled values."""
    ref, model = _mlp(), _mlp()
    ref_opt = OPTIMIZERS["adamw-fused"](ref.parameters())
    opt = master_weights(
        model, OPTIMIZERS["adamw-fused"](model.parameters()), WeightPrecision("fp16")
    )
    scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**12)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    for _ in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            assert p.grad is not None and p.grad.dtype == torch.float16
            r.grad = p.grad.float() / scale
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
        assert scaler.get_scale() == scale and not bool(scaler.last_step_skipped)
    _assert_masters_are(opt, ref)


def test_policy_islands_keep_fp32_weights() -> None:
    assert nn.LayerNorm in DEFAULT_FP32_MODULES
    policy = distamp.AutocastPolicy("bf16")
    make = OPTIMIZERS["adamw-foreach"]
    model, opt, ref, _ = _lockstep(make, WeightPrecision(), norm=True, policy=policy)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes == {
        "0.weight": torch.bfloat16,
        "0.bias": torch.bfloat16,
        "1.weight": torch.float32,
        "1.bias": torch.float32,
        "3.weight": torch.bfloat16,
        "3.bias": torch.bfloat16,
    }
    assert [m.kind for m in opt.masters.values()].count("fp32") == 2
    _assert_masters_are(opt, ref)  # the islands stepped in place, as torch steps them
    for p in model[1].parameters():
        assert opt.state[p]["exp_avg"].dtype == torch.float32


# ---------------------------------------------------------------------- the scaler's skip


def _scaled_step(
    model: nn.Module,
    opt: MasterWeightOptimizer,
    scaler: distamp.DistributedGradScaler,
    dtype: torch.dtype,
    step: int,
    inject: float | None = None,
) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    opt.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        loss = F.mse_loss(model(x), y)
    scaler.scale(loss).backward()
    if inject is not None:
        model[2].weight.grad.view(-1)[5] = inject
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("value", [INF, -INF, NAN], ids=["inf", "-inf", "nan"])
def test_a_non_finite_gradient_skips_the_step_writing_nothing(
    dtype: torch.dtype, value: float
) -> None:
    model = _mlp()
    name = "fp16" if dtype == torch.float16 else "bf16"
    opt = master_weights(
        model, OPTIMIZERS["adamw-foreach"](model.parameters()), WeightPrecision(name)
    )
    loss_scaled = dtype == torch.float16
    scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**10, check_only=not loss_scaled)
    for step in range(2):
        _scaled_step(model, opt, scaler, dtype, step)
    before, scale = _snapshot(model, opt), scaler.get_scale()
    _scaled_step(model, opt, scaler, dtype, 2, inject=value)
    assert bool(scaler.last_step_skipped)
    assert _unchanged(before, _snapshot(model, opt))
    assert scaler.get_scale() == (scale / 2 if loss_scaled else 1.0)
    _scaled_step(model, opt, scaler, dtype, 3)
    assert not bool(scaler.last_step_skipped)
    assert not _unchanged(before, _snapshot(model, opt))
    assert all(bool(torch.isfinite(m).all()) for m in _masters(opt))


def test_clipping_through_the_scaler_matches_torch() -> None:
    ref, model = _mlp(), _mlp()
    ref_opt = OPTIMIZERS["adamw-foreach"](ref.parameters())
    opt = master_weights(
        model, OPTIMIZERS["adamw-foreach"](model.parameters()), WeightPrecision("fp16")
    )
    scaler = distamp.DistributedGradScaler("cpu", init_scale=2.0**12)
    x, y = torch.randn(32, 8), 10 * torch.randn(32, 4)
    for _ in range(3):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            r.grad = p.grad.float() / scale
        expected = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=0.5)
        norm = scaler.clip_grad_norm_(opt, max_norm=0.5)
        assert expected > 0.5  # it clips
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        scaler.step(opt)
        scaler.update()
        ref_opt.step()
    for m, r in zip(_masters(opt), ref.parameters(), strict=True):
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------- refusals


def _fp32_bits(model: nn.Module) -> list[tuple[torch.dtype, torch.Tensor]]:
    return [(p.dtype, _bits(p)) for p in model.parameters()]


def _same_fp32(
    before: list[tuple[torch.dtype, torch.Tensor]], after: list[tuple[torch.dtype, torch.Tensor]]
) -> bool:
    return len(before) == len(after) and all(
        da == db and torch.equal(a, b) for (da, a), (db, b) in zip(before, after, strict=True)
    )


class _OwnStep(torch.optim.AdamW):
    def step(self, closure: Any = None) -> Any:  # an update of its own
        return super().step(closure)


def test_optimizers_it_cannot_drive_are_refused_by_name() -> None:
    for make, name in (
        (lambda ps: torch.optim.RMSprop(ps), "RMSprop"),
        (lambda ps: _OwnStep(ps), "_OwnStep"),
    ):
        model = _mlp()
        before = _fp32_bits(model)
        with pytest.raises(ValueError, match=name):
            master_weights(model, make(model.parameters()))
        assert _same_fp32(before, _fp32_bits(model))


def test_a_subclass_that_keeps_torch_step_is_driven() -> None:
    class Plain(torch.optim.AdamW):
        pass

    # torch wraps the step of the first instance's class in its profiling hook
    Plain.step = torch.optim.Optimizer.profile_hook_step(torch.optim.AdamW.step)  # type: ignore[method-assign]
    make: Factory = lambda ps: Plain(ps, lr=1e-2)  # noqa: E731
    _, opt, ref, _ = _lockstep(make, WeightPrecision(), steps=2)
    _assert_masters_are(opt, ref)


def _refused_unchanged(model: nn.Module, opt: torch.optim.Optimizer, match: str) -> None:
    before = _fp32_bits(model)
    state = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        master_weights(model, opt)
    assert _same_fp32(before, _fp32_bits(model))
    assert str(opt.state_dict()) == str(state)


def test_a_stepped_optimizer_or_a_16bit_model_is_refused() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    _refused_unchanged(model, opt, "stepped")
    model = _mlp().half()
    _refused_unchanged(model, torch.optim.AdamW(model.parameters()), "not fp32")
    model = _mlp()
    opt = master_weights(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(ValueError, match="already keeps master"):
        MasterWeightOptimizer(opt, WeightPrecision())


def test_fp16_weights_do_not_step_without_loss_scaling() -> None:
    model = _mlp()
    opt = master_weights(model, torch.optim.AdamW(model.parameters()), WeightPrecision("fp16"))
    model(torch.randn(4, 8).half()).float().sum().backward()
    before = _snapshot(model, opt)
    for step in (opt.step, lambda: torch.amp.GradScaler("cpu", enabled=False).step(opt)):
        with pytest.raises(RuntimeError, match="without loss scaling"):
            step()
        assert _unchanged(before, _snapshot(model, opt))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # torch's speaks the protocol too
    opt.zero_grad()
    scaler.scale(model(torch.randn(4, 8).half()).float().sum()).backward()
    scaler.step(opt)
    assert not _unchanged(before, _snapshot(model, opt))


def test_a_precision_that_is_not_a_weight_precision_is_refused() -> None:
    model = _mlp()
    before = _fp32_bits(model)
    with pytest.raises(TypeError, match="precision='bf16'"):
        master_weights(model, torch.optim.AdamW(model.parameters()), "bf16")  # type: ignore[arg-type]
    assert _same_fp32(before, _fp32_bits(model))


def test_call_order_misuse_is_refused() -> None:
    model = _mlp()
    opt = master_weights(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(RuntimeError, match="before wrapping"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "fp8"}, ValueError, "dtype='fp8'"),
        ({"dtype": "fp32"}, ValueError, "dtype='fp32'"),
        ({"master": "shared"}, ValueError, "master='shared'"),
        ({"states": "fp16"}, ValueError, "states='fp16'"),
        ({"dtype": "fp16", "master": "stochastic"}, ValueError, "stochastic"),
        ({"dtype": "fp16", "master": "kahan"}, ValueError, "kahan"),
        ({"chunk_elements": 0}, ValueError, "chunk_elements=0"),
        ({"chunk_elements": 1.5}, TypeError, "chunk_elements=1.5"),
        ({"chunk_elements": True}, TypeError, "chunk_elements=True"),
    ],
)
def test_weight_precision_refuses_bad_values(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        WeightPrecision(**kwargs)


def test_weight_precision_defaults_and_bytes() -> None:
    wp = WeightPrecision()
    assert (wp.torch_dtype, wp.master, wp.state_dtype, wp.needs_scaler) == (
        torch.bfloat16,
        "exact",
        torch.float32,
        False,
    )
    assert bytes_per_parameter(None) == 16
    assert bytes_per_parameter(wp) == 14
    assert bytes_per_parameter(WeightPrecision("fp16")) == 16
    assert bytes_per_parameter(WeightPrecision(master="sharded"), world_size=4) == 7
    assert bytes_per_parameter(WeightPrecision(states="bf16", master="stochastic")) == 8


# ---------------------------------------------------------------------- checkpoints


def _train(
    model: nn.Module,
    opt: MasterWeightOptimizer,
    scaler: distamp.DistributedGradScaler,
    steps: range,
    dtype: torch.dtype,
) -> None:
    for step in steps:
        _scaled_step(model, opt, scaler, dtype, step)


def _save(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    ("name", "optimizer"),
    [("bf16", "adamw-foreach"), ("fp16", "adamw-foreach"), ("bf16", "sgd-nesterov")],
)
def test_resume_continues_bit_for_bit(name: str, optimizer: str) -> None:
    precision = WeightPrecision(name)
    dtype = precision.torch_dtype

    def build(seed: int) -> tuple[nn.Module, MasterWeightOptimizer, Any]:
        model = _mlp(seed)
        opt = master_weights(model, OPTIMIZERS[optimizer](model.parameters()), precision)
        scaler = distamp.DistributedGradScaler(
            "cpu", init_scale=2.0**10, growth_interval=2, check_only=name == "bf16"
        )
        return model, opt, scaler

    model, opt, scaler = build(0)
    _train(model, opt, scaler, range(3), dtype)
    saved = _save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()}
    )
    _train(model, opt, scaler, range(3, 6), dtype)

    fresh, fresh_opt, fresh_scaler = build(1)  # other weights: everything comes from the save
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    fresh_scaler.load_state_dict(saved["scaler"])
    _train(fresh, fresh_opt, fresh_scaler, range(3, 6), dtype)
    assert _unchanged(_snapshot(model, opt), _snapshot(fresh, fresh_opt))
    assert all(_same_bits(a, b) for a, b in zip(_masters(opt), _masters(fresh_opt), strict=True))


def test_state_dict_loads_into_torch_optimizer_and_back() -> None:
    make = OPTIMIZERS["adamw-foreach"]
    model, opt, ref, ref_opt = _lockstep(make, WeightPrecision(), steps=3)
    # ours -> torch's: fp32 parameters set from the saved masters, then three more steps
    sd = _save(opt.state_dict())
    assert all(v["exp_avg"].dtype == torch.float32 for v in sd["state"].values())
    plain = _mlp(1)
    with torch.no_grad():
        for i, p in enumerate(plain.parameters()):
            p.copy_(sd["state"][i]["master"])
    plain_opt = make(plain.parameters())
    plain_opt.load_state_dict(sd)
    # torch's -> ours: a fresh 16-bit model from the fp32 weights, torch's state loaded
    fresh = copy.deepcopy(ref)
    fresh_opt = master_weights(fresh, make(fresh.parameters()))
    fresh_opt.load_state_dict(_save(ref_opt.state_dict()))
    for step in range(3, 6):
        grads = _grads(list(ref.parameters()), step, torch.bfloat16)
        for net in (model, ref, plain, fresh):
            for p, g in zip(net.parameters(), grads, strict=True):
                p.grad = g.to(p.dtype)
        for o in (opt, ref_opt, plain_opt, fresh_opt):
            o.step()
    _assert_masters_are(opt, ref)
    _assert_masters_are(opt, plain)
    _assert_masters_are(fresh_opt, ref)


def test_a_checkpoint_that_does_not_fit_is_refused_changing_nothing() -> None:
    make = OPTIMIZERS["adamw-foreach"]
    model, opt, _, _ = _lockstep(make, WeightPrecision(), steps=2)
    good = _save(opt.state_dict())

    def variant(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        sd = copy.deepcopy(good)
        for group in sd["param_groups"]:
            group["lr"] = 123.0  # would show if the groups were applied before the check
        for entry in sd["state"].values():
            entry["exp_avg"].add_(1.0)
            entry["master"].add_(1.0)
        edit(sd)
        return sd

    def wrong_moment(sd: dict[str, Any]) -> None:
        sd["state"][3]["exp_avg"] = torch.zeros(5)

    def wrong_master(sd: dict[str, Any]) -> None:
        sd["state"][2]["master"] = torch.zeros(16, 9)

    def wrong_group(sd: dict[str, Any]) -> None:
        sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]

    def extra_group(sd: dict[str, Any]) -> None:
        sd["param_groups"].append({**sd["param_groups"][0], "params": []})

    def unknown_entry(sd: dict[str, Any]) -> None:
        sd["state"][17] = {"exp_avg": torch.zeros(3)}

    before = _snapshot(model, opt)
    lrs = [g["lr"] for g in opt.param_groups]
    for edit, match in (
        (wrong_moment, "exp_avg"),
        (wrong_master, "master"),
        (wrong_group, "parameter groups"),
        (extra_group, "parameter groups"),
        (unknown_entry, "names no parameter"),
    ):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(variant(edit))
        assert _unchanged(before, _snapshot(model, opt)), edit.__name__
        assert [g["lr"] for g in opt.param_groups] == lrs
    opt.load_state_dict(variant(lambda sd: None))  # the same edits, fitting, do apply
    assert [g["lr"] for g in opt.param_groups] == [123.0]
    assert not _unchanged(before, _snapshot(model, opt))


# ---------------------------------------------------------------------- lossy modes


def _regression(master: str | None, steps: int = 150) -> float:
    """A linear regression whose Adam updates (lr 0.012) start below half a bf16 step of its
    weights (1/64 at 4); ``master=None``: torch's Adam over bf16 weights, with no master."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen)
    y = x @ (4 + torch.randn(16, 1, generator=gen))
    model = nn.Linear(16, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(4.0)
    opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.012)
    if master is None:
        model.bfloat16()
    else:
        opt = master_weights(model, opt, WeightPrecision(master=master))

    def loss_and_grad() -> tuple[float, torch.Tensor]:
        error = x @ model.weight.detach().float().T - y
        return error.square().mean().item(), (2 / len(x)) * (error.T @ x)

    for _ in range(steps):
        model.weight.grad = loss_and_grad()[1].bfloat16()
        opt.step()
    return loss_and_grad()[0]


def test_stochastic_and_kahan_train_as_the_exact_master() -> None:
    start, exact = _regression("exact", steps=0), _regression("exact")
    assert exact < start / 20
    assert _regression(None) > 10 * exact  # without a master the small updates are lost
    for master in ("stochastic", "kahan"):
        loss = _regression(master)
        assert loss < start / 10 and abs(loss - exact) < 0.05 * start, (master, loss, exact)
