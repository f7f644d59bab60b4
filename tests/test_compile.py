"""torch.compile of a training step that uses the scaler: no graph break comes from distamp.

torch's own GradScaler methods are on Dynamo's skip list (every ``scale()`` breaks the graph) and
its non-fused ``step()`` reads found_inf with ``.item()``. With ``sync_free=True`` the breaks left
in a whole step are torch's own: ``backward()``, the optimizer's step wrapper and ``zero_grad``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn

import distamp
from distamp import DistributedGradScaler

PACKAGE = str(Path(distamp.__file__).resolve().parent)
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
pytestmark = pytest.mark.skipif(
    _TORCH < (2, 13),
    reason="Dynamo before torch 2.13 fails an internal assertion on the attributes a fused "
    "optimizer's step reads (grad_scale/found_inf)",
)


def _setup(kind: str) -> tuple[nn.Module, torch.optim.Optimizer, DistributedGradScaler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-2, **({"fused": True} if kind == "fused" else {"foreach": True})
    )
    return model, opt, DistributedGradScaler("cpu", sync_free=True, init_scale=1024.0)


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer, scaler: DistributedGradScaler) -> Any:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        norm = scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return norm

    return step


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_no_graph_break_inside_distamp(kind: str) -> None:
    model, opt, scaler = _setup(kind)
    step = _step_fn(model, opt, scaler)
    step(torch.randn(4, 8))  # creates optimizer state (its one host sync for non-fused)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(torch.randn(4, 8))
    innermost = [
        (r.reason, r.user_stack[-1].filename) for r in explained.break_reasons if r.user_stack
    ]
    assert innermost, "expected torch's own breaks (backward, optimizer) to be reported"
    # A break inside distamp's code, or at a call into a scaler method Dynamo refuses to trace
    # (torch's GradScaler methods are on its skip list; the break is then at the caller).
    ours = [
        (reason, f)
        for reason, f in innermost
        if f.startswith(PACKAGE) or "GradScaler" in reason or "distamp" in reason
    ]
    assert not ours, f"graph breaks inside distamp: {ours}"


def test_compiled_step_honours_skips() -> None:
    model, opt, scaler = _setup("fused")
    step = torch.compile(_step_fn(model, opt, scaler), backend="eager")
    x = torch.randn(4, 8)
    norms = []
    for i in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        bad = x.clone()
        if i == 2:
            bad[0, 0] = float("inf")
        norms.append(float(step(bad)))
        same = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
        assert same == (i == 2), f"step {i}: params unchanged={same}"
    assert scaler.skipped_steps == 1 and scaler.get_scale() == 512.0
    assert [n == n and n != float("inf") for n in norms] == [True, True, False, True]
