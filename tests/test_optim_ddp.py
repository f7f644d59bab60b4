"""16-bit weights with their masters under DDP on 2 gloo ranks (tests/optim_scenarios.py).

DDP all-reduces the 16-bit gradients; ranks stay bitwise equal; an inf, -inf or NaN in ONE
rank's gradient, during backward or after DDP's all-reduce, skips the step on both ranks with
nothing written; the sharded master (ZeRO-1) trains bit for bit as the exact one while each rank
holds only its share, and resumes from its per-rank checkpoint bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
from _dist import run_ranks
from optim_scenarios import EVERY_FAULT, INJECTED_RANK, Case, run_cases

CASES = {
    "bf16-exact": Case("bf16", "exact", injections=EVERY_FAULT),
    "bf16-sharded": Case("bf16", "sharded", injections=EVERY_FAULT),
    "fp16-exact": Case("fp16", "exact", injections=EVERY_FAULT),
    "fp16-sharded": Case("fp16", "sharded", injections=EVERY_FAULT),
    "bf16-sharded-resume": Case("bf16", "sharded", steps=6, save_at=3),
}
WORLD = 2


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    """Every case, once, on 2 ranks: ``{case: [rank 0's result, rank 1's]}``."""
    per_rank = run_ranks(run_cases, WORLD, list(CASES.values()), timeout=180)
    return {name: [per_rank[r][i] for r in range(WORLD)] for i, name in enumerate(CASES)}


def _same_on_every_rank(ranks: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    for step, records in enumerate(zip(*(r["steps"] for r in ranks), strict=True)):
        for key in keys:
            values = [rec[key] for rec in records]
            assert all(v == values[0] for v in values), f"step {step}: ranks differ on {key}"


@pytest.mark.parametrize("name", ["bf16-exact", "fp16-exact"])
def test_ddp_reduces_16bit_gradients_and_ranks_stay_equal(
    results: dict[str, list[dict[str, Any]]], name: str
) -> None:
    ranks = results[name]
    dtype = "torch.bfloat16" if name.startswith("bf16") else "torch.float16"
    for rank in ranks:
        assert all(rec["grad_dtypes"] == [dtype] for rec in rank["steps"])
    _same_on_every_rank(ranks, ("weights", "masters", "state", "skipped", "scale"))
    assert len(ranks[0]["steps"][0]["masters"]) == 6  # every rank holds every master


@pytest.mark.parametrize("name", ["bf16-exact", "bf16-sharded", "fp16-exact", "fp16-sharded"])
def test_one_rank_non_finite_gradient_skips_on_every_rank(
    results: dict[str, list[dict[str, Any]]], name: str
) -> None:
    ranks = results[name]
    _same_on_every_rank(ranks, ("weights", "skipped", "scale", "changed"))
    for rank, result in enumerate(ranks):
        steps = result["steps"]
        assert result["skipped_steps"] == len(EVERY_FAULT)
        for k, rec in enumerate(steps):
            fault = EVERY_FAULT.get(k)
            assert rec["skipped"] == (fault is not None), (rank, k)
            assert rec["changed"] == (fault is None), (rank, k)
            # where the fault was: all-reduced from a hook (every rank) or one rank's only
            seen = fault is not None and (fault[0] == "hook" or rank == INJECTED_RANK)
            assert rec["nonfinite"] == seen, (rank, k)
            if fault is not None:  # nothing written: masters and states as the step before
                for key in ("weights", "masters", "state"):
                    assert rec[key] == steps[k - 1][key], (rank, k, key)
    scales = [rec["scale"] for rec in ranks[0]["steps"]]
    if name.startswith("fp16"):  # backed off at each fault
        assert scales == [2.0**12 / 2 ** sum(f <= k for f in EVERY_FAULT) for k in range(13)]
    else:
        assert set(scales) == {1.0}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_sharded_master_trains_as_the_exact_one(
    results: dict[str, list[dict[str, Any]]], dtype: str
) -> None:
    exact, sharded = results[f"{dtype}-exact"], results[f"{dtype}-sharded"]
    for rank in range(WORLD):
        for k, (a, b) in enumerate(zip(exact[rank]["steps"], sharded[rank]["steps"], strict=True)):
            assert a["weights"] == b["weights"], (rank, k)
            for index, digest in b["masters"].items():  # each share is the exact masters'
                assert a["masters"][index] == digest, (rank, k, index)
    owned = [r["holdings"]["owned"] for r in sharded]
    assert all(sum(o) == 1 for o in zip(*owned, strict=True))  # every master on one rank


def test_each_rank_holds_its_share_only(results: dict[str, list[dict[str, Any]]]) -> None:
    exact = results["bf16-exact"][0]["holdings"]
    total = sum(exact["numels"])
    assert exact["state_entries"] == 6 and exact["moment_bytes"] == 8 * total
    assert exact["master_bytes"] == 2 * total  # the int16 remainders
    shares = []
    for rank, result in enumerate(results["bf16-sharded"]):
        held = result["holdings"]
        mine = sum(n for n, o in zip(held["numels"], held["owned"], strict=True) if o)
        assert 0 < mine < total
        assert held["state_entries"] == sum(held["owned"]), rank
        assert held["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
        assert held["moment_bytes"] == 8 * mine and held["master_bytes"] == 4 * mine, rank
        kinds = ["copy" if o else "remote" for o in held["owned"]]
        assert held["kinds"] == kinds
        shares.append(mine)
        assert len(result["steps"][-1]["masters"]) == sum(held["owned"])
    assert sum(shares) == total


def test_sharded_checkpoint_resumes_bit_for_bit(
    results: dict[str, list[dict[str, Any]]],
) -> None:
    case = CASES["bf16-sharded-resume"]
    assert case.save_at is not None
    for rank, result in enumerate(results["bf16-sharded-resume"]):
        original = result["steps"][case.save_at :]
        assert len(result["resumed"]) == len(original) == 3
        for a, b in zip(original, result["resumed"], strict=True):
            for key in ("weights", "masters", "state", "skipped", "scale"):
                assert a[key] == b[key], (rank, key)
