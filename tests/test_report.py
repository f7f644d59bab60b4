"""``distamp report DIR`` (distamp.observe.report): one self-contained page of a run's precision,
PNG figures, and a clear refusal for a folder that is not a run.

The page is loaded in headless Chromium (Debian's ``chromium``, installed by the README's system
packages): it must render with no console message at error level, and its screenshot must not be
blank. The run is tests/telemetry_scenarios.py's (the ``telemetry_run`` fixture).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.image import imread
from telemetry_scenarios import HOT

from distamp.cli import main
from distamp.observe.report import ReportError, load_run, summary, write_report
from distamp.observe.report_plots import FIGURES

Run = tuple[Path, list[dict[str, Any]]]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_holds_every_figure_inline_and_nothing_from_the_network(
    telemetry_run: Run, tmp_path: Path
) -> None:
    out, results = telemetry_run
    page = write_report(out, tmp_path / "report.html", png=tmp_path / "png")
    text = page.read_text()
    assert text.count("<svg") == len(FIGURES)
    for name, _ in FIGURES:
        assert f'id="{name}"' in text
        png = imread(tmp_path / "png" / f"{name}.png")
        assert png.shape[0] > 100 and png.std() > 0.01, name  # drawn, not blank
    # No script, no stylesheet or image fetched: every reference is inline.
    assert "<script" not in text and "<link" not in text and "<?xml" not in text
    assert not re.findall(r"""(?:src|href)=["'](?!data:|#)""", text)
    # The skips are marked with the module blamed and the ranks; the promotion is drawn.
    assert HOT in text and "fp16 -&gt; fp32" in text
    figures = summary(load_run(out))
    assert figures["overflow_skips"] == results[0]["skipped"] > 0
    assert figures["ranks"] == 2 and figures["precision_changes"] == 1
    assert figures["steps"] == 24


def test_every_skip_is_blamed_on_a_module_and_ranks(telemetry_run: Run) -> None:
    out, results = telemetry_run
    skips = load_run(out).skips()
    assert len(skips) == results[0]["skipped"]
    assert all(s.reason == "overflow" for s in skips)
    assert HOT in {s.module for s in skips}
    assert all(s.ranks for s in skips)  # from the window's overflow report


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (README system packages)")
def test_the_page_renders_in_a_browser_without_errors(telemetry_run: Run, tmp_path: Path) -> None:
    out, _ = telemetry_run
    page = write_report(out, tmp_path / "report.html")
    shot = tmp_path / "shot.png"
    assert CHROMIUM is not None
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",  # root in a container: Chromium's sandbox needs user namespaces
            "--disable-gpu",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    errors = [line for line in console if re.search(r"ERROR|Uncaught", line)]
    assert not errors, errors
    image = imread(shot)
    assert image.shape[0] >= 2000 and image.shape[1] >= 1000
    # Not blank: the figures put many distinct colours on the page.
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50, len(colours)


def test_the_command_writes_the_page_and_prints_its_figures(
    telemetry_run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _ = telemetry_run
    target = tmp_path / "r.html"
    assert main(["report", str(out), "-o", str(target), "--png", str(tmp_path / "p")]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {target}" in printed and "overflow skips" in printed
    assert target.is_file() and (tmp_path / "p" / "loss.png").is_file()


def test_a_folder_that_is_not_a_run_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds neither metrics.jsonl nor telemetry" in err and "--out" in err
    with pytest.raises(ReportError):
        load_run(tmp_path)


def test_without_matplotlib_the_command_says_which_extra_to_install(
    telemetry_run: Run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The library installed alone (``pip install -e .``) lacks the ``report`` extra: the
    command the main job suggests ends in one line naming it, not a traceback."""
    out, _ = telemetry_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    assert main(["report", str(out), "-o", str(out / "r.html")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("distamp report draws with matplotlib")
    assert "pip install -e '.[report]'" in err
    assert "Traceback" not in err and not (out / "r.html").exists()


def test_metrics_alone_draw_a_page(tmp_path: Path) -> None:
    """A plug-in's or a plain loop's metrics.jsonl without telemetry: the scalar figures are
    drawn, the per-module ones say what to switch on."""
    lines = [
        '{"step": 10, "loss": 2.0, "loss_scale": 65536.0, "skipped_steps": 0}',
        '{"step": 20, "loss": 1.5, "loss_scale": 32768.0, "skipped_steps": 1, '
        '"overflow": "overflow at iteration 14: fc.weight (inf, rank 1)"}',
        '{"step": 30, "loss": 1.4, "loss_scale": 32768.0, "skipped_steps": 1, "spike_skips": 1}',
        '{"step": 3',  # a line cut short by a killed run
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    page = write_report(tmp_path).read_text()
    assert "no telemetry" in page
    run = load_run(tmp_path)
    assert [(s.step, s.reason, s.ranks) for s in run.skips()] == [
        (20, "overflow", "1"),
        (30, "spike", None),
    ]
    assert summary(run)["spike_skips"] == 1 and "spike" in page


def test_the_command_runs_as_a_console_script(telemetry_run: Run, tmp_path: Path) -> None:
    out, _ = telemetry_run
    proc = subprocess.run(
        [sys.executable, "-m", "distamp.cli", "report", str(out), "-o", str(tmp_path / "x.html")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "x.html").is_file()
