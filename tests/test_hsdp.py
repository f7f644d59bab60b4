"""Precision policies under FSDP1, FSDP2 and HSDP (2-D mesh) through DistAMP, on 2 and 4 real
gloo ranks.

Per strategy and rank: parameters seen *inside forward* (the all-gathered ones) follow the policy
(LayerNorm fp32, Linear fp16), sharded gradients are fp32 (reduce dtype), an inf injected on one
rank makes every rank skip the same step, and replicas end with identical parameters. HSDP also
checks that found_inf and the clipping norm cost ONE collective per step over the whole mesh.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

from distamp.engine import DistAMP
from distamp.precision.policy import AutocastPolicy

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from launch.model import GPT, GPTConfig, lm_loss  # noqa: E402

CFG = GPTConfig(context=8, d_model=16, n_layers=1, n_heads=2)
STEPS, INF_STEP = 3, 1


def _batch(rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + k)
    seq = torch.randint(0, CFG.vocab_size, (2, CFG.context + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _run(rank: int, strategy: str, **kw: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(CFG)
    seen: dict[str, str] = {}

    def record(name: str) -> Any:
        def hook(mod: nn.Module, _args: Any, _out: Any) -> None:
            seen[name] = str(mod.weight.dtype)

        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.LayerNorm, nn.Linear)):
            mod.register_forward_hook(record(name))
    amp = DistAMP(precision="fp16", strategy=strategy, policy="default", max_grad_norm=1.0, **kw)
    model, _ = amp.setup(model, lambda p: torch.optim.SGD(p, lr=0.1))
    skipped, collectives, grad_dtypes = [], [], set()
    for k in range(STEPS):
        with amp.autocast():
            loss = lm_loss(model, _batch(rank, k))
        if k == INF_STEP and rank == 0:
            loss = loss * float("inf")
        before = amp.scaler.collectives_issued
        amp.backward(loss)
        grad_dtypes |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        result = amp.step()
        collectives.append(amp.scaler.collectives_issued - before)
        skipped.append(not result.stepped)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    checksum = sum(float(v.double().sum()) for v in full.values())
    return {
        "seen": seen,
        "skipped": skipped,
        "collectives": collectives,
        "grad_dtypes": sorted(grad_dtypes),
        "checksum": checksum,
    }


def _scenarios(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {"fsdp": _run(rank, "fsdp"), "fsdp2": _run(rank, "fsdp2")}
    if world == 4:
        out["hsdp"] = _run(rank, "hsdp", hsdp_shard_size=2)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_policy_dtypes_and_consistent_skips(world: int) -> None:
    per_rank = run_ranks(_scenarios, world, timeout=170)
    for strategy, r0 in per_rank[0].items():
        for rank, res in enumerate(per_rank):
            r = res[strategy]
            where = f"{strategy}, rank {rank}"
            for name, dtype in r["seen"].items():
                want = (
                    "torch.float32" if ".ln" in name or name.startswith("ln") else "torch.float16"
                )
                assert dtype == want, f"{where}: {name} computed with {dtype} weights"
            assert r["grad_dtypes"] == ["torch.float32"], where
            assert r["skipped"] == [k == INF_STEP for k in range(STEPS)], where
            assert r["checksum"] == pytest.approx(r0["checksum"], rel=1e-6), where
        assert {"blocks.0.ln1", "blocks.0.qkv", "ln_f", "head"} <= set(r0["seen"]), strategy
    if world == 4:
        # found_inf + norm in one collective per step over the whole 2x2 mesh.
        assert per_rank[0]["hsdp"]["collectives"] == [1] * STEPS


def test_hsdp_shard_size_must_divide_the_world() -> None:
    from distamp.parallel.fsdp import hsdp_mesh

    with pytest.raises(ValueError, match="hsdp_shard_size=3"):
        hsdp_mesh("cpu", 4, 3)


def test_policy_precision_must_match() -> None:
    with pytest.raises(ValueError, match="same precision"):
        DistAMP(precision="bf16", policy=AutocastPolicy("fp16"))
    with pytest.raises(ValueError, match="comm_hook"):
        DistAMP(strategy="fsdp2", comm_hook="fp16")
