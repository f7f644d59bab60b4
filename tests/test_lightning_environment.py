"""Lightning where mpi4py is installed but cannot load its MPI library: the adaptive guide's
Trainer block runs, since the ``DistAMPEnvironment`` it passes spares the job Lightning's own MPI
detection, which imports ``mpi4py.MPI`` (distamp/integrations/lightning/environment.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import launcher_free_env

ROOT = Path(__file__).resolve().parents[1]


_BROKEN_MPI = """\
raise RuntimeError(
    "cannot load MPI library\\nlibmpi.so.40: cannot open shared object file: No such file"
)
"""


def _guide_block(page: Path, marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    (block,) = [b for b in blocks if marker in b]
    return block


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="needs lightning")
def test_adaptive_guides_trainer_block_runs_where_mpi4py_cannot_load_libmpi(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "site" / "mpi4py"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "4.1.2"\n')
    (fake / "MPI.py").write_text(_BROKEN_MPI)
    check = (
        "try:\n    from mpi4py import MPI\nexcept RuntimeError:\n    pass\n"
        "else:\n    raise SystemExit('the broken mpi4py loaded')\n"
    )
    block = _guide_block(ROOT / "docs" / "guides" / "adaptive.md", "DistAMPTrainerPrecision(")
    (tmp_path / "block.py").write_text(check + block)
    env = launcher_free_env()
    env.update(PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT)]), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "block.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "fc fp16 -> fp32" in done.stdout, done.stdout
