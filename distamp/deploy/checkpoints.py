"""Exporting from an engine checkpoint: the model rebuilt, its weights loaded, its decisions read.

An engine checkpoint (:mod:`distamp.engine.checkpoint`) holds tensors and the trainer's state
(the precision, the adaptive rules' change log), not the code that builds the model. The
training script records that once, next to the checkpoints, as ``DIR/model.json``
(:func:`record_model`; ``launch/train.py --out DIR`` does): an importable factory and its
keyword arguments, the training precision and policy options, and what the model takes as
input. :func:`export_checkpoint` (the ``distamp export`` command) then needs nothing else:

1. the target's needs are checked first (:func:`~distamp.deploy.targets.require_target`);
2. the model is built by the factory, and the checkpoint is checked against it (every entry
   and shape, as a resume checks) before its weights are read, in one process;
3. it is exported with the recorded policy and the checkpoint's adaptive promotions, with a
   dynamic batch, and saved with its precision record.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distamp.deploy.check import Tolerance
from distamp.deploy.export import annotate_record, export
from distamp.deploy.plan import adaptive_changes
from distamp.deploy.targets import require_runnable, require_target, save
from distamp.engine.checkpoint import MANIFEST, CheckpointError, latest_checkpoint
from distamp.engine.checkpoint_layout import refuse_foreign
from distamp.precision.policy import AutocastPolicy

__all__ = [
    "MODEL_SPEC",
    "InputSpec",
    "ModelSpec",
    "export_checkpoint",
    "load_model",
    "record_model",
]

MODEL_SPEC = "model.json"
"""The name of the model's description in a checkpoint directory."""
SPEC_FORMAT = 1

_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One positional input of the model: its shape (``None`` for the batch dimension), its
    dtype, and for integers the range of values (token ids: ``[0, vocab)``)."""

    shape: tuple[int | None, ...]
    dtype: str = "float32"
    low: int = 0
    high: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"InputSpec(dtype={self.dtype!r}): one of {sorted(_DTYPES)}")

    def sample(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """A random input of this spec with the batch dimension ``batch``."""
        shape = [batch if s is None else s for s in self.shape]
        dtype = _DTYPES[self.dtype]
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator, dtype=dtype)
        high = self.high if self.high is not None else self.low + 2
        return torch.randint(self.low, high, shape, generator=generator, dtype=dtype)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """How to rebuild a trained model and what it takes (``DIR/model.json``).

    Attributes:
        factory: ``"package.module:callable"``, importable where the export runs; called with
            ``kwargs`` it returns the untrained model.
        kwargs: the factory's keyword arguments (JSON values).
        precision: the training precision.
        policy: keyword arguments of the training :class:`~distamp.AutocastPolicy` (JSON
            values: name patterns for ``fp32_modules``, fp8 options); ``None``: the run had no
            policy, and the default policy of its precision is exported.
        inputs: the forward's positional inputs.
        source: a directory to import ``factory`` from when it is not importable as is (the
            training script's checkout).
    """

    factory: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    precision: str
    policy: Mapping[str, Any] | None = None
    inputs: tuple[InputSpec, ...]
    source: str | None = None

    def build(self) -> nn.Module:
        """Import the factory and build the model.

        Raises:
            CheckpointError: the factory cannot be imported, or is not a module factory.
        """
        module_name, _, attr = self.factory.partition(":")
        module = None
        for root in (None, self.source, os.getcwd()):
            if root is not None and root not in sys.path:
                sys.path.insert(0, root)  # where the training script said its model lives
            try:
                module = importlib.import_module(module_name)
                break
            except ModuleNotFoundError:
                continue
        make = getattr(module, attr, None) if module is not None else None
        if not callable(make):
            raise CheckpointError(
                f"cannot import the model's factory {self.factory!r} ({MODEL_SPEC}): run from "
                f"the directory it was trained from, or add it to PYTHONPATH"
            )
        model = make(**self.kwargs)
        if not isinstance(model, nn.Module):
            raise CheckpointError(f"{self.factory}(**{dict(self.kwargs)}) did not return a module")
        return model

    def policy_for(self, precision: str) -> AutocastPolicy:
        """The training policy (the default one of ``precision`` when none was recorded, or
        when the checkpoint's precision differs from the recorded one)."""
        if self.policy is None or precision != self.precision:
            return AutocastPolicy(precision)
        return AutocastPolicy(precision, **self.policy)

    def example_inputs(self, batch: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """Random inputs of the recorded specs (deterministic for a seed)."""
        generator = torch.Generator().manual_seed(seed)
        return tuple(spec.sample(batch, generator) for spec in self.inputs)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["inputs"] = [{**asdict(s), "shape": list(s.shape)} for s in self.inputs]
        return {"format": SPEC_FORMAT, **data}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        if data.get("format") != SPEC_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this distamp reads {SPEC_FORMAT}")
        inputs = tuple(InputSpec(**{**i, "shape": tuple(i["shape"])}) for i in data["inputs"])
        fields = {k: data[k] for k in ("factory", "precision") if k in data}
        return cls(
            **fields,
            kwargs=dict(data.get("kwargs") or {}),
            policy=data.get("policy"),
            inputs=inputs,
            source=data.get("source"),
        )


def record_model(directory: str | os.PathLike[str], spec: ModelSpec) -> Path:
    """Write ``spec`` to ``DIR/model.json`` (atomically: a temporary file renamed), so that
    ``distamp export DIR`` can rebuild the model. Call it once, on one rank.

    Raises:
        ValueError: ``kwargs`` or ``policy`` hold values JSON cannot write.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    try:
        text = json.dumps(spec.to_dict(), indent=2) + "\n"
    except TypeError as exc:
        raise ValueError(
            f"ModelSpec: the factory's kwargs and the policy must be JSON: {exc}"
        ) from None
    tmp = root / f".{MODEL_SPEC}.tmp"
    tmp.write_text(text)
    os.replace(tmp, root / MODEL_SPEC)
    return root / MODEL_SPEC


def _read_spec(root: Path) -> ModelSpec:
    path = root / MODEL_SPEC
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: the checkpoint does not say how to rebuild its model. "
            "launch/train.py writes it with --out DIR; from your own script call "
            "distamp.deploy.record_model(DIR, ModelSpec(...)), or export in Python with "
            "distamp.export(model, example_inputs)"
        )
    try:
        return ModelSpec.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a model description distamp wrote: {exc}") from exc


def _latest(root: Path) -> Path:
    """The checkpoint to export; a path that is not a run directory is named for what it is
    (missing, a file, one step of a run: pass its parent), not as a run without a manifest."""
    path = latest_checkpoint(root)
    if path is None and not root.exists():
        raise CheckpointError(
            f"{root} does not exist: pass the directory a training run saved to "
            "(launch/train.py prints it: runs/<start time>, or its --out DIR)"
        )
    if path is None:
        refuse_foreign(root)  # a file, a step directory, a bare DCP directory
        raise CheckpointError(
            f"{root} holds no checkpoint ({MANIFEST} is missing): pass the directory a training "
            "run saved to (launch/train.py --out DIR, or DistAMP.save_state(DIR))"
        )
    return path


def _load_weights(root: Path, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    """Check the latest checkpoint of ``root`` against ``model`` (entries and shapes), then
    read its model tensors into it; returns the trainer state. One process, no optimizer."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    path = _latest(root)
    try:
        trainer = torch.load(path / "trainer.pt", weights_only=True)
        saved = FileSystemReader(str(path / "state")).read_metadata().state_dict_metadata
    except Exception as exc:  # missing, truncated or corrupted files
        raise CheckpointError(f"checkpoint {path} is unreadable: {exc}") from exc
    theirs = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    mine = model.state_dict()
    problems = [
        f"{len(s)} {what} ({', '.join(sorted(s)[:4])})"
        for what, s in (
            ("entries the model lacks", set(theirs) - set(mine)),
            ("model entries missing from the checkpoint", set(mine) - set(theirs)),
        )
        if s
    ]
    sizes: dict[str, tuple[int, ...] | None] = {
        k: tuple(v.size) if hasattr(v, "size") else None for k, v in theirs.items()
    }  # None: not a tensor
    problems += [
        f"{k}: shape {sizes[k]} in the checkpoint, {tuple(mine[k].shape)} here"
        for k in sorted(set(theirs) & set(mine))
        if sizes[k] is not None and sizes[k] != tuple(mine[k].shape)
    ]
    if problems:
        built = f"{spec.factory}(**{dict(spec.kwargs)})"
        raise CheckpointError(
            f"checkpoint {path} does not fit the model {built} that {MODEL_SPEC} describes: "
            f"{'; '.join(problems[:4])}. It was saved from another model: fix {root / MODEL_SPEC} "
            "(the factory's kwargs, e.g. the --size it was trained with) or export the "
            "checkpoint its description belongs to"
        )
    state = dict(mine)
    with warnings.catch_warnings():  # one process on purpose: DCP's warning says it assumes so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        dcp_load({"model": state}, checkpoint_id=path / "state", no_dist=True)
    model.load_state_dict(state)
    trainer = dict(trainer)
    trainer["checkpoint"] = str(path)
    return trainer


def load_model(directory: str | os.PathLike[str]) -> tuple[nn.Module, ModelSpec, dict[str, Any]]:
    """The trained model of a checkpoint directory, in fp32 and eval mode: built from its
    ``model.json``, weights from the latest checkpoint; with the spec and the trainer state.

    Raises:
        CheckpointError: no checkpoint or no ``model.json`` there, an unreadable file, a
            checkpoint of another model (the entries that differ are named).
    """
    root = Path(directory)
    _latest(root)  # a directory with no checkpoint is named as such first
    spec = _read_spec(root)
    model = spec.build()
    trainer = _load_weights(root, model, spec)
    return model.eval(), spec, trainer


def export_checkpoint(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    target: str = "pt2",
    check: int = 0,
    auto_islands: bool = False,
    tolerance: Tolerance | None = None,
    max_batch: int = 1024,
    seed: int = 0,
    precision: str | None = None,
) -> Path:
    """Export the latest checkpoint of ``directory`` to ``output`` (``distamp export``).

    The policy is the recorded one (or the default policy of the checkpoint's precision), the
    promotions are the checkpoint's adaptive changes, the batch is dynamic (1 to
    ``max_batch``).

    Args:
        check: compare with the fp32 model on this many random inputs of the recorded specs
            (0: no check); see :func:`distamp.export`.
        auto_islands, tolerance: as :func:`distamp.export`'s.
        seed: of the random example and check inputs.
        precision: export in this precision instead of the trained one (``"fp32"`` always
            holds; ``"fp16"`` for a target without bf16 kernels, with ``check``); its
            default policy, with the checkpoint's adaptive promotions.

    Returns:
        The file written (its precision record is ``output + ".json"``).

    Raises:
        CheckpointError: see :func:`load_model`. And the refusals of
            :func:`~distamp.deploy.targets.require_target` (first),
            :func:`~distamp.deploy.targets.require_runnable` (before exporting) and
            :func:`distamp.export`.
    """
    require_target(target)
    model, spec, trainer = load_model(directory)
    policy = spec.policy_for(precision or str(trainer.get("precision") or spec.precision))
    require_runnable(target, policy.compute_dtype or torch.float32)
    program = export(
        model,
        spec.example_inputs(1, seed),
        policy=policy,
        promotions=adaptive_changes(trainer),
        dynamic_shapes="batch",
        max_batch=max_batch,
        check=spec.example_inputs(check, seed + 1) if check else None,
        auto_islands=auto_islands,
        tolerance=tolerance,
    )
    annotate_record(
        program,
        checkpoint=trainer["checkpoint"],
        step=trainer.get("step"),
        factory=spec.factory,
        kwargs=dict(spec.kwargs),
    )
    return save(program, output, target=target)
