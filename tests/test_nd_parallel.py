"""DistributedGradScaler on N-D parallel layouts: 4 real gloo ranks, real FSDP2, DDP, DTensor
tensor parallelism, expert meshes and torch.distributed.pipelining schedules.

Layouts (``nd_scenarios``): pp=2 x dp=2 with FSDP2 per stage under GPipe, 1F1B and
Interleaved1F1B (2 stages per rank), with DDP per stage and with plain stages synchronised by
hand; dp=2 x tp=2 (Colwise/Rowwise + a SequenceParallel LayerNorm, FSDP2 over dp); a small
mixture of experts (dense layers sharded over all 4 ranks, experts sharded over ep and
replicated over edp). In each, inf (step 1) and NaN (step 4) are written into ONE rank's local
gradient (a stage-1 rank in pp layouts), and every step runs ``scaler.clip_grad_norm_`` with a
max_norm that always clips, then ``step`` and ``update``. The contract, one test per part:

- agreement: every rank skips exactly the injected steps, with the same scale and the backoff
  applied; ranks holding the same elements (a stage's dp replicas) hold bitwise-equal gathered
  parameters, and no stage's parameters move on a skipped step;
- norm: every rank gets the WHOLE model's gradient norm (non-finite on a skipped step), equal to
  a single-process fp32 reference (torch.nn.utils.clip_grad_norm_ on the whole batch) to 1e-5;
- reference step: the clipped SGD step lands on the reference's parameters (1e-5);
- one collective: ``scaler.collectives_issued`` grows by exactly 1 per step (clip + step);
- pipeline loss: with ``loss_fn=scaler.scaled_loss_fn(mse)`` the schedule's losses are each
  micro-batch's loss times the current scale;
- resume: saved through DCP + ``scaler.state_dict()`` (pipelines: flattened optimizer state;
  dp x tp and experts: ``distamp.engine.checkpoint``, the engine's path) and resumed in freshly
  built
  objects, training goes on bitwise equal to the run that was never interrupted.

A scaler-free check shows that every layout computes the reference's gradients, so a failure
of the tests above is the scaler's. The layouts run in a few groups, each ONE spawn of 4 ranks
(cached for the module), so a group costs one process start-up however many tests read it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nd_scenarios as nd
import pytest
import torch
from _dist import run_ranks


@dataclass(frozen=True)
class Case:
    layout: nd.Layout
    resume: str | None = None  # checkpoint route of the resume run ("dcp" | "engine")
    round_trip: str | None = None  # checkpoint route of a save/load round trip


GROUPS: dict[str, tuple[Case, ...]] = {
    "pipeline_fsdp2": (
        Case(nd.PP_FSDP2_GPIPE, resume="dcp", round_trip="engine"),
        Case(nd.PP_FSDP2_1F1B),
        Case(nd.PP_FSDP2_INTERLEAVED),
    ),
    "pipeline_ddp": (Case(nd.PP_DDP, resume="dcp"), Case(nd.PP_PLAIN)),
    "dp_tp": (Case(nd.DP_TP, resume="engine"),),
    "moe": (Case(nd.MOE, resume="engine"),),
}
TIMEOUTS = {"pipeline_fsdp2": 240.0, "pipeline_ddp": 200.0, "dp_tp": 150.0, "moe": 150.0}
CASES = {case.layout.name: (group, case) for group, cases in GROUPS.items() for case in cases}
ALL = list(CASES)
RESUMED = [name for name, (_, case) in CASES.items() if case.resume]


def _worker(rank: int, world: int, cases: tuple[Case, ...], root: str) -> dict[str, Any]:
    # torch's notes that FSDP2 modules return views (nothing here writes into one) and that a
    # strided-shard gather takes two all-gathers: noise in a failure's output.
    warnings.filterwarnings("ignore", message=".*returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    assert world == nd.WORLD
    out: dict[str, Any] = {}
    references: dict[str, nd.Reference] = {}
    for case in cases:
        name = case.layout.name
        ckpt = f"{root}/{name}-resume" if case.resume else None
        out[name] = nd.run_layout(rank, case.layout, ckpt, route=case.resume or "dcp")
        if case.round_trip:
            out[name]["round_trip"] = nd.round_trip(
                rank, case.layout, f"{root}/{name}-round-trip", case.round_trip
            )
        if rank == 0:  # the single-process reference: deterministic, one rank computes it
            kind = case.layout.kind
            if kind not in references:
                references[kind] = nd.reference_run(kind)
            out[name]["reference"] = references[kind]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    """``results(layout_name)``: the per-rank records of that layout; its group's 4-rank run
    happens on first use."""
    cache: dict[str, Any] = {}

    def get(name: str) -> list[dict[str, Any]]:
        group, _ = CASES[name]
        if group not in cache:
            root = str(tmp_path_factory.mktemp(group))
            try:
                cache[group] = run_ranks(
                    _worker, nd.WORLD, GROUPS[group], root, timeout=TIMEOUTS[group]
                )
            except (RuntimeError, TimeoutError) as exc:
                cache[group] = exc
        if isinstance(cache[group], BaseException):
            pytest.fail(f"the 4-rank run of group {group!r} failed:\n{cache[group]}")
        return [per_rank[name] for per_rank in cache[group]]

    return get


def _fail_on(problems: list[str], name: str) -> None:
    assert not problems, f"{name}: {len(problems)} problem(s):\n" + "\n".join(problems)


def _reference(per_rank: list[dict[str, Any]]) -> nd.Reference:
    ref: nd.Reference = per_rank[0]["reference"]
    # The comparison is only meaningful if clipping was active on every clean step.
    assert all(ref.norms[s] > 2 * nd.MAX_NORM for s in range(nd.STEPS)), ref.norms
    return ref


EXPECTED_SKIPS = [s in nd.INJECTIONS for s in range(nd.STEPS)]


@pytest.mark.parametrize("name", ALL)
def test_every_rank_skips_the_same_steps(
    name: str, results: Callable[[str], list[dict[str, Any]]]
) -> None:
    per_rank = results(name)
    problems = []
    for rank, res in enumerate(per_rank):
        recs = res["records"]
        assert [r["step"] for r in recs] == list(range(nd.STEPS))
        skips = [r["skipped"] for r in recs]
        if skips != EXPECTED_SKIPS:
            problems.append(f"rank {rank}: skipped {skips}, expected {EXPECTED_SKIPS}")
        scales = [r["scale"] for r in recs]
        if scales != nd.EXPECTED_SCALES:
            problems.append(f"rank {rank}: scales {scales}, expected {nd.EXPECTED_SCALES}")
        for step in range(1, nd.STEPS):
            moved = recs[step]["digest"] != recs[step - 1]["digest"]
            if moved == EXPECTED_SKIPS[step]:
                what = "changed on a skipped" if moved else "unchanged on a clean"
                problems.append(f"rank {rank}, step {step}: parameters {what} step")
        # Bitwise agreement with the first rank holding the same elements.
        first = next(r for r, o in enumerate(per_rank) if o["replica_key"] == res["replica_key"])
        for step in range(nd.STEPS):
            if recs[step]["digest"] != per_rank[first]["records"][step]["digest"]:
                problems.append(f"rank {rank}, step {step}: parameters differ from rank {first}'s")
    _fail_on(problems, name)


@pytest.mark.parametrize("name", ALL)
def test_clip_norm_is_the_whole_models_on_every_rank(
    name: str, results: Callable[[str], list[dict[str, Any]]]
) -> None:
    per_rank = results(name)
    ref = _reference(per_rank)
    problems = []
    for rank, res in enumerate(per_rank):
        for step, rec in enumerate(res["records"]):
            norm = rec["norm"]
            if step in nd.INJECTIONS:
                if math.isfinite(norm):
                    who, value = nd.INJECTIONS[step]
                    problems.append(
                        f"rank {rank}, step {step}: norm {norm:.7g} is finite although rank "
                        f"{who} injected {value}"
                    )
            elif not (math.isfinite(norm) and abs(norm / ref.norms[step] - 1) <= 1e-5):
                problems.append(
                    f"rank {rank}, step {step}: norm {norm:.7g}, whole model {ref.norms[step]:.7g}"
                )
    _fail_on(problems, name)


@pytest.mark.parametrize("name", ALL)
def test_clipped_step_matches_the_reference(
    name: str, results: Callable[[str], list[dict[str, Any]]]
) -> None:
    per_rank = results(name)
    ref = _reference(per_rank)
    problems = []
    for rank, res in enumerate(per_rank):
        for step, rec in enumerate(res["records"]):
            mismatched = []
            for pname, values in rec["params"].items():
                assert pname in ref.params[step], f"{pname} is not a parameter of the model"
                got, want = torch.tensor(values), torch.tensor(ref.params[step][pname])
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                    mismatched.append(f"{pname} (max abs diff {(got - want).abs().max():.3g})")
            if mismatched:  # later steps follow from the first divergence: report that one
                problems.append(f"rank {rank}: from step {step}: {', '.join(mismatched)}")
                break
    _fail_on(problems, name)


@pytest.mark.parametrize("name", ALL)
def test_one_collective_per_step(name: str, results: Callable[[str], list[dict[str, Any]]]) -> None:
    per_rank = results(name)
    problems = [
        f"rank {rank}: collectives per step {c}, expected 1 each"
        for rank, res in enumerate(per_rank)
        if (c := [r["collectives"] for r in res["records"]]) != [1] * nd.STEPS
    ]
    _fail_on(problems, name)


@pytest.mark.parametrize("name", RESUMED)
def test_resume_is_bitwise_equal_to_an_uninterrupted_run(
    name: str, results: Callable[[str], list[dict[str, Any]]]
) -> None:
    per_rank = results(name)
    problems = []
    for rank, res in enumerate(per_rank):
        for i, step in enumerate(range(nd.RESUME_AT, nd.STEPS)):
            run, resumed = res["records"][step], res["resumed"][i]
            problems += [
                f"rank {rank}, step {step}: resumed {key} {resumed[key]!r} != {run[key]!r}"
                for key in ("skipped", "scale", "norm", "digest")
                if repr(resumed[key]) != repr(run[key])  # repr: nan == nan, bitwise floats
            ]
        if res["resumed_state_dict"] != res["state_dict"]:
            problems.append(
                f"rank {rank}: final scaler state {res['resumed_state_dict']} after resuming, "
                f"{res['state_dict']} uninterrupted"
            )
    _fail_on(problems, name)


PIPELINED = [name for name, (_, case) in CASES.items() if case.layout.kind == "pp"]


@pytest.mark.parametrize("name", PIPELINED)
def test_scaled_loss_fn_returns_each_microbatch_loss_times_the_scale(
    name: str, results: Callable[[str], list[dict[str, Any]]]
) -> None:
    """``scaler.scaled_loss_fn(mse)`` as the schedule's loss_fn: the losses the schedule hands
    back on the last stage are the micro-batch losses (recomputed from the outputs it returns;
    at step 0, before any update, the reference's) times the scale current at that step."""
    per_rank = results(name)
    ref = _reference(per_rank)
    problems = []
    for rank, res in enumerate(per_rank):
        last_stage, dp = rank // 2 == 1, rank % 2  # mesh (pp, dp): ranks 2 and 3 hold it
        for step, rec in enumerate(res["records"]):
            if not last_stage:
                assert rec["losses"] == [], "only the last stage computes losses"
                continue
            scale = nd.INIT_SCALE if step == 0 else res["records"][step - 1]["scale"]
            want = [loss * scale for loss in rec["unscaled_losses"]]
            got = rec["losses"]
            assert len(want) == nd.N_MICROBATCHES
            if len(got) != len(want) or any(
                abs(g / w - 1) > 1e-6 for g, w in zip(got, want, strict=False)
            ):
                problems.append(f"rank {rank}, step {step}: losses {got}, expected {want}")
        if last_stage:  # the micro-batches are the ones the reference sees
            first = res["records"][0]["unscaled_losses"]
            mine = ref.microbatch_losses[0][dp * nd.N_MICROBATCHES : (dp + 1) * nd.N_MICROBATCHES]
            same = all(abs(a / b - 1) < 1e-5 for a, b in zip(first, mine, strict=True))
            assert same, f"rank {rank}: step 0 losses {first}, reference {mine}"
    _fail_on(problems, name)


def test_engine_checkpoint_round_trip_under_pipeline_parallelism(
    results: Callable[[str], list[dict[str, Any]]],
) -> None:
    per_rank = results(nd.PP_FSDP2_GPIPE.name)
    _fail_on([p for res in per_rank for p in res["round_trip"]], nd.PP_FSDP2_GPIPE.name)


def _layout_grads(rank: int, world: int, names: list[str]) -> dict[str, dict[str, list[Any]]]:
    return {name: nd.layout_grads(rank, CASES[name][1].layout) for name in names}


def test_layouts_compute_the_reference_gradients() -> None:
    """The harness itself, scaler-free: each layout's gathered gradients (loss times a fixed
    scale, divided back) equal the single-process reference's, on every rank. A failure of the
    other tests is then the scaler's, not the layout's."""
    per_rank = run_ranks(_layout_grads, nd.WORLD, ALL, timeout=150)
    refs = {kind: nd.reference_grads(kind) for kind in ("pp", "dp_tp", "moe")}
    problems = []
    for name in ALL:
        ref = refs[CASES[name][1].layout.kind]
        for rank, res in enumerate(per_rank):
            grads = res[name]
            assert grads and set(grads) <= set(ref), (name, rank, sorted(grads))
            for pname, values in grads.items():
                got, want = torch.tensor(values), torch.tensor(ref[pname])
                if not torch.allclose(got, want, rtol=1e-5, atol=1e-7):
                    diff = (got - want).abs().max()
                    problems.append(f"{name}, rank {rank}: {pname} off by up to {diff:.3g}")
        covered = set().union(*(set(res[name]) for res in per_rank))
        assert covered == set(ref), f"{name}: the ranks hold {sorted(covered)}"
    _fail_on(problems, "gradients")


@pytest.mark.parametrize("kind", ["pp", "dp_tp", "moe"])
def test_reference_clips_and_skips(kind: str) -> None:
    """The single-process reference itself: it clips on every step, its skipped steps leave the
    parameters alone, and the others move them."""
    ref = nd.reference_run(kind)
    assert all(n > 2 * nd.MAX_NORM for n in ref.norms)
    for step in range(1, nd.STEPS):
        assert (ref.params[step] == ref.params[step - 1]) == (step in nd.INJECTIONS)


def _engine_pipeline(rank: int, world: int, schedule_name: str, root: str) -> dict[str, Any]:
    """DistAMP driving a user-built pp=2 x dp=2 job, FSDP2 per stage: GPipe over one stage per
    rank, or Interleaved1F1B over two (setup() given the list), which also saves through the
    engine after step 2 and resumes in freshly built stages."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    from distamp import DistAMP, DistributedGradScaler

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    interleaved = schedule_name == "interleaved"

    def build(seed: int) -> tuple[DistAMP, Any]:
        torch.manual_seed(seed)
        full = nd.make_model("pp") if seed == 0 else nd.MLP()
        split, ids = (
            ([[0], [1], [2], [3]], [pp, pp + 2]) if interleaved else ([[0, 1], [2, 3]], [pp])
        )
        stages = []
        for sid in ids:
            module = nd._stage_module(full, split[sid])
            for layer in module.layers.values():  # type: ignore[union-attr]
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
            group = mesh.get_group("pp")
            stages.append(PipelineStage(module, sid, len(split), torch.device("cpu"), group=group))
        amp = DistAMP(
            precision="fp16",
            mesh=mesh,
            max_grad_norm=nd.MAX_NORM,
            scaler=DistributedGradScaler("cpu", init_scale=1024.0),
        )
        amp.setup(stages if interleaved else stages[0], lambda p: torch.optim.SGD(p, lr=0.1))
        assert amp.strategy == "none"  # the engine wraps nothing of a parallelised model
        loss_fn = amp.scaled_loss_fn(nd.mse)
        schedule = (
            ScheduleInterleaved1F1B(stages, nd.N_MICROBATCHES, loss_fn=loss_fn)
            if interleaved
            else ScheduleGPipe(stages[0], nd.N_MICROBATCHES, loss_fn=loss_fn)
        )
        return amp, schedule

    def run(amp: DistAMP, schedule: Any, steps: range) -> list[tuple[Any, ...]]:
        out = []
        for step in steps:
            x, y = nd.global_batch("pp", step)
            x, y = x.chunk(2)[dp], y.chunk(2)[dp].clone()
            if step == 1 and rank == 3:  # an overflowing loss on one last-stage rank
                y[0, 0] = float("inf")
            result = (
                amp.pipeline_step(schedule, x) if pp == 0 else amp.pipeline_step(schedule, target=y)
            )
            digest = nd.digest([(n, p.full_tensor()) for n, p in amp.model.named_parameters()])
            out.append((result.stepped, result.loss_scale, float(result.grad_norm or 0.0), digest))
        return out

    amp, schedule = build(0)
    steps = run(amp, schedule, range(3))
    names = sorted(n for n, _ in amp.model.named_parameters())
    resumed: list[tuple[Any, ...]] = []
    if interleaved:
        amp.save_state(root)
        steps += run(amp, schedule, range(3, 5))
        again, schedule = build(7)
        assert again.load_state(root) and again.step_count == 3
        resumed = run(again, schedule, range(3, 5))
        again.close()
    amp.close()
    return {"steps": steps, "resumed": resumed, "names": names}


@pytest.mark.parametrize("schedule_name", ["gpipe", "interleaved"])
def test_engine_runs_a_pipeline_schedule_with_one_decision(
    schedule_name: str, tmp_path: Any
) -> None:
    """``DistAMP(mesh=...)`` + ``setup(stage or [stages])`` + ``scaled_loss_fn`` +
    ``pipeline_step``: an inf in one last-stage rank's loss skips the step on all four ranks
    (every stage), every rank clips with the same whole-model norm, and the scale backs off
    everywhere alike. Interleaved: two stages per rank train as one ``ModuleDict`` keyed by
    global stage index, and an engine checkpoint resumes bitwise."""
    per_rank = run_ranks(_engine_pipeline, nd.WORLD, schedule_name, str(tmp_path), timeout=150)
    for rank, res in enumerate(per_rank):
        steps = res["steps"]
        assert [s[0] for s in steps[:3]] == [True, False, True], (rank, steps)
        assert [s[1] for s in steps[:3]] == [1024.0, 512.0, 512.0], (rank, steps)
        mine = [s[:3] for s in steps]
        assert repr(mine) == repr([s[:3] for s in per_rank[0]["steps"]]), f"rank {rank}"
        assert steps[1][3] == steps[0][3] and steps[2][3] != steps[1][3]  # skipped, then moved
    first = per_rank[0]["steps"]
    assert all(math.isfinite(s[2]) and s[2] > nd.MAX_NORM for s in first[::2])
    assert not math.isfinite(first[1][2])  # the skipped step's norm is the overflow's
    for rank in (0, 2):  # dp replicas of a stage (set) hold the same parameters
        assert [s[3] for s in per_rank[rank]["steps"]] == [
            s[3] for s in per_rank[rank + 1]["steps"]
        ]
    if schedule_name == "interleaved":
        assert per_rank[0]["names"][0].startswith("stage0.") and any(
            n.startswith("stage2.") for n in per_rank[0]["names"]
        )
        for rank, res in enumerate(per_rank):
            assert repr(res["resumed"]) == repr(res["steps"][3:]), f"rank {rank}"
