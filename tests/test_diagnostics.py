"""Overflow diagnostics: the report names the parameter, module, rank and kind of a skip; forward
tracing names the module that overflowed; no host sync on steps that did not skip."""

from __future__ import annotations

from typing import Any

import medium_scenarios as medium
import pytest
import torch
from _dist import run_ranks
from test_scaler import _SyncCounter
from torch import nn

from distamp import DistributedGradScaler
from distamp.observe.diagnostics import ScaleHealth, trace_nonfinite

INF = float("inf")
NAN = float("nan")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x)))


def _step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    scaler: DistributedGradScaler,
    x: torch.Tensor,
    poison: tuple[str, float] | None = None,
    clip: bool = False,
) -> None:
    opt.zero_grad(set_to_none=False)
    scaler.scale(model(x).square().mean()).backward()
    if poison is not None:
        name, value = poison
        dict(model.named_parameters())[name].grad.view(-1)[-1] = value
    if clip:
        scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("clip", [False, True])
def test_report_names_parameter_module_and_kind(kind: str, clip: bool) -> None:
    model = Net()
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, **({"fused": True} if kind == "fused" else {"foreach": True})
    )
    scaler = DistributedGradScaler("cpu", init_scale=256.0)
    scaler.register_module(model)
    x = torch.randn(4, 8)
    _step(model, opt, scaler, x, clip=clip)
    assert scaler.overflow_report() is None  # nothing skipped yet
    _step(model, opt, scaler, x, ("block.0.weight", INF), clip=clip)
    report = scaler.overflow_report()
    assert report is not None and report.step == 1
    assert [(e.parameter, e.module, e.ranks, e.kind) for e in report.entries] == [
        ("block.0.weight", "block.0", (0,), "inf")
    ]
    assert report.modules == ("block.0",)
    assert "block.0.weight (inf, rank 0)" in report.one_line()
    assert {name for name, _ in report.largest_grad_norms} <= dict(model.named_parameters()).keys()
    for _ in range(2):  # good steps keep the last skip's record
        _step(model, opt, scaler, x, clip=clip)
    later = scaler.overflow_report()
    assert later is not None and later.step == 1
    assert [e.parameter for e in later.entries] == ["block.0.weight"]
    assert later.entries[0].kind == "non-finite"  # its gradient is gone: the kind is unknown now
    _step(model, opt, scaler, x, ("head.bias", NAN), clip=clip)
    newest = scaler.overflow_report()
    assert newest is not None and newest.step == 4
    assert [(e.parameter, e.kind) for e in newest.entries] == [("head.bias", "nan")]


def test_no_host_sync_on_good_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = DistributedGradScaler("cpu", init_scale=256.0, sync_free=True)
    x = torch.randn(4, 8)
    _step(model, opt, scaler, x, clip=True)
    counter = _SyncCounter(monkeypatch, opt)
    for poison in (None, ("embed.weight", INF), None):
        _step(model, opt, scaler, x, poison, clip=True)
    assert counter.count == 0  # the flags stayed on device, skipped step included
    monkeypatch.undo()
    assert scaler.skipped_steps == 1


def test_report_can_be_switched_off() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = DistributedGradScaler("cpu", report_overflow=False)
    _step(model, opt, scaler, torch.randn(4, 8), ("head.bias", INF))
    assert scaler.skipped_steps == 1 and scaler.overflow_report() is None


class Overflowing(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e30  # the kind of activation fp16 cannot hold


def test_tracer_names_first_module_with_a_nonfinite_output() -> None:
    model = Net()
    model.block[1] = nn.Identity()  # no tanh to saturate the inf away
    model.block.insert(1, Overflowing())  # block.1 overflows; block.2 and head pass it on
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = DistributedGradScaler("cpu", init_scale=256.0)
    scaler.register_module(model)
    x = torch.randn(4, 8)
    with trace_nonfinite(model) as tracer:
        scaler.attach_tracer(tracer)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        tracer.record_loss(loss)
        assert tracer.first_nonfinite() == "block.1"
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    report = scaler.overflow_report()
    assert report is not None and report.forward == "block.1 (rank 0)"
    assert report.loss_nonfinite is True
    assert "first non-finite forward output: block.1" in report.one_line()
    assert len(model._forward_hooks) == 0  # the hooks are gone after the block


def test_tracer_compiles_into_the_graph_once() -> None:
    """The tracer's hooks are tensor updates only: a compiled model traces them into its graph
    (no graph break per module) that later steps reuse (no recompilation per step), and it
    still names the first module whose output went non-finite, in every compiled step."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = Net()
    model.block[1] = nn.Identity()
    model.block.insert(1, Overflowing())
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    seen, first = [], 0
    with trace_nonfinite(model) as tracer:
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                compiled(torch.randn(4, 8)).float().sum()
            seen.append(tracer.first_nonfinite())
            tracer.commit(torch.tensor(True))
            assert tracer.first_nonfinite() is None  # the commit cleared the record
            first = first or counter.frame_count
    assert seen == ["block.1"] * 4
    # the model's graph, and the root module's own hook (run after the compiled forward)
    assert first <= 2, f"{first} graphs: a graph break per module"
    assert counter.frame_count == first, "recompiled at a later step"
    torch._dynamo.reset()


def test_scale_health_warns_once_per_episode() -> None:
    health = ScaleHealth(consecutive=3)
    assert health.check(skipped_in_a_row=2, scale=1024.0, report=None) is None
    text = health.check(skipped_in_a_row=3, scale=512.0, report=None)
    assert text is not None and "3 optimizer steps in a row" in text and "bf16" in text
    assert health.check(skipped_in_a_row=4, scale=256.0, report=None) is None  # once
    assert health.check(skipped_in_a_row=0, scale=256.0, report=None) is None  # episode ends
    assert health.check(skipped_in_a_row=3, scale=128.0, report=None) is not None


# ---------------------------------------------------------------------------- distributed
def _named_overflow_on_rank1(rank: int, world: int, strategy: str) -> list[Any]:
    model = Net()
    if strategy == "ddp":
        wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for sub in (model.embed, model.block, model.head):
            fully_shard(sub, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, foreach=True)
    scaler = DistributedGradScaler("cpu", init_scale=256.0)
    # The inner module: names only. (Registering the DDP wrapper would also switch to its
    # zero-collective mode, which relies on an overflow travelling through DDP's all-reduce.)
    scaler.register_module(model)
    x = torch.randn(8, 8)[rank::world]
    out = []
    for step in range(3):
        opt.zero_grad()
        scaler.scale(wrapped(x).square().mean()).backward()
        if step == 1 and rank == 1:
            grad = dict(model.named_parameters())["block.0.weight"].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = INF
        scaler.step(opt)
        scaler.update()
        report = scaler.overflow_report()  # on every rank, every step: it is a collective
        out.append(None if report is None else [str(e) for e in report.entries])
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_report_names_parameter_and_rank_on_every_rank(strategy: str) -> None:
    results = run_ranks(_named_overflow_on_rank1, 2, strategy, timeout=120)
    expected = [None, ["block.0.weight (inf, rank 1)"], ["block.0.weight (non-finite, rank 1)"]]
    assert results == [expected, expected]


def test_skip_streak_counts_consecutive_skips() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = DistributedGradScaler("cpu", init_scale=256.0)
    x = torch.randn(4, 8)
    streaks = []
    for poison in (None, ("head.bias", INF), ("head.bias", NAN), None):
        _step(model, opt, scaler, x, poison)
        streaks.append(scaler.skip_streak)
    assert streaks == [0, 1, 2, 0]


def test_engine_logs_the_overflow_report_of_a_skipped_window() -> None:
    from distamp import DistAMP

    amp = DistAMP(precision="fp16", strategy="none", device="cpu", trace_nonfinite=True)
    amp.setup(Net(), lambda params: torch.optim.AdamW(params, lr=1e-3))
    xs = [torch.randn(4, 8) for _ in range(4)]
    xs[2][0, 0] = INF  # batch 2 overflows in the forward pass

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().square().mean()

    logged = []
    amp.fit(lambda k: xs[k], loss_fn, steps=4, log_interval=1, on_log=logged.append)
    lines = [s.overflow for s in logged]
    assert lines[:2] == [None, None] and lines[3] is None
    assert lines[2] is not None and lines[2].startswith("overflow at iteration 2: embed.weight")
    assert "first non-finite forward output: embed (rank 0)" in lines[2]
    assert "the loss itself was non-finite" in lines[2]


def test_a_resumed_engine_reports_no_overflow_for_a_clean_first_window(tmp_path: Any) -> None:
    """Skips restored from a checkpoint are not new: the first window after a resume, with no
    skip of its own, carries no overflow report."""
    from distamp import DistAMP

    def loss_fn(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).float().square().mean()

    xs = [torch.randn(4, 8) for _ in range(4)]
    xs[1][0, 0] = INF
    first = DistAMP(precision="fp16", strategy="none", device="cpu")
    first.setup(Net(), lambda params: torch.optim.AdamW(params, lr=1e-3))
    first.fit(lambda k: xs[k], loss_fn, steps=2, log_interval=1)
    assert first.scaler.skipped_steps == 1
    first.save_state(tmp_path)
    again = DistAMP(precision="fp16", strategy="none", device="cpu")
    again.setup(Net(), lambda params: torch.optim.AdamW(params, lr=1e-3))
    assert again.load_state(tmp_path)
    logged: list[Any] = []
    again.fit(lambda k: xs[k], loss_fn, steps=4, log_interval=1, on_log=logged.append)
    assert [s.skipped_steps for s in logged] == [1, 1]
    assert [s.overflow for s in logged] == [None, None]


def _medium_gpt_overflow(rank: int, world: int) -> list[Any]:
    """The medium GPT through the engine with tracing on; at the second step an inf appears in
    ``blocks.7.fc``'s output on rank 1 alone."""
    from distamp import DistAMP
    from launch.model import lm_loss

    model, forwards = medium.gpt(), [0]

    def inject(_m: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor | None:
        forwards[0] += 1
        if rank != 1 or forwards[0] != 2:
            return None
        out = out.clone()
        out.view(-1)[5] = INF
        return out

    model.blocks[7].fc.register_forward_hook(inject)
    amp = DistAMP("fp16", strategy="ddp", device="cpu", trace_nonfinite=True, max_grad_norm=1.0)
    amp.setup(model, medium.optimizer)
    logged: list[Any] = []
    batches = medium.data(rank, world).batch
    amp.fit(batches, lm_loss, steps=2, log_interval=1, on_log=logged.append)
    amp.close()
    return [(s.step, s.skipped_steps, s.overflow) for s in logged]


@pytest.mark.slow
def test_medium_gpt_overflow_report_names_the_module_on_every_rank() -> None:
    """On the medium GPT (149 parameters, every gradient NaN after DDP's all-reduce) the report
    reaches both ranks, the same, and the forward trace names the one module and rank."""
    r0, r1 = run_ranks(_medium_gpt_overflow, 2, timeout=240)
    assert r0 == r1
    assert [(step, skipped) for step, skipped, _ in r0] == [(1, 0), (2, 1)]
    assert r0[0][2] is None
    line = r0[1][2]
    assert line.startswith("overflow at iteration 1: tok.weight") and "+146 more" in line, line
    assert "first non-finite forward output: blocks.7.fc (rank 1)" in line, line
