"""``benchmarks/weight_memory.py`` at the tiny size: the bytes per parameter it counts by storage
are the designed ones (``distamp.optim.bytes_per_parameter``) in one process and per rank on two
gloo ranks, and its table prints them as ratios to torch's fp32-master loop.

Figures (the medium model, 21.5M parameters, torch 2.13 CPU; the benchmark's own run): bytes
per parameter torch 16.00, exact-fp32 14.00, exact-bf16 10.00, sharded-fp32 10.01 on the
larger of 2 ranks, stochastic-bf16 8.00, kahan-bf16 10.00.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from distamp.optim import bytes_per_parameter

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.weight_memory import MODES, WORLD, main  # noqa: E402


def test_bytes_per_parameter_by_storage_are_the_designed_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "figures.json"
    main(["--size", "tiny", "--parts", "bytes", "--quick", "--json", str(out)])
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text("utf-8"))["bytes"]
    assert list(rows) == list(MODES)
    for mode, row in rows.items():
        one = bytes_per_parameter(MODES[mode])
        ranks = bytes_per_parameter(MODES[mode], world_size=WORLD)
        assert row["design_one"] == one and row["design_ranks"] == ranks
        # The optimizer's step counts (4 bytes a tensor) are the only bytes beyond the design.
        assert one <= row["one_process"]["total"] < one + 0.01, (mode, row["one_process"])
        totals = [r["total"] for r in row["ranks"]]
        assert ranks <= sum(totals) / WORLD < ranks + 0.01, (mode, totals)
        if mode != "sharded-fp32":  # whole parameters per rank: the sharded ranks differ a little
            assert max(totals) - min(totals) < 1e-9, (mode, totals)
        # The table: this mode's row, its ratios to torch's loop in one process and per rank.
        line = next(ln for ln in printed.splitlines() if ln.startswith(f"{mode} "))
        cells = [c.split() for c in line.split("|")]
        torch_one = rows["torch"]["one_process"]["total"]
        assert cells[2][2] == f"{row['one_process']['total'] / torch_one:.2f}", line
        assert cells[3][3] == f"{max(totals) / rows['torch']['ranks'][0]['total']:.2f}", line
