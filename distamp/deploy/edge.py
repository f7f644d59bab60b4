"""ExecuTorch (the ``"pte"`` target): every name of it distamp uses, in one module.

The program is lowered with the XNNPACK partitioner (the CPU delegate ExecuTorch ships: the
linears, convolutions and elementwise ops it supports run there, the rest on the portable
kernels), written as a ``.pte`` file, loaded back with ExecuTorch's runtime and run once.

One private name: ``EdgeCompileConfig(_check_ir_validity=False)``. With the check on,
executorch 1.5.1's edge lowering turns a dynamic batch into the traced example's batch in any
model that calls ``Tensor.split`` (the main job's attention does; measured on torch 2.13: the
``.pte`` then refused batch 1 after tracing with 2). The check verifies that the graph holds
core ATen ops only; the programs distamp exports are traced by ``torch.export`` and hold
nothing else, and the emitter still refuses an op it cannot run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["write_pte"]


def write_pte(program: torch.export.ExportedProgram, path: Path, args: tuple[Any, ...]) -> Any:
    """Lower ``program`` to an ExecuTorch program at ``path``; return its outputs on ``args``
    as run by ExecuTorch's runtime (loaded back from the file)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    edge = to_edge_transform_and_lower(
        program,
        partitioner=[XnnpackPartitioner()],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),  # see the module docstring
    )
    path.write_bytes(edge.to_executorch().buffer)
    method = Runtime.get().load_program(str(path)).load_method("forward")
    if method is None:
        raise RuntimeError(f"ExecuTorch could not load the method 'forward' of {path}")
    # ExecuTorch takes contiguous (or channels-last) tensors only.
    plain = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in args]
    return list(method.execute(plain))
