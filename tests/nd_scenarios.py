"""N-D parallel layouts on 4 ranks, for the scaler tests and the overhead benchmark.

Each layout takes this rank's part of ONE small fp32 model built from a fixed seed and
parallelises it the torchtitan way: the user builds the ``DeviceMesh`` with named dimensions and
applies ``fully_shard``, DDP, ``parallelize_module`` and ``torch.distributed.pipelining`` stages
driven by a real schedule. The global batch of a step is a function of the step alone and each
rank takes its data-parallel slice, so a single-process run of the same model on the whole batch
(:func:`reference_run`: fp32, ``torch.nn.utils.clip_grad_norm_``, no collectives) gives the norm
and parameters every rank must reproduce.

Mesh coordinates (row-major, as ``init_device_mesh`` lays them out):

- ``pp`` layouts: mesh ``(pp=2, dp=2)``, rank = 2 * pp + dp; ranks 2 and 3 hold stage 1.
- ``dp_tp``: mesh ``(dp=2, tp=2)``, rank = 2 * dp + tp.
- ``moe``: dense layers sharded over a 1-D mesh of all 4 ranks; experts on ``(edp=2, ep=2)``,
  rank = 2 * edp + ep, placements ``(Replicate(), Shard(0))``.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WORLD = 4
IN, HID, OUT = 8, 16, 4
BATCH = 8  # global batch; pp: 4 per dp rank, 2 micro-batches of 2
SEQ = 4  # dp_tp: sequence length, split over tp by SequenceParallel
N_MICROBATCHES = 2
N_EXPERTS, LOCAL_EXPERTS = 4, 2
LR, MOMENTUM = 0.1, 0.9
MAX_NORM = 0.05  # well below every step's norm: every clean step clips
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2
SEED = 0

INF, NAN = float("inf"), float("nan")
STEPS = 6
# step -> (rank, value): that rank's local gradient gets the value after backward. Ranks 3 and 2
# hold pipeline stage 1 in the pp layouts.
INJECTIONS: dict[int, tuple[int, float]] = {1: (3, INF), 4: (2, NAN)}
# With growth_interval=2: back off at 1 and 4, grow after the two clean steps 2 and 3.
EXPECTED_SCALES = [1024.0, 512.0, 512.0, 1024.0, 512.0, 512.0]
RESUME_AT = 3  # save after steps 0-2 (growth tracker at 1: the resumed run must grow at step 3)


@dataclass(frozen=True)
class Layout:
    """One parallel layout of the 4 ranks.

    ``kind``: "pp" (pp=2 x dp=2), "dp_tp" (dp=2 x tp=2) or "moe". For "pp": ``dp`` wraps each
    stage ("fsdp2": ``fully_shard`` on its dp sub-mesh; "ddp": DDP over the dp group; "plain": no
    wrapper, gradients all-reduced over dp by hand), ``schedule`` is "gpipe", "1f1b" or
    "interleaved" (Interleaved1F1B, 2 stages per rank), and ``register`` says what is passed to
    ``scaler.register_module``: "stage" (the PipelineStage objects), "ddp" (the DDP module) or
    "none".
    """

    kind: str
    dp: str = "fsdp2"
    schedule: str = "gpipe"
    register: str = "none"

    @property
    def name(self) -> str:
        if self.kind != "pp":
            return self.kind
        return f"pp_{self.dp}_{self.schedule}_register-{self.register}"


PP_FSDP2_GPIPE = Layout("pp", "fsdp2", "gpipe", "stage")
PP_FSDP2_1F1B = Layout("pp", "fsdp2", "1f1b", "none")
PP_FSDP2_INTERLEAVED = Layout("pp", "fsdp2", "interleaved", "stage")
PP_DDP = Layout("pp", "ddp", "1f1b", "ddp")
PP_PLAIN = Layout("pp", "plain", "gpipe", "stage")
DP_TP = Layout("dp_tp")
MOE = Layout("moe")


# ---------------------------------------------------------------------------- models
class MLP(nn.Module):
    """Linear layers with tanh between them, in a ModuleDict so that a pipeline stage built by
    deleting the other layers keeps the full model's parameter names (unique across stages, as
    DCP needs them)."""

    def __init__(self, widths: tuple[int, ...] = (IN, HID, HID, HID, OUT)) -> None:
        super().__init__()
        pairs = itertools.pairwise(widths)
        self.layers = nn.ModuleDict({str(i): nn.Linear(a, b) for i, (a, b) in enumerate(pairs)})
        self.last = str(len(widths) - 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name, layer in self.layers.items():
            x = layer(x)
            if name != self.last:
                x = torch.tanh(x)
        return x


class TPNet(nn.Module):
    """A pre-norm residual MLP block between an input and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.w1 = nn.Linear(HID, 2 * HID)
        self.w2 = nn.Linear(2 * HID, HID)
        self.out = nn.Linear(HID, OUT)
        with torch.no_grad():  # not the default ones and zeros: their gradients must matter
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.w2(torch.tanh(self.w1(self.norm(h))))
        return self.out(h)


class MoE(nn.Module):
    """Dense in/out projections around a residual expert layer. Token i of a rank's batch goes
    to that rank's local expert ``i % LOCAL_EXPERTS``; ``ep_rank`` picks the local experts of
    the full (reference) weight, a DTensor weight uses its own shard."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HID)
        self.experts = nn.Parameter(torch.randn(N_EXPERTS, HID, HID) / math.sqrt(HID))
        self.out = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor, ep_rank: int) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        experts = self.experts
        if hasattr(experts, "to_local"):
            local = experts.to_local()
        else:
            local = experts[ep_rank * LOCAL_EXPERTS : (ep_rank + 1) * LOCAL_EXPERTS]
        route = torch.arange(h.shape[0]) % LOCAL_EXPERTS
        h = h + torch.tanh(torch.bmm(h.unsqueeze(1), local[route]).squeeze(1))
        return self.out(h)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(SEED)
    if kind == "pp":
        return MLP()
    if kind == "dp_tp":
        return TPNet()
    if kind == "moe":
        return MoE()
    raise ValueError(f"unknown layout kind {kind!r}")


def global_batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (the same on every rank and in the reference)."""
    gen = torch.Generator().manual_seed(1000 + step)
    shape = (BATCH, SEQ) if kind == "dp_tp" else (BATCH,)
    x = torch.randn(*shape, IN, generator=gen)
    y = 2.0 * torch.randn(*shape, OUT, generator=gen)
    return x, y


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    # Plain for-loop SGD: exact enough to compare with the reference, and momentum gives the
    # checkpoint an optimizer state to carry. foreach=False: the expert and dense DTensors live
    # on different meshes, which one foreach call cannot mix.
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, foreach=False)


# ---------------------------------------------------------------------------- single process
@dataclass
class Reference:
    norms: list[float] = field(default_factory=list)
    params: list[dict[str, list[Any]]] = field(default_factory=list)
    # pp: per step, the unscaled loss of each micro-batch, dp rank 0's first
    microbatch_losses: list[list[float]] = field(default_factory=list)


def _reference_loss(kind: str, model: nn.Module, step: int) -> torch.Tensor:
    x, y = global_batch(kind, step)
    if kind != "moe":
        return mse(model(x), y)
    # Each rank's tokens meet only its local experts: the global mean loss is the mean of the
    # 4 ranks' mean losses (equal batch slices), rank r holding the experts of ep rank r % 2.
    parts = zip(x.chunk(WORLD), y.chunk(WORLD), strict=True)
    return sum(mse(model(xr, r % 2), yr) for r, (xr, yr) in enumerate(parts)) / WORLD


def reference_run(kind: str, steps: int = STEPS, skip: Any = INJECTIONS) -> Reference:
    """The full model on the whole batch in one process, fp32, no collectives: the norm before
    clipping and the parameters after each step (steps in ``skip`` are not applied)."""
    model = make_model(kind)
    opt = make_optimizer(model.parameters())
    ref = Reference()
    for step in range(steps):
        opt.zero_grad()
        if kind == "pp":
            with torch.no_grad():
                x, y = global_batch(kind, step)
                pieces = zip(x.chunk(2 * N_MICROBATCHES), y.chunk(2 * N_MICROBATCHES), strict=True)
                ref.microbatch_losses.append([float(mse(model(a), b)) for a, b in pieces])
        _reference_loss(kind, model, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref.norms.append(float(norm))
        if step not in skip:
            opt.step()
        ref.params.append({n: p.detach().tolist() for n, p in model.named_parameters()})
    return ref


def reference_grads(kind: str, step: int = 0) -> dict[str, list[Any]]:
    """The whole model's gradients of the mean loss at ``step`` (from the initial weights)."""
    model = make_model(kind)
    _reference_loss(kind, model, step).backward()
    return {n: p.grad.tolist() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------------------- distributed
@dataclass
class Built:
    """This rank's part of a layout, ready to train.

    ``forward_backward(step)`` runs the forward and the backward of a step with the loss
    multiplied by the scale (through the pipeline schedule's ``loss_fn`` in pp layouts) and
    whatever gradient synchronisation the layout does by hand. ``modules`` are this rank's model
    parts, ``checkpoint_module`` the one module handed to DCP, ``replica_key`` equal on ranks
    that hold the same parameter elements, ``inject_into`` the parameter whose local gradient an
    injection overwrites, ``to_register`` what goes to ``scaler.register_module``.
    """

    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    forward_backward: Callable[[int], None]
    checkpoint_module: nn.Module
    replica_key: int
    inject_into: nn.Parameter
    to_register: list[Any]
    keep_alive: list[Any] = field(default_factory=list)  # stages, schedules
    # pp last stage, the latest step: the losses the schedule returned, and the same recomputed
    # without the scale from the schedule's outputs
    losses: list[float] = field(default_factory=list)
    unscaled_losses: list[float] = field(default_factory=list)


def build(layout: Layout, rank: int, scaler: Any, pp_loss_fn: Callable[..., Any] | None) -> Built:
    """Build ``layout`` on this rank. ``scaler`` scales the loss of the non-pipeline layouts;
    ``pp_loss_fn(output, target)`` is the pipeline schedule's (already scaled) loss function."""
    if layout.kind == "pp":
        assert pp_loss_fn is not None, "pp layouts take the schedule's loss_fn"
        return _build_pp(layout, rank, pp_loss_fn)
    if layout.kind == "dp_tp":
        return _build_dp_tp(rank, scaler)
    if layout.kind == "moe":
        return _build_moe(rank, scaler)
    raise ValueError(f"unknown layout kind {layout.kind!r}")


def _stage_module(full: nn.Module, keep: list[int]) -> MLP:
    stage = copy.deepcopy(full)
    assert isinstance(stage, MLP)
    for name in list(stage.layers):
        if int(name) not in keep:
            del stage.layers[name]
    return stage


def _build_pp(layout: Layout, rank: int, loss_fn: Callable[..., Any]) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    dp_mesh, pp_group, dp_group = mesh["dp"], mesh.get_group("pp"), mesh.get_group("dp")
    full = make_model("pp")
    if layout.schedule == "interleaved":  # stage s = layer s; rank pp holds stages pp, pp + 2
        num_stages, split = 4, [[0], [1], [2], [3]]
        stage_ids = [pp_rank, pp_rank + 2]
    else:
        num_stages, split = 2, [[0, 1], [2, 3]]
        stage_ids = [pp_rank]
    modules: list[nn.Module] = []
    stages = []
    to_register: list[Any] = []
    for sid in stage_ids:
        module: nn.Module = _stage_module(full, split[sid])
        if layout.dp == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for layer in module.layers.values():  # type: ignore[union-attr]
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(module, mesh=dp_mesh)
        elif layout.dp == "ddp":
            module = nn.parallel.DistributedDataParallel(module, process_group=dp_group)
            if layout.register == "ddp":
                to_register.append(module)
        elif layout.dp != "plain":
            raise ValueError(f"unknown pp data parallelism {layout.dp!r}")
        meta: dict[str, Any] = {}
        if layout.dp == "ddp":
            # Static shapes: dynamic metadata inference runs a forward and backward outside
            # no_sync(), which leaves DDP's reducer expecting both (torch 2.13: "rebuilt
            # parameter indices size is not same as original model parameters size").
            first, last = split[sid][0], split[sid][-1]
            mb = BATCH // 2 // N_MICROBATCHES
            # requires_grad as at run time: a later stage's input is an activation, and a
            # receive buffer that does not require grad sends no gradient back.
            x = torch.empty(mb, full.layers[str(first)].in_features, requires_grad=sid > 0)
            y = torch.empty(mb, full.layers[str(last)].out_features, requires_grad=True)
            meta = {
                "input_args": x,
                "output_args": y,
                "input_grads": None if sid == 0 else x,  # the model's input needs no grad
                "output_grads": None if sid == num_stages - 1 else y,  # the loss's
            }
        # input_grads/output_grads exist from torch 2.12; older releases take the shapes alone.
        accepted = inspect.signature(PipelineStage).parameters
        meta = {k: v for k, v in meta.items() if k in accepted}
        stage = PipelineStage(module, sid, num_stages, torch.device("cpu"), group=pp_group, **meta)
        if layout.register == "stage":
            to_register.append(stage)
        modules.append(module)
        stages.append(stage)
    if layout.schedule == "gpipe":
        schedule: Any = ScheduleGPipe(stages[0], N_MICROBATCHES, loss_fn=loss_fn)
    elif layout.schedule == "1f1b":
        schedule = Schedule1F1B(stages[0], N_MICROBATCHES, loss_fn=loss_fn)
    elif layout.schedule == "interleaved":
        schedule = ScheduleInterleaved1F1B(stages, N_MICROBATCHES, loss_fn=loss_fn)
    else:
        raise ValueError(f"unknown schedule {layout.schedule!r}")
    params = [p for m in modules for p in m.parameters()]
    optimizer = make_optimizer(params)

    def forward_backward(step: int) -> None:
        x, y = global_batch("pp", step)
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        if pp_rank == 0:  # holds stage 0 (and 2): feeds the inputs
            schedule.step(x)
        else:  # holds the last stage: computes the loss
            losses: list[torch.Tensor] = []
            out = schedule.step(target=y, losses=losses)
            built.losses[:] = [float(loss) for loss in losses]
            # The same micro-batch losses, unscaled, from the outputs the schedule returns.
            pieces = zip(out.chunk(N_MICROBATCHES), y.chunk(N_MICROBATCHES), strict=True)
            built.unscaled_losses[:] = [float(mse(o, t)) for o, t in pieces]
        if layout.dp == "plain":  # data parallelism by hand: average over the stage's dp ranks
            for p in params:
                assert p.grad is not None
                dist.all_reduce(p.grad, group=dp_group)
                p.grad.div_(2)

    built = Built(
        modules=modules,
        optimizer=optimizer,
        forward_backward=forward_backward,
        checkpoint_module=modules[0] if len(modules) == 1 else nn.ModuleList(modules),
        replica_key=pp_rank,
        inject_into=_first_nonempty(params),
        to_register=to_register,
        keep_alive=[stages, schedule, mesh],
    )
    return built


def _first_nonempty(params: list[nn.Parameter]) -> nn.Parameter:
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.numel():
            return p
    raise AssertionError("this rank holds no parameter elements")


def _build_dp_tp(rank: int, scaler: Any) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model = make_model("dp_tp")
    # Sequence parallel between the projections: activations sharded on the sequence dimension
    # (dim 1) outside the tp matmuls, the norm computed on the local sequence shard.
    plan = {
        "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], plan)
    for name in ("inp", "w1", "w2", "out"):
        fully_shard(getattr(model, name), mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = make_optimizer(model.parameters())

    def forward_backward(step: int) -> None:
        x, y = global_batch("dp_tp", step)
        x, y = x.chunk(2)[dp_rank], y.chunk(2)[dp_rank]
        scaler.scale(mse(model(x), y)).backward()

    w1 = model.w1.weight  # Shard(0) over tp and dp: rank 3's shard is its alone
    return Built(
        modules=[model],
        optimizer=optimizer,
        forward_backward=forward_backward,
        checkpoint_module=model,
        replica_key=0,
        inject_into=w1,
        to_register=[],
        keep_alive=[mesh],
    )


def _build_moe(rank: int, scaler: Any) -> Built:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dense_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    ep_rank = expert_mesh.get_local_rank("ep")
    edp_group = expert_mesh.get_group("edp")
    model = make_model("moe")
    assert isinstance(model, MoE)
    full = model.experts.detach()
    local = full[ep_rank * LOCAL_EXPERTS : (ep_rank + 1) * LOCAL_EXPERTS].clone()
    model.experts = nn.Parameter(
        DTensor.from_local(local, expert_mesh, [Replicate(), Shard(0)], run_check=False)
    )
    fully_shard(model.inp, mesh=dense_mesh)
    fully_shard(model.out, mesh=dense_mesh)
    fully_shard(model, mesh=dense_mesh, ignored_params={model.experts})
    optimizer = make_optimizer(model.parameters())

    def forward_backward(step: int) -> None:
        x, y = global_batch("moe", step)
        x, y = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
        scaler.scale(mse(model(x, ep_rank), y)).backward()
        # The experts are replicated over edp but each replica saw only its own rank's tokens:
        # sum over edp, divide by the world so that it is the gradient of the global mean loss
        # (FSDP2 averages the dense gradients over all 4 ranks).
        grad = model.experts.grad
        assert grad is not None
        local_grad = grad.to_local()
        dist.all_reduce(local_grad, group=edp_group)
        local_grad.div_(WORLD)

    return Built(
        modules=[model],
        optimizer=optimizer,
        forward_backward=forward_backward,
        checkpoint_module=model,
        replica_key=0,
        inject_into=model.experts,
        to_register=[],
        keep_alive=[dense_mesh, expert_mesh],
    )


# ---------------------------------------------------------------------------- inspection
def canonical_name(name: str) -> str:
    """A parameter name as in the unwrapped model (DDP prefixes ``module.``)."""
    return name.removeprefix("module.")


def full_params(built: Built) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's parameters, gathered (``full_tensor``) where they are DTensors. Collective
    over each DTensor's mesh: every rank holding it calls this in the same order."""
    for module in built.modules:
        for name, p in module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            yield canonical_name(name), full.detach()


def digest(named: list[tuple[str, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def inject(param: nn.Parameter, value: float) -> None:
    """Write ``value`` into the first element of this rank's local gradient of ``param``."""
    grad = param.grad
    assert grad is not None, "inject after backward"
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    assert local.numel(), "this rank holds no element of the parameter"
    local.view(-1)[0] = value


# ---------------------------------------------------------------------------- training
def new_scaler() -> Any:
    from distamp import DistributedGradScaler

    return DistributedGradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)


def setup(layout: Layout, rank: int) -> tuple[Any, Built]:
    """A fresh scaler and this rank's part of ``layout``, registered with the scaler.

    The pipeline schedules get ``scaler.scaled_loss_fn(mse)``: created on every rank, so that the
    scale exists on the stages that never compute a loss.
    """
    scaler = new_scaler()
    loss_fn = scaler.scaled_loss_fn(mse) if layout.kind == "pp" else None
    built = build(layout, rank, scaler, loss_fn)
    for module in built.to_register:
        scaler.register_module(module)
    return scaler, built


def train(rank: int, scaler: Any, built: Built, steps: range) -> list[dict[str, Any]]:
    """Train ``steps`` (forward, backward, injection, clip, step, update); per step, what the
    ranks must agree on and what the reference must match."""
    records = []
    for step in steps:
        built.optimizer.zero_grad()
        before = scaler.collectives_issued
        built.forward_backward(step)
        target = INJECTIONS.get(step)
        if target is not None and target[0] == rank:
            inject(built.inject_into, target[1])
        norm = scaler.clip_grad_norm_(built.optimizer, MAX_NORM)
        scaler.step(built.optimizer)
        scaler.update()
        collectives = scaler.collectives_issued - before
        named = list(full_params(built))
        records.append(
            {
                "step": step,
                "skipped": bool(scaler.last_step_skipped),
                "scale": scaler.get_scale(),
                "norm": float(norm),
                "collectives": collectives,
                "digest": digest(named),
                "params": {name: t.tolist() for name, t in named},
                "losses": list(built.losses),
                "unscaled_losses": list(built.unscaled_losses),
            }
        )
    return records


def save_state(directory: str, built: Built, scaler: Any, route: str) -> None:
    """Save model, optimizer and scaler. Collective: every rank.

    ``route="engine"``: :func:`distamp.engine.checkpoint.save_checkpoint`, the path of
    ``DistAMP.save_state``. ``route="dcp"``: ``get_state_dict`` with
    ``flatten_optimizer_state_dict=True`` + ``dcp.save``, the scaler state written by rank 0.
    Flattening keys every optimizer hyperparameter by parameter name: unflattened, the
    ``param_groups`` entry has the same key on every pipeline stage, DCP keeps one copy of it, and
    the other stage loads param groups that name none of its parameters.
    """
    if route == "engine":
        from distamp.engine.checkpoint import save_checkpoint

        save_checkpoint(
            directory,
            step=RESUME_AT,
            model=built.checkpoint_module,
            optimizer=built.optimizer,
            trainer_state={"scaler": scaler.state_dict()},
        )
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(built.checkpoint_module, built.optimizer, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{directory}/state")
    if dist.get_rank() == 0:
        torch.save(scaler.state_dict(), f"{directory}/scaler.pt")
    dist.barrier()


def load_state(directory: str, built: Built, scaler: Any, route: str) -> None:
    """Load what :func:`save_state` saved into freshly built objects. Collective: every rank."""
    if route == "engine":
        from distamp.engine.checkpoint import load_checkpoint

        trainer = load_checkpoint(
            directory, model=built.checkpoint_module, optimizer=built.optimizer
        )
        assert trainer is not None, f"no checkpoint in {directory}"
        scaler.load_state_dict(trainer["scaler"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(built.checkpoint_module, built.optimizer, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{directory}/state")
    set_state_dict(
        built.checkpoint_module,
        built.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    scaler.load_state_dict(torch.load(f"{directory}/scaler.pt", weights_only=True))


def run_layout(
    rank: int, layout: Layout, checkpoint_dir: str | None = None, route: str = "dcp"
) -> dict[str, Any]:
    """Train ``layout`` for :data:`STEPS` steps on this rank and return its records.

    With ``checkpoint_dir``: the model, optimizer and scaler are saved after :data:`RESUME_AT`
    steps (:func:`save_state` by ``route``), the run goes on to the end, and then everything is
    built again from scratch, loaded and trained over the same last steps: ``"resumed"`` must
    equal the tail of ``"records"`` bitwise.
    """
    scaler, built = setup(layout, rank)
    records = train(rank, scaler, built, range(RESUME_AT if checkpoint_dir else STEPS))
    out: dict[str, Any] = {"replica_key": built.replica_key}
    if checkpoint_dir is not None:
        save_state(checkpoint_dir, built, scaler, route)
        records += train(rank, scaler, built, range(RESUME_AT, STEPS))
        out["state_dict"] = scaler.state_dict()
        scaler, built = setup(layout, rank)
        load_state(checkpoint_dir, built, scaler, route)
        out["resumed"] = train(rank, scaler, built, range(RESUME_AT, STEPS))
        out["resumed_state_dict"] = scaler.state_dict()
    out["records"] = records
    return out


def _local_state(built: Built) -> dict[str, Any]:
    """This rank's model and optimizer state, local shards only (no collective)."""

    def local(t: torch.Tensor) -> list[Any]:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().tolist()

    names = {id(p): canonical_name(n) for m in built.modules for n, p in m.named_parameters()}
    groups = [
        {k: v for k, v in g.items() if k != "params"}
        | {"params": [names[id(p)] for p in g["params"]]}
        for g in built.optimizer.param_groups
    ]
    state = {
        names[id(p)]: {k: local(v) for k, v in s.items() if isinstance(v, torch.Tensor)}
        for p, s in built.optimizer.state.items()
    }
    params = {names[id(p)]: local(p) for m in built.modules for p in m.parameters()}
    return {"param_groups": groups, "state": state, "params": params}


def round_trip(rank: int, layout: Layout, directory: str, route: str) -> list[str]:
    """Train one step, save by ``route``, load into freshly built objects, and list what this
    rank's model, optimizer (hyperparameters, momentum) or scaler state lost on the way."""
    scaler, built = setup(layout, rank)
    train(rank, scaler, built, range(1))
    saved, saved_scaler = _local_state(built), scaler.state_dict()
    save_state(directory, built, scaler, route)
    scaler, built = setup(layout, rank)
    load_state(directory, built, scaler, route)
    loaded = _local_state(built)
    problems = []
    if loaded["param_groups"] != saved["param_groups"]:
        problems.append(
            f"rank {rank}: optimizer param_groups after loading {loaded['param_groups']} != "
            f"saved {saved['param_groups']}"
        )
    for key in ("state", "params"):
        names = sorted(set(loaded[key]) | set(saved[key]))
        lost = [n for n in names if loaded[key].get(n) != saved[key].get(n)]
        if lost:
            problems.append(f"rank {rank}: {key} of {lost} after loading differ from the saved")
    if scaler.state_dict() != saved_scaler:
        problems.append(f"rank {rank}: scaler state {scaler.state_dict()} != {saved_scaler}")
    return problems


class FixedScale:
    """Multiplies the loss by :data:`INIT_SCALE`: the layouts' own gradients, with no scaler
    involved (see :func:`layout_grads`)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * INIT_SCALE


def layout_grads(rank: int, layout: Layout, step: int = 0) -> dict[str, list[Any]]:
    """This rank's gathered gradients of ``step`` from the initial weights, divided by the fixed
    scale: what the layout computes before any scaler logic runs (collective on every rank)."""
    built = build(layout, rank, FixedScale(), lambda out, target: mse(out, target) * INIT_SCALE)
    built.forward_backward(step)
    grads = {}
    for module in built.modules:
        for name, p in module.named_parameters():
            assert p.grad is not None, f"{name} has no gradient"
            full = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[canonical_name(name)] = (full / INIT_SCALE).tolist()
    return grads
