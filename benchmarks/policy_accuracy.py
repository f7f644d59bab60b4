"""How far does mixed precision drift from fp32 on the bundled task, with and without a policy?

Trains the main job's byte-level GPT on the bundled text three times from the same initial
weights and batches: fp32 (the reference), plain ``torch.autocast`` bf16, and
``AutocastPolicy("bf16")``; prints each run's final loss and the relative distance of its weights
to the reference, and the ratio raw/policy. Two attention variants: the bundled one
(``scaled_dot_product_attention``: one fused op) and an explicit ``softmax(q k^T)`` one, as many
models write it. Run: ``python benchmarks/policy_accuracy.py [--steps N] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from distamp.precision.policy import AutocastPolicy  # noqa: E402
from launch.model import GPT, Block, GPTConfig, ShardedText, load_text  # noqa: E402


class ExplicitBlock(Block):
    """The bundled block with attention written out: softmax(q k^T / sqrt(d) + causal mask) v."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(c // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        y = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


def build(cfg: GPTConfig, explicit: bool) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(cfg)
    if explicit:
        blocks = [ExplicitBlock(cfg) for _ in range(cfg.n_layers)]
        for new, old in zip(blocks, model.blocks, strict=True):
            new.load_state_dict(old.state_dict())
        model.blocks = nn.ModuleList(blocks)
    return model


def train(
    cfg: GPTConfig, explicit: bool, mode: str, steps: int, device: str
) -> tuple[float, torch.Tensor]:
    model = build(cfg, explicit).to(device)
    policy = AutocastPolicy("bf16") if mode == "policy" else None
    if policy is not None:
        policy.apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = ShardedText(
        load_text(), context=cfg.context, batch_size=16, rank=0, world_size=1, seed=0, device=device
    )
    loss = torch.zeros(())
    for k in range(steps):
        x, y = data.batch(k)
        if policy is not None:
            ctx = policy.autocast(device)
        elif mode == "raw":
            ctx = torch.autocast(device, dtype=torch.bfloat16)
        else:
            ctx = torch.autocast(device, enabled=False)
        with ctx:
            # The loss as models usually write it (no explicit fp32 cast of the logits).
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()
    return float(loss.detach()), flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(context=32, d_model=64, n_layers=2, n_heads=4)
    print(f"{'attention':<10} {'mode':<7} {'final loss':>10} {'|w - w32| / |w32|':>18}")
    for explicit in (False, True):
        name = "explicit" if explicit else "sdpa"
        loss32, ref = train(cfg, explicit, "fp32", args.steps, args.device)
        print(f"{name:<10} {'fp32':<7} {loss32:>10.4f} {0.0:>18.2e}")
        dist = {}
        for mode in ("raw", "policy"):
            loss, w = train(cfg, explicit, mode, args.steps, args.device)
            dist[mode] = float((w - ref).norm() / ref.norm())
            print(f"{name:<10} {mode:<7} {loss:>10.4f} {dist[mode]:>18.2e}")
        ratio = dist["raw"] / dist["policy"] if dist["policy"] else float("inf")
        print(f"{name:<10} raw/policy distance ratio: {ratio:.2f}x")


if __name__ == "__main__":
    main()
