"""The main job's model and data: a small byte-level GPT and a rank-sharded text sampler.

Kept apart from ``train.py`` so that the step-time benchmark and the tests train exactly the same
model on exactly the same batches.

The sampler is a pure function of (seed, rank, world size, micro-batch index): a resumed run
draws the same batches as an uninterrupted one without saving any iterator state, and the same
seed gives the same data whichever launcher started the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "SIZES", "Block", "GPTConfig", "ShardedText", "build", "lm_loss", "load_text"]

DATA_FILE = Path(__file__).resolve().parent / "data" / "coriolanus.txt"


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model. The defaults take about 20 ms a step in fp32 on one CPU thread (about
    150 ms in fp16 on CPUs without fp16 matrix units), so the main job fits in a minute."""

    vocab_size: int = 256  # bytes: no tokenizer to ship or to disagree about
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4


SIZES: dict[str, GPTConfig] = {
    # The default: every test and figure of the main job that names no size is this one.
    "tiny": GPTConfig(),
    # 0.9M parameters: a step in between, four blocks.
    "small": GPTConfig(d_model=128, n_layers=4, n_heads=4),
    # 21.5M parameters, 86 MB of fp32 gradients: four DDP buckets at DDP's default 25 MB cap
    # (from the second step; DDP sends the first in one) and 13 FSDP2 units (12 blocks and the
    # root), so that comm hooks, sharding and checkpoints run at the shape of a real job and not
    # only on a one-bucket, three-unit toy (tests/test_train.py measures both counts).
    "medium": GPTConfig(d_model=384, n_layers=12, n_heads=6),
}
"""The main job's model sizes (``launch/train.py --size``), one place for the job, the tests and
the benchmarks, so that they all build exactly the same models. The context stays 64 bytes in
each, so the same data file serves every size."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level GPT. ``blocks`` is a ModuleList: the FSDP strategies shard each entry apart."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's init; residual projections scaled down with depth so the stream's
                # variance stays flat, which keeps the fp16 activations far from overflow.
                std = (
                    0.02 / math.sqrt(2 * cfg.n_layers)
                    if name.endswith(("proj.weight", "out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build(size: str = "tiny") -> GPT:
    """The main job's model of ``size`` (a key of :data:`SIZES`), untrained: the factory that
    ``launch/train.py --out DIR`` records in ``DIR/model.json``, so that ``distamp export DIR``
    rebuilds the model before loading the trained weights."""
    if size not in SIZES:
        raise ValueError(f"size={size!r}: one of {sorted(SIZES)}")
    return GPT(SIZES[size])


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-byte cross-entropy. Logits go to fp32 first: a 256-way log-softmax in fp16/bf16
    loses the small probabilities the loss is made of (and FSDP's policy, unlike autocast, does
    not do this cast for us)."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def load_text(path: Path = DATA_FILE) -> torch.Tensor:
    """The training text as a 1-D int64 tensor of bytes."""
    raw = path.read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


class ShardedText:
    """Batches of (input, next-byte target) windows; each rank reads its own disjoint shard.

    Every position of the text starts a window. Epoch ``e`` permutes all windows with a generator
    seeded by ``(seed, e)`` (identical on every rank), and rank ``r`` takes every ``world``-th
    window from offset ``r``, truncated so that all ranks have the same number of batches (like
    ``DistributedSampler(drop_last=True)``).
    """

    def __init__(
        self,
        data: torch.Tensor,
        *,
        context: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.data, self.context, self.batch_size = data, context, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.device = torch.device(device)
        self.windows = data.numel() - context - 1
        per_rank = self.windows // world_size
        self.batches_per_epoch = per_rank // batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"text of {data.numel()} bytes is too short for {world_size} ranks x batch "
                f"{batch_size} x context {context}"
            )
        self._epoch = -1
        self._shard = torch.empty(0, dtype=torch.long)
        self._offsets = torch.arange(context + 1)

    def _shard_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.windows, generator=gen)
            self._shard = perm[self.rank :: self.world_size][
                : self.batches_per_epoch * self.batch_size
            ]
            self._epoch = epoch
        return self._shard

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's micro-batch number ``index`` (counting from 0 over the whole run)."""
        epoch, b = divmod(index, self.batches_per_epoch)
        starts = self._shard_of(epoch)[b * self.batch_size : (b + 1) * self.batch_size]
        chunk = self.data[starts[:, None] + self._offsets]
        chunk = chunk.to(self.device, non_blocking=True)
        return chunk[:, :-1], chunk[:, 1:]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.context
