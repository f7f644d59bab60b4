"""16-bit weights with their masters under DDP, run on every rank by tests/test_optim_ddp.py.

Each case trains a small MLP cast by :func:`distamp.optim.master_weights`, wrapped in DDP with
small buckets (several all-reduces a step) and stepped through a
:class:`~distamp.DistributedGradScaler` (loss-scaling for fp16, check-only for bf16). At chosen
steps ONE rank's gradient gets a non-finite element, either during backward (a tensor hook on
one parameter: DDP all-reduces it) or after DDP's all-reduce (written into ``.grad``: only that
rank sees it). Every step records what the ranks must agree on, as digests: the weights, the
masters this rank holds, the optimizer state, the skip decision and the scale.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distamp import DistributedGradScaler
from distamp.optim import MasterWeightOptimizer, WeightPrecision, master_weights

INF, NAN = float("inf"), float("nan")
INJECTED_RANK = 1
# step -> (site, value): "hook" during backward, "after" DDP's all-reduce, on INJECTED_RANK
EVERY_FAULT: dict[int, tuple[str, float]] = {
    1: ("hook", INF),
    3: ("hook", -INF),
    5: ("hook", NAN),
    7: ("after", INF),
    9: ("after", -INF),
    11: ("after", NAN),
}


@dataclass(frozen=True)
class Case:
    dtype: str = "bf16"
    master: str = "exact"
    steps: int = 13
    injections: dict[int, tuple[str, float]] = field(default_factory=dict)
    save_at: int | None = None  # save there, train on, then resume a fresh run from the save


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )


class Run:
    """One rank's model, DDP wrapper, master-weight optimizer and scaler."""

    def __init__(self, case: Case, seed: int) -> None:
        self.case = case
        self.precision = WeightPrecision(case.dtype, master=case.master)  # type: ignore[arg-type]
        self.model = mlp(seed)
        inner = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.opt: MasterWeightOptimizer = master_weights(self.model, inner, self.precision)
        self.ddp = DDP(self.model, bucket_cap_mb=0.001)  # a bucket a parameter or so
        self.scaler = DistributedGradScaler(
            "cpu", init_scale=2.0**12, growth_interval=1000, check_only=case.dtype == "bf16"
        )

    def step(self, rank: int, step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own batch
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
        target = self.model[2].weight
        site, value = self.case.injections.get(step, (None, 0.0))
        mine = rank == INJECTED_RANK
        handle = (
            target.register_hook(lambda g: _poisoned(g, value)) if mine and site == "hook" else None
        )
        self.opt.zero_grad()
        with torch.autocast("cpu", dtype=self.precision.torch_dtype):
            loss = F.mse_loss(self.ddp(x), y)
        self.scaler.scale(loss).backward()
        if handle is not None:
            handle.remove()
        if mine and site == "after":
            with torch.no_grad():
                target.grad.view(-1)[7] = value  # type: ignore[union-attr]
        grads = [p.grad for p in self.model.parameters()]
        before = self.weights()
        self.scaler.step(self.opt)
        self.scaler.update()
        return {
            "grad_dtypes": sorted({str(g.dtype) for g in grads if g is not None}),
            "nonfinite": any(not bool(torch.isfinite(g).all()) for g in grads if g is not None),
            "skipped": bool(self.scaler.last_step_skipped),
            "scale": self.scaler.get_scale(),
            "changed": self.weights() != before,
            "weights": self.weights(),
            "masters": self.masters(),
            "state": self.state(),
        }

    def weights(self) -> str:
        return _digest(p.detach() for p in self.model.parameters())

    def masters(self) -> dict[int, str]:
        """The digest of each master this rank holds, by parameter index."""
        index = {p: i for i, p in enumerate(self.model.parameters())}
        return {index[p]: _digest([m]) for p, m in self.opt.master_tensors()}

    def state(self) -> str:
        return _digest(
            v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )

    def checkpoint(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "opt": self.opt.state_dict(),
                "scaler": self.scaler.state_dict(),
            },
            buf,
        )
        return buf.getvalue()

    def load(self, saved: bytes) -> None:
        sd = torch.load(io.BytesIO(saved), weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["opt"])
        self.scaler.load_state_dict(sd["scaler"])

    def holdings(self) -> dict[str, Any]:
        """What this rank keeps: which masters, how many state entries, how many bytes."""
        params = list(self.model.parameters())
        owned = [self.opt.holds_master(p) for p in params]
        masters = [m for m in self.opt.masters.values() if m.low is not None]
        return {
            "owned": owned,
            "numels": [p.numel() for p in params],
            "state_entries": len(self.opt.state),
            "state_keys": sorted({k for s in self.opt.state.values() for k in s}),
            "moment_bytes": sum(
                v.numel() * v.element_size()
                for s in self.opt.state.values()
                for k, v in s.items()
                if k != "step"
            ),
            "master_bytes": sum(m.low.numel() * m.low.element_size() for m in masters),  # type: ignore[union-attr]
            "kinds": [self.opt.masters[p].kind for p in params],
        }


def _poisoned(grad: torch.Tensor, value: float) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[7] = value
    return grad


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank: the per-step records, what it holds, and (``save_at``)
    the records of a fresh run resumed from the save."""
    out = []
    for case in cases:
        run = Run(case, seed=0)
        saved = b""
        steps = []
        for step in range(case.steps):
            if step == case.save_at:
                saved = run.checkpoint()
            steps.append(run.step(rank, step))
        result: dict[str, Any] = {
            "steps": steps,
            "holdings": run.holdings(),
            "skipped_steps": run.scaler.skipped_steps,
        }
        if case.save_at is not None:
            fresh = Run(case, seed=1)  # other weights: everything comes from the save
            fresh.load(saved)
            result["resumed"] = [fresh.step(rank, s) for s in range(case.save_at, case.steps)]
        out.append(result)
    return out
