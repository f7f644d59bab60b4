"""distamp.observe.recorder: ``metrics.jsonl`` from a loop of one's own, and what the report
says of a run that has it, lacks it, clips, or watches a module that never runs as a module.

Two runs on 2 gloo ranks: the drop-in scaler in a hand loop (clipping, one inf on rank 1) with a
:class:`~distamp.MetricsRecorder`; and the engine's ``backward_and_step`` in a hand loop over a
model with ``nn.MultiheadAttention`` (whose ``out_proj`` is never called as a module), with
telemetry and clipping but no ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import run_ranks
from torch import nn

import distamp
from distamp.observe.metrics import WindowStats
from distamp.observe.recorder import METRICS_FILE, MetricsRecorder
from distamp.observe.report import load_run, summary, write_report
from distamp.observe.report_plots import MISSING, grad_norm, headroom_heatmap, loss_and_scale
from distamp.observe.run_settings import SETTINGS, read_settings

STEPS, INTERVAL, INF_STEP = 7, 3, 4  # 7 steps: the last window (step 7) is a partial one


def _drop_in_loop(rank: int, world: int, out: str) -> dict[str, Any]:
    """The drop-in scaler in a hand loop: autocast, clip in one pass, the recorder after
    update(); an inf in rank 1's gradient at INF_STEP (both ranks skip it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = distamp.DistributedGradScaler("cpu")
    scaler.register_module(model)
    recorder = MetricsRecorder(out, log_interval=INTERVAL, settings={"max_grad_norm": 1.0})
    windows: list[WindowStats] = []
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().square().mean()
        scaler.scale(loss).backward()
        if step == INF_STEP and rank == 1:
            model[2].weight.grad[0, 3] = float("inf")
        norm = scaler.clip_grad_norm_(optimizer, max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        window = recorder.step(scaler, loss=loss, grad_norm=norm)
        if window is not None:
            windows.append(window)
    recorder.close(scaler)  # the partial last window
    assert recorder.last is not None
    windows.append(recorder.last)
    return {
        "steps": [w.step for w in windows],
        "skipped": scaler.skipped_steps,
        "file_on_this_rank": Path(out, METRICS_FILE).is_file() and dist.get_rank() == 0,
    }


class _Attention(nn.Module):
    """A block around ``nn.MultiheadAttention``: its ``out_proj`` is applied by the attention's
    functional forward, never called as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0])


def _engine_loop(rank: int, world: int, out: str) -> dict[str, Any]:
    """The engine's backward_and_step in a hand loop, clipping, telemetry, no metrics.jsonl."""
    torch.manual_seed(0)
    amp = distamp.DistAMP(
        "fp16",
        strategy="ddp",
        max_grad_norm=1.0,
        telemetry=distamp.Telemetry(out, interval=2),
    )
    amp.setup(_Attention(), lambda params: torch.optim.SGD(params, lr=1e-2))
    for step in range(4):
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        with amp.autocast():
            loss = F.mse_loss(amp.model(x).float(), torch.zeros(2, 5, 1))
        amp.backward_and_step(loss)
    window = amp.collect_metrics()  # what fit would log; not written here
    settings = amp.settings
    amp.close()
    return {"norm": window.grad_norm, "max_grad_norm": settings["max_grad_norm"]}


@pytest.fixture(scope="module")
def drop_in_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("drop_in")
    return out, run_ranks(_drop_in_loop, 2, str(out), timeout=120)


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("engine")
    return out, run_ranks(_engine_loop, 2, str(out), timeout=120)


def test_a_drop_in_loop_writes_the_engines_lines_on_rank_0(
    drop_in_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, ranks = drop_in_run
    assert [r["steps"] for r in ranks] == [[3, 6, 7]] * 2  # every rank collects alike
    assert [r["skipped"] for r in ranks] == [1, 1]
    assert ranks[0]["file_on_this_rank"] and not ranks[1]["file_on_this_rank"]
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6, 7]  # one writer: rank 0's
    assert set(WindowStats.__dataclass_fields__) <= set(lines[0])  # the engine's keys
    for line in lines:
        assert line["loss"] > 0 and line["grad_norm"] > 0 and line["loss_scale"] > 0
    assert [line["skipped_steps"] for line in lines] == [0, 1, 1]
    assert lines[1]["overflow_rate"] == pytest.approx(1 / 3)
    assert "2.weight" in lines[1]["overflow"] and "rank 1" in lines[1]["overflow"]
    assert lines[0]["overflow"] is None and lines[2]["overflow"] is None  # reported once
    assert read_settings(out) == {"max_grad_norm": 1.0}


def test_the_report_of_a_drop_in_loop_draws_loss_norm_and_scale(
    drop_in_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out, _ = drop_in_run
    run = load_run(out)
    assert run.series("loss")[0] == run.series("grad_norm")[0] == [3, 6, 7]
    assert run.series("loss_scale")[0] == [3, 6, 7]
    assert [(s.step, s.reason, s.ranks) for s in run.skips()] == [(6, "overflow", "1")]
    head = summary(run)
    assert head["steps"] == 7 and head["overflow_skips"] == 1 and head["final_loss"] > 0
    page = write_report(out, tmp_path / "report.html").read_text()
    for false in ("did not clip", "no loss was logged", "no metrics.jsonl", "no gradient norm"):
        assert false not in page


def test_a_run_without_metrics_says_the_file_is_missing_not_that_nothing_was_logged(
    engine_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    out, _ = engine_run
    assert not (out / METRICS_FILE).exists() and (out / "telemetry").is_dir()
    run = load_run(out)
    assert not run.metrics_file
    for figure in (loss_and_scale, grad_norm):
        fig, caption = figure(run)
        said = " ".join(t.get_text() for t in fig.axes[0].texts) + caption
        assert "no metrics.jsonl" in said and "MetricsRecorder" in said
        assert "holds no 'loss'" not in said


def test_a_clipping_run_is_never_called_unclipped(
    engine_run: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    out, ranks = engine_run
    assert [r["max_grad_norm"] for r in ranks] == [1.0, 1.0]
    assert all(r["norm"] is not None and r["norm"] > 0 for r in ranks)
    assert read_settings(out)["max_grad_norm"] == 1.0  # the engine's agreed settings, kept
    run = load_run(out)
    assert run.clipping() == (True, 1.0)
    fig, _ = grad_norm(run)
    said = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert said.startswith(MISSING) and "clipped at max_grad_norm=1" in said
    page = write_report(out, tmp_path / "report.html").read_text()
    assert "did not clip" not in page and "max_grad_norm=None" not in page


def test_a_module_never_called_as_a_module_is_drawn_as_no_data(
    engine_run: tuple[Path, list[dict[str, Any]]],
) -> None:
    import numpy as np

    out, _ = engine_run
    run = load_run(out)
    assert run.silent() == {"attn.out_proj"}
    assert all(r.silent == ("attn.out_proj",) for rs in run.telemetry.values() for r in rs)
    fig, caption = headroom_heatmap(run)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "attn.out_proj (no data)" in labels and "inp" in labels
    row = labels.index("attn.out_proj (no data)")
    grid = ax.images[0].get_array()
    assert np.ma.getmaskarray(grid)[row].all()  # masked: the "bad" grey, not the scale's
    assert not np.ma.getmaskarray(grid)[labels.index("inp")].any()
    assert any(p.get_hatch() == "///" for p in ax.patches)
    assert "attn.out_proj never ran as a module call" in caption


def test_without_settings_the_report_does_not_guess_the_clipping(tmp_path: Path) -> None:
    (tmp_path / METRICS_FILE).write_text('{"step": 5, "loss": 1.0, "loss_scale": 8.0}\n')
    run = load_run(tmp_path)
    assert run.clipping() == (False, None)
    fig, _ = grad_norm(run)
    said = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert "recorded no clipping setting" in said and "did not clip" not in said
    (tmp_path / SETTINGS).write_text('{"max_grad_norm": null}')
    fig, _ = grad_norm(load_run(tmp_path))
    assert "did not clip (max_grad_norm=None)" in fig.axes[0].texts[0].get_text()


def test_the_log_interval_is_checked() -> None:
    with pytest.raises(ValueError, match="log_interval=0"):
        MetricsRecorder("unused", log_interval=0)
