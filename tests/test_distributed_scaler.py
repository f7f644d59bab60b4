"""Rank consistency of DistributedGradScaler on real gloo process groups (2 and 4 processes).

Every scenario injects inf/NaN into ONE rank's local gradient or shard at steps 1, 3 and 4 and
checks, after every step, that all ranks took the same skip decision, hold the same scale and hold
bitwise-identical full parameters. Scalers built with different settings on different ranks
fail at their first collective, on every rank, naming the field.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _dist import run_ranks
from scaler_scenarios import INF, Scenario, run_many
from torch import nn

from distamp import DistributedGradScaler
from distamp.cluster import SettingsMismatchError

EXPECTED_SKIPS = [False, True, False, True, True, False]


def _check_consistent(results: list[dict[str, Any]], sc: Scenario) -> None:
    first = results[0]
    for rank, res in enumerate(results[1:], start=1):
        for key in ("skipped", "scale", "params", "state_dict", "collectives"):
            assert res[key] == first[key], f"{sc}: rank {rank} disagrees with rank 0 on {key}"
    expected = [step in sc.injections for step in range(sc.steps)]
    assert first["skipped"] == expected, f"{sc}: skips {first['skipped']} != injections {expected}"
    assert first["state_dict"]["skipped_steps"] == sum(expected)
    if sc.two_optimizers and not sc.explicit_unscale:
        return  # as in torch, only the optimizer holding the inf skips; the other one steps
    # Params change on stepped iterations and stay put on skipped ones.
    for step in range(1, sc.steps):
        same = first["params"][step] == first["params"][step - 1]
        assert same == expected[step], f"{sc}: step {step} params changed={not same}"


def _run(
    scenarios: list[Scenario], world: int = 2, timeout: float = 240
) -> list[list[dict[str, Any]]]:
    per_rank = run_ranks(run_many, world, scenarios, timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(scenarios))]


def _matrix(strategy: str) -> list[Scenario]:
    return [
        Scenario(strategy, optimizer=opt, explicit_unscale=explicit)
        for opt in ("foreach", "fused")
        for explicit in (False, True)
    ]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp1", "fsdp1_orig", "fsdp2"])
def test_same_decision_on_every_rank(strategy: str) -> None:
    scenarios = _matrix(strategy)
    scenarios += [
        Scenario(strategy, two_optimizers=True),
        Scenario(strategy, two_optimizers=True, explicit_unscale=True, optimizer="fused"),
        Scenario(strategy, optimizer="forloop", hysteresis=2),
    ]
    for sc, results in zip(scenarios, _run(scenarios), strict=True):
        _check_consistent(results, sc)
        collectives = results[0]["collectives"]
        if sc.two_optimizers and not sc.explicit_unscale:
            assert collectives == [2] * sc.steps  # one per optimizer step
        else:
            assert collectives == [1] * sc.steps  # one per iteration, whatever the optimizers


def test_hsdp_on_a_2x2_mesh() -> None:
    scenarios = [
        Scenario("hsdp", optimizer="fused", explicit_unscale=True),
        Scenario("hsdp", optimizer="foreach"),
    ]
    for sc, results in zip(scenarios, _run(scenarios, world=4, timeout=300), strict=True):
        _check_consistent(results, sc)


def test_ddp_registered_module_needs_no_extra_collective() -> None:
    scenarios = [
        Scenario("ddp", register_ddp=True, inject_via_hook=True),
        Scenario(
            "ddp", register_ddp=True, inject_via_hook=True, optimizer="fused", explicit_unscale=True
        ),
        # An inf written after DDP's all-reduce is not spread by it: without registration the
        # scaler must (and does) reduce.
        Scenario("ddp", register_ddp=False, inject_via_hook=False),
    ]
    out = _run(scenarios)
    for sc, results in zip(scenarios, out, strict=True):
        _check_consistent(results, sc)
    assert out[0][0]["collectives"] == [0] * 6
    assert out[1][0]["collectives"] == [0] * 6
    assert out[2][0]["collectives"] == [1] * 6


def test_torch_failure_regressions() -> None:
    """The three failures torch's scalers show on these paths, run through distamp.

    1. FSDP1 + fused AdamW, inf on one rank: ShardedGradScaler lets one rank step.
    2. Same with explicit unscale_ before clipping: ShardedGradScaler crashes on found_inf's shape.
    3. A plain GradScaler under FSDP1: the ranks' scales drift apart.
    """
    one_rank_inf = {2: (1, INF)}
    TORCH_SCALERS = ("sharded", "sharded", "torch", "sharded")
    scenarios = [
        Scenario("fsdp1", optimizer="fused", injections=one_rank_inf, steps=4),
        Scenario(
            "fsdp1", optimizer="fused", explicit_unscale=True, injections=one_rank_inf, steps=4
        ),
        Scenario("fsdp1", optimizer="foreach", injections=one_rank_inf, steps=4),
        Scenario(
            "fsdp2", optimizer="fused", explicit_unscale=True, injections=one_rank_inf, steps=4
        ),
    ]
    torch_scenarios = [
        replace(sc, scaler=name) for sc, name in zip(scenarios, TORCH_SCALERS, strict=True)
    ]
    out = _run(scenarios + torch_scenarios)
    for sc, results in zip(scenarios, out[: len(scenarios)], strict=True):
        _check_consistent(results, sc)
    # The same runs through torch's own scalers show the failures distamp exists to prevent.
    for sc, results in zip(torch_scenarios, out[len(scenarios) :], strict=True):
        with pytest.raises(AssertionError):
            if "error" in results[0]:
                raise AssertionError(results[0]["error"])
            _check_consistent(results, sc)


def _explicit_unscale_fsdp2(rank: int, world: int) -> dict[str, Any]:
    """FSDP2, two optimizers unscaled explicitly, inf in rank 1's shard of the first one."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from distamp import DistributedGradScaler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    opts = [torch.optim.Adam(layer.parameters(), lr=1e-2) for layer in model]
    scaler = DistributedGradScaler("cpu", init_scale=2.0)
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    if rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    before = scaler.collectives_issued
    for opt in opts:
        scaler.unscale_(opt)
    unscaled = scaler.collectives_issued - before
    seen = [
        [float(v) for v in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()]
        for opt in opts
    ]
    stages = [scaler._per_optimizer_states[id(opt)]["stage"].name for opt in opts]
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    return {
        "unscale_collectives": unscaled,
        "collectives": scaler.collectives_issued - before,
        "found_inf_per_device": seen,
        "stages": stages,
        "scale": scaler.get_scale(),
    }


def test_explicit_unscale_leaves_the_agreed_flag_for_readers() -> None:
    """torch's FSDP2 contract: after ``unscale_``, ``found_inf_per_device`` holds the agreed value
    on every rank. Here it is agreed lazily, on that read, so two optimizers unscaled
    explicitly still cost ONE collective for the whole step."""
    results = run_ranks(_explicit_unscale_fsdp2, 2, timeout=120)
    for res in results:
        assert res["unscale_collectives"] == 0
        assert res["found_inf_per_device"] == [[1.0], [1.0]]  # both: they are skipped together
        assert res["stages"] == ["UNSCALED", "UNSCALED"]
        assert res["collectives"] == 1
        assert res["scale"] == 1.0  # backed off from 2 on both ranks


# ---------------------------------------------------------------------------- settings
def _model(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def _scaler_rank(rank: int, world: int) -> str:
    from distamp.cluster import init_distributed, shutdown_distributed

    init_distributed(timeout=60)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DistributedGradScaler("cpu", growth_interval=2000 if rank == 0 else 1000)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 4)).float().sum()
    scaler.scale(loss).backward()
    try:
        scaler.step(opt)  # the first collective: the settings are compared before it
        message = "no error"
    except SettingsMismatchError as exc:
        message = str(exc)
    shutdown_distributed()
    return message


@pytest.mark.timeout(60)
def test_scalers_built_differently_fail_at_their_first_collective() -> None:
    messages = run_ranks(_scaler_rank, 2, timeout=45)
    assert all("scaler.growth_interval: ranks 0: 2000; ranks 1: 1000" in m for m in messages)
