"""Training scenarios run on every rank by the distributed scaler tests.

Each scenario trains a small model for a few steps with inf/NaN injected into ONE rank's local
gradient (or shard) at chosen steps, and records per step what every rank must agree on: the skip
decision, the scale, and a digest of the full (gathered) parameters.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import event
from torch import nn

from distamp import DistributedGradScaler, ScaleUnderflowError

INF = float("inf")
NAN = float("nan")
ALL_RANKS = -1  # an injection "rank" meaning: every rank gets the value at that step


@dataclass(frozen=True)
class Scenario:
    strategy: str  # "ddp" | "fsdp1" | "fsdp1_orig" | "fsdp2" | "hsdp" | "local"
    optimizer: str = "foreach"  # "foreach" | "fused" | "forloop"
    explicit_unscale: bool = False  # unscale_ + clip before step
    two_optimizers: bool = False
    register_ddp: bool = False  # register_module(ddp_model, trust_ddp_sync=True): 0 collectives
    inject_via_hook: bool = False  # inject before DDP's all-reduce (a real overflow's path)
    hysteresis: int = 1
    scaler: str = "distamp"  # "distamp" | "torch" | "sharded": torch's scalers, for comparison
    steps: int = 6
    # step -> (rank, value): that rank's local gradient gets ``value`` at that step
    injections: dict[int, tuple[int, float]] = field(
        default_factory=lambda: {1: (1, INF), 3: (0, NAN), 4: (1, INF)}
    )
    # step -> site: which local gradient tensor (site % count) and element (site % numel) gets
    # the value; a step absent here uses the first element of the first tensor.
    sites: dict[int, int] = field(default_factory=dict)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # The 1-row head gives FSDP an empty shard on rank 1 and, with use_orig_params, a parameter
    # that lives on one rank only (the other's gradient is None).
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )


def _wrap(sc: Scenario, model: nn.Module) -> nn.Module:
    if sc.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    if sc.strategy in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            use_orig_params=sc.strategy == "fsdp1_orig",
            device_id=torch.device("cpu"),
        )
    if sc.strategy in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = dist.get_world_size()
        if sc.strategy == "fsdp2":
            mesh = init_device_mesh("cpu", (world,))
        else:
            mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model


def _optimizers(sc: Scenario, model: nn.Module) -> list[torch.optim.Optimizer]:
    kw: dict[str, Any] = (
        {"fused": True} if sc.optimizer == "fused" else {"foreach": sc.optimizer == "foreach"}
    )
    params = list(model.parameters())
    if sc.two_optimizers:
        half = len(params) // 2
        return [
            torch.optim.AdamW(params[:half], lr=1e-2, **kw),
            torch.optim.Adam(params[half:], lr=1e-2, **kw),  # fused SGD has no DTensor rule
        ]
    return [torch.optim.AdamW(params, lr=1e-2, **kw)]


def _full_params_digest(sc: Scenario, model: nn.Module) -> str:
    h = hashlib.sha256()
    if sc.strategy in ("fsdp1", "fsdp1_orig"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            tensors = [p.detach().clone() for p in model.parameters()]
    else:
        tensors = [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for p in model.parameters()
        ]
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _local_grads(opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    out = []
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    if g.numel():
                        out.append(g)
    return out


def _inject(grads: list[torch.Tensor], value: float, site: int) -> None:
    """Write ``value`` into one element of one of this rank's local gradients, chosen by ``site``.

    Every rank holds at least one non-empty local gradient in every scenario (the model's first
    layer is never an empty shard), so an injection always lands.
    """
    grad = grads[site % len(grads)].view(-1)
    grad[(site // len(grads)) % grad.numel()] = value


def run_scenario(rank: int, world: int, sc: Scenario) -> dict[str, Any]:
    """Train ``sc`` on this rank; return what every rank must agree on, per step."""
    model = _wrap(sc, _model(seed=0))
    opts = _optimizers(sc, model)
    kw: dict[str, Any] = {"init_scale": 2.0**10, "growth_interval": 2}
    scaler: Any
    if sc.scaler == "torch":
        scaler = torch.amp.GradScaler("cpu", **kw)
    elif sc.scaler == "sharded":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler("cpu", **kw)
    else:
        scaler = DistributedGradScaler("cpu", hysteresis=sc.hysteresis, **kw)
    if sc.register_ddp:
        scaler.register_module(model, trust_ddp_sync=True)
    gen = torch.Generator().manual_seed(100 + rank)
    record: dict[str, list[Any]] = {"skipped": [], "scale": [], "params": [], "collectives": []}
    hook_value: list[float | None] = [None]
    first_param = next(model.parameters())
    if sc.inject_via_hook:
        first_param.register_hook(lambda g: g * hook_value[0] if hook_value[0] is not None else g)
    for step in range(sc.steps):
        target = sc.injections.get(step)
        mine = target is not None and target[0] in (rank, ALL_RANKS)
        hook_value[0] = target[1] if (target is not None and mine and sc.inject_via_hook) else None
        for opt in opts:
            opt.zero_grad()
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).square().mean()
        before = getattr(scaler, "collectives_issued", 0)
        scaler.scale(loss).backward()
        if mine and not sc.inject_via_hook:
            assert target is not None
            _inject(_local_grads(opts), target[1], sc.sites.get(step, 0))
        if sc.explicit_unscale:
            for opt in opts:
                scaler.unscale_(opt)
            if sc.strategy in ("fsdp1", "fsdp1_orig"):
                model.clip_grad_norm_(1.0)  # type: ignore[operator]
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        prev_scale = record["scale"][-1] if record["scale"] else kw["init_scale"]
        record["skipped"].append(
            bool(scaler.last_step_skipped)
            if isinstance(scaler, DistributedGradScaler)
            else scaler.get_scale() < prev_scale  # torch's scalers: a skip backs off
        )
        record["scale"].append(scaler.get_scale())
        record["params"].append(_full_params_digest(sc, model))
        record["collectives"].append(getattr(scaler, "collectives_issued", 0) - before)
    record["state_dict"] = scaler.state_dict()
    return record


def run_many(rank: int, world: int, scenarios: list[Scenario]) -> list[dict[str, Any]]:
    out = []
    for sc in scenarios:
        try:
            out.append(run_scenario(rank, world, sc))
        except RuntimeError as e:  # torch's scalers crash on some paths; record it
            if sc.scaler == "distamp":
                raise
            out.append({"error": str(e)})
    return out


# The cross product of the reliability campaign: strategy x optimizer x unscale x optimizers x
# hysteresis. ``tests/test_reliability.py`` samples it; ``benchmarks/reliability.py`` runs it all.
CAMPAIGN_AXES: dict[str, tuple[Any, ...]] = {
    "strategy": ("ddp", "fsdp1", "fsdp2"),
    "optimizer": ("fused", "foreach"),
    "explicit_unscale": (False, True),
    "two_optimizers": (False, True),
    "hysteresis": (1, 2),
}


def campaign_configs() -> list[dict[str, Any]]:
    """Every combination of :data:`CAMPAIGN_AXES`, as keyword arguments of :class:`Scenario`."""
    import itertools

    names = list(CAMPAIGN_AXES)
    return [
        dict(zip(names, values, strict=True))
        for values in itertools.product(*(CAMPAIGN_AXES[n] for n in names))
    ]


def random_scenario(
    config: dict[str, Any], *, seed: int, steps: int, world: int, rate: float = 0.3
) -> Scenario:
    """``config`` with inf/NaN injected at random steps, ranks and gradient elements.

    Each step is hit with probability ``rate``; the target is one rank or every rank, the value
    +inf, -inf or NaN, the site any element of any local gradient. Seeded: the same arguments
    always give the same campaign, so a failure is reproducible from its printed scenario.
    """
    import random

    rng = random.Random(seed)
    injections: dict[int, tuple[int, float]] = {}
    sites: dict[int, int] = {}
    for step in range(steps):
        if rng.random() < rate:
            rank = rng.choice([*range(world), ALL_RANKS])
            injections[step] = (rank, rng.choice([INF, -INF, NAN]))
            sites[step] = rng.randrange(1 << 30)
    return Scenario(**config, steps=steps, injections=injections, sites=sites)


def check_agreement(results: list[dict[str, Any]], sc: Scenario) -> list[str]:
    """Every way the ranks of one scenario disagree (or a skip was missed); empty when none.

    Per step: the same skip decision on every rank, the same scale, bitwise-equal full
    parameters; at the end the same scaler state. A step with an injection must be skipped and
    a clean one must not.
    """
    problems = []
    first = results[0]
    for rank, res in enumerate(results[1:], start=1):
        for key in ("skipped", "scale", "params"):
            problems += [
                f"rank {rank} differs from rank 0 on {key} at step {step}"
                for step, (a, b) in enumerate(zip(first[key], res[key], strict=True))
                if a != b
            ]
        if res["state_dict"] != first["state_dict"]:
            problems.append(f"rank {rank} differs from rank 0 on the final scaler state")
    expected = [step in sc.injections for step in range(sc.steps)]
    if first["skipped"] != expected:
        problems.append(f"skips {first['skipped']} != injected steps {expected}")
    return problems


_F32 = torch.finfo(torch.float32)


def check_real_steps(scaler: DistributedGradScaler, overflows: int = 3) -> None:
    """Real fp16-style steps, some overflowing: a constructed scaler must work (not fail later
    inside torch) and keep a normal float32 scale and finite weights (no silent corruption);
    the only error allowed is ScaleUnderflowError, the scale at its floor."""
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if not scaler.is_enabled():
        overflows = 0  # disabled: plain fp32 training, an inf loss would be the caller's NaN
    for k in range(overflows + 2):
        opt.zero_grad()
        loss = model(torch.ones(2, 3)).sum() * (math.inf if 0 < k <= overflows else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        try:
            scaler.update()
            scale = scaler.get_scale()
        except ScaleUnderflowError:
            event("ScaleUnderflowError at the floor")
            scale = scaler.state_dict().get("scale", 1.0)  # the flag was consumed: no raise
        assert _F32.tiny <= scale <= _F32.max, f"scale {scale!r} left normal float32"
        assert all(torch.isfinite(p).all() for p in model.parameters())
    sd = scaler.state_dict()
    assert all(v is None or type(v) in (int, float) for v in sd.values()), sd
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True) == sd
