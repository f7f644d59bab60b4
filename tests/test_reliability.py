"""Faults that must never make ranks disagree or hang: injected inf/NaN, and a stalled rank.

The injection campaign is the CI-sized sample of ``benchmarks/reliability.py`` (which runs the
whole cross product, several seeds, longer): random steps, ranks (one or all) and gradient
elements, checked after every step on 2 real gloo ranks. The stalled-rank test runs the fault
job under real torchrun and checks that the surviving rank fails with a timeout error, in time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _dist import launcher_free_env, run_ranks
from scaler_scenarios import (
    ALL_RANKS,
    CAMPAIGN_AXES,
    INF,
    Scenario,
    campaign_configs,
    check_agreement,
    random_scenario,
    run_many,
)

REPO = Path(__file__).resolve().parents[1]
CI_CONFIGS, CI_STEPS = 12, 8


def _ci_sample() -> list[Scenario]:
    """A fixed sample of the cross product that holds every value of every axis."""
    configs = random.Random(7).sample(campaign_configs(), CI_CONFIGS)
    return [
        random_scenario(cfg, seed=i, steps=CI_STEPS, world=2, rate=0.35)
        for i, cfg in enumerate(configs)
    ]


def test_ci_sample_covers_every_axis_value() -> None:
    scenarios = _ci_sample()
    for axis, values in CAMPAIGN_AXES.items():
        seen = {getattr(sc, axis) for sc in scenarios}
        assert seen == set(values), f"the CI sample misses {axis}={set(values) - seen}"
    targets = {rank for sc in scenarios for rank, _ in sc.injections.values()}
    assert targets == {0, 1, ALL_RANKS}  # one rank alone, the other alone, and both


def test_injection_campaign_no_rank_ever_disagrees() -> None:
    scenarios = _ci_sample()
    # A control the checker must flag: torch's own ShardedGradScaler under FSDP1 with a fused
    # optimizer lets the rank without the inf step (see test_distributed_scaler).
    control = Scenario(
        "fsdp1", optimizer="fused", scaler="sharded", steps=4, injections={2: (1, INF)}
    )
    per_rank = run_ranks(run_many, 2, [*scenarios, control], timeout=240)
    steps = injections = skips = 0
    for i, sc in enumerate(scenarios):
        results = [per_rank[0][i], per_rank[1][i]]
        problems = check_agreement(results, sc)
        assert not problems, f"{sc}:\n" + "\n".join(problems)
        steps += sc.steps
        injections += len(sc.injections)
        skips += sum(results[0]["skipped"])
    assert injections >= CI_CONFIGS and skips == injections
    print(f"{len(scenarios)} configs, {steps} steps, {injections} injections, {skips} skips, "
          "0 divergences")  # fmt: skip
    control_results = [per_rank[0][-1], per_rank[1][-1]]
    assert "error" in control_results[0] or check_agreement(control_results, control)


def test_random_scenarios_are_reproducible() -> None:
    """A failure report (the printed Scenario) must be enough to replay the campaign."""
    cfg = campaign_configs()[5]
    a = random_scenario(cfg, seed=3, steps=20, world=2)
    assert a == random_scenario(cfg, seed=3, steps=20, world=2)
    assert a != random_scenario(cfg, seed=4, steps=20, world=2)
    assert replace(a, injections={}).injections == {}


# ---------------------------------------------------------------------------------- stalled rank
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_stalled_rank_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    """Rank 1 stops participating after step 5; rank 0, inside DDP's all-reduce of step 6, must
    fail with an error that names the timeout within ``DistAMP(timeout=3)``, not hang."""
    timeout_s = 3
    cmd = [*TORCHRUN, str(REPO / "tests" / "scripts" / "fault_train.py"), "--steps", "16",
           "--out", str(tmp_path / "ckpt"), "--checkpoint-interval", "0", "--stall-at", "5",
           "--timeout", str(timeout_s)]  # fmt: skip
    env = launcher_free_env()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError("a stalled rank hung the job: no error within 90 s") from None
    wall = time.monotonic() - t0
    assert proc.returncode != 0, "the job succeeded although rank 1 stalled"
    reports: list[dict[str, Any]] = [
        json.loads(line) for line in err.splitlines() if line.startswith('{"rank"')
    ]
    assert [r["rank"] for r in reports] == [0], err[-3000:]  # the survivor, and only it, reports
    report = reports[0]
    # The error arrives after the timeout (not before: no false alarm) and soon after it.
    assert timeout_s <= report["failed_after_s"] <= timeout_s + 5, report
    assert f"{timeout_s * 1000}ms" in report["error"] or f"{timeout_s} s" in report["error"], report
    took = report["failed_after_s"]
    print(f"stalled rank: rank 0 failed {took} s into the run (timeout {timeout_s} s), "
          f"job ended in {wall:.1f} s: {report['error'][-90:]}")  # fmt: skip


def _stall_in_barrier(rank: int, world: int, seconds: float) -> dict[str, Any]:
    """Rank 1 never joins the barrier; rank 0 waits in it under ``named_collective``."""
    from datetime import timedelta

    import torch.distributed as dist

    from distamp.cluster import CollectiveTimeoutError, named_collective

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    if rank == 1:
        time.sleep(seconds + 1)  # "stops participating", then leaves without the barrier
        return {}
    t0 = time.monotonic()
    try:
        with named_collective("save_state (checkpoint write)", seconds):
            dist.barrier(group=group)
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "after_s": time.monotonic() - t0}
    raise AssertionError("the barrier completed although rank 1 never joined it")


def test_stalled_peer_error_names_the_collective_and_the_timeout() -> None:
    out = run_ranks(_stall_in_barrier, 2, 2.0, timeout=60)[0]
    assert 2.0 <= out["after_s"] <= 5.0, out
    assert out["error"].startswith("save_state (checkpoint write) did not complete on rank 0 "
                                   "within the 2 s timeout"), out  # fmt: skip
    print(f"named collective timeout after {out['after_s']:.2f} s: {out['error'][:120]}")
