"""Mistakes refused where they are made, naming the argument and the fix, or handled.

Each of these was accepted and failed later, elsewhere, or never: a policy of another precision
in a plug-in (fp16 compute with no loss scaling), ``model.half()`` (torch's "Attempting to unscale
FP16 gradients" at the first step), a device this machine lacks, ``fit(log_interval=0)`` (a
``ZeroDivisionError`` after the first step), a per-sample loss or a token count that is no number,
``init_distributed()`` without a launcher (torch's advice to call ``init_process_group`` at the
first collective), training before ``setup()`` (an error at the optimizer step), a misspelt
``fp32_ops`` name (nothing forced to fp32), a second engine in one process (a hang until the
gloo timeout), ``tokens_per_s`` reported as 0.0 when no token was counted, and Lightning's MPI
detection where mpi4py cannot load its library.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import launcher_free_env
from torch import nn

from distamp import AutocastPolicy, DistAMP, detect_environment, init_distributed
from distamp.observe.metrics import AMPMetrics

ROOT = Path(__file__).resolve().parents[1]


def _engine(precision: str = "bf16", model: nn.Module | None = None) -> tuple[DistAMP, nn.Module]:
    amp = DistAMP(precision, device="cpu")
    model = model if model is not None else nn.Linear(4, 2)
    wrapped, _ = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, wrapped


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().square().mean()


# ---- init_distributed() without a launcher ------------------------------------------------------


def test_init_distributed_without_a_launcher_says_so(caplog: pytest.LogCaptureFixture) -> None:
    alone = detect_environment({})
    with caplog.at_level(logging.WARNING, logger="distamp.cluster"):
        assert init_distributed(alone) is alone
    assert not torch.distributed.is_initialized()
    text = caplog.text
    assert "no launcher started this process" in text and "no process group" in text, text
    for way in ("distamp launch --nproc-per-node N script.py", "torchrun", "mpirun", "srun"):
        assert way in text, way
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="distamp.cluster"):
        init_distributed(alone, warn_if_single=False)
        _engine()  # one process is a complete job for the engine: no warning
    assert not caplog.records, caplog.text


# ---- AutocastPolicy(fp32_ops=...) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "closest"), [("softmx", "softmax"), ("F.softmax", "softmax"), ("torch.exp", "exp")]
)
def test_fp32_ops_names_that_are_no_torch_function_are_refused(name: str, closest: str) -> None:
    with pytest.raises(ValueError, match=rf"fp32_ops: '{re.escape(name)}' is not.*'{closest}'"):
        AutocastPolicy("bf16", fp32_ops=(name,))
    policy = AutocastPolicy("bf16", fp32_ops=(closest, "linalg_norm"))
    assert policy.fp32_ops == frozenset({closest, "linalg_norm"})


# ---- tokens_per_s --------------------------------------------------------------------------------


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


# ---- Lightning where mpi4py cannot load its MPI library -----------------------------------------

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
        [sys.executable, "block.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "fc fp16 -> fp32" in done.stdout, done.stdout
