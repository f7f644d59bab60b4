"""AutocastPolicy: fp32 ops and modules under CPU (and CUDA) autocast, checked with dtype hooks;
custom_fwd/custom_bwd functions; name patterns; and accuracy against fp32 on the bundled task.

Figures (``benchmarks/policy_accuracy.py``, 60 AdamW steps, bf16, torch 2.13 CPU): relative
weight distance to the fp32 run — bundled GPT (fused ``scaled_dot_product_attention``, logits cast
to fp32): raw autocast 9.34e-2, policy 9.34e-2 (identical: nothing in it is policy-sensitive on
CPU); explicit ``softmax(q k^T)`` attention: raw 1.16e-1, policy 8.66e-2 (1.34x closer), final
loss fp32 3.283, raw 3.210, policy 3.250.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distamp.precision.policy import AutocastPolicy

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.policy_accuracy import ExplicitBlock, train  # noqa: E402
from launch.model import GPTConfig  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = ExplicitBlock(GPTConfig(context=8, d_model=16, n_layers=1, n_heads=2))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _dtypes_seen(model: nn.Module, device: str, policy: AutocastPolicy | None) -> dict[str, Any]:
    """Run one forward+loss under the policy (or raw autocast) and record output dtypes of the
    modules (forward hooks) and of softmax/loss (a wrapper around the real functions' results)."""
    seen: dict[str, Any] = {}
    for name, mod in model.named_modules():
        mod.register_forward_hook(
            lambda _m, _a, out, name=name: seen.__setitem__(name or "root", out.dtype)
        )
    x = torch.randn(2, 8, 16, device=device)
    ctx = (
        policy.autocast(device)
        if policy is not None
        else torch.autocast(device, dtype=torch.bfloat16)
    )
    with ctx:
        logits = model(x)
        seen["softmax"] = torch.softmax(logits, -1).dtype
        seen["log_softmax"] = F.log_softmax(logits, -1).dtype
        seen["exp"] = logits.exp().dtype
        seen["sum"] = logits.sum().dtype
        seen["loss"] = F.cross_entropy(
            logits.flatten(0, 1), torch.zeros(16, dtype=torch.long, device=device)
        ).dtype
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_default_policy_dtypes(device: str) -> None:
    policy = AutocastPolicy("bf16")
    model = policy.apply(_Net().to(device))
    seen = _dtypes_seen(model, device, policy)
    f32, low = torch.float32, torch.bfloat16
    for name in ("block.ln1", "block.ln2", "softmax", "log_softmax", "exp", "sum", "loss"):
        assert seen[name] == f32, (name, seen)
    for name in ("block.qkv", "block.proj", "block.fc", "block.out", "head"):
        assert seen[name] == low, (name, seen)


def test_raw_cpu_autocast_differs_which_is_why_the_policy_exists() -> None:
    seen = _dtypes_seen(_Net(), "cpu", None)
    assert seen["softmax"] == torch.bfloat16 and seen["sum"] == torch.bfloat16
    assert seen["exp"] == torch.bfloat16


def test_name_patterns_and_fp32_policy_and_remove() -> None:
    policy = AutocastPolicy("bf16", fp32_modules=("head", "Linear*"), fp32_ops=())
    model = policy.apply(_Net())
    assert policy.apply(model) is model  # idempotent
    seen = _dtypes_seen(model, "cpu", policy)
    assert seen["head"] == torch.float32 and seen["block.qkv"] == torch.float32
    with policy.autocast("cpu"):  # fp32_ops=(): autocast's own choice for ops
        assert torch.softmax(torch.randn(2, 3).bfloat16(), -1).dtype == torch.bfloat16
    policy.remove()
    assert _dtypes_seen(model, "cpu", policy)["head"] == torch.bfloat16
    # An fp32 policy casts nothing at all.
    assert _dtypes_seen(_Net(), "cpu", AutocastPolicy("fp32"))["head"] == torch.float32


def test_fp32_module_that_raises_restores_autocast() -> None:
    class Boom(nn.LayerNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert not torch.is_autocast_enabled("cpu")
            raise RuntimeError("boom")

    policy = AutocastPolicy("bf16")
    model = policy.apply(Boom(4))
    with policy.autocast("cpu"):
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.randn(2, 4))
        assert torch.is_autocast_enabled("cpu")


class _Scaled(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return (grad.float().sum() * torch.ones_like(x)).to(x.dtype)


class _Fp32Fn(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.exp()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def test_custom_fwd_functions() -> None:
    policy = AutocastPolicy("bf16")
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with policy.autocast("cpu"):
        h = lin(x)
        assert h.dtype == torch.bfloat16
        p = _Scaled.apply(h)  # autocast stays on inside: the matmul is bf16, the softmax fp32
        q = _Fp32Fn.apply(h)  # cast_inputs=fp32: autocast off inside, fp32 out
    assert p.dtype == torch.float32 and q.dtype == torch.float32
    (p.sum() + q.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_policy_is_closer_to_fp32_than_raw_autocast() -> None:
    cfg = GPTConfig(context=16, d_model=32, n_layers=1, n_heads=2)
    _, ref = train(cfg, True, "fp32", 15, "cpu")
    _, raw = train(cfg, True, "raw", 15, "cpu")
    _, pol = train(cfg, True, "policy", 15, "cpu")
    d_raw, d_pol = float((raw - ref).norm()), float((pol - ref).norm())
    print(f"distance to fp32 after 15 steps: raw {d_raw:.3e}, policy {d_pol:.3e}")
    assert d_pol < d_raw


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="fp32_modules"):
        AutocastPolicy("bf16", fp32_modules=(3,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp32_ops"):
        AutocastPolicy("bf16", fp32_ops="softmax")
    with pytest.raises(ValueError, match="precision"):
        AutocastPolicy("fp4")


def test_short_form_names_the_precision_and_what_differs() -> None:
    """Messages show a policy in short: its precision and only the settings off their
    defaults, in a fixed order (the full repr lists every fp32 module and op)."""
    assert AutocastPolicy("fp16").short() == "AutocastPolicy('fp16')"
    assert AutocastPolicy("bf16", reduce_dtype=torch.bfloat16).short() == (
        "AutocastPolicy('bf16'; reduce_dtype)"
    )
    custom = AutocastPolicy("fp16", fp32_modules=["head"], cast_inputs=False, backward_scales=True)
    assert custom.short() == "AutocastPolicy('fp16'; fp32_modules, cast_inputs, backward_scales)"
    assert AutocastPolicy("fp8", fp8_min_features=64).short() == "AutocastPolicy('fp8'; fp8)"
    assert len(custom.short()) < len(repr(custom))
