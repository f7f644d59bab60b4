"""The main job end to end: real launchers, its JSON line, resume, and mixed-precision parity; its
parser's usage errors (fuzzed arguments, a comm hook the strategy cannot carry, an --out that
cannot be a directory), found before any process group.

Every run is a subprocess in its own session with a hard timeout; a hung run is killed with all
its ranks (the parser's tests call ``launch.train.parse`` in process). Runs are short (tens of
steps) so the whole file stays well under a minute and a half on two cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import free_port, launcher_free_env, run_ranks
from fuzz_scenarios import ARG_VALUES
from hypothesis import event, example, given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "launch" / "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
KEYS = {
    "final_loss", "steps", "skipped_steps", "loss_scale", "tokens_per_s",
    "world_size", "precision", "strategy",
}  # fmt: skip


def _run(cmd: list[str], timeout: float = 120) -> dict[str, Any]:
    """Run the main job (``cmd``); its summary. Without ``--out`` in ``cmd`` the run is kept in
    a scratch directory, not in the checkout's ``runs/``."""
    env = launcher_free_env()
    with tempfile.TemporaryDirectory() as scratch:
        if TRAIN in cmd and "--out" not in cmd and "--help" not in cmd:
            cmd = [*cmd, "--out", scratch]
        pipe = subprocess.PIPE
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\n{err[-3000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{err[-3000:]}"
    lines = out.strip().splitlines()
    assert lines, f"no stdout from {' '.join(cmd)}\n{err[-3000:]}"
    result = json.loads(lines[-1])
    assert result.keys() >= KEYS, result
    from launch.train import SUMMARY_FIELDS

    assert list(result) == list(SUMMARY_FIELDS), "every summary field is explained in --help"
    assert "metrics.jsonl go to" in err and "for inference: distamp export" in err, err[-2000:]
    return result


def _torchrun(*args: str) -> dict[str, Any]:
    return _run([*TORCHRUN, TRAIN, *args])


def test_torchrun_json_line_and_resume_is_bitwise(tmp_path: Path) -> None:
    common = ["--steps", "12", "--log-interval", "4", "--precision", "fp16"]
    whole = _torchrun(*common)
    assert whole["steps"] == 12 and whole["world_size"] == 2 and whole["strategy"] == "ddp"
    assert whole["precision"] == "fp16" and whole["loss_scale"] == 2.0**16
    assert whole["skipped_steps"] == 0 and whole["tokens_per_s"] > 0
    assert whole["final_loss"] < 5.0  # from ln(256) = 5.55
    assert whole["grad_bytes"] == 4 * _params()  # DDP's own fp32 all-reduce on 2 ranks

    ckpt = str(tmp_path / "ckpt")
    first = _torchrun(*common, "--out", ckpt, "--stop-at", "5")
    assert first["steps"] == 5 and (tmp_path / "ckpt" / "step_00000005").is_dir()
    second = _torchrun(*common, "--out", ckpt, "--resume")
    assert second["resumed_from"] == 5 and second["steps"] == 12
    for key in ("final_loss", "grad_norm", "loss_scale", "skipped_steps"):
        assert second[key] == whole[key], (key, second, whole)  # bitwise: exact equality
    lines = (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 5, 8, 12]


def test_mixed_precision_final_loss_within_2_percent_of_fp32() -> None:
    losses = {
        p: _torchrun("--steps", "40", "--log-interval", "20", "--precision", p)["final_loss"]
        for p in ("fp32", "bf16", "fp16")
    }
    for p in ("bf16", "fp16"):
        delta = abs(losses[p] - losses["fp32"]) / losses["fp32"]
        assert delta < 0.02, f"{p}: {losses[p]:.5f} vs fp32 {losses['fp32']:.5f} ({delta:.2%})"
        print(f"{p}: final loss {losses[p]:.5f} vs fp32 {losses['fp32']:.5f}: {delta:.4%}")


def test_single_process() -> None:
    result = _run(
        [sys.executable, TRAIN, "--steps", "3", "--log-interval", "1", "--precision", "bf16"]
    )
    assert result["world_size"] == 1 and result["strategy"] == "none" and result["steps"] == 3
    assert result["loss_scale"] == 1.0  # bf16: no loss scaling
    assert result["grad_bytes"] is None  # one process: nothing sent, nothing counted


def _params(size: str = "tiny") -> int:
    from launch.model import GPT, SIZES

    return sum(p.numel() for p in GPT(SIZES[size]).parameters())


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not on PATH")
def test_same_seed_same_loss_under_torchrun_and_mpirun() -> None:
    args = ["--steps", "10", "--log-interval", "5", "--precision", "bf16", "--seed", "3",
            "--comm-hook", "fp8"]  # fmt: skip
    mpirun = [
        "mpirun", "-np", "2", "--allow-run-as-root", "--oversubscribe",
        "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
    ]  # fmt: skip
    via_mpi = _run([*mpirun, sys.executable, TRAIN, *args])
    via_torchrun = _torchrun(*args)
    assert via_mpi["world_size"] == 2 and via_mpi["final_loss"] == via_torchrun["final_loss"]
    assert 0.25 <= via_mpi["grad_bytes"] / (4 * _params()) <= 0.3  # 8-bit, scales included


def test_help_explains_every_summary_field_and_where_outputs_go() -> None:
    from launch.train import SUMMARY_FIELDS

    out = subprocess.run(
        [sys.executable, TRAIN, "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "the run is kept in --out DIR, by default runs/<start time>" in out
    for field, meaning in SUMMARY_FIELDS.items():
        assert f"  {field}" in out and meaning in out.replace("\n", " "), field


def _medium_units(rank: int, world: int) -> tuple[list[int], list[int], int]:
    """The medium model as the engine wraps it: the DDP buckets its gradients travel in (first
    and second backward) and the number of FSDP2 units.

    The buckets are counted by a comm hook recording ``bucket.index()`` (DDP calls the hook once
    per bucket): with the default cap, DDP sends the first backward in one bucket and rebuilds
    its buckets from the order the gradients arrived in, so the second backward shows the
    buckets every later step uses."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from distamp import DistAMP
    from distamp.parallel.ddp import apply_ddp
    from launch.model import GPT, SIZES, lm_loss

    torch.manual_seed(0)
    ddp = apply_ddp(GPT(SIZES["medium"]), device=torch.device("cpu"))  # the default 25 MB cap
    seen: list[int] = []

    # Unannotated: DDP checks a hook's annotations against the real classes, and this file's
    # annotations are strings (``from __future__ import annotations``).
    def record(_state, bucket):  # type: ignore[no-untyped-def]
        seen.append(bucket.index())
        work = dist.all_reduce(bucket.buffer().div_(world), async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp.register_comm_hook(None, record)
    x = torch.randint(0, 256, (2, SIZES["medium"].context))
    buckets = []
    for _ in range(2):
        seen.clear()
        lm_loss(ddp, (x, x)).backward()
        buckets.append(sorted(set(seen)))
    torch.manual_seed(0)
    amp = DistAMP("fp16", strategy="fsdp2", device="cpu")
    amp.setup(GPT(SIZES["medium"]), lambda params: torch.optim.AdamW(params))
    units = sum(isinstance(m, FSDPModule) for m in amp.model.modules())
    amp.close()
    return buckets[0], buckets[1], units


def test_medium_size_spans_ddp_buckets_and_fsdp2_units() -> None:
    """``--size medium`` is the shape a comm hook, a sharding path or a checkpoint must meet:
    over 10M parameters, four or more DDP buckets at DDP's default cap, twelve or more FSDP2
    units. Measured on the objects the engine builds, on 2 gloo ranks."""
    params = _params("medium")
    first, later, units = run_ranks(_medium_units, 2, timeout=240)[0]
    print(f"medium: {params:,} parameters, DDP buckets {len(first)} then {len(later)}, "
          f"FSDP2 units {units}")  # fmt: skip
    assert params >= 10_000_000
    assert later == list(range(len(later))) and len(later) >= 4, later
    assert units >= 12 and units == 12 + 1, units  # each of model.blocks, and the root


def test_medium_size_trains_on_two_ranks() -> None:
    result = _torchrun("--size", "medium", "--steps", "2", "--batch-size", "2",
                       "--log-interval", "1")  # fmt: skip
    assert result["size"] == "medium" and result["steps"] == 2 and result["world_size"] == 2
    assert result["skipped_steps"] == 0 and result["final_loss"] < 5.6  # from ln(256) = 5.55
    assert result["grad_bytes"] == 4 * _params("medium")  # DDP's fp32 all-reduce, every bucket
    print(f"medium, fp16 DDP, 2 ranks, batch 2: {result['train_s'] / 2:.2f} s/step")


@pytest.mark.slow
def test_medium_size_trains_in_fp8_under_fsdp2() -> None:
    """Every Linear of the 12 blocks and the head in float8 (49 layers), bf16 autocast on the
    CPU, sharded in FSDP2's 13 units."""
    result = _torchrun("--size", "medium", "--precision", "fp8", "--strategy", "fsdp2",
                       "--steps", "2", "--batch-size", "1", "--log-interval", "1")  # fmt: skip
    assert result["fp8_layers"] == 4 * 12 + 1 and result["strategy"] == "fsdp2"
    assert result["steps"] == 2 and result["skipped_steps"] == 0
    assert result["final_loss"] < 5.6  # from ln(256) = 5.55
    assert result["grad_bytes"] == 2 * _params("medium")  # fp32 reduce-scatter, every unit
    print(f"medium, fp8 FSDP2, 2 ranks, batch 1: {result['train_s'] / 2:.2f} s/step")


def test_size_flag_parses_and_refuses_unknown_sizes() -> None:
    import contextlib
    import io

    from launch.model import SIZES, GPTConfig
    from launch.train import parse

    assert SIZES["tiny"] == GPTConfig() and parse([]).size == "tiny"  # the default run
    assert parse(["--size", "small"]).size == "small"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exc:
        parse(["--size", "huge"])
    assert exc.value.code == 2 and "argument --size: invalid choice: 'huge'" in stderr.getvalue()


def test_resume_with_another_size_is_a_usage_error(tmp_path: Path) -> None:
    """A checkpoint of one size does not fit another (other shapes): refused before anything
    loads, as a usage error (exit 2) that names --size, not a traceback."""
    ckpt = str(tmp_path / "ckpt")
    _run([sys.executable, TRAIN, "--steps", "1", "--precision", "bf16", "--out", ckpt])
    done = subprocess.run(
        [sys.executable, TRAIN, "--steps", "2", "--precision", "bf16", "--out", ckpt,
         "--resume", "--size", "small"],
        cwd=REPO, env=launcher_free_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: argument --resume:" in done.stderr and "--size small" in done.stderr
    assert "does not fit this model" in done.stderr and "Traceback" not in done.stderr
    assert not done.stdout.strip()


def test_activation_checkpointing_and_compile_train_to_the_same_loss() -> None:
    """The memory recipe on the main job (FSDP2, 2 ranks): every block checkpointed and
    compiled (aot_eager: the same graphs as inductor, compiled in seconds on a CPU) trains to
    the eager run's loss, bitwise: a recomputed forward computes exactly as the first one, and
    the precision policy lives in each block's own forward."""
    common = ["--strategy", "fsdp2", "--steps", "2", "--log-interval", "1"]
    eager = _torchrun(*common)
    recipe = _torchrun(*common, "--activation-checkpointing", "full", "--compile",
                       "--compile-backend", "aot_eager")  # fmt: skip
    assert eager["activation_checkpointing"] == "none" and eager["compile"] is None
    assert recipe["activation_checkpointing"] == "full" and recipe["compile"] == "aot_eager"
    assert recipe["strategy"] == "fsdp2" and recipe["steps"] == 2
    for key in ("final_loss", "grad_norm", "loss_scale", "skipped_steps", "grad_bytes"):
        assert recipe[key] == eager[key], (key, recipe, eager)  # bitwise: exact equality


def test_recipe_flags_parse_and_refuse_unknown_values() -> None:
    import contextlib
    import io

    from launch.train import parse

    plain = parse([])
    assert plain.activation_checkpointing == "none" and not plain.compile
    assert plain.compile_backend is None  # no --compile: eager
    for mode in ("none", "full", "selective"):
        assert parse(["--activation-checkpointing", mode]).activation_checkpointing == mode
    assert parse(["--compile"]).compile_backend == "inductor"  # the default backend
    assert parse(["--compile", "--compile-backend", "aot_eager"]).compile_backend == "aot_eager"
    refused = [  # (argv, the argument named, what the message says, the values it lists)
        (["--activation-checkpointing", "partial"], "--activation-checkpointing",
         "invalid choice: 'partial'", ("none", "full", "selective")),
        (["--compile", "--compile-backend", "eager"], "--compile-backend",
         "invalid choice: 'eager'", ("inductor", "aot_eager")),
        (["--compile-backend", "aot_eager"], "--compile-backend", "pass --compile too", ()),
    ]  # fmt: skip
    for argv, flag, why, allowed in refused:
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exc:
            parse(argv)
        message = stderr.getvalue().splitlines()[-1]
        assert exc.value.code == 2 and f"error: argument {flag}: " in message, message
        assert why in message and all(value in message for value in allowed), message


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_multi_rank_strategy_without_a_launcher_is_a_usage_error_with_the_command(
    strategy: str,
) -> None:
    """One plain process has no process group: a usage error (exit 2) that shows the
    ``distamp launch`` line starting the same run (the user's arguments kept), not the
    engine's traceback about init_distributed()."""
    argv = ["--strategy", strategy, "--steps", "5", "--data", "my play.txt"]
    clean = launcher_free_env()
    command = [sys.executable, "launch/train.py", *argv]
    done = subprocess.run(command, cwd=REPO, env=clean, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "init_distributed" not in done.stderr
    line = (
        f"distamp launch --nproc-per-node 2 launch/train.py --strategy {strategy} --steps 5 "
        "--data 'my play.txt'"  # quoted as a shell needs it
    )
    assert f"error: argument --strategy: {strategy} runs on 2 or more ranks" in done.stderr
    assert f"\n  {line}\n" in done.stderr, done.stderr
    assert not done.stdout.strip()


def test_export_to_onnx_in_bf16_is_a_usage_error_before_training() -> None:
    """ONNX Runtime cannot run a bf16 program: --export PATH.onnx with --precision bf16 (or fp8,
    exported in bf16) stops the parser, with the fix, instead of failing after training."""
    import contextlib
    import io

    from launch.train import parse

    for precision in ("bf16", "fp8"):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exc:
            parse(["--precision", precision, "--export", "m.onnx"])
        message = stderr.getvalue().splitlines()[-1]
        assert exc.value.code == 2 and "error: argument --export: 'm.onnx'" in message, message
        assert "pass 'm.pt2', or --precision fp16 or fp32 for ONNX" in message, message
    assert parse(["--precision", "fp16", "--export", "m.onnx"]).export == Path("m.onnx")


def test_a_run_without_out_is_kept_under_runs_and_says_how_to_export_it(tmp_path: Path) -> None:
    """No --out: the run goes to runs/<start time> under the working directory, and the end
    prints that path with the export and report commands, which work as printed."""
    clean = launcher_free_env()
    train = [
        sys.executable,
        TRAIN,
        "--steps",
        "2",
        "--precision",
        "bf16",
        "--telemetry-interval",
        "1",
    ]
    done = subprocess.run(
        train, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    rel = f"runs/{run.name}"
    assert {"latest.json", "model.json", "metrics.jsonl"} <= {p.name for p in run.iterdir()}
    assert f"metrics.jsonl go to {rel}" in done.stderr
    command = f"distamp export {rel} -o model.pt2"
    assert f"saved to {rel}; for inference: {command}" in done.stderr, done.stderr[-2000:]
    json.loads(done.stdout.strip().splitlines()[-1])  # the summary is still the last line
    export = [sys.executable, "-m", "distamp.cli", *command.split()[1:]]
    exported = subprocess.run(
        export, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=240
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (tmp_path / "model.pt2").is_file() and (tmp_path / "model.pt2.json").is_file()
    # ... and its precision is kept and drawn by the command it prints.
    assert len((run / "telemetry" / "rank0.jsonl").read_text().splitlines()) == 2
    report = f"distamp report {rel}"
    assert f"its precision, drawn: {report}" in done.stderr
    drawn = subprocess.run(
        [sys.executable, "-m", "distamp.cli", *report.split()[1:]],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert (run / "report.html").is_file()


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_pages_summary_example_has_the_fields_the_main_job_prints(page: str) -> None:
    """The summary a page shows has the fields, in order, of the one the main job prints (which
    _run checks against SUMMARY_FIELDS on every run)."""
    from launch.train import SUMMARY_FIELDS

    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    shown = json.loads(lines[lines.index("summary (fields: python launch/train.py --help):") + 1])
    assert list(shown) == list(SUMMARY_FIELDS), set(shown) ^ set(SUMMARY_FIELDS)


# ----------------------------------------------- the parser: usage errors before any process group
TRAIN_FLAGS = st.sampled_from(
    [
        "--steps",
        "--precision",
        "--strategy",
        "--grad-accum",
        "--max-grad-norm",
        "--seed",
        "--batch-size",
        "--lr",
        "--warmup",
        "--log-interval",
        "--checkpoint-interval",
        "--stop-at",
        "--threads",
        "--timeout",
        "--fp8-recipe",
        "--fp8-min-features",
        "--data",
        "--comm-hook",
        "--size",
    ]
)


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
