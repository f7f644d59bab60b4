"""The compatibility stage: distamp against the edges of its support windows.

The README's install takes torch 2.13.0 and the newest release of every framework, so the main
test run covers the top of each framework window (:data:`distamp.versions.WINDOWS`); these
sessions cover the rest, each in a fresh uv environment:

- ``floors``: torch pinned, distamp editable, one framework at its floor, that framework's
  integration tests;
- ``torch``: the oldest and the newest torch of :data:`distamp.versions.TORCH` (no framework),
  the core tests and the main job.

A release that stops working shows up as a red session naming the package and the release.

    nox -s floors                 # every window whose floor is older than its newest release
    nox -s "floors(package='lightning')"
    nox -s torch                  # the torch floor and the newest torch
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
# The CPU build where a local wheel directory serves it (as on the CI machines); without the
# constraint uv may resolve the CUDA build of the same release.
LOCAL_WHEELS = Path("/opt/wheels")
_EVERYWHERE = "tests/test_adaptive_everywhere.py::test_"  # adaptive precision per plug-in
TESTS = {
    "transformers": ["tests/test_transformers.py", f"{_EVERYWHERE}hugging_face_trainer"],
    "accelerate": ["tests/test_accelerate.py", f"{_EVERYWHERE}accelerate"],
    "lightning": [
        "tests/test_lightning.py",
        "tests/test_lightning_trainer.py",
        f"{_EVERYWHERE}fabric",
        f"{_EVERYWHERE}lightning_trainer",
    ],
    "torchao": [
        "tests/test_fp8.py",
        "tests/test_adaptive_fp8.py::test_adaptive_fp8_falls_back_to_bf16_and_matches_bf16",
    ],
    "ray": ["tests/test_ray.py"],
    "trl": ["tests/test_trl.py"],
    "torchft": ["tests/test_torchft.py"],
}
# Installed next to the framework: what the tests import besides it.
TEST_TOOLS = ["pytest>=7", "pytest-timeout>=2.1", "hypothesis>=6", "numpy>=1.22", "packaging>=22"]
# What runs on each torch of the window: the scaler, the engine, its checkpoints (read and
# resharded through torch.distributed.checkpoint) and the parallel layouts, with torch's own
# scaler tests swapped in (test_scaler_parity), and the internal names. The fuzzed argument
# tests do not depend on torch's version: they run in the main test run only.
TORCH_TESTS = [
    "tests/test_scaler.py",
    "tests/test_distributed_scaler.py",
    "tests/test_scaler_parity.py",
    "tests/test_clipping.py",
    "tests/test_engine.py",
    "tests/test_engine_core.py",
    "tests/test_checkpoint_load.py",
    "tests/test_optim.py",  # 16-bit weights: torch's functional Adam/SGD and bit casts
    "tests/test_nd_parallel.py",
    "tests/test_policy.py",
    "tests/test_checkpointed_functions.py",  # torch's checkpoint frames, read by torch_compat
    "tests/test_torch_compat.py",
    "tests/test_versions.py",
]
# The N-D meshes (4 ranks, the slowest file here) at the floor only: the oldest DeviceMesh,
# DTensor and FSDP2 the window supports is where they break first, and the main suite runs them
# on the pinned torch; the newest torch runs the rest, its private names included.
FLOOR_ONLY = ["tests/test_nd_parallel.py"]
# The floors run each framework's integration tests, less the step guards' 2-rank runs: they
# drive the same plug-in hooks the other tests there drive, and the main suite runs them with
# the newest framework (CI's time is bounded).
FLOORS_DESELECT = "not spike_on_one_rank and not consecutive_skips"
MAIN_JOB = ["distamp", "launch", "--nproc-per-node", "2", "launch/train.py", "--steps", "20"]
SHOW_VERSION = "import importlib.metadata as m; print('{package}', m.version('{package}'))"
REQUIREMENT = {"ray": "ray[train]"}  # the name to pin when the tests need an extra of it
# what the tests import next to the framework; trl's GRPO module imports requests undeclared
ALSO = {"transformers": ["accelerate"], "trl": ["requests"]}

nox.options.default_venv_backend = "uv"


def _versions() -> object:
    """distamp.versions, read without importing distamp (which imports torch)."""
    spec = importlib.util.spec_from_file_location("_windows", ROOT / "distamp" / "versions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def _windows() -> dict[str, object]:
    return dict(_versions().WINDOWS)  # type: ignore[attr-defined]


def _torch_edges() -> list[str]:
    window = _versions().TORCH  # type: ignore[attr-defined]
    return [window.floor, window.newest]


def _floors() -> list[str]:
    return [name for name, w in _windows().items() if w.floor != w.newest]  # type: ignore[attr-defined]


def _torch() -> list[str]:
    cpu = sorted(LOCAL_WHEELS.glob("torch-2.13.0+cpu-*.whl")) if LOCAL_WHEELS.is_dir() else []
    return [str(cpu[0])] if cpu else [TORCH]


@nox.session(python=None)  # the interpreter that runs nox
@nox.parametrize("package", _floors())
def floors(session: nox.Session, package: str) -> None:
    """The integration tests of ``package`` at the floor of its window."""
    window = _windows()[package]
    floor = f"{REQUIREMENT.get(package, package)}=={window.floor}"  # type: ignore[attr-defined]
    session.install(*_torch(), *TEST_TOOLS)
    session.install("--no-deps", "-e", str(ROOT))
    session.install(floor, *ALSO.get(package, []), *_torch())  # torch again: never another build
    session.run("python", "-c", SHOW_VERSION.format(package=package))
    session.run(
        "python",
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "-k",
        FLOORS_DESELECT,
        *TESTS[package],
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session(name="torch", python=None)
@nox.parametrize("release", _torch_edges())
def torch_window(session: nox.Session, release: str) -> None:
    """The core tests and the main job with torch ``release`` (the registry's build: run on the
    CPU here, so a CUDA build's extra libraries are downloaded but unused)."""
    session.install(f"torch=={release}", *TEST_TOOLS)
    session.install("--no-deps", "-e", str(ROOT))
    session.run("python", "-c", SHOW_VERSION.format(package="torch"))
    env = {"OMP_NUM_THREADS": "1"}
    floor = release == _torch_edges()[0]
    tests = [t for t in TORCH_TESTS if floor or t not in FLOOR_ONLY]
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, env=env)
    session.run(*MAIN_JOB, env=env)
