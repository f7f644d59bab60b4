"""The recipe tier: every precision policy holds wherever the forward runs.

A policy (fp32 ops and modules, adaptive promotions, backward scales, fp8) trained together
with activation checkpointing (full, reentrant, selective, ``checkpoint_sequential``),
activation offloading and ``torch.compile`` per block must give the run without them, bitwise:
parameters, skips, loss scales and every adaptive decision, with an overflow injected as one
non-finite gradient element during backward. torch's own autocast loop is bitwise under each of
these; a policy that lived only in the context around the user's forward was not (a recomputed
forward raised ``CheckpointError`` or computed other gradients).

Harness: ``tests/recipe_scenarios.py``. Each run is a few steps of the main job's GPT (small
size in one process; medium under DDP and FSDP2) with one intra-op thread.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from _dist import run_ranks
from functorch.compile import make_boxed_func
from recipe_scenarios import (
    AC_MODES,
    apply_ac,
    batches,
    compile_blocks,
    gpt,
    run,
)
from torch import nn
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.compiled_autograd import _enable as compiled_autograd_enabled
from torch.utils.checkpoint import checkpoint

from distamp import AdaptiveRules, AutocastPolicy, BackwardScaleRules, DistAMP, export
from launch.model import lm_loss

NAN, INF = float("nan"), float("inf")


pytestmark = pytest.mark.usefixtures("one_thread")


def _cell(precision: str) -> dict[str, Any]:
    """A run of ``precision`` whose policy decides something while the blocks are
    checkpointed: an adaptive promotion, a skipped step from one non-finite gradient element."""
    if precision == "fp16":  # a forward overflow in blocks.1.fc until it is promoted to fp32
        return {
            "spike": 1e5,
            "poison": (0, {4}, NAN),
            "adaptive": AdaptiveRules(interval=2, skips=1, window=4, max_promoted_fraction=0.5),
            "backward_scales": BackwardScaleRules(grow_above=0.0),
        }
    if precision == "bf16":  # the modules with the largest outputs promoted on headroom
        rules = AdaptiveRules(
            interval=2, headroom_limit=1e-39, demote_below=0.0, patience=1,
            max_promoted_fraction=0.05,
        )  # fmt: skip
        return {"poison": (0, {3}, INF), "adaptive": rules}
    rules = AdaptiveRules(  # fp8: layers whose input flushes in e4m3 fall back to bf16
        interval=2, fp8_flush_limit=1e-6, fp8_demote_below=0.0, patience=1,
        headroom_limit=1.0, max_promoted_fraction=0.3,
    )  # fmt: skip
    return {
        "poison": (0, {4}, -INF),
        "adaptive": rules,
        "policy_kwargs": {"fp8_min_features": 64},
    }


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_every_ac_mode_is_bitwise_the_run_without_it(precision: str) -> None:
    cell = _cell(precision)
    reference = run(precision=precision, ac="none", **cell)
    assert not all(reference["stepped"]), "the injected element must skip a step"
    assert reference["adaptive"], "the rules must decide something while checkpointed"
    for ac in AC_MODES[1:]:
        got = run(precision=precision, ac=ac, **cell)
        assert got == reference, f"{precision} with AC {ac!r} differs from the run without AC"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16_bit_weights_hold_in_every_ac_mode(precision: str) -> None:
    """16-bit weights with an exact master under the same cells: the promoted islands compute
    from the masters, a non-finite gradient element skips, and every AC mode is bitwise the
    run without AC."""
    cell = _cell(precision)
    reference = run(precision=precision, ac="none", weights="exact", **cell)
    assert not all(reference["stepped"]), "the injected element must skip a step"
    assert reference["adaptive"], "the rules must decide something while checkpointed"
    for ac in AC_MODES[1:]:
        got = run(precision=precision, ac=ac, weights="exact", **cell)
        assert got == reference, f"{precision} weights with AC {ac!r} differ from no AC"


class _Graphs:
    """An ``aot_eager``-like backend that keeps every forward and backward graph it compiles."""

    def __init__(self) -> None:
        self.forward: list[torch.fx.GraphModule] = []
        self.backward: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._keep(self.forward),
                                    bw_compiler=self._keep(self.backward))  # fmt: skip

    @staticmethod
    def _keep(into: list[torch.fx.GraphModule]) -> Any:
        def compiler(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
            into.append(gm)
            return make_boxed_func(gm.forward)

        return compiler


def _dtypes(graphs: list[torch.fx.GraphModule], op: str) -> set[torch.dtype]:
    """The output dtypes of every ``op`` node (``aten.<op>``) in ``graphs``."""
    found = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith(f"aten.{op}."):
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor):
                    found.add(val.dtype)
                elif isinstance(val, (tuple, list)) and isinstance(val[0], torch.Tensor):
                    found.add(val[0].dtype)
    return found


@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_compiled_blocks_keep_the_islands_in_forward_and_backward(ac: str) -> None:
    """The policy's dtypes in the compiled program: softmax and layer norm in fp32 in the
    forward and in the backward (which never inherits the forward's autocast), the matmuls in
    bf16; and one compilation shared by every block, none per step."""
    torch._dynamo.reset()
    graphs = _Graphs()
    model = gpt("small")
    apply_ac(model, ac)
    policy = AutocastPolicy("bf16")
    policy.apply(model)
    compile_blocks(model, graphs.backend)
    x = torch.randint(0, 256, (2, 64))
    for step in range(3):
        with policy.autocast("cpu"):
            loss = model(x).float().square().mean()
        loss.backward()
        if step == 0:
            compiled = (len(graphs.forward), len(graphs.backward))
    assert compiled == (1, 1), f"one graph for all four blocks, got {compiled}"
    assert (len(graphs.forward), len(graphs.backward)) == compiled, "recompiled at a later step"
    assert _dtypes(graphs.forward, "_softmax") == {torch.float32}
    assert _dtypes(graphs.forward, "native_layer_norm") == {torch.float32}
    assert _dtypes(graphs.forward, "mm") | _dtypes(graphs.forward, "addmm") == {torch.bfloat16}
    assert _dtypes(graphs.backward, "_softmax_backward_data") == {torch.float32}
    assert _dtypes(graphs.backward, "native_layer_norm_backward") == {torch.float32}
    assert _dtypes(graphs.backward, "mm") == {torch.bfloat16}


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp8"])
def test_compiled_recipe_is_bitwise_the_eager_run(precision: str) -> None:
    """Per-block compile with and without AC, the policy deciding (a promotion or an fp8
    fallback, a skip): the eager run without AC, bitwise, and at most one recompilation per
    promotion, none per step (fp8: the monitor's flush hook reads tensors, not step counts)."""
    if precision == "fp8":
        pytest.importorskip("torchao")
    cell = _cell(precision)
    reference = run(precision=precision, ac="none", **cell)
    promotions = len(reference["adaptive"])
    assert promotions, "the rules must promote a module inside a compiled block"
    # fp8 (torchao's float8 layers, the slowest cell): one AC mode, for the recompilations
    for ac in ("full",) if precision == "fp8" else ("none", "full", "selective"):
        torch._dynamo.reset()
        graphs = _Graphs()
        got = run(precision=precision, ac=ac, compile_backend=graphs.backend, **cell)
        assert got == reference, f"compiled {precision} with AC {ac!r} differs from eager"
        # One graph for every block; the spiky block is of another class (its own graph);
        # then one recompilation per promotion at most, none per step.
        allowed = 1 + ("spike" in cell) + promotions
        compiled = len(graphs.forward)
        assert 1 <= compiled <= allowed, (
            f"{compiled} compilations of the blocks for {promotions} promotions (AC {ac!r})"
        )


def test_compiled_16_bit_weights_are_bitwise_the_eager_run() -> None:
    """16-bit weights with an exact master, blocks compiled and checkpointed: the eager run,
    bitwise, promotions (islands reading the masters) and the skip included."""
    cell = _cell("bf16")
    reference = run(precision="bf16", ac="none", weights="exact", **cell)
    assert reference["adaptive"], "the rules must promote a module inside a compiled block"
    torch._dynamo.reset()
    got = run(
        precision="bf16", ac="selective", weights="exact", compile_backend="aot_eager", **cell
    )
    assert got == reference


def _strategy_runs(
    rank: int, world: int, strategy: str, precision: str, backend: str | None, ac: str
) -> dict[str, Any]:
    """On each rank: the medium GPT under ``strategy`` without AC and with ``ac``, one engine
    after the other in this process; one element of one rank's gradient non-finite after the
    exchange."""
    cell: dict[str, Any] = {"poison_after": (1, {1}, INF if precision == "fp16" else NAN)}
    if strategy == "ddp":
        cell["poison"] = (0, {2}, -INF)  # and one during backward, on the other rank
    out = {}
    for mode in ("none", ac):
        torch._dynamo.reset()
        out[mode] = run(
            precision=precision,
            ac=mode,
            strategy=strategy,
            size="medium",
            steps=3,
            rank=rank,
            world=world,
            compile_backend=backend,
            **cell,
        )
    return out


# One AC mode per strategy: the other pairs are the single-process cells above, and FSDP2 with
# full AC and compiled blocks is the main job's own test (tests/test_train.py). Each 2-rank
# medium run costs about a minute on 2 cores.
@pytest.mark.parametrize(
    ("strategy", "precision", "backend", "ac"),
    [("ddp", "fp16", None, "full"), ("fsdp2", "bf16", "aot_eager", "selective")],
    ids=["ddp-fp16-full", "fsdp2-bf16-compiled-selective"],
)
def test_medium_model_under_ddp_and_fsdp2(
    strategy: str, precision: str, backend: str | None, ac: str
) -> None:
    """The main job's medium GPT (many DDP buckets, 13 FSDP2 units) on 2 ranks: with AC it
    trains to the run without AC bitwise, skips included, on every rank."""
    results = run_ranks(_strategy_runs, 2, strategy, precision, backend, ac, timeout=600)
    for rank, runs in enumerate(results):
        reference = runs["none"]
        assert not all(reference["stepped"]), "the injected elements must skip steps"
        assert runs[ac] == reference, f"rank {rank}: {strategy} with AC {ac!r} differs"
    assert results[0] == results[1], "the ranks disagree"


@pytest.mark.parametrize("ac", [False, True])
def test_compiled_autograd_keeps_the_islands(ac: bool) -> None:
    """torch's compiled autograd (the backward traced at run time) computes the gradients of
    the eager backward, bitwise, with the policy's islands (a LayerNorm module, a softmax)."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.softmax(self.proj(self.norm(x)), dim=-1) @ self.proj.weight

    def grads(compiled_autograd: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        head, policy = Head(), AutocastPolicy("bf16")
        policy.apply(head)
        x = torch.randn(8, 16, requires_grad=True)
        with policy.autocast("cpu"):
            out = checkpoint(head, x, use_reentrant=False) if ac else head(x)
        loss = out.float().square().sum()
        if compiled_autograd:
            with compiled_autograd_enabled(torch.compile(backend="aot_eager")):
                loss.backward()
        else:
            loss.backward()
        return [p.grad for p in head.parameters()] + [x.grad]

    torch._dynamo.reset()
    eager, compiled = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True))


def test_a_model_trained_with_checkpointing_exports() -> None:
    """Export after training with full AC: the checkpoint wrappers stay in the program's copy,
    the policy's casts are explicit (an fp32 softmax meeting a bf16 matmul included), and the
    numerical check against fp32 eager passes."""
    model = gpt("small")
    apply_ac(model, "full")
    amp = DistAMP(precision="bf16", policy=AutocastPolicy("bf16"), strategy="none", device="cpu")
    amp.setup(model, lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True))
    data = batches("small", 0, 1)
    for k in range(2):
        with amp.autocast():
            loss = lm_loss(amp.model, data.batch(k))
        amp.backward_and_step(loss)
    x = data.batch(5)[0][:1]
    program = export(amp, (x,))
    with torch.no_grad(), amp.autocast():
        trained = amp.model(x).float()
    exported = program.module()(x)
    assert exported.dtype == torch.float32
    torch.testing.assert_close(exported, trained, atol=0.1, rtol=0.05)
