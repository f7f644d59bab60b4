"""8-bit gradient communication (``comm_hook="fp8"`` / ``"fp8-ef"``) on 2 gloo ranks (CPU).

Checked: the reduced gradient against the exact fp32 average of the same gradients (relative
error per format and hook), an inf written into one rank's gradient at chosen steps (every rank
skips exactly those steps, the error-feedback residual is reset, the run goes on), the bytes
each rank sends (payload and scales, against fp32's all-reduce and against the sizes handed to
the collectives), the main job's model trained 300 steps within 1% of the uncompressed run, and
a resume with error-feedback state bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import distamp
from distamp.agreement.traffic import wire_bytes
from distamp.parallel.fp8_comm import Fp8CommState

D = 64


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1)
    )


def _batch(k: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * k + rank)
    x = torch.randn(32, D, generator=g)
    return x, torch.sin(x[:, :1] * 3) + 0.1 * torch.randn(32, 1, generator=g)


def _reduced(rank: int, world: int) -> dict[str, Any]:
    """One backward per hook on the same weights and data (DDP with the hook registered by
    hand); the reduced gradient against the exact fp32 average (each rank's raw gradient
    all-reduced by hand)."""
    import torch.distributed as dist

    from distamp.parallel.comm_hooks import register_comm_hook

    out: dict[str, Any] = {}
    for hook in ("fp32", "fp16", "bf16", "fp8", "fp8-e5m2"):
        kind, options = (hook, {}) if hook != "fp8-e5m2" else ("fp8", {"format": "e5m2"})
        net, plain = _net(), _net()
        ddp = nn.parallel.DistributedDataParallel(net)
        state = register_comm_hook(ddp, kind, **options)
        x, y = _batch(0, rank)
        scale = 1024.0
        (F.mse_loss(ddp(x), y) * scale).backward()
        got = torch.cat([p.grad.flatten() for p in net.parameters()])
        (F.mse_loss(plain(x), y) * scale).backward()
        exact = torch.cat([p.grad.flatten() for p in plain.parameters()])
        dist.all_reduce(exact)
        exact /= world
        out[hook] = {
            "error": float((got - exact).norm() / exact.norm()),
            "sent": state.sent.per_step(),  # type: ignore[union-attr]
            "numel": exact.numel(),
        }
    return out


def test_reduced_gradient_against_the_exact_average() -> None:
    r0, r1 = run_ranks(_reduced, 2, timeout=180)
    errors = {h: r0[h]["error"] for h in r0}
    assert errors["fp32"] < 1e-6 and errors["bf16"] < 1e-2 and errors["fp16"] < 1e-3, errors
    assert errors["fp8"] < 0.05 and errors["fp8-e5m2"] < 0.1, errors
    assert errors["fp8"] < errors["fp8-e5m2"], errors  # e4m3 keeps one more mantissa bit
    # bytes: payload and scales against fp32's all-reduce of the same gradients
    fp32 = r0["fp32"]["sent"]["payload"]
    n = r0["fp32"]["numel"]
    assert fp32 == wire_bytes("all_reduce", 4 * n, 2)
    fp8 = r0["fp8"]["sent"]
    assert (fp8["payload"] + fp8["scales"]) / fp32 <= 0.3, (fp8, fp32)
    assert r0["fp8"]["sent"] == r1["fp8"]["sent"]


# ---------------------------------------------------------------------------- the engine

BAD_LOSS, BAD_GRAD = 3, 6  # an inf in rank 1's loss (inside the bucket); in its gradient after


def _engine(hook: str | None, strategy: str = "ddp") -> distamp.DistAMP:
    amp = distamp.DistAMP("fp16", strategy=strategy, comm_hook=hook)
    amp.setup(_net(), lambda p: torch.optim.AdamW(p, lr=1e-3))
    return amp


def _steps(amp: distamp.DistAMP, rank: int, steps: range, inject: bool = True) -> list[bool]:
    stepped = []
    for k in steps:
        x, y = _batch(k, rank)
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), y)
        if inject and k == BAD_LOSS and rank == 1:
            loss = loss * float("inf")  # the inf reaches the bucket: the hook's raw flag sees it
        amp.backward(loss)
        if inject and k == BAD_GRAD and rank == 1:  # after the all-reduce: the scaler's flag
            grad = next(iter(amp.model.parameters())).grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad  # FSDP2: the shard
            local.view(-1)[0] = float("inf")
        stepped.append(amp.step().stepped)
    return stepped


def _full(amp: distamp.DistAMP) -> list[list[float]]:
    """Every parameter, whole (FSDP2's shards gathered)."""
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in amp.model.parameters()]
    return [p.detach().flatten().tolist() for p in params]


def _skips(rank: int, world: int, strategy: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for hook in ("fp8", "fp8-ef"):
        amp = _engine(hook, strategy)
        stepped = _steps(amp, rank, range(BAD_LOSS + 1))
        state = amp.comm_hook_state
        assert isinstance(state, Fp8CommState)
        kept = state.residuals
        reset = bool(kept) and all(bool((r == 0).all()) for r in kept.values())
        stepped += _steps(amp, rank, range(BAD_LOSS + 1, 12))
        out[hook] = {
            "stepped": stepped,
            "reset": reset if hook == "fp8-ef" else None,
            "finite": all(torch.isfinite(torch.tensor(p)).all() for p in _full(amp)),
            "params": _full(amp),
        }
        amp.close()
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_an_inf_anywhere_skips_the_step_on_every_rank(strategy: str) -> None:
    """An inf in rank 1's bucket (torch's fp8 cast would saturate it to 448) and one written
    into its gradient after the all-reduce (or reduce-scatter): both ranks skip exactly those
    steps, the residual is reset after the first, and the run goes on finite."""
    r0, r1 = run_ranks(_skips, 2, strategy, timeout=180)
    for hook in ("fp8", "fp8-ef"):
        expected = [k not in (BAD_LOSS, BAD_GRAD) for k in range(12)]
        assert r0[hook]["stepped"] == r1[hook]["stepped"] == expected, (hook, r0[hook])
        assert r0[hook]["finite"] and r1[hook]["finite"]
        assert r0[hook]["params"] == r1[hook]["params"]
    assert r0["fp8-ef"]["reset"] and r1["fp8-ef"]["reset"]


def _resume(rank: int, world: int, root: str, strategy: str) -> dict[str, Any]:
    amp = _engine("fp8-ef", strategy)
    _steps(amp, rank, range(10), inject=False)
    amp.save_state(root)
    _steps(amp, rank, range(10, 20), inject=False)
    whole = _full(amp)
    amp.close()
    again = _engine("fp8-ef", strategy)
    assert again.load_state(root)
    state = again.comm_hook_state
    assert isinstance(state, Fp8CommState) and state.residuals  # restored, not empty
    _steps(again, rank, range(10, 20), inject=False)
    resumed = _full(again)
    again.close()
    return {"whole": whole, "resumed": resumed}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_with_error_feedback_is_bitwise_equal(tmp_path: Path, strategy: str) -> None:
    for r in run_ranks(_resume, 2, str(tmp_path), strategy, timeout=180):
        assert r["resumed"] == r["whole"]


# ---------------------------------------------------------------------------- bytes

HOOK_MODULES = ("distamp.parallel.comm_hooks", "distamp.parallel.fp8_comm")
FSDP_MODULES = "torch.distributed.fsdp"  # FSDP2's own reduce-scatter (no hook)
RS_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")  # torch 2.13's name, the older one
TRAFFIC = [("ddp", None), ("ddp", "fp32"), ("ddp", "fp8"), ("fsdp2", None), ("fsdp2", "fp8")]


def _counted(rank: int, world: int) -> dict[str, Any]:
    """Per path: the bytes the engine's metrics report per step (``grad_bytes``, payload, and
    ``grad_scale_bytes``) against the sizes handed to the real collectives (each called through
    a counting wrapper): the hooks' own and FSDP2's reduce-scatter; DDP's own all-reduce (no
    hook) is checked against the counted fp32 hook, which all-reduces the same buckets."""
    import torch.distributed as dist

    from distamp.parallel import fp8_comm

    handed: list[tuple[str, int]] = []
    real = {
        "all_reduce": dist.all_reduce,
        "all_to_all": dist.all_to_all_single,
        "all_gather": fp8_comm._all_gather,
    }
    real.update({n: getattr(dist, n) for n in RS_NAMES if hasattr(dist, n)})

    def counting(kind: str, name: str, arg: int) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller in HOOK_MODULES or caller.startswith(FSDP_MODULES):  # not the scaler's
                t = kwargs["input"] if "input" in kwargs else args[arg]
                handed.append((kind, t.numel() * t.element_size()))
            return real[name](*args, **kwargs)

        return call

    dist.all_reduce = counting("all_reduce", "all_reduce", 0)
    dist.all_to_all_single = counting("all_to_all", "all_to_all", 1)  # (output, input)
    fp8_comm._all_gather = counting("all_gather", "all_gather", 1)  # (output, input)
    for name in RS_NAMES:
        if name in real:
            setattr(dist, name, counting("reduce_scatter", name, 1))
    out: dict[str, Any] = {}
    try:
        for strategy, hook in TRAFFIC:
            amp = _engine(hook, strategy)
            handed.clear()
            _steps(amp, rank, range(3), inject=False)
            stats = amp.metrics.collect(scaler=amp.scaler)  # the three steps' window
            sent = getattr(amp.comm_hook_state, "sent", None)
            out[f"{strategy} {hook}"] = {
                "expected": sum(wire_bytes(kind, n, world) for kind, n in handed) / 3,
                "sent": None if sent is None else (sent.payload + sent.scales) / 3,
                "metrics": (stats.grad_bytes, stats.grad_scale_bytes),
            }
            amp.close()
    finally:
        for name, fn in real.items():
            if name == "all_gather":
                fp8_comm._all_gather = fn
            else:
                setattr(dist, "all_to_all_single" if name == "all_to_all" else name, fn)
    return out


def test_bytes_sent_match_the_collectives_and_fp8_is_under_0_3_of_fp32() -> None:
    r0, r1 = run_ranks(_counted, 2, timeout=180)
    for r in (r0, r1):
        for path, got in r.items():
            payload, scales = got["metrics"]
            assert payload is not None and scales is not None, path
            if path != "ddp None":  # DDP's own all-reduce runs in C++: nothing to wrap
                assert payload + scales == got["expected"], (path, got)
            if got["sent"] is not None:
                assert payload + scales == got["sent"], (path, got)
        assert r["ddp None"]["metrics"] == r["ddp fp32"]["metrics"]  # computed == counted
        for strategy in ("ddp", "fsdp2"):
            fp32, fp8 = r[f"{strategy} None"]["metrics"], r[f"{strategy} fp8"]["metrics"]
            assert fp8[1] > 0 and fp32[1] == 0, (strategy, fp8, fp32)  # scales apart
            ratio = (fp8[0] + fp8[1]) / fp32[0]
            assert 0.25 <= ratio <= 0.3, (strategy, ratio, fp8, fp32)


# ---------------------------------------------------------------------------- the main job

MAIN_STEPS = 300
# FSDP2's uncompressed run ends bitwise where DDP's does (2.14624 both): one reference serves;
# fp8 without error feedback is measured by benchmarks/grad_compression.py, not asserted here.
RUNS = [("ddp", None), ("ddp", "fp8-ef"), ("fsdp2", "fp8-ef")]


def _main_job(rank: int, world: int) -> dict[str, float]:
    """The main job's GPT (launch/model.py), 300 AdamW steps on 2 ranks' own shards, per hook;
    the held-out loss at the end (the same batch of the text for every hook). fp32 compute
    (fp16 matmuls are 7x slower on these CPUs; the hooks scale whatever arrives by powers of
    two, so the loss scale changes nothing here: the skip and rescale paths are tested above)."""
    from launch.model import DATA_FILE, GPT, GPTConfig, ShardedText, lm_loss, load_text

    cfg, text = GPTConfig(), load_text(DATA_FILE)
    held_out = ShardedText(text, context=cfg.context, batch_size=64, rank=0, world_size=1,
                           seed=99, device=torch.device("cpu")).batch(0)  # fmt: skip
    out = {}
    for strategy, hook in RUNS:
        torch.manual_seed(0)
        amp = distamp.DistAMP("fp32", strategy=strategy, comm_hook=hook, max_grad_norm=1.0)
        amp.setup(GPT(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3))
        data = ShardedText(text, context=cfg.context, batch_size=16, rank=rank, world_size=world,
                           seed=0, device=torch.device("cpu"))  # fmt: skip
        for k in range(MAIN_STEPS):
            with amp.autocast():
                loss = lm_loss(amp.model, data.batch(k))
            amp.backward_and_step(loss)
        with torch.no_grad():
            out[f"{strategy} {hook}"] = float(lm_loss(amp.model, held_out))
        amp.close()
    return out


@pytest.mark.slow
def test_main_job_trains_within_1_percent_of_uncompressed() -> None:
    r0, r1 = run_ranks(_main_job, 2, timeout=900)
    assert r0 == r1  # the same model on both ranks: the same held-out loss
    ref = r0["ddp None"]
    for strategy in ("ddp", "fsdp2"):
        assert abs(r0[f"{strategy} fp8-ef"] - ref) / ref < 0.01, r0


def test_bucket_residuals_follow_new_buckets_and_world_sizes() -> None:
    """The flat per-bucket residuals (DDP's hot path) against the names they belong to: a bucket
    of another composition or padding (DDP's rebuilt buckets, a torchft quorum of another size)
    is assembled from what each parameter lost, and the checkpoint holds them by name."""
    from distamp.parallel.fp8_comm import _BucketLayout

    state = Fp8CommState(error_feedback=True, chunk=4)
    names, numels = ("a", "b", "c"), [5, 3, 9]
    two = _BucketLayout(names, numels, 4, world=2)
    lost = torch.arange(two.total, dtype=torch.float32)
    state.keep_bucket(two, lost)
    by_name = {n: v.clone() for n, v in state.residuals.items()}
    assert [by_name[n].numel() for n in names] == numels
    assert torch.equal(by_name["b"], lost[8:11])  # "a" padded to 8 elements, then "b"
    four = _BucketLayout(names, numels, 4, world=4)  # other padding: assembled by name
    assert four.total != two.total
    err = state.bucket_residual(four, torch.zeros(four.total))
    assert err is not None and err.shape == (four.total,)
    for name, part in zip(names, four.views(err), strict=True):
        assert torch.equal(part, by_name[name])
    state.keep_bucket(four, err)
    reordered = _BucketLayout(("c", "a", "b"), [9, 5, 3], 4, world=4)  # DDP's first-step order
    again = state.bucket_residual(reordered, torch.zeros(reordered.total))
    assert again is not None
    assert torch.equal(reordered.views(again)[0], by_name["c"])
    state.keep_bucket(reordered, again)  # as the exchange does
    saved = state.state_dict()
    assert set(saved["residuals"]) == set(names)
    fresh = Fp8CommState(error_feedback=True, chunk=4)
    fresh.load_state_dict(saved)
    restored = fresh.bucket_residual(four, torch.zeros(four.total))
    assert restored is not None
    assert torch.equal(restored, err)
