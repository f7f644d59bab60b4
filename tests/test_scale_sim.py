"""benchmarks/scale_sim.py runs every layout through torch's fake process group (small sizes
here: the benchmark itself goes to 16384 ranks) and prints its table and ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_scale_sim_runs_every_layout() -> None:
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "scale_sim.py")]
    cmd += ["--worlds", "8,64", "--steps", "2"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for layout in ("dp x tp", "pp x dp", "experts"):
        rows = [line for line in lines if line.startswith(layout)]
        assert len(rows) == 3, (layout, proc.stdout)  # two world sizes and the ratio line
        assert "64/8: step x" in rows[-1]
        for row in rows[:2]:
            setup_ms, step_ms = (float(v) for v in row.split("|")[1].split()[1:3])
            assert setup_ms > 0 and step_ms > 0, row
