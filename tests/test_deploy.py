"""Deployment: the trained precision exported as explicit casts in a torch.export program.

The main job's model trained by the engine with an adaptive promotion: the exported graph computes
the promoted module and the policy's norms in fp32 and the rest in fp16 (read from the graph's
node dtypes), matches eager autocast, serves batch 1 and 32, and its ``.pt2`` runs in a process
that cannot import distamp. A model whose activations overflow fp16: the plain export gives
inf/NaN, the check refuses naming the layer, ``auto_islands`` promotes it. Targets (ONNX,
AOTInductor, ExecuTorch) where installed; refusals with their fixes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import distamp
from distamp import AdaptiveRules, AutocastPolicy, DistAMP
from distamp.cli import main as cli_main
from distamp.deploy import (
    MODEL_SPEC,
    ExportCheckError,
    InputSpec,
    ModelSpec,
    Tolerance,
    export_checkpoint,
    export_engine,
    precision_record,
    read_record,
    record_model,
    require_runnable,
    require_target,
    save,
)
from distamp.engine.checkpoint import CheckpointError
from distamp.precision.regions import Region
from launch.model import SIZES, ShardedText, build, lm_loss, load_text

ROOT = Path(__file__).resolve().parents[1]
PROMOTED = "blocks.1.fc"  # the module the adaptive rules promote in the engine fixture
NORMS = {"blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln_f"}
# Exported fp16 vs the engine's eager autocast on the main job's tiny model: 5e-4 of the logits'
# scale measured (the residual stream is fp16 in the program, fp32 under autocast); stated: 1%.
MATCH_AUTOCAST = 0.01
LINEAR_OPS = {
    torch.ops.aten.linear.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.mm.default,
}


def _spec() -> ModelSpec:
    cfg = SIZES["tiny"]
    return ModelSpec(
        factory="launch.model:build",
        kwargs={"size": "tiny"},
        precision="fp16",
        inputs=(InputSpec(shape=(None, cfg.context), dtype="int64", high=cfg.vocab_size),),
        source=str(ROOT),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The main job's tiny model, 3 fp16 steps through the engine with adaptive rules that
    promote one module; its checkpoint (with model.json) and its exported program."""
    torch.manual_seed(0)
    rules = AdaptiveRules(
        interval=1, patience=1, headroom_limit=1e-6, demote_below=0.0, watch=[PROMOTED]
    )
    policy = AutocastPolicy("fp16", adaptive=rules)
    amp = DistAMP(precision="fp16", strategy="none", policy=policy, device="cpu")
    model, _ = amp.setup(build("tiny"), lambda p: torch.optim.AdamW(p, lr=1e-3))
    data = ShardedText(load_text(), context=64, batch_size=4, rank=0, world_size=1, seed=0)
    for k in range(3):
        with amp.autocast():
            loss = lm_loss(model, data.batch(k))
        amp.backward_and_step(loss)
    assert amp.adaptive is not None and amp.adaptive.adaptive is not None
    assert amp.adaptive.adaptive.promoted == (PROMOTED,)
    ckpt = tmp_path_factory.mktemp("deploy") / "ckpt"
    amp.save_state(ckpt)
    record_model(ckpt, _spec())
    program = distamp.export(
        amp, data.batch(0)[0][:1], dynamic_shapes="batch", check=data.batch(9)[0]
    )
    yield {"amp": amp, "model": model, "data": data, "program": program, "ckpt": ckpt}
    amp.close()


def _module_of(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack.values())[-1][0]) if stack else ""


def _inside(name: str, islands: set[str]) -> bool:
    return any(name == i or name.startswith(i + ".") for i in islands)


def _linear_dtypes(program: torch.export.ExportedProgram) -> dict[str, torch.dtype]:
    return {
        _module_of(n): n.meta["val"].dtype
        for n in program.graph.nodes
        if n.op == "call_function" and n.target in LINEAR_OPS
    }


def test_graph_computes_islands_in_fp32_and_the_rest_in_fp16(trained: dict[str, Any]) -> None:
    program = trained["program"]
    record = precision_record(program)
    assert record is not None
    fp32 = {m["module"]: m["source"] for m in record["modules"] if m["dtype"] == "float32"}
    assert fp32 == {**dict.fromkeys(NORMS, "policy"), PROMOTED: "adaptive"}
    linears = _linear_dtypes(program)
    assert len(linears) == 9  # qkv, proj, fc, out per block, and the head
    for module, dtype in linears.items():
        assert dtype == (torch.float32 if module == PROMOTED else torch.float16), module
    norms = {
        _module_of(n): n.meta["val"].dtype
        for n in program.graph.nodes
        if n.op == "call_function" and "layer_norm" in str(n.target)
    }
    assert norms == dict.fromkeys(NORMS, torch.float32)
    # the promoted module's parameters are stored in fp32, the others in fp16
    state = program.state_dict
    assert state[f"{PROMOTED}.weight"].dtype == torch.float32
    assert state["blocks.1.out.weight"].dtype == torch.float16
    assert record["check"]["passed"] and record["check"]["outputs"][0]["top1"] >= 0.9


def test_program_matches_eager_autocast_at_batch_1_and_32(trained: dict[str, Any]) -> None:
    amp, model, program = trained["amp"], trained["model"], trained["program"]
    for batch in (1, 32):  # one export (dynamic batch) serves both
        x = torch.randint(0, 256, (batch, 64), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            with amp.autocast():
                ref = model(x).float()
            out = program.module()(x)
        assert out.shape == (batch, 64, 256) and out.dtype == torch.float32
        assert float((out - ref).abs().max()) <= MATCH_AUTOCAST * float(ref.abs().max())


def test_pt2_runs_in_a_process_that_never_imports_distamp(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    path = save(trained["program"], tmp_path / "gpt.pt2")
    script = f"""
import importlib.abc, json, sys
class NoDistamp(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "distamp":
            raise ImportError("distamp must not be imported here")
sys.meta_path.insert(0, NoDistamp())
sys.path = [p for p in sys.path if p not in ("", ".", {str(ROOT)!r})]  # not the checkout
import torch
extra = {{"distamp_precision.json": ""}}
program = torch.export.load({str(path)!r}, extra_files=extra)
shapes = [list(program.module()(torch.randint(0, 256, (b, 64))).shape) for b in (1, 32)]
dtypes = sorted({{str(n.meta["val"].dtype) for n in program.graph.nodes
                 if n.op == "call_function" and "linear" in str(n.target)}})
assert "distamp" not in sys.modules
print(json.dumps({{"shapes": shapes, "dtypes": dtypes,
                  "precision": json.loads(extra["distamp_precision.json"])["precision"]}}))
"""
    done = subprocess.run(
        [sys.executable, "-I", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "shapes": [[1, 64, 256], [32, 64, 256]],
        "dtypes": ["torch.float16", "torch.float32"],
        "precision": "fp16",
    }
    assert read_record(path)["modules"] == precision_record(trained["program"])["modules"]


def test_cli_exports_the_checkpoint_with_its_promotion(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pt2"
    assert cli_main(["export", str(trained["ckpt"]), "-o", str(out), "--check", "8"]) == 0
    printed = capsys.readouterr().out
    assert f"{PROMOTED}: float32 (adaptive: promoted at step 1" in printed
    assert "top-1 agreement" in printed
    record = read_record(out)
    assert record["step"] == 3 and record["check"]["passed"]
    program = torch.export.load(out)
    # the same weights and decisions as the live model's export
    x = trained["data"].batch(4)[0]
    same = program.module()(x) - trained["program"].module()(x)
    assert float(same.abs().max()) == 0.0
    assert _linear_dtypes(program)[PROMOTED] == torch.float32


def test_onnx_agrees_with_the_pt2_program(trained: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    pytest.importorskip("onnxscript", reason="the onnx extra is not installed")
    import onnxruntime

    path = save(trained["program"], tmp_path / "gpt.onnx", target="onnx")
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 5):
        x = torch.randint(0, 256, (batch, 64), generator=torch.Generator().manual_seed(batch))
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
        want = trained["program"].module()(x)
        assert got.shape == want.shape
        assert float((got - want).abs().max()) <= 0.01 * float(want.abs().max())
    assert read_record(path)["runtime_check"]["runtime"].startswith("onnxruntime")


def test_onnx_of_a_bf16_program_is_refused_before_anything_is_written(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ONNX Runtime's CPU provider has no bf16 Add: refused up front in one line naming the fix,
    rather than a runtime traceback after model.onnx was written."""
    refusal = r"target 'onnx' cannot run a bf16 program.*Add.*--target pt2.*--precision fp16"
    with pytest.raises(ValueError, match=refusal):
        require_runnable("onnx", torch.bfloat16)
    require_runnable("onnx", torch.float16)
    require_runnable("pt2", torch.bfloat16)
    pytest.importorskip("onnxruntime", reason="the onnx extra is not installed")
    pytest.importorskip("onnxscript", reason="the onnx extra is not installed")
    x = trained["data"].batch(0)[0][:2]
    with pytest.raises(ValueError, match="cannot run a bf16 program"):
        bf16 = distamp.export(trained["model"], (x,), policy="bf16")
        save(bf16, tmp_path / "a.onnx", target="onnx")
    out = tmp_path / "model.onnx"
    argv = ["export", str(trained["ckpt"]), "-o", str(out), "--target", "onnx"]
    assert cli_main([*argv, "--precision", "bf16"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert err.startswith("distamp export: error: target 'onnx' cannot run a bf16 program"), err
    assert list(tmp_path.iterdir()) == []  # neither model.onnx nor a record


def test_export_names_a_missing_path_and_the_run_of_a_step_directory(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = trained["ckpt"]
    step = next(ckpt.glob("step_*"))
    cases = {
        tmp_path / "no_such_run": f"{tmp_path / 'no_such_run'} does not exist",
        step: f"{step} is one step of a checkpoint directory, not the directory itself: pass "
        f"its parent {ckpt}",
    }
    for path, message in cases.items():
        assert cli_main(["export", str(path), "-o", str(tmp_path / "m.pt2")]) == 1
        err = capsys.readouterr().err
        assert message in err and "latest.json is missing" not in err, err
    assert not (tmp_path / "m.pt2").exists()


class Overflow(nn.Module):
    """A layer whose activations (~1e5) overflow fp16's 65504, then a LayerNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.big = nn.Linear(16, 64), nn.Linear(64, 64)
        self.norm, self.head = nn.LayerNorm(64), nn.Linear(64, 10)
        with torch.no_grad():
            self.big.weight.mul_(30000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.big(torch.relu(self.inp(x)))))


@pytest.fixture(scope="module")
def overflow() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Overflow()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * 4
    with torch.no_grad():
        assert float(model.big(torch.relu(model.inp(x))).abs().max()) > 65504
    return model, x


def test_overflowing_layer_refused_by_the_check_then_promoted(
    overflow: tuple[nn.Module, torch.Tensor],
) -> None:
    model, x = overflow
    plain = distamp.export(model, (x,), policy="fp16")
    assert not torch.isfinite(plain.module()(x)).all()  # what an unchecked fp16 export gives
    with pytest.raises(ExportCheckError, match=r"'big' \(Linear\).*inf/NaN in fp16") as refused:
        distamp.export(model, (x,), policy="fp16", check=x)
    assert refused.value.divergence is not None and refused.value.divergence.module == "big"
    assert "auto_islands=True" in str(refused.value)
    program = distamp.export(model, (x,), policy="fp16", check=x, auto_islands=True)
    assert torch.isfinite(program.module()(x)).all()
    record = precision_record(program)
    assert record is not None
    promoted = [m for m in record["modules"] if m["source"] == "auto_islands"]
    assert [m["module"] for m in promoted] == ["big"]
    assert "round 1" in promoted[0]["reason"] and "65504" in promoted[0]["reason"]
    assert _linear_dtypes(program) == {
        "inp": torch.float16,
        "big": torch.float32,
        "head": torch.float16,
    }
    assert record["check"]["passed"] and record["check"]["auto_island_rounds"] == 1


def test_a_tight_tolerance_with_no_rounds_left_is_refused(
    overflow: tuple[nn.Module, torch.Tensor],
) -> None:
    model, x = overflow
    with pytest.raises(ExportCheckError, match="export check failed"):
        distamp.export(
            model, (x,), policy="fp16", check=x, auto_islands=True, max_rounds=0,
            tolerance=Tolerance(max_rel=1e-9),
        )  # fmt: skip


def test_inputs_of_the_wrong_dtype_or_shape_are_refused_with_the_fix(
    trained: dict[str, Any],
) -> None:
    model = trained["model"]
    tokens = torch.randint(0, 256, (2, 64))
    with pytest.raises(ValueError, match=r"example_inputs do not fit GPT.*forward raised"):
        distamp.export(model, (tokens.float(),), policy="fp16")
    with pytest.raises(ValueError, match=r"check= input 0 has dtype torch.float32.*\(B, 64\)"):
        distamp.export(model, (tokens,), policy="fp16", dynamic_shapes="batch",
                       check=tokens.float())  # fmt: skip
    with pytest.raises(ValueError, match=r"shape \(2, 32\).*int64 inputs of shape \(B, 64\)"):
        distamp.export(model, (tokens,), policy="fp16", dynamic_shapes="batch",
                       check=tokens[:, :32])  # fmt: skip
    with pytest.raises(TypeError, match="a tensor or a tuple"):
        distamp.export(model, {"idx": tokens}, policy="fp16")
    with pytest.raises(ValueError, match="dynamic_shapes='rows'"):
        distamp.export(model, (tokens,), policy="fp16", dynamic_shapes="rows")


def test_a_checkpoint_of_another_model_is_refused(trained: dict[str, Any], tmp_path: Path) -> None:
    ckpt = trained["ckpt"]
    spec = json.loads((ckpt / MODEL_SPEC).read_text())
    other = tmp_path / "other"
    other.mkdir()
    for entry in ckpt.iterdir():  # the same checkpoint, described as the small model
        (other / entry.name).symlink_to(entry)
    (other / MODEL_SPEC).unlink()
    (other / MODEL_SPEC).write_text(json.dumps({**spec, "kwargs": {"size": "small"}}))
    with pytest.raises(CheckpointError, match=r"does not fit the model .*size': 'small'.*saved "
                       r"from another model"):  # fmt: skip
        export_checkpoint(other, tmp_path / "x.pt2")
    assert not (tmp_path / "x.pt2").exists()
    (other / MODEL_SPEC).unlink()
    with pytest.raises(CheckpointError, match="does not say how to rebuild its model"):
        export_checkpoint(other, tmp_path / "x.pt2")
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "x.pt2")


def test_a_target_whose_extra_is_missing_is_refused_with_the_install_command(
    trained: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.metadata

    import distamp.deploy.targets
    import distamp.versions

    real = importlib.metadata.version

    def missing(package: str) -> str:
        if package in ("executorch", "onnxruntime"):
            raise importlib.metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(distamp.versions, "version", missing)
    with pytest.raises(ImportError, match=r'executorch.*pip install -e "\.\[edge\]".*torch 2\.13'):
        save(trained["program"], tmp_path / "m.pte", target="pte")
    with pytest.raises(ImportError, match=r'onnxruntime.*pip install -e "\.\[onnx\]"'):
        require_target("onnx")
    assert not (tmp_path / "m.pte").exists()
    assert cli_main(["export", str(trained["ckpt"]), "-o", str(tmp_path / "m.onnx"),
                     "--target", "onnx"]) == 1  # fmt: skip
    monkeypatch.setattr(distamp.deploy.targets.shutil, "which", lambda _name: None)
    with pytest.raises(RuntimeError, match=r"C\+\+ compiler.*apt-get install -y g\+\+"):
        require_target("aoti")
    with pytest.raises(ValueError, match="target='tflite' is not one of"):
        require_target("tflite")


def test_the_model_itself_is_not_changed_by_export(trained: dict[str, Any]) -> None:
    model = trained["model"]
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    fc = dict(model.named_modules())[PROMOTED]
    assert Region(fc).promoted  # the live promotion is still in place


def _fp32_modules(program: torch.export.ExportedProgram) -> set[str]:
    record = precision_record(program)
    assert record is not None
    return {m["module"] for m in record["modules"] if m["dtype"] == "float32"}


def test_an_engine_exports_with_its_own_policy_and_promotions_unless_given(
    trained: dict[str, Any],
) -> None:
    amp, x = trained["amp"], trained["data"].batch(0)[0][:1]
    assert _fp32_modules(trained["program"]) == {*NORMS, PROMOTED}  # distamp.export(amp, ...)
    assert _fp32_modules(export_engine(amp, x)) == {*NORMS, PROMOTED}  # the same entry
    assert _fp32_modules(distamp.export(amp, x, promotions=())) == NORMS  # given: replaces


def test_an_engine_whose_strategy_shards_the_model_is_refused_with_the_fix() -> None:
    engine: Any = SimpleNamespace(
        strategy="fsdp2", model=nn.Linear(2, 2), precision="bf16", config=None, adaptive=None
    )
    with pytest.raises(ValueError, match=r"no rank holds the whole model.*distamp export DIR"):
        distamp.export(engine, torch.ones(1, 2))


def test_train_py_exports_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "gpt.pt2"
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), "--steps", "2", "--precision", "bf16",
         "--out", str(tmp_path / "ck"), "--export", str(out)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"exported to {out}" in done.stderr
    record = read_record(out)
    assert record["precision"] == "bf16" and record["dynamic_batch"] == {"min": 1, "max": 1024}
    assert json.loads((tmp_path / "ck" / MODEL_SPEC).read_text())["kwargs"] == {"size": "tiny"}
    program = torch.export.load(out)
    assert set(_linear_dtypes(program).values()) == {torch.bfloat16}


@pytest.mark.slow
def test_aoti_and_executorch_run_the_promoted_program(
    overflow: tuple[nn.Module, torch.Tensor], tmp_path: Path
) -> None:
    """AOTInductor compiles C++ (~15-30 s on 2 cores) and ExecuTorch lowers (~15 s): the small
    model only."""
    model, x = overflow
    program = distamp.export(model, (x,), policy="fp16", check=x, auto_islands=True,
                             dynamic_shapes="batch", max_batch=64)  # fmt: skip
    targets = []
    try:
        require_target("aoti")
        targets.append(("aoti", "m_aoti.pt2"))
    except RuntimeError:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            require_target("pte")
        targets.append(("pte", "m.pte"))
    except ImportError:
        pass
    if not targets:
        pytest.skip("neither a C++ compiler nor executorch here")
    for target, name in targets:
        path = save(program, tmp_path / name, target=target)
        check = read_record(path)["runtime_check"]
        assert check["max_abs_vs_pt2"] <= 1e-2, (target, check)
    if any(t == "pte" for t, _ in targets):
        from executorch.runtime import Runtime

        method = Runtime.get().load_program(str(tmp_path / "m.pte")).load_method("forward")
        assert method is not None
        for batch in (1, 32):  # the dynamic batch survives the lowering
            xb = torch.randn(batch, 16)
            got = method.execute([xb])[0]
            assert torch.allclose(got, program.module()(xb), atol=1e-2, rtol=1e-2)
