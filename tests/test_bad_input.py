"""Bad input never crashes deep inside torch: arguments, checkpoints, world sizes, NaN losses.

- Fuzzed constructor arguments of the engine: either a working object or a ``ValueError`` that
  names the offending field (the scaler's: tests/test_scaler.py).
- A truncated or corrupted checkpoint: a ``CheckpointError`` naming the file; the model and the
  checkpoint directory are left exactly as they were.
- A checkpoint from another world size: loads, resharded through torch.distributed.checkpoint.
- A loss that is NaN before scaling: the step is skipped and reported.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from fuzz_scenarios import ARG_VALUES, JUNK, numeric
from hypothesis import event, example, given
from hypothesis import strategies as st

from distamp import (
    AutocastPolicy,
    detect_environment,
    init_distributed,
)
from distamp.cli import main as cli_main


@given(
    st.one_of(st.sampled_from(["fp8", "bf16", "fp16", 16, 32]), numeric(JUNK)),
    st.one_of(st.none(), numeric(st.integers(-5, 5000)), numeric(JUNK)),
)
@example("fp8", np.int64(64))
@example(np.int64(16), None)
@example(torch.tensor(32), None)
def test_fuzzed_policy_arguments(precision: Any, min_features: Any) -> None:
    try:
        policy = AutocastPolicy(precision, fp8_min_features=min_features)
    except ValueError as exc:
        assert "precision=" in str(exc) or "fp8_min_features" in str(exc), exc
        event("rejected with ValueError")
        return
    event("constructed")
    if policy.fp8 is not None:
        assert type(policy.fp8.min_features) is int and policy.fp8.min_features >= 0


# -------------------------------------------------------------------- launcher and environment
LAUNCHER_VARS = st.sampled_from(
    ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT", "GROUP_RANK",
     "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_LOCALID", "SLURM_NODEID",
     "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
     "DISTAMP_LAUNCHER"]
)  # fmt: skip
ENV_VALUES = st.one_of(
    st.integers(-3, 5).map(str),
    st.sampled_from(["abc", "99999", "-1", "1e3", " 2 ", "1_0", "", "9" * 40, "torchrun"]),
    st.text(max_size=5),
)


@given(st.dictionaries(LAUNCHER_VARS, ENV_VALUES, max_size=6))
@example({"RANK": "0", "WORLD_SIZE": "abc"})
@example({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"})
@example({"MASTER_PORT": "99999"})
@example({"RANK": "0", "WORLD_SIZE": "0\x1f"})
@example({"RANK": "0", "WORLD_SIZE": "9" * 5000})
@example({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_NODEID": "-1",
          "SLURM_TASKS_PER_NODE": "2", "SLURM_LOCALID": "0"})  # fmt: skip
def test_fuzzed_launcher_environment(env: dict[str, str]) -> None:
    try:
        found = detect_environment(env)
    except ValueError as exc:
        # It names a variable: one given, or one its launcher needs and that is missing.
        assert re.search(r"\b[A-Z][A-Z_]+_?[A-Z]+\b", str(exc)), f"unnamed variable: {exc}"
        event("rejected with ValueError")
        return
    event("detected")
    assert 0 <= found.rank < found.world_size < 2**31
    assert found.main_port is None or 0 < found.main_port < 65536


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, r"WORLD_SIZE='abc' is not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, r"LOCAL_RANK=-1 is out of range"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "99999"}, r"MASTER_PORT=99999 .*1-65535"),
    ],
)
def test_init_distributed_refuses_bad_variables_before_any_group(
    env: dict[str, str], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        init_distributed(timeout=5)
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="timeout"):
        init_distributed(timeout=math.nan)


TRAIN_FLAGS = st.sampled_from(
    ["--steps", "--precision", "--strategy", "--grad-accum", "--max-grad-norm", "--seed",
     "--batch-size", "--lr", "--warmup", "--log-interval", "--checkpoint-interval", "--stop-at",
     "--threads", "--timeout", "--fp8-recipe", "--fp8-min-features", "--data", "--comm-hook",
     "--size"]
)  # fmt: skip


@given(st.lists(st.tuples(TRAIN_FLAGS, ARG_VALUES), max_size=4))
@example([("--precision", "fp17")])
@example([("--warmup", "-5")])
@example([("--steps", "3"), ("--stop-at", "10")])
@example([("--threads", "-1")])
@example([("--data", "/nonexistent")])
@example([("--comm-hook", "fp8")])  # one process: nothing to exchange
def test_fuzzed_main_job_arguments(pairs: list[tuple[str, str]]) -> None:
    """launch/train.py's parser: a usage error (exit 2) naming an argument, or values that mean
    something; never a traceback (parse() runs before any process group)."""
    from launch.train import parse

    argv = [f"{flag}={value}" for flag, value in pairs]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse(argv)
    except SystemExit as exc:
        assert exc.code == 2
        assert "argument --" in stderr.getvalue() or "launcher" in stderr.getvalue()
        event("usage error")
        return
    event("parsed")
    assert args.steps >= 1 and args.warmup >= 0 and args.threads >= 0
    assert args.stop_at is None or 1 <= args.stop_at <= args.steps
    assert math.isfinite(args.lr) and args.lr > 0 and args.data.is_file()


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--comm-hook", "fp16", "--strategy", "fsdp2"], "comm_hook='fp16' with strategy='fsdp2'"),
        (["--comm-hook", "fp8", "--strategy", "fsdp"], "comm_hook='fp8' with strategy='fsdp'"),
    ],
)
def test_main_job_comm_hook_against_the_strategy_is_a_usage_error(
    argv: list[str], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a 2-rank launcher's variables, a hook the strategy cannot carry stops the parser
    (exit 2, the engine's own message) before any process group."""
    from launch.train import parse

    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2 and match in stderr.getvalue(), stderr.getvalue()
    assert parse(["--comm-hook", "fp8", "--strategy", "fsdp2"]).comm_hook == "fp8"


def test_main_job_out_that_cannot_be_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    """--out under a regular file (or the file itself) stops the parser, before training and
    not at the first save; a directory that does not exist yet is fine."""
    from launch.train import parse

    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub", blocker / "sub" / "deeper"):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exc:
            parse(["--out", str(out)])
        assert exc.value.code == 2 and "argument --out" in stderr.getvalue(), stderr.getvalue()
        assert "not a directory" in stderr.getvalue() or "is a file" in stderr.getvalue()
    assert parse(["--out", str(tmp_path / "new" / "run")]).out == tmp_path / "new" / "run"


LAUNCH_FLAGS = st.sampled_from(["--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint"])


@given(st.lists(st.tuples(LAUNCH_FLAGS, ARG_VALUES), max_size=3), st.booleans())
@example([("--nproc-per-node", "1")], False)
@example([("--node-rank", "3"), ("--nnodes", "2")], True)
@example([("--rdzv-endpoint", "host:99999")], True)
def test_fuzzed_launcher_arguments(pairs: list[tuple[str, str]], dry_run: bool) -> None:
    """``distamp launch``: exit 2 with a usage error, or a command; the script missing.py does
    not exist, so only --dry-run may get past the checks."""
    argv = ["launch", *(f"{flag}={value}" for flag, value in pairs)]
    argv += ["--dry-run", "t.py"] if dry_run else ["missing.py"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(argv)
    if code == 2:
        assert "distamp launch: error: " in err.getvalue()
        event("usage error")
        return
    event("command printed")
    assert code == 0 and dry_run and out.getvalue().strip()
