"""The tiny engine the engine's refusal tests build (tests/test_engine_*.py): a bf16 ``DistAMP``
on the CPU over one ``nn.Linear(4, 2)`` with SGD, and a loss that reads its output in fp32."""

from __future__ import annotations

import torch
from torch import nn

from distamp import DistAMP


def tiny_engine(
    precision: str = "bf16", model: nn.Module | None = None
) -> tuple[DistAMP, nn.Module]:
    """A set-up engine and its wrapped model."""
    amp = DistAMP(precision, device="cpu")
    model = model if model is not None else nn.Linear(4, 2)
    wrapped, _ = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, wrapped


def square_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The mean square of the model's output, in fp32."""
    return model(x).float().square().mean()


def clipped_engine(precision: str = "fp16") -> tuple[DistAMP, nn.Module]:
    """One process, ``nn.Linear(8, 2)`` with AdamW and clipping at 1.0 (seeded): the engine the
    NaN-loss and checkpoint-reading tests train a few steps."""
    torch.manual_seed(0)
    amp = DistAMP(precision=precision, strategy="none", max_grad_norm=1.0)
    model, _ = amp.setup(nn.Linear(8, 2), lambda p: torch.optim.AdamW(p, lr=1e-2))
    return amp, model


def train_steps(
    amp: DistAMP, model: nn.Module, steps: int, nan_at: int | None = None
) -> list[bool]:
    """``steps`` steps on seeded batches (the loss made NaN at step ``nan_at``); whether each
    step was taken."""
    stepped = []
    for k in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        with amp.autocast():
            loss = model(x).float().square().mean()
        if k == nan_at:
            loss = loss * float("nan")
        result = amp.backward_and_step(loss)
        assert result is not None
        stepped.append(result.stepped)
    return stepped
