"""Which unscale kernel a step runs; per-gradient overflow flags computed for skipped steps only.

On CUDA a plain step's unscale must cost what torch's does: it runs torch's fused
``_amp_foreach_non_finite_check_and_unscale_``, and only the passes that need more (the sum of
squares of clipping, per-gradient flags of a sync-free scaler) take the Triton kernel. That rests
on two things checked here on CPU: the dispatcher's table (device, flags asked, sum asked) ->
kernel, and a scaler that asks a plain pass for nothing more. The flags the overflow report needs
are then computed at ``update()`` of a skipped step only, from the gradients, once the decision
is on the host: read there on the CPU, copied there as it is agreed on a device (no wait for the
optimizer's step). Decisions, reports and parameters equal those of the device-side bookkeeping
(counters kept as tensors, as a sync-free scaler keeps them; forced here on CPU) and of eager
flags (a sync-free scaler's). The CUDA tests (``-m gpu``) check the same on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_diagnostics import INF, NAN, Net, _step

from distamp import DistributedGradScaler
from distamp.kernels import dispatch, reference, unscale_check_sumsq_
from distamp.observe import overflow_flags
from distamp.scaler import clipping, records
from distamp.scaler.scale_state import ScaleState

ROUTE = dispatch.auto_backend  # the table itself, whatever a test spies on


@pytest.mark.parametrize(
    ("device", "flags", "sumsq", "kernel"),
    [
        ("cuda", False, False, "torch"),  # a plain unscale or check: torch's fused op
        ("cuda", False, True, "triton"),  # clipping: the sum of squares in the same pass
        ("cuda", True, False, "triton"),  # a sync-free scaler's flags
        ("cuda", True, True, "triton"),
        ("cpu", False, False, "torch"),
        ("cpu", True, True, "torch"),
        ("meta", True, False, "torch"),
    ],
)
def test_auto_routing_table(device: str, flags: bool, sumsq: bool, kernel: str) -> None:
    assert ROUTE(device, flags=flags, sumsq=sumsq) == kernel


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """Record (flags, sumsq) of every automatic dispatch. A clip on the CPU reads its values on
    the host and calls the torch backend's CPU check directly (``clipping.reads_on_host``); it is
    turned off here, so that the passes go through the dispatcher as a device's do."""
    seen: list[tuple[bool, bool]] = []

    def spy(device: Any, *, flags: bool, sumsq: bool) -> str:
        seen.append((flags, sumsq))
        return ROUTE(device, flags=flags, sumsq=sumsq)

    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "auto_backend", spy)
    monkeypatch.setattr(clipping, "reads_on_host", lambda: False)
    return seen


@pytest.mark.parametrize(
    ("optimizer", "clip", "sync_free", "asked"),
    [
        ("sgd", False, False, {(False, False)}),
        ("fused", False, False, {(False, False)}),
        ("sgd", True, False, {(False, True), (False, False)}),  # the norm pass, then the multiply
        ("fused", True, False, {(False, True)}),  # the fused step applies the factor
        ("fused", False, True, {(True, False)}),  # sync-free: flags in the pass, every step
        ("fused", True, True, {(True, True)}),
    ],
)
def test_a_plain_step_asks_for_no_flags(
    optimizer: str, clip: bool, sync_free: bool, asked: set, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each scaler pass asks the dispatcher for, good steps and a skipped one alike; on
    CUDA a plain step's pass is then torch's fused op and a clipping norm pass Triton's."""
    model = Net()
    kwargs = {"fused": True} if optimizer == "fused" else {}
    opt = (torch.optim.AdamW if optimizer == "fused" else torch.optim.SGD)(
        model.parameters(), lr=1e-3, **kwargs
    )
    scaler = DistributedGradScaler("cpu", init_scale=256.0, sync_free=sync_free)
    seen = _calls(monkeypatch)
    x = torch.randn(4, 8)
    for poison in (None, ("head.bias", INF), None):
        _step(model, opt, scaler, x, poison, clip=clip)
    assert set(seen) == asked
    kernels = {ROUTE("cuda", flags=f, sumsq=s) for f, s in seen}
    assert kernels == (
        {"triton"}
        if sync_free or (clip and optimizer == "fused")
        else {"torch", "triton"}
        if clip
        else {"torch"}
    )


def _device_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the scale counters as tensors, as a GPU scaler does: update() then hands the
    recorder no host decision and the lazy flags take the device path."""
    create = ScaleState.create
    monkeypatch.setattr(ScaleState, "create", lambda self, dev, on_host=False: create(self, dev))


SCHEDULE = [None, ("block.0.weight", INF), None, None, ("head.bias", NAN), ("embed.bias", -INF)]


def _run(optimizer: str, clip: bool, sync_free: bool = False) -> list[tuple[Any, ...]]:
    model = Net()
    kwargs = {"fused": True} if optimizer == "fused" else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kwargs)
    scaler = DistributedGradScaler("cpu", init_scale=256.0, growth_interval=2, sync_free=sync_free)
    scaler.register_module(model)
    out = []
    for poison in SCHEDULE:
        _step(
            model,
            opt,
            scaler,
            torch.randn(4, 8, generator=torch.Generator().manual_seed(3)),
            poison,
            clip=clip,
        )
        report = scaler.overflow_report()
        entries = None if report is None else (report.step, report.entries)
        out.append(
            (
                scaler.get_scale(),
                scaler.skipped_steps,
                bool(scaler.last_step_skipped),
                entries,
                [p.detach().clone() for p in model.parameters()],
            )
        )
    return out


def _same(a: list[tuple[Any, ...]], b: list[tuple[Any, ...]]) -> None:
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x[:4] == y[:4], f"step {step}: {x[:4]} != {y[:4]}"
        assert all(torch.equal(p, q) for p, q in zip(x[4], y[4], strict=True)), f"step {step}"


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
@pytest.mark.parametrize("clip", [False, True])
def test_device_bookkeeping_decides_and_reports_as_the_host_one(
    optimizer: str, clip: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same scales, skips, reports and parameters, step by step: CPU bookkeeping, the device
    bookkeeping with lazy flags, and eager flags (a sync-free scaler, whose report comes from
    flags the unscale pass raised)."""
    host = _run(optimizer, clip)
    eager = _run(optimizer, clip, sync_free=True)
    with monkeypatch.context() as m:
        _device_bookkeeping(m)
        device = _run(optimizer, clip)
    _same(device, host)
    reports = [(r[3][0], [(e.parameter, e.kind) for e in r[3][1]]) for r in host if r[3]]
    assert reports[-1] == (5, [("embed.bias", "inf")])
    assert [r[3] for r in eager] == [r[3] for r in host]  # the same reports from eager flags
    assert [r[:3] for r in eager] == [r[:3] for r in host]


@pytest.mark.parametrize("bookkeeping", ["host", "device"])
def test_flags_are_computed_for_skipped_steps_only(
    bookkeeping: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted: the per-gradient check runs once per skipped step (one optimizer, one dtype:
    one list), never on a good one; with host counters (every scaler but a sync-free one, on
    any device) each decision comes from the agreed flag's host copy."""
    if bookkeeping == "device":
        _device_bookkeeping(monkeypatch)
    checks: list[int] = []
    original = overflow_flags._nonfinite
    monkeypatch.setattr(
        overflow_flags, "_nonfinite", lambda p, d: checks.append(len(p)) or original(p, d)
    )
    decisions: list[bool | None] = []
    read = records.StepAgreement.skipped_on_host

    def spy(self: records.StepAgreement) -> bool | None:
        decisions.append(read(self))
        return decisions[-1]

    monkeypatch.setattr(records.StepAgreement, "skipped_on_host", spy)
    _run("foreach", clip=False)
    assert checks == [6, 6, 6]  # steps 1, 4 and 5 skipped; Net has 6 parameter tensors
    if bookkeeping == "host":  # the decision read from the agreed flags' host copies
        assert decisions == [False, True, False, False, True, True]
    else:
        assert decisions == []  # device counters: the recorder reads the device flag itself


def test_host_flag_reads_the_agreed_value() -> None:
    flag = torch.ones(())
    copy = records.HostFlag(flag)
    assert copy.read() is True and records.HostFlag(torch.zeros(())).read() is False


def test_a_device_check_is_torchs_one_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A check without the sum or flags on a device (simulated: the reference's device norm
    strategy forced on CPU) is torch's check-and-unscale by exactly 1, as torch's scaler checks
    fused optimizers' gradients: one launch, values bitwise unchanged, the flag raised."""
    monkeypatch.setattr(reference, "_norm_strategy", lambda device, dtype: "fp64")

    def no_norms(*args: Any) -> Any:
        raise AssertionError("a plain check took the norm passes")

    monkeypatch.setattr(reference, "_flags_and_sumsq", no_norms)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grads = [torch.randn(5).to(dtype), torch.randn(300).to(dtype) * 1e-3]
        grads[1][3] = -INF
        before = [g.clone() for g in grads]
        found = torch.zeros(())
        unscale_check_sumsq_(grads, found, torch.tensor(0.5), write=False, backend="torch")
        assert float(found) == 1.0
        assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_cuda_plain_steps_skip_the_kernel_and_report_as_the_cpu(optimizer: str) -> None:
    """On CUDA: a plain step builds no Triton table (torch's op ran), and the decisions and the
    reports are the CPU's, step by step, lazy flags and all."""
    from distamp.kernels import triton as kt

    def run(device: str) -> list[tuple[Any, ...]]:
        model = Net().to(device)
        kw = {"fused": True} if optimizer == "fused" else {"foreach": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **kw)
        scaler = DistributedGradScaler(device, init_scale=256.0, growth_interval=2)
        scaler.register_module(model)
        out = []
        for poison in SCHEDULE:
            _step(model, opt, scaler, torch.randn(4, 8, device=device), poison)
            report = scaler.overflow_report()
            out.append((scaler.get_scale(), scaler.skipped_steps,
                        None if report is None else (report.step, report.entries)))  # fmt: skip
        return out

    kt.plan_cache_clear()
    on_cuda = run("cuda")
    assert kt.plan_cache_info()["misses"] == 0, "a plain step launched the Triton kernel"
    assert on_cuda == run("cpu")


@pytest.mark.gpu
@CUDA
def test_cuda_fused_step_reads_no_device_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused optimizer's good steps: no host read of a CUDA tensor (the
    decision arrives as a pinned copy; update() waits for its event only)."""
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = DistributedGradScaler("cuda", init_scale=256.0)
    x = torch.randn(4, 8, device="cuda")
    _step(model, opt, scaler, x)  # first step: lazy state, compiles
    reads: list[str] = []
    for name in ("item", "__bool__", "tolist"):
        original = getattr(torch.Tensor, name)

        def read(t: torch.Tensor, *a: Any, _name: str = name, _orig: Any = original) -> Any:
            if t.is_cuda:
                reads.append(_name)
            return _orig(t, *a)

        monkeypatch.setattr(torch.Tensor, name, read)
    for poison in (None, None, None):
        _step(model, opt, scaler, x, poison)
    monkeypatch.undo()
    assert reads == [], reads
    assert scaler.skipped_steps == 0
