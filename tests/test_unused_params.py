"""DDP with a parameter the forward never uses, on 2 real gloo ranks, driven through DistAMP.

Without ``find_unused_parameters`` DDP leaves that parameter's bucket un-averaged, so the ranks
step different gradients and only the next forward raises (measured, without a hook and under
every comm hook: parameters 1e-2 apart after step 1). The engine refuses at the first backward,
on every rank, before the optimizer changes anything.
"""

from __future__ import annotations

from typing import Any

import torch
from _dist import run_ranks
from torch import nn

from distamp.engine import DistAMP


class _WithUnused(nn.Module):
    """Three layers; ``unused`` is built but skipped by the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _run(rank: int, comm_hook: str | None, ddp_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    amp = DistAMP(
        precision="fp16", strategy="ddp", comm_hook=comm_hook, device="cpu", ddp_kwargs=ddp_kwargs
    )
    model, _ = amp.setup(_WithUnused(), lambda p: torch.optim.SGD(p, lr=0.1))
    before = _flat(model).clone()
    error, steps = None, 0
    try:
        for k in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + k))
            with amp.autocast():
                loss = model(x).float().square().mean()
            amp.backward(loss)
            amp.step()
            steps += 1
    except ValueError as exc:
        error = str(exc)
    after = _flat(model)
    everyone = [torch.zeros_like(after) for _ in range(2)]
    torch.distributed.all_gather(everyone, after)
    return {
        "error": error,
        "steps": steps,
        "unchanged": bool(torch.equal(before, after)),
        "ranks_equal": bool(torch.equal(everyone[0], everyone[1])),
    }


def _scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {
        "fp8": _run(rank, "fp8", None),
        "none": _run(rank, None, None),
        "fp8 find_unused": _run(rank, "fp8", {"find_unused_parameters": True}),
    }


def test_unused_parameter_is_refused_before_any_step_on_every_rank() -> None:
    results = run_ranks(_scenarios, 2, timeout=180)
    for rank, r in enumerate(results):
        for hook in ("fp8", "none"):
            got = r[hook]
            assert got["error"] is not None, (rank, hook, got)
            assert "'unused.weight', 'unused.bias'" in got["error"], got["error"]
            assert "ranks 0,1: " in got["error"], got["error"]
            assert "ddp_kwargs={'find_unused_parameters': True}" in got["error"]
            assert got["steps"] == 0 and got["unchanged"] and got["ranks_equal"], (hook, got)
        # The fix named in the refusal trains, and the replicas stay identical.
        fixed = r["fp8 find_unused"]
        assert fixed["error"] is None and fixed["steps"] == 3, fixed
        assert fixed["ranks_equal"] and not fixed["unchanged"], fixed
