"""The main job's medium GPT, as the multi-rank tests at the shape of a real job build it.

``SIZES["medium"]`` of ``launch/model.py``: 12 blocks, 21.5M parameters, 76 modules with
parameters of their own, 149 parameter tensors, 4+ DDP buckets and 13 FSDP2 units. The tests of
adaptive precision, backward scales, the overflow report and checkpoints train it here on the
main job's batches, so that they all run the same model. An fp16 step takes about 1.5 s per rank
on one CPU thread at batch 1, so each test runs a handful of steps.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from launch.model import GPT, SIZES, ShardedText, lm_loss, load_text

MODULES, PARAMS = 76, 149  # watched modules (own parameters) and parameter tensors
BLOCKS = ("tok", "pos", *(f"blocks.{i}" for i in range(12)), "ln_f", "head")  # backward scales'


def gpt() -> GPT:
    """The medium GPT, initialised as the main job does (same seed on every rank)."""
    torch.manual_seed(0)
    return GPT(SIZES["medium"])


def optimizer(params: Any) -> torch.optim.Optimizer:
    """The engine's optimizer factory: AdamW as the main job's."""
    return torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def data(rank: int, world: int) -> ShardedText:
    """This rank's shard of the main job's text, batch 1."""
    cfg = SIZES["medium"]
    return ShardedText(
        load_text(), context=cfg.context, batch_size=1, rank=rank, world_size=world, seed=0
    )


def train(amp: Any, batches: ShardedText, start: int, stop: int) -> list[bool]:
    """Steps ``start..stop`` through ``amp`` (a set-up :class:`distamp.DistAMP`); returns
    whether each stepped."""
    stepped = []
    for k in range(start, stop):
        with amp.autocast():
            loss = lm_loss(amp.model, batches.batch(k))
        stepped.append(bool(amp.backward_and_step(loss).stepped))
    return stepped


def digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, whole (an FSDP2 shard is gathered: collective)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(name.encode())
        h.update(whole.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SpikyLinear(nn.Linear):
    """A Linear that multiplies its input by ``spike`` and divides its output by it: with a
    spike of 1e6 the fp16 product overflows (inf, then NaN downstream); in fp32 the result is the
    plain Linear's up to rounding."""

    spike = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x * self.spike, self.weight, self.bias) / self.spike


def make_spiky(model: GPT, block: int, spike: float) -> None:
    """``blocks[block].fc`` becomes a :class:`SpikyLinear` with the same weights."""
    fc = model.blocks[block].fc
    assert isinstance(fc, nn.Linear)
    spiky = SpikyLinear(fc.in_features, fc.out_features)
    spiky.load_state_dict(fc.state_dict())
    spiky.spike = spike
    model.blocks[block].fc = spiky
