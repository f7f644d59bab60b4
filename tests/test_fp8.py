"""precision="fp8": torchao float8 Linear layers under DistAMP (CPU, gloo, 2 real ranks).

Layer selection is pure and always tested; everything that converts a model needs torchao and
skips without it. The multi-process scenarios of one topic share ONE spawned group (spawning and
importing torchao cost seconds per rank).
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks, run_torchrun
from torch import nn

from distamp import AutocastPolicy, DistAMP, audit, parse_precision
from distamp.precision.fp8 import DEFAULT_MIN_FEATURES, plan_linears, torchao_version_tested
from distamp.versions import require_torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from launch.model import GPT, GPTConfig, ShardedText, lm_loss, load_text  # noqa: E402

SMALL = GPTConfig(context=8, d_model=16, n_layers=2, n_heads=2)  # every Linear a multiple of 16
LOSS_STEPS = 50  # see test_fp8_final_loss_within_2_percent_of_bf16


def _torchao() -> Any:
    return pytest.importorskip("torchao.float8", reason="precision='fp8' needs torchao")


def _rowwise_on_cpu() -> None:
    """The rowwise recipe's CPU GEMM needs a newer torch than the window's floor: skipped with
    the refusal distamp itself gives there."""
    try:
        require_torch("fp8-rowwise-cpu")
    except RuntimeError as refused:
        pytest.skip(str(refused))


def _fp8_layers(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def _batch(rank: int, k: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + k)
    seq = torch.randint(0, SMALL.vocab_size, (size, SMALL.context + 1), generator=gen)
    return seq[:, :-1], seq[:, 1:]


def _policy(precision: str, **kw: Any) -> AutocastPolicy:
    return (
        AutocastPolicy(precision, fp8_min_features=16, **kw)
        if precision == "fp8"
        else (AutocastPolicy(precision))
    )


# ------------------------------------------------------------------------------ selection (pure)
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(64, 128)
        self.small = nn.Linear(32, 128)
        self.odd = nn.Linear(64, 72)
        self.island = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(128, 256)


def test_filter_excludes_islands_unaligned_small_and_named_layers() -> None:
    policy = AutocastPolicy(
        "fp8", fp32_modules=("island", nn.LayerNorm), fp8_min_features=64, fp8_exclude=["head"]
    )
    choices = {c.name: c for c in plan_linears(_Net(), policy)}
    assert list(choices) == ["big", "small", "odd", "island.0", "head"]
    assert [n for n, c in choices.items() if c.fp8] == ["big"]
    assert "fp32 island" in choices["island.0"].reason
    assert "multiples of 16" in choices["odd"].reason
    assert "fp8_min_features=64" in choices["small"].reason
    assert "fp8_exclude" in choices["head"].reason
    # The default threshold keeps every layer of a small model in bf16.
    assert not any(c.fp8 for c in plan_linears(_Net(), AutocastPolicy("fp8")))
    assert DEFAULT_MIN_FEATURES == 2048


def test_precision_and_policy_options() -> None:
    p = parse_precision("FP8")
    assert (p.name, p.compute_dtype, p.needs_scaler, p.float8_linears) == (
        "fp8", torch.bfloat16, False, True,
    )  # fmt: skip
    assert parse_precision("float8") is p and not parse_precision("bf16").float8_linears
    assert AutocastPolicy("fp8", recipe="rowwise").fp8.recipe == "rowwise"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="recipe"):
        AutocastPolicy("bf16", recipe="rowwise")
    with pytest.raises(ValueError, match="fp8_min_features"):
        AutocastPolicy("fp8", fp8_min_features=-1)
    with pytest.raises(ValueError, match="recipe='blockwise'"):
        AutocastPolicy("fp8", recipe="blockwise")
    with pytest.raises(ValueError, match="fp8"):
        DistAMP(precision="fp8", policy=AutocastPolicy("bf16"))
    assert torchao_version_tested("0.18.0") and torchao_version_tested("0.18.0+cpu")
    assert not torchao_version_tested("0.16.1") and not torchao_version_tested("0.19.0")


def test_audit_lists_fp8_and_excluded_layers() -> None:
    report = audit(_Net().big, torch.randn(2, 64), precision="fp8")  # runs without torchao
    assert [c.fp8 for c in report.fp8] == [False] and "fp8_min_features=2048" in str(report)
    torch.manual_seed(0)
    policy = AutocastPolicy("fp8", fp8_min_features=16, fp8_exclude=["head"])
    report = audit(GPT(SMALL), _batch(0, 0)[0], policy=policy)
    text = str(report)
    assert "fp8: 8 of 9 Linear layers run in float8" in text
    assert "head (16->256): bf16, excluded by name (fp8_exclude)" in text


# ------------------------------------------------------------------------------ one process
@pytest.mark.parametrize(("gemm", "op"), [("scaled_mm", "aten::_scaled_mm"), ("auto", "aten::mm")])
def test_conversion_keeps_state_dict_and_runs_scaled_mm(gemm: str, op: str) -> None:
    """fp8_gemm="scaled_mm": every float8 product is one torch._scaled_mm; "auto" on the CPU
    multiplies the same float8 operands in fp32 (torchao's emulation), no _scaled_mm at all."""
    _torchao()
    torch.manual_seed(0)
    reference = GPT(SMALL).state_dict()
    policy = _policy("fp8", fp8_exclude=["head"], fp8_gemm=gemm)
    amp = DistAMP(precision="fp8", strategy="none", policy=policy, device="cpu")
    torch.manual_seed(0)
    model, _ = amp.setup(GPT(SMALL), lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert amp.scaler.check_only and amp.fp8 is not None
    layers = _fp8_layers(model)
    assert layers == amp.fp8.converted and len(layers) == 8 and "head" not in layers
    state = model.state_dict()
    assert list(state) == list(reference)  # Float8Linear keeps weight/bias
    assert all(torch.equal(state[k], reference[k]) for k in state)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with amp.autocast():
            loss = lm_loss(model, _batch(0, 0))
        result = amp.backward_and_step(loss)
    names = [e.name for e in prof.events()]
    # forward, grad input, grad weight: 3 float8 products per layer, by the chosen op
    assert names.count("aten::_scaled_mm") == (3 * len(layers) if gemm == "scaled_mm" else 0)
    assert names.count(op) >= 3 * len(layers)
    assert result is not None and result.stepped and math.isfinite(loss.item())
    amp.close()


def test_convert_for_fp8_and_the_float8_tensor_parallel_plan() -> None:
    """The conversion step for models parallelised by hand, and the plan it pairs with: float8
    styles for tensorwise float8 layers only, the plan's layouts kept, unknown names refused."""
    _torchao()
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from distamp.precision.fp8 import convert_for_fp8
    from distamp.precision.fp8_parallel import fp8_tp_plan, is_float8_linear

    model = _Net()
    with pytest.raises(ValueError, match="not an fp8 policy"):
        convert_for_fp8(model, AutocastPolicy("bf16"))
    state = convert_for_fp8(model, AutocastPolicy("fp8", fp8_min_features=64))
    assert state.converted == ["big", "island.0", "head"] and is_float8_linear(model.big)
    assert not is_float8_linear(model.small)
    plan = fp8_tp_plan(
        model,
        {
            "big": ColwiseParallel(output_layouts=Replicate(), use_local_output=False),
            "head": RowwiseParallel(input_layouts=Replicate()),
            "small": ColwiseParallel(),  # not converted: keeps its style
        },
    )
    assert type(plan["big"]).__name__ == "Float8ColwiseParallel"
    assert plan["big"].output_layouts == (Replicate(),) and plan["big"].use_local_output is False
    assert type(plan["head"]).__name__ == "Float8RowwiseParallel"
    assert plan["head"].input_layouts == (Replicate(),)
    assert plan["head"].output_layouts == (Replicate(),)
    assert type(plan["small"]) is ColwiseParallel
    with pytest.raises(ValueError, match="matches no module"):
        fp8_tp_plan(model, {"nope": ColwiseParallel()})
    # Patterns as parallelize_module takes them: atom by atom, every match must be float8.
    nested = nn.ModuleDict({"a": _Net(), "b": _Net()})
    convert_for_fp8(nested, AutocastPolicy("fp8", fp8_min_features=64))
    by_pattern = fp8_tp_plan(nested, {"*.big": ColwiseParallel(), "*.small": ColwiseParallel()})
    assert type(by_pattern["*.big"]).__name__ == "Float8ColwiseParallel"
    assert type(by_pattern["*.small"]) is ColwiseParallel  # plain Linear layers: kept
    with pytest.raises(ValueError, match="matches no module"):
        fp8_tp_plan(nested, {"*": ColwiseParallel(), "big": ColwiseParallel()})
    rowwise = _Net()
    convert_for_fp8(rowwise, AutocastPolicy("fp8", recipe="rowwise", fp8_min_features=64))
    kept = fp8_tp_plan(rowwise, {"big": ColwiseParallel(input_layouts=Shard(1))})
    assert type(kept["big"]) is ColwiseParallel  # torchao's float8 styles are tensorwise only


def test_rowwise_recipe_and_default_threshold_warning() -> None:
    _torchao()
    _rowwise_on_cpu()
    torch.manual_seed(0)
    amp = DistAMP(
        precision="fp8", strategy="none", policy=_policy("fp8", recipe="rowwise"), device="cpu"
    )
    model, _ = amp.setup(GPT(SMALL), lambda p: torch.optim.SGD(p, lr=0.1))
    assert "axs" in repr(model.blocks[0].fc)  # torchao's short name for axiswise scaling
    with amp.autocast():
        loss = lm_loss(model, _batch(0, 1))
    assert amp.backward_and_step(loss).stepped and math.isfinite(loss.item())  # type: ignore[union-attr]
    with pytest.warns(RuntimeWarning, match="no Linear layer qualifies"):
        DistAMP(precision="fp8", strategy="none", device="cpu").setup(
            GPT(SMALL), lambda p: torch.optim.SGD(p)
        )


def test_overflow_report_names_the_saturated_fp8_layer() -> None:
    """One inf in an fp8 layer's input: its scale becomes 0 and its whole output NaN. The step is
    skipped and the engine's report names that layer first (from the forward tracer)."""
    _torchao()
    torch.manual_seed(0)
    amp = DistAMP(
        precision="fp8", strategy="none", policy=_policy("fp8"), trace_nonfinite=True, device="cpu"
    )
    model, _ = amp.setup(GPT(SMALL), lambda p: torch.optim.SGD(p, lr=0.1))

    def one_inf(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        x = args[0].clone()
        x.view(-1)[0] = float("inf")
        return (x,)

    model.blocks[1].fc.register_forward_pre_hook(one_inf)
    seen: list[Any] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        amp.fit(lambda k: _batch(0, k), lm_loss, steps=1, log_interval=1, on_log=seen.append)
    assert seen[0].skipped_steps == 1
    assert "fp8 amax saturated: blocks.1.fc (output non-finite)" in seen[0].overflow
    assert "first non-finite forward output: blocks.1.fc" in seen[0].overflow
    amp.close()


def test_compile_guard_raises_instead_of_compiling() -> None:
    _torchao()
    from distamp.precision.fp8 import install_compile_guard

    torch.manual_seed(0)
    amp = DistAMP(precision="fp8", strategy="none", policy=_policy("fp8"), device="cpu")
    model, _ = amp.setup(GPT(SMALL), lambda p: torch.optim.SGD(p, lr=0.1))
    install_compile_guard(model.blocks[0].fc, "refused: use strategy='fsdp2'")
    x = _batch(0, 2)[0]
    model(x)  # eager: passes
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match="refused: use strategy='fsdp2'"):
        torch.compile(model, backend="eager")(x)
    torch._dynamo.reset()


def test_env_reports_fp8_support() -> None:
    from distamp.cli import environment_report

    fp8 = environment_report({})["fp8"]
    assert fp8.keys() == {"torchao", "torchao_tested", "cpu", "cuda_sm89", "supported"}
    assert fp8["cpu"] is True  # torch 2.13 runs torch._scaled_mm on the CPU


# ------------------------------------------------------------------------------ 2 ranks
def _train(rank: int, world: int, strategy: str, precision: str, steps: int) -> dict[str, Any]:
    """The main job's model and data, as launch/train.py trains them."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    amp = DistAMP(
        precision=precision,
        strategy=strategy,
        policy=_policy(precision),
        max_grad_norm=1.0,
        device="cpu",
    )
    model, _ = amp.setup(
        GPT(GPTConfig()),
        lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
    )
    data = ShardedText(load_text(), context=64, batch_size=16, rank=rank, world_size=world, seed=0)
    start = time.perf_counter()
    stats = amp.fit(data.batch, lm_loss, steps=steps, log_interval=steps)
    seconds = time.perf_counter() - start
    assert stats is not None
    fp8 = _fp8_layers(model)
    gathered_in_fp8 = [
        n
        for n, m in model.named_modules()
        if n in fp8
        and isinstance(m.weight, DTensor)
        and type(m.weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
        # set by the engine's one all-reduce after each step (to_local() would drop it)
        and m.weight._local_tensor._precomputed_scale is not None
    ]
    amp.close()
    return {
        "loss": stats.last_loss,
        "skipped": stats.skipped_steps,
        "fp8_layers": len(fp8),
        "fp8_all_gather": len(gathered_in_fp8),
        "seconds": seconds,
    }


def _loss_runs(rank: int, world: int, steps: int) -> dict[str, dict[str, Any]]:
    torch.use_deterministic_algorithms(True)
    return {
        f"{s}/{p}": _train(rank, world, s, p, steps)
        for s in ("ddp", "fsdp2")
        for p in ("bf16", "fp8")
    }


@pytest.mark.slow
def test_fp8_final_loss_within_2_percent_of_bf16() -> None:
    """DDP and FSDP2 (float8 all-gather) on the main job's model, every Linear in fp8.

    300 steps of the four runs take about 6 minutes on 2 cores (fp8 on CPU runs torch's
    reference float8 GEMM: 2.5x bf16's step time), so the test trains LOSS_STEPS = 50 steps,
    from ln(256) = 5.55 to about 2.55; the README has the 300-step figures.
    """
    _torchao()
    runs = run_ranks(_loss_runs, 2, LOSS_STEPS, timeout=280)[0]
    for strategy in ("ddp", "fsdp2"):
        bf16, fp8 = runs[f"{strategy}/bf16"], runs[f"{strategy}/fp8"]
        assert bf16["fp8_layers"] == 0 and fp8["fp8_layers"] == 9  # 4 per block + head
        assert bf16["skipped"] == fp8["skipped"] == 0
        assert math.isfinite(fp8["loss"]) and fp8["loss"] < 3.0
        assert abs(fp8["loss"] - bf16["loss"]) / bf16["loss"] < 0.02, (strategy, runs)
    assert runs["fsdp2/fp8"]["fp8_all_gather"] == 9 and runs["ddp/fp8"]["fp8_all_gather"] == 0


def _engine(strategy: str, precision: str, seed: int = 0) -> tuple[DistAMP, nn.Module]:
    torch.manual_seed(seed)
    shard = 1 if strategy == "hsdp" else None  # HSDP on 2 ranks: 2 replicas of 1 shard
    amp = DistAMP(
        precision=precision,
        strategy=strategy,
        policy=_policy(precision),
        hsdp_shard_size=shard,
        device="cpu",
    )
    model, _ = amp.setup(GPT(SMALL), lambda p: torch.optim.AdamW(p, lr=1e-2))
    return amp, model


def _scales_are_the_whole_weights(model: nn.Module) -> int:
    """How many float8-gathered weights carry torchao's scale of the whole weight (asserts
    that all do)."""
    from torchao.float8.float8_utils import EPS

    from distamp.precision.fp8_parallel import gathers_in_float8

    gathered = [(n, m) for n, m in model.named_modules() if gathers_in_float8(m)]
    for name, module in gathered:
        amax = module.weight.full_tensor().abs().max()
        want = (torch.finfo(torch.float8_e4m3fn).max / torch.clamp(amax, EPS).double()).float()
        got = module.weight._local_tensor._precomputed_scale
        assert got is not None and torch.equal(got, want), (name, got, want)
    return len(gathered)


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def _steps(amp: DistAMP, model: nn.Module, rank: int, ks: range) -> None:
    for k in ks:
        with amp.autocast():
            loss = lm_loss(model, _batch(rank, k))
        amp.backward_and_step(loss)


def _same_on_every_rank(params: dict[str, torch.Tensor]) -> bool:
    flat = torch.cat([p.flatten().float() for p in params.values()])
    others = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(others, flat)
    return all(torch.equal(o, flat) for o in others)


def _nan_skip(rank: int, strategy: str) -> None:
    """A NaN on rank 0 only: every rank skips and the parameters stay bitwise equal.

    DDP: in the gradient flowing into one fp8 layer's output (its grad_output cast saturates),
    before the all-reduce. FSDP2/HSDP: in rank 0's shard of that layer's weight gradient, after
    the reduce-scatter (HSDP: all-reduce), so that only the scaler's agreement makes rank 1 skip
    too. Before that, every float8-gathered weight's scale is its whole weight's (HSDP: the
    weight is replicated over one mesh dimension and sharded over the other).
    """
    amp, model = _engine(strategy, "fp8")
    _steps(amp, model, rank, range(2))
    assert _scales_are_the_whole_weights(model) == (0 if strategy == "ddp" else 9)
    before = _full(model)
    fc = getattr(model, "module", model).get_submodule("blocks.1.fc")
    hook = None
    if rank == 0 and strategy == "ddp":

        def poison(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
            out.register_hook(lambda g: g * float("nan"))

        hook = fc.register_forward_hook(poison)
    with amp.autocast():
        loss = lm_loss(model, _batch(rank, 2))
    amp.backward(loss)
    if hook is not None:
        hook.remove()
    if rank == 0 and strategy != "ddp":
        fc.weight.grad.to_local().view(-1)[0] = float("nan")
    result = amp.step()
    assert not result.stepped, f"rank {rank} stepped"
    after = _full(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert _same_on_every_rank(after)
    # From the flags the scaler kept on device (the gradients themselves are gone).
    report = amp.fp8.annotate(amp.scaler.overflow_report())  # type: ignore[union-attr]
    assert report is not None and "fp8 amax saturated: " in report.one_line()
    saturated = report.extra["fp8_saturated"]
    ranks = "0,1" if strategy == "ddp" else "0"  # DDP's all-reduce spread it
    assert f"blocks.1.fc (weight.grad non-finite, rank {ranks})" in saturated, saturated
    assert not any(s.startswith(("blocks.1.out", "head")) for s in saturated), saturated
    _steps(amp, model, rank, range(3, 4))  # trains on
    assert _same_on_every_rank(_full(model)) and not torch.equal(
        after["blocks.1.fc.weight"], _full(model)["blocks.1.fc.weight"]
    )
    amp.close()


def _ddp_matches_one_process(rank: int) -> None:
    """Eager DDP with fp8 layers == one process accumulating the ranks' micro-batches, bitwise.

    Each rank scales its own activations (tensorwise amax of its micro-batch), which is what
    the one process does per micro-batch; DDP's averaging of two gradients is exact.
    """
    ddp, model = _engine("ddp", "fp8")
    _steps(ddp, model, rank, range(3))
    torch.manual_seed(0)
    one = DistAMP(
        precision="fp8", strategy="none", policy=_policy("fp8"), grad_accum_steps=2, device="cpu"
    )
    single, _ = one.setup(GPT(SMALL), lambda p: torch.optim.AdamW(p, lr=1e-2))
    for k in range(3):
        for r in range(2):
            with one.autocast():
                loss = lm_loss(single, _batch(r, k))
            one.backward_and_step(loss)
    got, want = _full(model), single.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want), "DDP fp8 differs from one process"
    ddp.close()
    one.close()


def _resume_and_cross_precision(rank: int, strategy: str, root: str) -> None:
    whole, model_w = _engine(strategy, "fp8")
    _steps(whole, model_w, rank, range(4))
    expected = _full(model_w)

    first, model_f = _engine(strategy, "fp8")
    _steps(first, model_f, rank, range(2))
    at_two = _full(model_f)
    first.save_state(f"{root}/fp8")
    second, model_s = _engine(strategy, "fp8", seed=7)
    assert second.load_state(f"{root}/fp8") and second.step_count == 2
    _steps(second, model_s, rank, range(2, 4))
    got = _full(model_s)
    assert all(torch.equal(got[k], expected[k]) for k in expected), "resumed fp8 run differs"

    # fp8 -> bf16 and bf16 -> fp8: the same fp32 master weights under the same names.
    bf16, model_b = _engine(strategy, "bf16", seed=3)
    assert bf16.load_state(f"{root}/fp8")
    loaded = _full(model_b)
    assert loaded.keys() == at_two.keys() and all(torch.equal(loaded[k], at_two[k]) for k in at_two)
    _steps(bf16, model_b, rank, range(2, 3))
    bf16.save_state(f"{root}/bf16")
    trained = _full(model_b)
    back, model_back = _engine(strategy, "fp8", seed=5)
    assert back.load_state(f"{root}/bf16") and back.step_count == 3
    got = _full(model_back)
    assert all(torch.equal(got[k], trained[k]) for k in trained)
    _steps(back, model_back, rank, range(3, 4))
    assert all(math.isfinite(v.abs().max().item()) for v in _full(model_back).values())
    for amp in (whole, first, second, bf16, back):
        amp.close()


def _scenarios(rank: int, world: int, root: str) -> str:
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        _ddp_matches_one_process(rank)
        for strategy in ("ddp", "fsdp2"):
            _nan_skip(rank, strategy)
            _resume_and_cross_precision(rank, strategy, f"{root}/{strategy}")
        _nan_skip(rank, "hsdp")  # float8 weights replicated over one mesh dimension
    return "ok"


def test_fp8_ddp_parity_skips_agree_and_checkpoints_resume_bitwise(tmp_path: Path) -> None:
    _torchao()
    assert run_ranks(_scenarios, 2, str(tmp_path), timeout=240) == ["ok", "ok"]


def test_main_job_trains_in_fp8_under_fsdp2(tmp_path: Path) -> None:
    _torchao()
    out = run_torchrun(
        REPO / "launch" / "train.py",
        *("--precision", "fp8", "--strategy", "fsdp2", "--steps", "4", "--log-interval", "2"),
        *("--out", str(tmp_path / "run")),
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["precision"] == "fp8" and summary["strategy"] == "fsdp2"
    assert summary["fp8_layers"] == 9 and summary["skipped_steps"] == 0
    assert summary["loss_scale"] == 1.0 and summary["final_loss"] < 5.55


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_mesh_example_trains_tensor_parallel(recipe: str) -> None:
    """launch/fp8_mesh_example.py: the GPT converted, then tensor parallel MLPs (dp=1 x tp=2),
    fully_shard, DistAMP(mesh=...), and the loss well below its start (ln 256 = 5.55).
    Tensorwise: torchao's float8 TP styles, every float8 weight gathered in float8. Rowwise:
    the plain TP styles and bf16 gathers (torchao has neither float8 variant for it)."""
    _torchao()
    if recipe == "rowwise":
        _rowwise_on_cpu()
    out = run_torchrun(
        REPO / "launch" / "fp8_mesh_example.py", "--steps", "20", "--recipe", recipe, timeout=150
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["layout"] == {"dp": 1, "tp": 2} and summary["skipped_steps"] == 0
    assert len(summary["fp8_layers"]) == 9 and summary["recipe"] == recipe
    if recipe == "tensorwise":
        assert summary["tp_styles"] == ["Float8ColwiseParallel", "Float8RowwiseParallel"]
        assert sorted(summary["float8_gathered"]) == sorted(summary["fp8_layers"])
    else:
        assert summary["tp_styles"] == ["ColwiseParallel", "RowwiseParallel"]
        assert summary["float8_gathered"] == []
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < 4.0, summary


def _fp8_on_a_user_mesh(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from distamp import DistAMP

    mesh = init_device_mesh("cpu", (world,))
    amp = DistAMP(precision="fp8", mesh=mesh)
    try:
        amp.setup(torch.nn.Linear(32, 32), lambda params: torch.optim.SGD(params, lr=0.1))
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_fp8_refuses_a_model_parallelised_before_conversion() -> None:
    """float8 layers must be in place before fully_shard/parallelize_module: with mesh= (or a
    model already wrapped) and no float8 layer, the engine refuses fp8 on every rank and names
    the conversion step (tests/test_fp8_nd.py runs the converted N-D layouts)."""
    _torchao()  # precision="fp8" itself needs torchao: without it the engine refuses earlier
    out = run_ranks(_fp8_on_a_user_mesh, 2, timeout=120)
    assert all("convert_for_fp8" in msg and "strategy='ddp'" in msg for msg in out), out
