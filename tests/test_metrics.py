"""AMPMetrics, the engine's overflow rate, ``tokens_per_s`` (None until tokens are counted), and
the JSONL / TensorBoard writers (one process)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from distamp import DistAMP, DistributedGradScaler
from distamp.observe.metrics import AMPMetrics, Metrics
from distamp.observe.writers import JSONLWriter, TensorBoardWriter, make_writer


def _steps(scaler: DistributedGradScaler, bad: set[int], n: int, metrics: AMPMetrics) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    for k in range(n):
        scaler.scale(p.sum()).backward()
        if k in bad:
            p.grad.fill_(float("inf"))
        norm = scaler.clip_grad_norm_(opt, 10.0)
        scaler.step(opt)
        scaler.update()
        metrics.step(scaler, norm)
        metrics.add_tokens(100)
        opt.zero_grad()


def test_amp_metrics_window() -> None:
    scaler = DistributedGradScaler("cpu", init_scale=1024.0)
    m = AMPMetrics("cpu")
    _steps(scaler, {1}, 4, m)
    out = m.compute(scaler)
    assert set(out) == set(AMPMetrics.KEYS)
    assert out["skipped_steps"] == 1 and out["overflow_rate"] == 0.25 and out["steps"] == 4
    assert out["loss_scale"] == 512.0
    assert out["grad_norm"] == pytest.approx(3**0.5)  # unscaled: d(sum)/dp = 1 per element
    assert out["tokens_per_s"] > 0
    _steps(scaler, set(), 2, m)  # the next window starts empty
    nxt = m.compute(scaler)
    assert nxt["overflow_rate"] == 0.0 and nxt["skipped_steps"] == 1 and nxt["steps"] == 2


def test_amp_metrics_without_scaler() -> None:
    m = AMPMetrics()
    m.step(None)
    out = m.compute(None)
    assert out["loss_scale"] == 1.0 and out["skipped_steps"] == 0 and out["grad_norm"] is None


def test_engine_metrics_overflow_rate() -> None:
    scaler = DistributedGradScaler("cpu", init_scale=1024.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    metrics = Metrics(torch.device("cpu"))
    rates = []
    for k in range(8):
        loss = p.sum()
        metrics.record(loss, tokens=10)
        scaler.scale(loss).backward()
        if k in (0, 1, 5):
            p.grad.fill_(float("nan"))
        scaler.step(opt)
        scaler.update()
        metrics.end_step(None)
        opt.zero_grad()
        if k % 4 == 3:
            stats = metrics.collect(step=k + 1, scaler=scaler)
            rates.append(stats.overflow_rate)
            assert stats.as_dict()["overflow_rate"] == stats.overflow_rate
    assert rates == [0.5, 0.25]


def test_jsonl_writer(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "m.jsonl"
    w = make_writer("jsonl", path)
    assert isinstance(w, JSONLWriter)
    w.write(1, {"loss_scale": 2.0, "grad_norm": float("inf"), "note": None})
    w.write(2, {"loss_scale": 4.0})
    w.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [
        {"step": 1, "loss_scale": 2.0, "grad_norm": None, "note": None},
        {"step": 2, "loss_scale": 4.0},
    ]


def test_make_writer_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="'csv'"):
        make_writer("csv", "x")


@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="needs distamp[tensorboard]"
)
def test_tensorboard_writer(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = TensorBoardWriter(tmp_path, prefix="amp")
    w.write(3, {"loss_scale": 8.0, "grad_norm": None, "skipped_steps": 1, "flag": True})
    w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["amp/loss_scale", "amp/skipped_steps"]
    (event,) = acc.Scalars("amp/loss_scale")
    assert (event.step, event.value) == (3, 8.0)


def test_first_window_after_restore_counts_only_its_own_skips() -> None:
    """A skip count restored from a checkpoint is not charged to the first window, and the
    engine's and the integrations' views of one window agree (one reducer)."""
    before = DistributedGradScaler("cpu", init_scale=1024.0)
    _steps(before, {0, 1, 2}, 4, AMPMetrics())
    scaler = DistributedGradScaler("cpu", init_scale=1024.0)
    scaler.load_state_dict(before.state_dict())
    assert scaler.skipped_steps == 3
    engine, amp = Metrics(torch.device("cpu")), AMPMetrics()
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    for k in range(4):
        loss = p.sum()
        engine.record(loss, tokens=10)
        amp.add_tokens(10)
        scaler.scale(loss).backward()
        if k == 2:
            p.grad.fill_(float("inf"))
        norm = scaler.clip_grad_norm_(opt, 10.0)
        scaler.step(opt)
        scaler.update()
        engine.end_step(norm, scaler)
        amp.step(scaler, norm)
        opt.zero_grad()
    stats, out = engine.collect(step=8, scaler=scaler), amp.compute(scaler)
    assert stats.overflow_rate == out["overflow_rate"] == 0.25  # 1 of 4, not 4 of 4
    assert stats.skipped_steps == out["skipped_steps"] == 4
    assert stats.loss_scale == out["loss_scale"] and stats.grad_norm == out["grad_norm"]
    assert stats.step == 8 and out["steps"] == 4


def test_progress_printer_console_line_and_jsonl(tmp_path: Path) -> None:
    import io

    from distamp.observe.metrics import WindowStats
    from distamp.observe.writers import ProgressPrinter

    stream, path = io.StringIO(), tmp_path / "m.jsonl"
    printer = ProgressPrinter(8, jsonl=path, stream=stream)
    stats = WindowStats(
        step=4, loss=1.23456, last_loss=1.0, loss_scale=1024.0, skipped_steps=1,
        tokens_per_s=12345.6, grad_norm=float("inf"), stop=False, overflow="fc1.weight: inf",
        overflow_rate=0.25,
    )  # fmt: skip
    printer.step(4)  # not a terminal: nothing until a window is logged
    printer.log(stats)
    printer.close()
    assert stream.getvalue() == (
        "[############............] 4/8 loss 1.2346 | scale 1024 | skipped 1 | 12,346 tok/s\n"
        "  fc1.weight: inf\n"
    )
    (row,) = [json.loads(x) for x in path.read_text().splitlines()]
    assert row == {**stats.as_dict(), "grad_norm": None}  # JSONLWriter's record: inf -> null


def test_console_writer_takes_an_integration_dict() -> None:
    import io

    from distamp.observe.writers import ConsoleWriter

    assert isinstance(make_writer("console"), ConsoleWriter)
    stream = io.StringIO()
    w = ConsoleWriter(stream=stream)
    m = AMPMetrics()
    m.step(None)
    w.write(1, m.compute(None))  # no loss in it, no tokens counted: those fields are left out
    assert stream.getvalue() == "step 1 scale 1 | skipped 0\n"
    m.add_tokens(100)
    m.step(None)
    w.write(2, m.compute(None))
    second = stream.getvalue().splitlines()[1]
    assert re.fullmatch(r"step 2 scale 1 \| skipped 0 \| [\d,]+ tok/s", second), second


# ------------------------------------------------------------------------------------ tokens_per_s
def _engine(precision: str = "bf16", model: nn.Module | None = None) -> tuple[DistAMP, nn.Module]:
    amp = DistAMP(precision, device="cpu")
    model = model if model is not None else nn.Linear(4, 2)
    wrapped, _ = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, wrapped


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


def test_tokens_per_s_is_none_until_tokens_are_counted() -> None:
    metrics = AMPMetrics("cpu")
    metrics.step()
    first = metrics.compute()
    assert first["tokens_per_s"] is None and json.loads(json.dumps(first)) == first
    metrics.add_tokens(64)
    metrics.step()
    assert (metrics.compute()["tokens_per_s"] or 0) > 0
    metrics.step()
    assert metrics.compute()["tokens_per_s"] == 0.0  # counted before: a window without any
    amp, _ = _engine()
    stats = amp.fit(lambda k: torch.ones(3, 4), _loss, steps=1)
    assert stats is not None and stats.tokens_per_s is None


def test_a_replaced_scaler_without_a_skip_count_reads_as_never_skipping() -> None:
    """A plug-in's scaler replaced by a test double (``Mock(wraps=scaler)``, as Lightning's own
    tests do) or by torch's GradScaler: the window's figures are still computed, the scale read
    through the double, and the skips counted as none (neither keeps a readable count)."""
    from unittest.mock import Mock

    doubles = (
        Mock(wraps=DistributedGradScaler("cpu", init_scale=256.0)),
        torch.amp.GradScaler("cpu", init_scale=256.0),
    )
    for scaler in doubles:
        metrics = AMPMetrics()
        metrics.step(scaler)
        figures = metrics.compute(scaler)
        assert figures["loss_scale"] == 256.0 and figures["skipped_steps"] == 0, figures
