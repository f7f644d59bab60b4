"""Where an exported program goes: one file per target, each checked to load and run.

- ``"pt2"``: a ``torch.export.save`` archive, loaded by ``torch.export.load`` (Python, torch
  alone): serving from Python, and the input of the other targets;
- ``"aoti"``: an AOTInductor package (compiled C++ in a ``.pt2``), loaded by
  ``torch._inductor.aoti_load_package`` from Python or C++: the lowest latency from torch;
- ``"onnx"``: an ONNX model for ONNX Runtime (or TensorRT, OpenVINO...): runtimes outside torch;
- ``"pte"``: an ExecuTorch program (XNNPACK delegate) for ExecuTorch's runtime: phones and
  embedded CPUs.

Each target but ``"pt2"`` needs something torch does not bring: a C++ compiler (``"aoti"``), or
the packages of an extra of ``pyproject.toml`` (``distamp[onnx]``, ``distamp[edge]``), whose
verified releases are windows of :mod:`distamp.versions`. :func:`require_target` refuses a
target whose needs are missing, with the install command, before anything is exported.

Every file gets the precision record (:func:`~distamp.deploy.export.precision_record`) next to
it as ``FILE.json``; a ``.pt2`` also carries it inside (``torch.export.load(path,
extra_files={"distamp_precision.json": ""})``). After writing, :func:`save` loads the file with
its runtime, runs it on the program's example inputs and records the largest difference from
the ``.pt2`` program's outputs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from distamp.deploy.edge import write_pte
from distamp.deploy.export import precision_record
from distamp.torch_compat import aoti_compile_and_package, aoti_load_package
from distamp.versions import check_version

__all__ = [
    "RECORD_FILE",
    "TARGETS",
    "read_record",
    "require_runnable",
    "require_target",
    "save",
]

TARGETS: tuple[str, ...] = ("pt2", "aoti", "onnx", "pte")
"""The targets :func:`save` writes (see the module docstring)."""

RECORD_FILE = "distamp_precision.json"
"""The precision record's name inside a ``.pt2`` archive (``extra_files``)."""

# What a target's runtime cannot compute, with why: found when the file is loaded back, after
# it is written and with a runtime's traceback, unless refused before.
_NO_KERNELS: dict[str, dict[torch.dtype, str]] = {
    "onnx": {
        torch.bfloat16: "ONNX Runtime's CPU provider has no bf16 kernel for the graph's "
        "additions (Add), so a bf16 program does not load there",
    },
}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_PACKAGES = {"onnx": ("onnx", "onnxscript", "onnxruntime"), "pte": ("executorch",)}
_CXX = ("g++", "c++", "clang++")


def require_target(target: str) -> None:
    """Refuse ``target`` when what it needs is missing; changes nothing.

    Raises:
        ValueError: an unknown target (the message lists them).
        ImportError: the target's extra is not installed, or outside its verified window: the
            message names the package and the install command (``pip install -e ".[onnx]"``).
        RuntimeError: ``"aoti"`` without a C++ compiler on ``PATH`` (the install command).
    """
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not one of {TARGETS}")
    if target == "aoti":
        found = [c for c in ((os.environ.get("CXX") or "").split()[:1] + list(_CXX)) if c]
        if not any(shutil.which(c) for c in found):
            raise RuntimeError(
                "target 'aoti' compiles the program to C++ and needs a C++ compiler (g++ or "
                "clang++) on PATH; none was found. Install one (Debian/Ubuntu: apt-get install "
                "-y g++), or export with target='pt2'"
            )
    for package in _PACKAGES.get(target, ()):
        try:
            check_version(package)
        except ImportError as exc:
            note = (
                " (ExecuTorch ships native libraries built against one torch release: "
                "executorch 1.5.1 runs with torch 2.13)"
                if target == "pte"
                else ""
            )
            raise ImportError(f"target {target!r} needs {package}: {exc}{note}") from None


def require_runnable(target: str, dtype: torch.dtype) -> None:
    """Refuse ``target`` for a program that computes in ``dtype`` when the target's runtime has
    no kernels for it; changes nothing.

    Raises:
        ValueError: ``"onnx"`` and bf16 (also fp8 training, exported in bf16); the message
            names the runtime's gap and the fix: another target, or fp16/fp32 for ONNX.
    """
    why = _NO_KERNELS.get(target, {}).get(dtype)
    if why is not None:
        raise ValueError(
            f"target {target!r} cannot run a {_SHORT.get(dtype, str(dtype))} program: {why}. "
            "Export it for 'pt2' or 'aoti' (distamp export ... --target pt2), which run bf16, "
            "or in fp16 or fp32 for ONNX (distamp export ... --precision fp16 --target onnx; "
            "distamp.export(..., policy='fp16'))"
        )


def _dtypes(program: torch.export.ExportedProgram) -> set[torch.dtype]:
    """Every dtype a value of ``program``'s graph has (its parameters, inputs and the results
    of its casts): what its runtime must compute in."""
    found = set()
    for node in program.graph.nodes:
        for value in _outputs(node.meta.get("val")):
            found.add(value.dtype)
    return found


def _outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _outputs(v)]
    return []


def _max_diff(got: Any, want: Any) -> float:
    pairs = zip(_outputs(got), _outputs(want), strict=True)
    return max((float((a.float() - b.float()).abs().max()) for a, b in pairs), default=0.0)


def _args(program: torch.export.ExportedProgram) -> tuple[Any, ...]:
    example = program.example_inputs
    if example is None:
        raise ValueError("the program holds no example inputs: export it with distamp.export")
    return tuple(example[0])


def _write_onnx(program: torch.export.ExportedProgram, path: Path) -> dict[str, Any]:
    import onnxruntime

    args = _args(program)
    onnx_program = torch.onnx.export(program, args, dynamo=True, verbose=False)
    assert onnx_program is not None  # dynamo=True always returns the program
    onnx_program.save(str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    feed = {n: a.numpy() for n, a in zip(names, tensors, strict=True)}
    got = [torch.from_numpy(o) for o in session.run(None, feed)]
    return {
        "runtime": f"onnxruntime {onnxruntime.__version__} (CPUExecutionProvider)",
        "max_abs_vs_pt2": _max_diff(got, program.module()(*args)),
    }


def _write_pte(program: torch.export.ExportedProgram, path: Path) -> dict[str, Any]:
    args = _args(program)
    got = write_pte(program, path, args)
    return {
        "runtime": f"executorch {check_version('executorch')} (XNNPACK delegate, portable "
        "kernels for the rest)",
        "max_abs_vs_pt2": _max_diff(got, program.module()(*args)),
    }


def _write_aoti(program: torch.export.ExportedProgram, path: Path) -> dict[str, Any]:
    args = _args(program)
    aoti_compile_and_package(program, str(path))
    runner = aoti_load_package(str(path))
    return {
        "runtime": f"AOTInductor (torch {torch.__version__})",
        "max_abs_vs_pt2": _max_diff(runner(*args), program.module()(*args)),
    }


def save(
    program: torch.export.ExportedProgram, path: str | os.PathLike[str], *, target: str = "pt2"
) -> Path:
    """Write ``program`` for ``target`` to ``path``, and its precision record to
    ``path + ".json"``; every target but ``"pt2"`` is loaded back with its runtime and run on
    the program's example inputs (the difference from the program is recorded).

    Args:
        program: an ``ExportedProgram``, from :func:`distamp.export` (others are written without
            a precision record).
        path: the file to write (its directory is created).
        target: one of :data:`TARGETS`.

    Returns:
        The path written.

    Raises:
        ValueError, ImportError, RuntimeError: :func:`require_target`'s and
            :func:`require_runnable`'s refusals, and an AOTInductor package not named
            ``*.pt2``; before anything is written.
    """
    require_target(target)
    for dtype in sorted(_dtypes(program), key=str):
        require_runnable(target, dtype)
    path = Path(path)
    if target == "aoti" and path.suffix != ".pt2":
        raise ValueError(
            f"target 'aoti' writes an AOTInductor package, which torch names *.pt2: got "
            f"{str(path)!r}; pass e.g. {str(path.with_suffix('.pt2'))!r}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    record = precision_record(program) or {}
    record["target"] = target
    try:
        with torch.no_grad():
            if target == "pt2":
                torch.export.save(program, path, extra_files={RECORD_FILE: json.dumps(record)})
            elif target == "aoti":
                record["runtime_check"] = _write_aoti(program, path)
            elif target == "onnx":
                record["runtime_check"] = _write_onnx(program, path)
            else:
                record["runtime_check"] = _write_pte(program, path)
    except BaseException:
        # A file its runtime failed to load or run is no deliverable: nothing is left that
        # lacks its record.
        path.unlink(missing_ok=True)
        raise
    path.with_name(path.name + ".json").write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The precision record written next to ``path`` by :func:`save` (``path + ".json"``).

    Raises:
        FileNotFoundError: no record there (the file was not written by :func:`save`).
    """
    sidecar = Path(path).with_name(Path(path).name + ".json")
    if not sidecar.is_file():
        raise FileNotFoundError(
            f"{sidecar} does not exist: {path} was not written by distamp.deploy.save"
        )
    record: dict[str, Any] = json.loads(sidecar.read_text())
    return record
