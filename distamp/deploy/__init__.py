"""Deployment: a trained model exported for inference in the precision it was trained with.

:func:`export` turns the model into a ``torch.export`` program whose graph holds the trained
precision as explicit casts (fp32 islands, adaptive promotions, float8 Linears as bf16), with an
optional numerical check against the fp32 model; :func:`save` writes it for a target (``.pt2``,
AOTInductor, ONNX, ExecuTorch) with its precision record next to it. From an engine checkpoint:
:func:`export_checkpoint` (the ``distamp export`` command); after training with the engine,
``distamp.export(amp, example_inputs)``. Nothing below this package imports it: deploy reads the
engine and its checkpoints, never the other way round.
"""

from distamp.deploy.check import CheckReport, Divergence, ExportCheckError, OutputCheck, Tolerance
from distamp.deploy.checkpoints import (
    MODEL_SPEC,
    InputSpec,
    ModelSpec,
    export_checkpoint,
    load_model,
    record_model,
)
from distamp.deploy.export import export, export_engine, precision_record
from distamp.deploy.plan import ModuleDecision, PrecisionPlan
from distamp.deploy.targets import (
    RECORD_FILE,
    TARGETS,
    read_record,
    require_runnable,
    require_target,
    save,
)

__all__ = [
    "MODEL_SPEC",
    "RECORD_FILE",
    "TARGETS",
    "CheckReport",
    "Divergence",
    "ExportCheckError",
    "InputSpec",
    "ModelSpec",
    "ModuleDecision",
    "OutputCheck",
    "PrecisionPlan",
    "Tolerance",
    "export",
    "export_checkpoint",
    "export_engine",
    "load_model",
    "precision_record",
    "read_record",
    "record_model",
    "require_runnable",
    "require_target",
    "save",
]
