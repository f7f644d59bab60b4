"""DistAMP on 2 real gloo ranks, for each strategy: accumulation, clipping, skip handling and
checkpoint round trips; plus config validation in-process.

All scenarios of one strategy run in ONE spawned process group (spawning costs seconds per rank),
and every rank asserts what it sees; a failing assertion reaches the report with its traceback.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

from distamp.engine import DistAMP

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from launch.model import GPT, Block, GPTConfig, lm_loss  # noqa: E402

CFG = GPTConfig(context=8, d_model=16, n_layers=2, n_heads=2)
INF = float("inf")


def _model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def _batch(rank: int, k: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + k)
    seq = torch.randint(0, CFG.vocab_size, (size, CFG.context + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on every rank, with names independent of the wrapper."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _engine(strategy: str, seed: int = 0, **kw: Any) -> tuple[DistAMP, torch.nn.Module]:
    amp = DistAMP(strategy=strategy, **kw)
    model, _ = amp.setup(_model(seed), lambda p: torch.optim.SGD(p, lr=1.0))
    return amp, model


def _accumulation(rank: int, strategy: str) -> None:
    """Two accumulated micro-batches == one step on their concatenation (fp32)."""
    big, model_big = _engine(strategy, precision="fp32")
    acc, model_acc = _engine(strategy, precision="fp32", grad_accum_steps=2)
    before = _full_params(model_big)
    b1, b2 = _batch(rank, 0), _batch(rank, 1)
    cat = (torch.cat([b1[0], b2[0]]), torch.cat([b1[1], b2[1]]))
    assert big.backward_and_step(lm_loss(model_big, cat)) is not None
    for i, b in enumerate((b1, b2)):
        assert acc.is_last_micro_step == (i == 1)
        with acc.accumulate():
            result = acc.backward_and_step(lm_loss(model_acc, b))
        if strategy == "ddp" and i == 0:
            # Under no_sync the first micro-batch's gradients stay local: ranks differ.
            g = next(p.grad for p in model_acc.parameters() if p.grad is not None).clone()
            others = [torch.empty_like(g) for _ in range(2)]
            dist.all_gather(others, g)
            assert not torch.equal(others[0], others[1]), "micro-batch 1 was synchronized"
        assert (result is None) == (i == 0)
    after_big, after_acc = _full_params(model_big), _full_params(model_acc)
    for name, p0 in before.items():
        assert not torch.equal(p0, after_big[name]), f"{name} did not move"
        torch.testing.assert_close(after_acc[name], after_big[name], rtol=1e-5, atol=1e-6)


def _clipping(rank: int, strategy: str) -> None:
    """The reported norm is the unclipped norm; the update is clipped to max_grad_norm."""
    ref, model_ref = _engine(strategy, precision="fp16")
    clip, model_clip = _engine(strategy, precision="fp16", max_grad_norm=1e-2)
    start = _full_params(model_ref)
    batch = _batch(rank, 2)
    for amp, model in ((ref, model_ref), (clip, model_clip)):
        with amp.autocast():
            loss = lm_loss(model, batch)
        out = amp.backward_and_step(loss)
        assert out is not None and out.stepped and out.loss_scale == 2.0**16
    res = out
    delta = lambda p: torch.sqrt(sum(((p[k] - start[k]).double() ** 2).sum() for k in start))  # noqa: E731
    full_norm = float(delta(_full_params(model_ref)))  # SGD lr=1: the update is the gradient
    assert res.grad_norm is not None and math.isclose(res.grad_norm, full_norm, rel_tol=1e-3)
    assert math.isclose(float(delta(_full_params(model_clip))), 1e-2, rel_tol=1e-3)


def _skip_on_inf(rank: int, strategy: str, how: str) -> None:
    """An inf on ONE rank at step 1: every rank skips, the scheduler does not advance, the scale
    backs off; steps before and after apply normally."""
    amp = DistAMP(
        strategy=strategy, precision="fp16", max_grad_norm=1.0 if how == "shard" else None
    )
    model, _ = amp.setup(
        _model(),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    )
    inject = {"on": False}
    first_block = next(m for m in model.modules() if isinstance(m, Block))

    def poison(_m: Any, _i: Any, out: torch.Tensor) -> None:
        if inject["on"]:
            out.register_hook(lambda g: g * INF)

    first_block.register_forward_hook(poison)
    stepped, lrs = [], []
    for step in range(3):
        before = _full_params(model)
        inject["on"] = rank == 1 and step == 1 and how == "hook"
        with amp.autocast():
            loss = lm_loss(model, _batch(rank, 10 + step))
        amp.backward(loss)
        if rank == 1 and step == 1 and how == "shard":
            # Only rank 1's local shard is poisoned: without agreement rank 0 would step.
            for p in model.parameters():
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                if local is not None and local.numel():
                    local.view(-1)[0] = INF
                    break
        res = amp.step()
        stepped.append(res.stepped)
        lrs.append(amp.optimizer.param_groups[0]["lr"])
        after = _full_params(model)
        changed = any(not torch.equal(v, after[k]) for k, v in before.items())
        assert changed == res.stepped, f"step {step}: params changed={changed}"
        if step == 1:
            assert res.loss_scale == 2.0**15
    assert stepped == [True, False, True], stepped
    assert amp.scheduler.last_epoch == 2 and lrs == pytest.approx([1e-2 / 2, 1e-2 / 2, 1e-2 / 3])
    assert amp.scaler.skipped_steps == 1
    seen = [None, None]
    dist.all_gather_object(seen, (stepped, lrs, float(amp.scaler.get_scale())))
    assert seen[0] == seen[1], seen


def _round_trip(rank: int, strategy: str, directory: str) -> None:
    """save_state/load_state restore everything: the next step is bitwise the same."""
    sched = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)  # noqa: E731
    opt = lambda p: torch.optim.AdamW(p, lr=1e-2)  # noqa: E731
    a = DistAMP(strategy=strategy, precision="fp16", max_grad_norm=1.0)
    model_a, _ = a.setup(_model(0), opt, sched)
    for k in range(3):
        with a.autocast():
            a.backward_and_step(lm_loss(model_a, _batch(rank, 20 + k)))
    torch.manual_seed(1234 + rank)
    a.save_state(directory)
    ckpt = Path(directory)
    assert (ckpt / "latest.json").is_file() and (ckpt / "step_00000003" / "trainer.pt").is_file()
    expected_draw = torch.rand(3)

    b = DistAMP(strategy=strategy, precision="fp16", max_grad_norm=1.0)
    model_b, _ = b.setup(_model(7), opt, sched)  # different init: everything must come from disk
    torch.manual_seed(999)
    assert b.load_state(directory)
    assert torch.equal(torch.rand(3), expected_draw), "RNG stream not restored"
    assert b.step_count == 3 and b.scheduler.last_epoch == 3
    assert b.scaler.state_dict() == a.scaler.state_dict()
    pa, pb = _full_params(model_a), _full_params(model_b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for amp, model in ((a, model_a), (b, model_b)):
        with amp.autocast():
            amp.backward_and_step(lm_loss(model, _batch(rank, 30)))
    pa, pb = _full_params(model_a), _full_params(model_b)
    assert all(torch.equal(pa[k], pb[k]) for k in pa), "resumed step differs"


def _rebuilt_optimizer(rank: int, strategy: str) -> None:
    """FSDP with an already-built optimizer: rebuilt over the sharded parameters, groups kept."""
    model = _model()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    rest = [p for n, p in model.named_parameters() if p.dim() != 2]
    built = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    amp = DistAMP(strategy=strategy, precision="bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped, opt = amp.setup(model, built)
    assert opt is not built and any("rebuilt" in str(w.message) for w in caught)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in wrapped.parameters()
    }
    fresh = _model()
    built = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="factories"):
        DistAMP(strategy=strategy).setup(
            fresh, built, torch.optim.lr_scheduler.StepLR(built, step_size=1)
        )


def _scenarios(rank: int, world: int, strategy: str, directory: str) -> str:
    torch.use_deterministic_algorithms(True)
    _accumulation(rank, strategy)
    _clipping(rank, strategy)
    _skip_on_inf(rank, strategy, "hook")
    if strategy != "ddp":
        _skip_on_inf(rank, strategy, "shard")
        _rebuilt_optimizer(rank, strategy)
    _round_trip(rank, strategy, directory)
    return "ok"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp2"])
def test_engine_on_two_ranks(strategy: str, tmp_path: Path) -> None:
    assert run_ranks(_scenarios, 2, strategy, str(tmp_path / "ckpt"), timeout=180) == ["ok"] * 2


def test_single_process_trains_and_round_trips(tmp_path: Path) -> None:
    amp = DistAMP(precision="fp16", strategy="auto", grad_accum_steps=2, max_grad_norm=1.0)
    amp.setup(_model(), lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert amp.strategy == "none" and amp.scaler.is_enabled()
    stats = amp.fit(
        lambda k: _batch(0, k), lm_loss, steps=4, log_interval=2, checkpoint_dir=tmp_path
    )
    assert stats is not None and stats.step == 4 and math.isfinite(stats.loss)
    assert stats.loss_scale == 2.0**16 and stats.skipped_steps == 0 and stats.grad_norm
    again = DistAMP(precision="fp16", grad_accum_steps=2, max_grad_norm=1.0)
    again.setup(_model(3), lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert again.load_state(tmp_path) and again.step_count == 4
    assert again.fit(lambda k: _batch(0, k), lm_loss, steps=4) is None  # nothing left to do


def test_autocast_uses_the_compute_dtype_on_cpu() -> None:
    for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", None)):
        amp = DistAMP(precision=precision, strategy="none")
        model, _ = amp.setup(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1))
        with amp.autocast():
            out = model(torch.ones(2, 4))
        assert out.dtype == (dtype or torch.float32), precision
        assert amp.scaler.is_enabled() and amp.scaler.check_only == (precision != "fp16")


def test_step_releases_gradients_through_an_own_zero_grad() -> None:
    """After step() every gradient is None: released directly for torch's own ``zero_grad``,
    through the optimizer's method when it has one of its own (a wrapper that also starts the
    next quorum, say), which is then called once a step."""
    calls: list[bool] = []

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            calls.append(set_to_none)
            super().zero_grad(set_to_none)

    for cls in (torch.optim.SGD, Own):
        amp = DistAMP(precision="bf16", strategy="none", max_grad_norm=1.0)
        model, _ = amp.setup(_model(), lambda p, cls=cls: cls(p, lr=0.1))
        for k in range(2):
            with amp.autocast():
                loss = lm_loss(model, _batch(0, k))
            amp.backward_and_step(loss)
            assert all(p.grad is None for p in model.parameters())
        amp.close()
    assert calls == [True, True]


def test_call_order_errors() -> None:
    amp = DistAMP(precision="fp32", grad_accum_steps=2)
    with pytest.raises(RuntimeError, match="setup"):
        amp.step()
    model, _ = amp.setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    amp.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(RuntimeError, match="1 of grad_accum_steps=2"):
        amp.step()
    amp.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(RuntimeError, match="call step"):
        amp.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(ValueError, match="process group"):
        DistAMP(strategy="fsdp2").setup(torch.nn.Linear(2, 1), lambda p: torch.optim.SGD(p, 0.1))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"precision": "fp4"}, "precision"),
        ({"strategy": "zero3"}, "strategy"),
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"grad_accum_steps": 2.0}, "grad_accum_steps"),
        ({"grad_accum_steps": True}, "grad_accum_steps"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
        ({"scaler": torch.amp.GradScaler("cpu")}, "scaler"),
        ({"policy": "fp32-norms"}, "policy"),
        ({"timeout": 0}, "timeout"),
        ({"device": "gpu:x"}, "device"),
    ],
)
def test_bad_config_names_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DistAMP(**kwargs)
