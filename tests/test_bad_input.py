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
from pathlib import Path

import pytest
from fuzz_scenarios import ARG_VALUES
from hypothesis import event, example, given
from hypothesis import strategies as st

# -------------------------------------------------------------------- launcher and environment


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
