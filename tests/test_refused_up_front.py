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
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import free_port, launcher_free_env, run_ranks
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


# ---- what setup() is given ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "dtype", "refused"),
    [
        ("fp16", torch.float16, True),
        ("bf16", torch.float16, True),  # the check-only scaler refuses fp16 gradients too
        ("fp16", torch.bfloat16, True),  # bf16 weights drop what loss scaling keeps
        ("bf16", torch.bfloat16, False),  # pure bf16 training: a choice, it works
    ],
)
def test_low_precision_parameters_are_refused_at_setup(
    precision: str, dtype: torch.dtype, refused: bool
) -> None:
    model = nn.Linear(4, 2).to(dtype)
    if not refused:
        amp, wrapped = _engine(precision, model)
        with amp.autocast():
            loss = _loss(wrapped, torch.ones(3, 4))
        assert amp.backward_and_step(loss) is not None
        return
    amp = DistAMP(precision, device="cpu")
    with pytest.raises(ValueError, match=rf"{dtype}.*master weights in fp32.*autocast") as info:
        amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "'weight'" in str(info.value) and f"precision={precision!r}" in str(info.value)
    with pytest.raises(RuntimeError, match="setup"):  # refused: nothing was set up
        amp.model  # noqa: B018


def test_a_device_this_machine_lacks_is_refused_at_construction() -> None:
    absent = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU: none on a CPU host
    with pytest.raises(ValueError, match=rf"device='{absent}'.*device='cpu'"):
        DistAMP(device=absent)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"device='cuda': torch sees 0 cuda device"):
            DistAMP(device="cuda")
    assert DistAMP(device="cpu:0").config.device == torch.device("cpu:0")


# ---- fit() and backward() -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"log_interval": 0}, r"fit\(log_interval=0\).*>= 1"),
        ({"steps": -1}, r"fit\(steps=-1\)"),
        ({"steps": 2.5}, r"fit\(steps=2.5\)"),
        ({"tokens_per_batch": "many"}, r"fit\(tokens_per_batch='many'\)"),
        ({"checkpoint_interval": -2}, r"fit\(checkpoint_interval=-2\)"),
        ({"on_log": "print"}, r"fit\(on_log='print'\): expected a function or None"),
        ({"checkpoint_dir": 3}, r"fit\(checkpoint_dir=3\)"),
    ],
)
def test_fit_checks_every_argument_before_the_first_step(bad: dict[str, Any], match: str) -> None:
    amp, _ = _engine()
    kwargs: dict[str, Any] = {"steps": 2, **bad}
    with pytest.raises(ValueError, match=match):  # ArgumentTypeError is a ValueError too
        amp.fit(lambda k: torch.ones(3, 4), _loss, **kwargs)
    assert amp.step_count == 0


def test_backward_refuses_a_loss_that_is_not_one_number_and_a_token_count_that_is_none() -> None:
    amp, model = _engine()
    x = torch.ones(3, 4)
    with amp.autocast():
        per_sample = model(x).float()
    with pytest.raises(ValueError, match=r"backward\(loss=\.\.\.\): a tensor of shape \(3, 2\)"):
        amp.backward(per_sample)
    with pytest.raises(TypeError, match=r"backward\(tokens='abc'\)"):
        amp.backward(per_sample.mean(), tokens="abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"backward\(tokens=-1\)"):
        amp.backward(per_sample.mean(), tokens=-1)
    # Nothing changed: the cycle still expects its one backward; a shape-[1] loss is one number.
    result = amp.backward_and_step(per_sample.mean().reshape(1), tokens=6)
    assert result is not None and result.stepped and amp.step_count == 1


def test_training_calls_before_setup_name_setup() -> None:
    amp = DistAMP("bf16", device="cpu")
    for call in (
        amp.autocast,
        amp.accumulate,
        lambda: amp.backward(torch.ones((), requires_grad=True)),
    ):
        with pytest.raises(
            RuntimeError, match=r"no model set up: call `model, optimizer = amp\.setup"
        ):
            call()
    amp, _ = _engine()
    amp.close()
    with pytest.raises(RuntimeError, match=r"DistAMP\.autocast\(\).*after close\(\), build a new"):
        amp.autocast()


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


# ---- a second engine in the same process --------------------------------------------------------


def _two_engines(rank: int, world: int, port: int) -> list[float]:
    torch.distributed.destroy_process_group()  # the harness's group: the engines make their own
    os.environ["MASTER_PORT"] = str(port)
    took = []
    for _ in range(2):
        start = time.monotonic()
        amp = DistAMP("bf16", device="cpu", timeout=15)
        model, _ = amp.setup(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1))
        assert torch.distributed.get_world_size() == world  # the engine made the group
        with amp.autocast():
            loss = _loss(model, torch.ones(3, 4) * (rank + 1))
        result = amp.backward_and_step(loss)
        assert result is not None and result.stepped
        amp.close()
        assert not torch.distributed.is_initialized()
        took.append(time.monotonic() - start)
    return took


def test_a_second_engine_in_the_same_process_sets_up_promptly() -> None:
    # Before: the second setup() met the first group's keys in the store, and its first
    # collective waited for the whole timeout.
    for took in run_ranks(_two_engines, 2, free_port(), timeout=90):
        assert took[1] < 12, took


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
