"""precision="fp8" on N-D layouts built by hand: 4 real gloo ranks, torchao float8 layers
converted before parallelising, FSDP2 float8 all-gather, float8 tensor-parallel styles and a
torch.distributed.pipelining schedule, driven by ``DistAMP(mesh=...)``.

Layouts (one spawn of 4 ranks runs both):

- ``dp_tp``: mesh (dp=2, tp=2); ``w1``/``w2`` tensor parallel (Float8Colwise/Float8Rowwise),
  every layer ``fully_shard``-ed over dp, so the float8-gathered weights live on two meshes (a
  1-D dp mesh and the 2-D one), which torchao's own scale precompute refuses.
- ``pp``: mesh (pp=2, dp=2); each stage holds 2 of the 4 layers, FSDP2 over its dp sub-mesh,
  under GPipe with ``amp.scaled_loss_fn``. ``pp_mixed``: the same with stage 1's layers
  excluded from fp8, so its ranks hold no float8 weight yet must join every scale all-reduce
  (a rank that skipped it would hang the others: Megatron-LM's missing-fp8-group failure).
  ``pp_interleaved``: four one-layer stages, two per rank, under Interleaved1F1B.

The contract:

- scales: after setup and after every step, each float8-gathered weight's scale is exactly
  torchao's ``float8_max / amax`` of the WHOLE weight (gathered over every rank that holds a
  shard), on every rank, computed with one all-reduce per step;
- agreement: an inf in one rank's loss skips the step on all four ranks, and ranks holding the
  same parameters hold bitwise-equal ones;
- accuracy: the pipeline's losses equal a single-process fp8 run of the same model on the same
  micro-batches (the weight scales are the same, so the float8 casts are), and the tensor
  parallel losses stay within 1% of it;
- resume (dp_tp): saved through the engine and loaded into a freshly built job, the scales are
  the loaded weights' and training goes on bitwise equal to the uninterrupted run.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn

torchao = pytest.importorskip("torchao", reason="precision='fp8' needs the fp8 extra")

D = 32  # float8 GEMMs need multiples of 16
STEPS = 5
# step at which rank 3 feeds an inf target
INJECT = {"dp_tp": 2, "pp": 1, "pp_mixed": 1, "pp_interleaved": 1}
LR = 0.05
RESUME_AT = 3  # dp_tp: saved after steps 0-2, resumed for steps 3-4


def _policy(exclude: tuple[str, ...] = ()) -> Any:
    from distamp import AutocastPolicy

    return AutocastPolicy("fp8", fp8_min_features=16, fp8_exclude=exclude)


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.w1 = nn.Linear(D, 2 * D)
        self.w2 = nn.Linear(2 * D, D)
        self.out = nn.Linear(D, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.out(h + self.w2(torch.relu(self.w1(h))))


class Chain(nn.Module):
    """Four D x D layers in a ModuleDict: a stage built by deleting layers keeps their names."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(D, D) for i in range(4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return TPNet() if kind == "dp_tp" else Chain()


def _batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: 4 samples of 16 tokens (dp_tp) or 8 rows (pp)."""
    g = torch.Generator().manual_seed(100 + step)
    if kind == "dp_tp":
        return torch.randn(4, 16, D, generator=g), torch.randn(4, 16, 16, generator=g)
    return torch.randn(8, D, generator=g), torch.rand(8, D, generator=g) - 0.5


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.float() - target) ** 2).mean()


def _expected_scale(weight: Any) -> torch.Tensor:
    """torchao's tensorwise weight scale, from the whole (gathered) weight."""
    from torchao.float8.float8_utils import EPS

    amax = weight.full_tensor().abs().max()
    return (torch.finfo(torch.float8_e4m3fn).max / torch.clamp(amax, EPS).double()).float()


def _scale_problems(model: nn.Module, rank: int, when: str, *, some: bool = True) -> list[str]:
    from distamp.precision.fp8_parallel import gathers_in_float8

    problems = []
    gathered = [(n, m) for n, m in model.named_modules() if gathers_in_float8(m)]
    if some and not gathered:
        problems.append(f"rank {rank}: no weight is gathered in float8")
    for name, module in gathered:
        got = module.weight._local_tensor._precomputed_scale
        want = _expected_scale(module.weight)
        if got is None or not torch.equal(got, want):
            problems.append(f"rank {rank}, {when}: {name} scale {got}, whole weight's {want}")
    return problems


def _digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().full_tensor().numpy().tobytes())
    return h.hexdigest()


def _dp_tp_engine(mesh: Any, seed: int = 0) -> tuple[Any, nn.Module, list[str]]:
    """Convert, tensor-parallelise with the float8 plan, fully_shard over dp, hand to the
    engine. Returns the engine, the model and the tensor-parallel styles used."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from distamp import DistAMP
    from distamp.precision.fp8 import convert_for_fp8
    from distamp.precision.fp8_parallel import fp8_tp_plan

    model = _model("dp_tp")
    if seed:
        torch.manual_seed(seed)
        model = TPNet()
    convert_for_fp8(model, _policy(), fully_sharded=True)
    plan = fp8_tp_plan(model, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    for name in ("inp", "w1", "w2", "out"):
        fully_shard(getattr(model, name), mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    amp = DistAMP(precision="fp8", policy=_policy(), mesh=mesh)
    model, _ = amp.setup(model, lambda params: torch.optim.SGD(params, lr=LR))
    assert amp.fp8 is not None
    return amp, model, sorted(type(s).__name__ for s in plan.values())


def _dp_tp_steps(
    amp: Any, model: nn.Module, mesh: Any, rank: int, steps: range, out: dict[str, Any]
) -> list[dict[str, Any]]:
    dp = mesh.get_local_rank("dp")
    records = []
    for step in steps:
        x, y = (t.chunk(2)[dp] for t in _batch("dp_tp", step))
        if step == INJECT["dp_tp"] and rank == 3:
            y = y.clone()
            y[0, 0, 0] = float("inf")
        with amp.autocast():
            loss = _mse(model(x), y)
        before = amp.fp8.scales.collectives
        amp.backward(loss)
        result = amp.step()
        after = amp.fp8.scales.collectives
        out["problems"] += _scale_problems(model, rank, f"step {step}")
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean, group=mesh.get_group("dp"))
        records.append(
            {
                "stepped": result.stepped,
                "loss": mean.item() / 2,
                "digest": _digest(model),
                "scale_collectives": after - before,
            }
        )
    return records


def _dp_tp(rank: int, root: str) -> dict[str, Any]:
    """The whole run (saving through the engine after step RESUME_AT - 1), then a fresh engine
    over a differently initialised model that loads it and runs the remaining steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    amp, model, styles = _dp_tp_engine(mesh)
    out: dict[str, Any] = {"styles": styles, "problems": []}
    out["problems"] += _scale_problems(model, rank, "after setup")
    out["steps"] = _dp_tp_steps(amp, model, mesh, rank, range(RESUME_AT), out)
    amp.save_state(root)
    out["steps"] += _dp_tp_steps(amp, model, mesh, rank, range(RESUME_AT, STEPS), out)
    amp.close()
    again, model, _ = _dp_tp_engine(mesh, seed=7)
    assert again.load_state(root) and again.step_count == RESUME_AT
    out["problems"] += _scale_problems(model, rank, "after loading")
    out["resumed"] = _dp_tp_steps(again, model, mesh, rank, range(RESUME_AT, STEPS), out)
    again.close()
    return out


def _pp(rank: int, exclude: tuple[str, ...] = (), *, interleaved: bool = False) -> dict[str, Any]:
    """pp=2 x dp=2; with ``exclude`` naming stage 1's layers, stage 1 holds no float8 layer
    and must still join every step's scale all-reduce (or stage 0 would hang in it).
    ``interleaved``: 4 one-layer stages, 2 per rank, under Interleaved1F1B, given to the engine
    as a list."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from distamp import DistAMP
    from distamp.precision.fp8 import convert_for_fp8
    from distamp.precision.fp8_parallel import gathers_in_float8

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    full = _model("pp")
    convert_for_fp8(full, _policy(exclude), fully_sharded=True)
    split = [["0"], ["1"], ["2"], ["3"]] if interleaved else [["0", "1"], ["2", "3"]]
    ids = [pp, pp + 2] if interleaved else [pp]
    stages = []
    for sid in ids:
        part = copy.deepcopy(full)
        for name in [n for n in list(part.layers) if n not in split[sid]]:  # type: ignore[arg-type]
            del part.layers[name]  # type: ignore[union-attr]
        for layer in part.layers.values():  # type: ignore[union-attr]
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        group = mesh.get_group("pp")
        stages.append(PipelineStage(part, sid, len(split), torch.device("cpu"), group=group))
    amp = DistAMP(precision="fp8", policy=_policy(exclude), mesh=mesh)
    module, _ = amp.setup(
        stages if interleaved else stages[0], lambda params: torch.optim.SGD(params, lr=LR)
    )
    assert amp.fp8 is not None
    loss_fn = amp.scaled_loss_fn(_mse)
    schedule = (
        ScheduleInterleaved1F1B(stages, 2, loss_fn=loss_fn)
        if interleaved
        else ScheduleGPipe(stages[0], 2, loss_fn=loss_fn)
    )
    some = not (exclude and pp == 1)
    out: dict[str, Any] = {"steps": []}
    out["problems"] = _scale_problems(module, rank, "after setup", some=some)
    # One mesh per stage: torchao's own precompute works here, and must agree bitwise.
    gathered = [m for m in module.modules() if gathers_in_float8(m)]
    ours = [m.weight._local_tensor._precomputed_scale.clone() for m in gathered]
    precompute_float8_dynamic_scale_for_fsdp(module)
    theirs = [m.weight._local_tensor._precomputed_scale for m in gathered]
    out["same_as_torchao"] = len(ours) == 2 * some and all(map(torch.equal, ours, theirs))
    for step in range(STEPS):
        x, y = (t.chunk(2)[dp] for t in _batch("pp", step))
        if step == INJECT["pp"] and rank == 3:
            y = y.clone()
            y[0, 0] = float("inf")
        before = amp.fp8.scales.collectives if amp.fp8.scales else -1
        losses: list[torch.Tensor] = []
        result = (
            amp.pipeline_step(schedule, x)
            if pp == 0
            else amp.pipeline_step(schedule, target=y, losses=losses)
        )
        after = amp.fp8.scales.collectives if amp.fp8.scales else -1
        out["problems"] += _scale_problems(module, rank, f"step {step}", some=some)
        out["steps"].append(
            {
                "stepped": result.stepped,
                "losses": [float(v) for v in losses],  # fp8: nothing is scaled
                "digest": _digest(module),
                "scale_collectives": after - before,
            }
        )
    amp.close()
    return out


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {
        "dp_tp": _dp_tp(rank, root),
        "pp": _pp(rank),
        "pp_mixed": _pp(rank, exclude=("layers.2", "layers.3")),
        "pp_interleaved": _pp(rank, interleaved=True),
    }


def _reference(kind: str) -> list[list[float]]:
    """One process, the same fp8 conversion, the micro-batches the ranks see, accumulated:
    each step's micro-batch losses (dp_tp: one per dp rank; pp: two per dp rank)."""
    from distamp.precision.fp8 import convert_for_fp8

    model = _model(kind)
    convert_for_fp8(model, _policy())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_step = []
    for step in range(STEPS):
        x, y = _batch(kind, step)
        pieces = list(
            zip(
                x.chunk(2 if kind == "dp_tp" else 4),
                y.chunk(2 if kind == "dp_tp" else 4),
                strict=True,
            )
        )
        losses = []
        for xs, ys in pieces:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _mse(model(xs), ys)
            (loss / len(pieces)).backward()
            losses.append(loss.item())
        if step != INJECT[kind]:
            opt.step()
        opt.zero_grad()
        per_step.append(losses)
    return per_step


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("fp8_nd")), timeout=240)


@pytest.mark.parametrize("kind", ["dp_tp", "pp", "pp_mixed", "pp_interleaved"])
def test_fp8_weight_scales_are_the_whole_weights_in_one_all_reduce(
    kind: str, runs: list[dict[str, Any]]
) -> None:
    problems = [p for res in runs for p in res[kind]["problems"]]
    assert not problems, "\n".join(problems)
    if kind != "dp_tp":  # where torchao's precompute works (one mesh per stage), the same bits
        assert all(res[kind]["same_as_torchao"] for res in runs)
    for rank, res in enumerate(runs):
        counts = [s["scale_collectives"] for s in res[kind]["steps"]]
        assert counts == [1] * STEPS, f"rank {rank}: scale all-reduces per step {counts}"


@pytest.mark.parametrize("kind", ["dp_tp", "pp", "pp_mixed", "pp_interleaved"])
def test_fp8_skip_is_agreed_and_replicas_stay_bitwise_equal(
    kind: str, runs: list[dict[str, Any]]
) -> None:
    expected = [step != INJECT[kind] for step in range(STEPS)]
    for rank, res in enumerate(runs):
        steps = res[kind]["steps"]
        assert [s["stepped"] for s in steps] == expected, f"rank {rank}"
        for step in range(1, STEPS):
            moved = steps[step]["digest"] != steps[step - 1]["digest"]
            assert moved == expected[step], f"rank {rank}, step {step}: moved={moved}"
    # dp_tp: every rank holds (shards of) the same parameters; pp: the stage's dp replicas.
    peers = [[0, 1, 2, 3]] if kind == "dp_tp" else [[0, 1], [2, 3]]
    for group in peers:
        digests = [[s["digest"] for s in runs[r][kind]["steps"]] for r in group]
        assert all(d == digests[0] for d in digests), f"ranks {group} differ"


def test_fp8_losses_track_a_single_process_run(runs: list[dict[str, Any]]) -> None:
    ref = _reference("pp")
    for rank in (2, 3):  # the last stage's ranks; dp rank r computes micro-batches 2r, 2r+1
        dp = rank - 2
        for step, rec in enumerate(runs[rank]["pp"]["steps"]):
            if step == INJECT["pp"]:
                continue
            want = ref[step][2 * dp : 2 * dp + 2]
            assert rec["losses"] == pytest.approx(want, rel=1e-5), (rank, step)
    ref_tp = _reference("dp_tp")
    for step, rec in enumerate(runs[0]["dp_tp"]["steps"]):
        if step != INJECT["dp_tp"]:
            assert rec["loss"] == pytest.approx(sum(ref_tp[step]) / 2, rel=1e-2), step
    assert runs[0]["dp_tp"]["styles"] == ["Float8ColwiseParallel", "Float8RowwiseParallel"]


def test_fp8_tensor_parallel_resume_is_bitwise_equal(runs: list[dict[str, Any]]) -> None:
    """Saved through the engine (DCP: DTensor shards of float8-gathered, tensor-parallel
    weights) and loaded into a freshly built, differently initialised job: the float8 scales are
    recomputed from the loaded weights and training goes on bitwise as if never interrupted."""
    for rank, res in enumerate(runs):
        run, resumed = res["dp_tp"]["steps"][RESUME_AT:], res["dp_tp"]["resumed"]
        assert len(resumed) == STEPS - RESUME_AT
        for a, b in zip(run, resumed, strict=True):
            assert (a["stepped"], a["digest"]) == (b["stepped"], b["digest"]), rank
            assert repr(a["loss"]) == repr(b["loss"]), rank
