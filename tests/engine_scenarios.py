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
