"""16-bit weights with an exact master (``weights=``) through DistAMPAccelerator and the Hugging
Face Trainer (distamp.integrations.accelerate_weights), on 2 gloo ranks and on one (CPU).

Checked: the parameters become 16-bit and the policy's fp32 modules stay fp32; the gradients are
16-bit; the prepared optimizer is a MasterWeightOptimizer under Accelerate's wrapper; an inf
written into one rank's gradient after DDP's all-reduce skips that step on both ranks (weights
and masters untouched, the scheduler held), and the ranks, built from different seeds, end
bitwise equal; ``save_state``/``load_state`` and the Trainer's ``resume_from_checkpoint`` end
bitwise where the uninterrupted run ended; an optimizer passed before its model or built after
it over the cast parameters trains as the usual order does; bad combinations are refused with a
``ValueError`` (or ``TypeError``) naming the fix, before anything changes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs distamp[transformers] (accelerate and transformers)",
)

from _dist import run_ranks  # noqa: E402
from accelerate_weights_scenarios import (  # noqa: E402
    BAD_STEP,
    HF_BAD_STEP,
    HF_SAVE_AT,
    HF_STEPS,
    SAVE_AT,
    STEPS,
    accelerate_run,
    trainer_run,
)

# ---------------------------------------------------------------------------- Accelerate


@pytest.fixture(scope="module")
def accelerate_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("accelerate_weights")
    return run_ranks(accelerate_run, 2, str(root), timeout=120)


def test_accelerate_casts_the_weights_and_wraps_the_optimizer(
    accelerate_ranks: list[dict[str, Any]],
) -> None:
    for r in accelerate_ranks:
        assert r["dtypes"] == {
            "0.weight": "torch.bfloat16",
            "0.bias": "torch.bfloat16",
            "1.weight": "torch.float32",  # the policy's fp32 module (LayerNorm) stays fp32
            "1.bias": "torch.float32",
            "3.weight": "torch.bfloat16",
            "3.bias": "torch.bfloat16",
        }, r["dtypes"]
        assert r["grad_dtypes"] == ["torch.bfloat16", "torch.float32"], r["grad_dtypes"]
        assert r["classes"] == [
            "DistributedDataParallel",
            "DistAMPOptimizer",
            "MasterWeightOptimizer",
        ], r["classes"]


def test_accelerate_inf_on_one_rank_skips_on_both(accelerate_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = accelerate_ranks
    assert r0["start"] == r1["start"]  # rank 0's weights and masters on both, from two seeds
    for r in accelerate_ranks:
        assert r["skipped"] == [k == BAD_STEP for k in range(STEPS)], r["skipped"]
        assert r["unchanged"] == r["skipped"], r["unchanged"]  # weights and masters untouched
        assert r["lrs"][BAD_STEP] == r["lrs"][BAD_STEP - 1]  # the scheduler held
        assert r["lrs"][BAD_STEP + 1] < r["lrs"][BAD_STEP]
    assert r0["end"] == r1["end"]  # weights and masters bitwise equal across the ranks


def test_accelerate_load_state_resumes_bitwise(accelerate_ranks: list[dict[str, Any]]) -> None:
    for r in accelerate_ranks:
        assert r["resumed"]["skipped"] == r["skipped"][SAVE_AT:]
        assert r["resumed"]["end"] == r["end"]  # weights and masters, from other initial ones


# ---------------------------------------------------------------------------- the Trainer


@pytest.fixture(scope="module")
def trainer_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("trainer_weights")
    return run_ranks(trainer_run, 2, str(root), timeout=180)


def test_trainer_trains_16bit_weights_with_masters(trainer_ranks: list[dict[str, Any]]) -> None:
    for r in trainer_ranks:
        dtypes = r["dtypes"]
        norms = {n for n in dtypes if n.endswith("norm.weight")}
        assert len(norms) == 3 and all(dtypes[n] == "torch.float32" for n in norms), dtypes
        assert all(dtypes[n] == "torch.float16" for n in dtypes if n not in norms), dtypes
        assert r["grad_dtypes"] == ["torch.float16", "torch.float32"], r["grad_dtypes"]
        assert r["optimizer"] == ["DistAMPOptimizer", "MasterWeightOptimizer"], r["optimizer"]
        assert r["fused"]  # the Trainer's default fused AdamW, stepped through the masters
        sixteen = sum(d == "torch.float16" for d in dtypes.values())
        assert r["saved_masters"] == ["torch.float32"] * sixteen  # optimizer.pt: the masters


def test_trainer_inf_on_one_rank_skips_on_both(trainer_ranks: list[dict[str, Any]]) -> None:
    r0, r1 = trainer_ranks
    expected = [k == HF_BAD_STEP for k in range(HF_STEPS)]
    for r in trainer_ranks:
        assert r["skipped"] == expected, r["skipped"]
        assert r["unchanged"] == expected, r["unchanged"]
        assert r["scheduler"] == [k + 1 - (k >= HF_BAD_STEP) for k in range(HF_STEPS)]
        assert r["scale"] == 2.0**8 / 2  # one backoff, on both ranks
    assert r0["end"] == r1["end"]


def test_trainer_resume_from_checkpoint_is_bitwise(trainer_ranks: list[dict[str, Any]]) -> None:
    for r in trainer_ranks:
        resumed = r["resumed"]
        assert resumed["skipped"] == r["skipped"][HF_SAVE_AT:], resumed
        assert resumed["scheduler"] == r["scheduler"][-1] and resumed["scale"] == r["scale"]
        assert resumed["end"] == r["end"]  # weights and masters


# ---------------------------------------------------------------------------- one process


def _one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Refusals (nothing changed by any), then the other orders of ``prepare``."""
    import torch
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
    from accelerate_weights_scenarios import small_model, unwrap
    from transformers import TrainingArguments

    import distamp
    from distamp.integrations.accelerate import DistAMPAccelerator
    from distamp.integrations.transformers import DistAMPTrainer

    bf16, fp16 = distamp.WeightPrecision(), distamp.WeightPrecision("fp16")
    refused: dict[str, str] = {}

    def refuse(name: str, call: Any, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except (ValueError, TypeError) as exc:
            refused[name] = f"{type(exc).__name__}: {exc}"

    # Refused before Accelerate's state exists (it can be set only once a process).
    refuse("no", DistAMPAccelerator, mixed_precision="no", cpu=True, weights=bf16)
    refuse("fp8", DistAMPAccelerator, mixed_precision="fp8", cpu=True, weights=bf16)
    refuse("dtype", DistAMPAccelerator, mixed_precision="bf16", cpu=True, weights=fp16)
    refuse("type", DistAMPAccelerator, mixed_precision="bf16", cpu=True, weights="exact")
    sharded = distamp.WeightPrecision(master="sharded")
    refuse("sharded", DistAMPAccelerator, mixed_precision="bf16", cpu=True, weights=sharded)
    refuse("fsdp", DistAMPAccelerator, mixed_precision="bf16", cpu=True, weights=bf16,
           fsdp_plugin=object())  # fmt: skip
    hook = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.BF16)
    refuse("comm_hook", DistAMPAccelerator, mixed_precision="bf16", cpu=True, weights=bf16,
           kwargs_handlers=[hook])  # fmt: skip

    acc = DistAMPAccelerator(mixed_precision="bf16", cpu=True, weights=bf16)
    model = small_model(0)
    before = [p.detach().clone() for p in model.parameters()]

    def unchanged() -> bool:
        return all(
            p.dtype == torch.float32 and torch.equal(p, b)
            for p, b in zip(model.parameters(), before, strict=True)
        )

    refuse("adagrad", acc.prepare, model, torch.optim.Adagrad(model.parameters()))
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    stepped.step()
    model.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    refuse("stepped", acc.prepare, model, stepped)
    other = small_model(1)
    refuse("stray", acc.prepare, model, torch.optim.AdamW([*model.parameters(), other[0].weight]))
    buffers = [state["momentum_buffer"] for state in stepped.state.values()]
    refused_nothing_changed = unchanged() and all(b.dtype == torch.float32 for b in buffers)
    half = small_model(0).to(torch.bfloat16)
    refuse("16-bit", acc.prepare, half, torch.optim.AdamW(half.parameters()))

    # The same training three ways: prepare(model, opt), prepare(opt, model), and the model
    # first with an optimizer built afterwards over its cast parameters (the Trainer's delayed
    # path); bitwise the same weights and masters.
    def train(order: str, acc: Any = acc) -> tuple[tuple[str, str], Any, Any]:
        from accelerate_weights_scenarios import digest

        net = small_model(3)
        if order == "model-then-optimizer":
            net = acc.prepare(net)
            opt = acc.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2))
        elif order == "optimizer-first":
            opt, net = acc.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2), net)
        else:
            net, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        masters = type(unwrap(opt)).__name__ == "MasterWeightOptimizer"
        assert masters == (acc.weights is not None), order
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            acc.backward(net(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        return digest(net, opt), net, opt

    orders = ("together", "optimizer-first", "model-then-optimizer")
    runs = {o: train(o)[0] for o in orders}

    # A checkpoint of fp32 weights (no masters): refused by load_state before anything loads.
    plain = DistAMPAccelerator(mixed_precision="bf16", cpu=True)
    train("together", plain)
    plain.save_state(f"{root}/fp32")
    fresh = DistAMPAccelerator(mixed_precision="bf16", cpu=True, weights=bf16)  # one model
    start, net, opt = train("together", fresh)
    refuse("fp32_checkpoint", fresh.load_state, f"{root}/fp32")
    from accelerate_weights_scenarios import digest

    checkpoint_unchanged = digest(net, opt) == start

    # A policy's adaptive islands promote their computes from the exact masters.
    policy = distamp.AutocastPolicy("bf16", adaptive=True)
    adaptive = DistAMPAccelerator(mixed_precision="bf16", cpu=True, weights=bf16, policy=policy)
    _, net, opt = train("together", adaptive)
    run = adaptive.adaptive
    reads_masters = run is not None and run.adaptive.exact_weights == unwrap(opt).exact_weight

    # The Trainer: fp16=/bf16= give the dtype (neither: refused, naming TrainingArguments).
    args = TrainingArguments(root, use_cpu=True, report_to=[], bf16=False)
    refuse("trainer", DistAMPTrainer, model=small_model(0), args=args, weights=bf16)
    refuse("trainer_type", DistAMPTrainer, model=small_model(0), args=args, weights="exact")
    return {
        "refused": refused,
        "unchanged": refused_nothing_changed and checkpoint_unchanged,
        "runs": runs,
        "adaptive_reads_masters": reads_masters,
    }


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("one_rank")
    (result,) = run_ranks(_one_rank, 1, str(root), timeout=120)
    return result


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("no", ["mixed_precision='no'", "'bf16' or 'fp16'", "drop weights"]),
        ("fp8", ["mixed_precision='fp8'", "'bf16' or 'fp16'"]),
        ("dtype", ["the compute dtype", "WeightPrecision('bf16', ...)"]),
        ("type", ["TypeError", "pass a distamp.WeightPrecision"]),
        ("sharded", ["share of the masters", "main process", "use master='exact'"]),
        ("fsdp", ["fsdp_plugin=", "covered under DDP", "drop weights"]),
        ("comm_hook", ["comm_hook=bf16", "16-bit already", "drop the comm hook"]),
        ("adagrad", ["Adagrad"]),
        ("stepped", ["stepped already", "before its first step"]),
        ("stray", ["parameters of no model prepared here (1 of 7", "prepare the fp32 model"]),
        ("fp32_checkpoint", ["optimizer.bin: no fp32 master for 6 of the 6", "nothing was loaded"]),
        ("16-bit", ["16-bit already", "build or load the model in fp32"]),
        ("trainer", ["TrainingArguments", "mixed_precision='no'", "bf16=True"]),
        ("trainer_type", ["TypeError", "pass a distamp.WeightPrecision"]),
    ],
)
def test_bad_combinations_are_refused_naming_the_fix(
    one_rank: dict[str, Any], name: str, words: list[str]
) -> None:
    message = one_rank["refused"].get(name, "not refused")
    assert all(w in message for w in words), message
    if name not in ("type", "trainer_type"):
        assert message.startswith("ValueError"), message


def test_a_refused_prepare_changes_nothing(one_rank: dict[str, Any]) -> None:
    assert one_rank["unchanged"]  # fp32 weights as they were; nothing prepared


def test_adaptive_islands_read_the_masters(one_rank: dict[str, Any]) -> None:
    assert one_rank["adaptive_reads_masters"]


def test_optimizer_in_any_order_gets_the_masters(one_rank: dict[str, Any]) -> None:
    runs = one_rank["runs"]
    assert runs["optimizer-first"] == runs["together"]
    assert runs["model-then-optimizer"] == runs["together"]
