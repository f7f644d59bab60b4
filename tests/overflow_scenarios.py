"""One overflow element in one rank's gradient, on the gradient paths users train with.

An overflow reaches a real job as one element: a product in one layer's backward that leaves
fp16's range on one rank's data, during backward (before the gradient's exchange), or after
the exchange (user code between backward and step, a corrupted value). A poisoned loss is not
that: it makes every element NaN at once, which any check finds. These scenarios put exactly
one element of ``+inf``, ``-inf``, NaN or a large finite value into one parameter's gradient,
and read what each rank decided and applied.

- :class:`Tap`: sits between a parameter and its use in a Linear's forward (the instance's
  ``forward`` is replaced, so that DDP, FSDP2 and torchft see an ordinary module). In backward it
  sees the parameter's raw local gradient of each micro-batch before DDP's bucket or FSDP2's
  reduce-scatter does: it writes the injected element, and records the gradient's largest
  magnitude (``inf`` when it holds a non-finite element, natural overflows included).
- :func:`run_case`: one :class:`Case` on one rank of a live group, through ``distamp.DistAMP``
  in fp16 at the default initial scale (65536). Returns per step: whether the rank stepped, the
  largest raw magnitude it saw (unscaled), and the largest gradient magnitude the optimizer was
  handed, plus a digest of the final parameters and the losses.
"""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import distamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))

__all__ = ["Case", "Injection", "Tap", "install_taps", "run_case", "reference_skips"]

VALUES = (float("inf"), float("-inf"), float("nan"), 1e30)
"""What an injection writes: the three non-finite values and a finite one far past fp16's and
fp8's range (in the loss-scaled units of the raw gradient)."""


@dataclass(frozen=True)
class Injection:
    """One element of one parameter's gradient on one rank, at one step.

    Attributes:
        rank: the rank whose gradient is changed.
        tap: which tapped parameter (index into :func:`install_taps`' list).
        element: the flat index (taken modulo the gradient's size, or its local shard's).
        value: what is written.
        step: the optimizer step.
        place: ``"backward"`` (the raw gradient of the last micro-batch, before the exchange)
            or ``"exchanged"`` (the rank's gradient after backward, before ``step``).
    """

    rank: int
    tap: int
    element: int
    value: float
    step: int
    place: str = "backward"


@dataclass(frozen=True)
class Case:
    """One run: the model, the strategy, the comm hook, accumulation, the injection."""

    strategy: str
    hook: str | None
    accum: int = 1
    injection: Injection | None = None
    steps: int = 3
    model: str = "mlp"  # "mlp" (all Linear: every gradient tapped) or a launch/model.py size
    batch: int = 4
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)


class Tap:
    """A parameter's gradient hook that knows about injections (see the module doc)."""

    def __init__(self) -> None:
        self.pending: tuple[int, float] | None = None
        self.seen: list[float] = []

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            element, value = self.pending
            grad = grad.clone()
            grad.view(-1)[element % grad.numel()] = value
            self.pending = None
        finite = bool(torch.isfinite(grad).all())
        self.seen.append(float(grad.abs().max()) if finite else float("inf"))
        return grad


class _TapFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tap: Tap) -> torch.Tensor:
        ctx.tap = tap
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tap(grad), None


def _tapped_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else _TapFn.apply(self.bias, self.taps[1])
    return F.linear(x, _TapFn.apply(self.weight, self.taps[0]), bias)


def install_taps(model: nn.Module) -> list[Tap]:
    """A :class:`Tap` on every Linear's weight and bias (module order), through each
    instance's ``forward``."""
    taps: list[Tap] = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.taps = [Tap(), Tap()]  # type: ignore[assignment]
            module.forward = types.MethodType(_tapped_forward, module)  # type: ignore[method-assign]
            taps.extend(module.taps if module.bias is not None else module.taps[:1])
    return taps


class _Mlp(nn.Module):
    """Six 256-wide Linear blocks (a ModuleList: FSDP2 shards each apart): every parameter
    is a Linear's, so every raw gradient is tapped."""

    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _model_and_loss(case: Case) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    if case.model == "mlp":
        net = _Mlp()

        def mlp_loss(model: nn.Module, k: int, rank: int) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * k + rank)
            x = torch.randn(case.batch, 256, generator=g)
            return F.mse_loss(model(x).float(), torch.sin(x[:, :1] * 3))

        return net, mlp_loss
    from model import GPT, SIZES, lm_loss

    cfg = SIZES[case.model]
    gpt = GPT(cfg)

    def gpt_loss(model: nn.Module, k: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * k + rank)
        x = torch.randint(0, cfg.vocab_size, (case.batch, cfg.context + 1), generator=g)
        return lm_loss(model, (x[:, :-1], x[:, 1:]))

    return gpt, gpt_loss


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _digest(model: nn.Module) -> tuple[bool, list[float]]:
    """Whether every parameter is finite, and a per-parameter fingerprint (sum and sum of
    squares of the full tensor, so that ranks holding shards compare the same numbers)."""
    finite, prints = True, []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        full = full.detach().double()
        finite &= bool(torch.isfinite(full).all())
        prints += [float(full.sum()), float((full * full).sum())]
    return finite, prints


def run_case(rank: int, world: int, case: Case) -> dict[str, Any]:
    """Run ``case`` on this rank (see the module doc)."""
    net, loss_of = _model_and_loss(case)
    taps = install_taps(net)
    hook, options = case.hook, {}
    if hook == "powersgd":  # compress from the second step on (torch's default: the 11th)
        hook, options = None, {"start_powerSGD_iter": 2}
    amp = distamp.DistAMP(
        precision="fp16",
        strategy=case.strategy,
        comm_hook=hook,
        grad_accum_steps=case.accum,
        device="cpu",
        hsdp_shard_size=1 if case.strategy == "hsdp" else None,  # 2 replicas of 1 shard
        **({"ddp_kwargs": case.ddp_kwargs} if case.ddp_kwargs else {}),
    )
    model, opt = amp.setup(net, lambda params: torch.optim.AdamW(params, lr=1e-3))
    if case.hook == "powersgd":
        from distamp.parallel.comm_hooks import register_comm_hook

        register_comm_hook(model, "powersgd", scaler=amp.scaler, **options)
    handed: list[float] = []

    def record(optimizer: Any, *_: Any) -> None:  # what the optimizer is handed to apply
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        handed.append(max((float(g.abs().max()) for g in grads if g.numel()), default=0.0))

    opt.register_step_pre_hook(record)
    inj = case.injection
    steps: list[dict[str, Any]] = []
    for step in range(case.steps):
        scale = float(amp.scaler.get_scale())
        began = time.perf_counter()
        for t in taps:
            t.seen.clear()
        handed.clear()
        losses = []
        for micro in range(case.accum):
            last = micro == case.accum - 1
            if inj and inj.rank == rank and inj.step == step and inj.place == "backward" and last:
                taps[inj.tap].pending = (inj.element, inj.value)
            with amp.accumulate():
                with amp.autocast():
                    loss = loss_of(model, step * case.accum + micro, rank)
                amp.backward(loss)
            losses.append(float(loss.detach()))
        # the raw gradient's largest element: per micro-batch the largest over the taps, summed
        # over the micro-batches (the accumulated element is at most that), in unscaled units
        per_micro = [max(t.seen[m] for t in taps if len(t.seen) > m) for m in range(case.accum)]
        raw = sum(per_micro) / scale
        if inj and inj.rank == rank and inj.step == step and inj.place == "exchanged":
            _write_after_exchange(net, inj)
            # NaN counts as non-finite: inf in the record
            raw = float("inf") if inj.value != inj.value else max(raw, abs(inj.value) / scale)
        result = amp.step()
        steps.append(
            {
                "stepped": bool(result.stepped),
                "raw": raw,
                "handed": handed[0] if handed else None,
                "scale": scale,
                "loss": sum(losses) / len(losses),
                "seconds": time.perf_counter() - began,
            }
        )
    finite, prints = _digest(model)
    amp.close()
    return {"steps": steps, "finite": finite, "prints": prints}


def _write_after_exchange(net: nn.Module, inj: Injection) -> None:
    """Write the injection into this rank's gradient as the exchange left it (its local shard
    under FSDP2), by the tap's parameter."""
    params = [
        p for m in net.modules() if isinstance(m, nn.Linear) for p in (m.weight, m.bias)
        if p is not None
    ]  # fmt: skip
    grad = params[inj.tap].grad
    assert grad is not None, "no gradient after backward"
    local = _local(grad)
    if local.numel():
        with torch.no_grad():
            local.view(-1)[inj.element % local.numel()] = inj.value


def reference_skips(results: list[dict[str, Any]]) -> list[bool]:
    """The decision every rank must take at each step: skip iff any rank's raw gradient held a
    non-finite element (the taps' record, natural overflows included)."""
    n = len(results[0]["steps"])
    return [any(r["steps"][i]["raw"] == float("inf") for r in results) for i in range(n)]
