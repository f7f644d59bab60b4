"""Activation checkpointing of *functions*: a method other than ``forward``, a closure, a
``functools.partial`` and a lambda over modules, checkpointed reentrant, non-reentrant and
selective, under every policy arm (fp32 ops, the default fp32 modules, an adaptive promotion,
backward scales, fp8), train bitwise as the run without checkpointing, as torch's plain
autocast does. The attention softmax is computed outside any submodule, so only the policy's
ops, carried into the recomputation (:mod:`distamp.precision.checkpointed`), keep it fp32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import distamp
from distamp import AutocastPolicy
from distamp.precision.promotion import Island

D = 32
KINDS = ("method", "partial", "closure")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention whose softmax is a direct call, not a submodule's."""
    return torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    del ctx, args, kwargs
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


Checkpoint = Callable[..., Any]
MODES: dict[str, Checkpoint] = {
    "reentrant": functools.partial(checkpoint, use_reentrant=True),
    "non-reentrant": functools.partial(checkpoint, use_reentrant=False),
    "selective": functools.partial(
        checkpoint,
        use_reentrant=False,
        context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls),
    ),
}


class Block(nn.Module):
    """A pre-norm block; ``kind`` says how its attention and MLP are checkpointed."""

    def __init__(self, ckpt: Checkpoint | None, kind: str | None) -> None:
        super().__init__()
        self.ln, self.qkv, self.out = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.ckpt, self.kind = ckpt, kind

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(q, k, v, 1 / math.sqrt(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln(x)).chunk(3, -1)
        if self.ckpt is None:
            h = self.attend(q, k, v)
        elif self.kind == "method":
            h = self.ckpt(self.attend, q, k, v)
        elif self.kind == "partial":
            h = self.ckpt(functools.partial(attend, scale=1 / math.sqrt(D)), q, k, v)
        else:

            def closure(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return self.attend(q, k, v)

            h = self.ckpt(closure, q, k, v)
        x = x + self.out(h)

        def mlp(t: torch.Tensor) -> torch.Tensor:
            return self.mlp(self.ln2(t))  # a function over modules

        return x + (mlp(x) if self.ckpt is None else self.ckpt(mlp, x))


POLICIES: dict[str, Callable[[], AutocastPolicy]] = {
    "fp32-ops": lambda: AutocastPolicy("bf16", fp32_ops=["softmax"]),
    "fp32-modules": lambda: AutocastPolicy("bf16"),
    "adaptive": lambda: AutocastPolicy("bf16", fp32_ops=["softmax"], adaptive=True),
    "backward-scales": lambda: AutocastPolicy("fp16", backward_scales=True),
    "fp8": lambda: AutocastPolicy("fp8", fp8_min_features=16),
}


def _train(arm: str, mode: str | None, kind: str | None, steps: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ckpt = None if mode is None else MODES[mode]
    net = nn.Sequential(nn.Linear(16, D), Block(ckpt, kind), Block(ckpt, kind), nn.Linear(D, 16))
    policy = POLICIES[arm]()
    amp = distamp.DistAMP(policy.precision.name, strategy="none", policy=policy, device="cpu")
    model, _ = amp.setup(net, lambda p: torch.optim.AdamW(p, lr=1e-2))
    if arm == "adaptive":  # a promoted layer inside the checkpointed MLP function
        Island(net[1].mlp[0])  # type: ignore[index]
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)
        with amp.autocast():
            loss = (model(x).float() - y).square().mean()
        result = amp.backward_and_step(loss)
        assert result is not None and result.stepped
    params = [p.detach().clone() for p in model.parameters()]
    amp.close()
    return params


@functools.cache
def _reference(arm: str) -> list[torch.Tensor]:
    return _train(arm, None, None)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arm", list(POLICIES))
def test_checkpointed_functions_train_bitwise_as_without(arm: str, mode: str) -> None:
    if arm == "fp8":
        pytest.importorskip("torchao")
    ref = _reference(arm)
    for kind in KINDS:
        got = _train(arm, mode, kind)
        for i, (a, b) in enumerate(zip(ref, got, strict=True)):
            assert torch.equal(a, b), (arm, mode, kind, i, (a.float() - b.float()).abs().max())


def test_the_softmax_runs_in_fp32_in_the_recomputation() -> None:
    """The drop-in path (policy applied by hand, torch's own checkpoint): the recomputed softmax
    is fp32, as in the forward; without the policy, autocast's bf16 softmax both times."""
    seen: list[tuple[bool, torch.dtype]] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        out = torch.softmax(t * 2, -1)
        seen.append((torch._C._current_graph_task_id() != -1, out.dtype))
        return out * out  # saves ``out``: the recomputation runs on past the probe

    policy = AutocastPolicy("bf16", fp32_ops=["softmax"])
    x = torch.randn(4, 4, requires_grad=True)
    for reentrant in (True, False):
        seen.clear()
        with policy.autocast("cpu"):
            y = checkpoint(probe, x @ torch.eye(4), use_reentrant=reentrant)
        y.float().sum().backward()
        assert seen == [(False, torch.float32), (True, torch.float32)], (reentrant, seen)


def test_a_function_that_cannot_be_carried_is_refused_in_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch release that keeps the recomputed function elsewhere: the forward raises
    distamp's error naming the function and the fix, before any backward or step."""
    import distamp.precision.checkpointed as carried

    def moved(frame: Any) -> Any:
        if frame.f_code.co_filename.endswith("checkpoint.py"):
            raise RuntimeError("torch 9.9: moved")
        return None

    monkeypatch.setattr(carried, "checkpoint_recomputation", moved)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, D), Block(MODES["non-reentrant"], "method"))
    policy = AutocastPolicy("bf16", fp32_ops=["softmax"])
    amp = distamp.DistAMP("bf16", strategy="none", policy=policy, device="cpu")
    model, optimizer = amp.setup(net, lambda p: torch.optim.AdamW(p, lr=1e-2))
    before = [p.detach().clone() for p in model.parameters()]
    refused = r"'Block.attend' calls the policy's fp32 ops"
    with pytest.raises(RuntimeError, match=refused) as e, amp.autocast():
        model(torch.randn(2, 8, 16))
    assert "Checkpoint a module instead" in str(e.value) and "moved" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not optimizer.state
    amp.close()
