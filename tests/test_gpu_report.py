"""The device report's pipeline, run dry on CPU: every section at tiny sizes, one JSON and one
Markdown file with the environment, each section's status and its tables.

The figures of a dry run mean nothing; what is checked is that the command the documentation
gives for a GPU machine (``python benchmarks/gpu_report.py --out DIR``) runs every benchmark and
the GPU tests through to the files, so that a device run is not spent finding a broken section.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from _dist import ROOT, script_env

SECTIONS = [
    "tests",
    "end_to_end",
    "host_overhead",
    "fp8_exchange",
    "unscale_bandwidth",
    "overflow_diagnostics",
    "fp8",
    "policy_accuracy",
]


def test_dry_run_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "report"
    cmd = [sys.executable, "benchmarks/gpu_report.py", "--out", str(out), "--device", "cpu"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_report.json").read_text("utf-8"))
    env = report["environment"]
    for key in ("device", "driver", "torch", "triton", "date", "commit"):
        assert env[key], key
    assert "dry run" in env["device"]
    sections = {s["name"]: s for s in report["sections"]}
    assert list(sections) == SECTIONS
    for name, section in sections.items():
        assert section["status"] == "ok", f"{name}: {section['output'][-2000:]}"
        assert section["command"].startswith("python ")
    assert sections["tests"]["data"]["total"] > 0  # the GPU tests were collected (and skipped)
    e2e = sections["end_to_end"]["data"]["rows"]
    assert [r["precision"] for r in e2e] == ["fp16", "bf16"]
    assert all(r[k]["tokens_per_s"] > 0 for r in e2e for k in ("torch", "drop-in", "engine"))
    assert "torch" in sections["fp8_exchange"]["data"]["buckets"]
    assert {"fp32", "fp8", "fp8-ef"} <= set(sections["fp8_exchange"]["data"]["steps"])
    fp8 = sections["fp8"]["data"]["rows"][0]
    assert fp8["bf16_loss"] < fp8["bf16_first"] and fp8["fp8_loss"] < fp8["fp8_first"]
    md = (out / "gpu_report.md").read_text("utf-8")
    assert md.startswith("# distamp device report")
    for line in ("| device |", "| driver |", "| torch |", "| triton |", "| date |"):
        assert line in md, line
    assert md.count("| ok |") == len(SECTIONS)
    assert "| fp16 | engine |" in md and "| fp8 | torch |" in md
    assert seconds < 60, f"the dry run took {seconds:.0f} s"
