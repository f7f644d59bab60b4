"""Every torch-internal name distamp uses, in one module.

distamp builds on a few torch names that are not public API: the multi-tensor ops torch's own
``GradScaler`` and ``clip_grad_norm_`` run on (``torch._foreach_norm``,
``torch._amp_foreach_non_finite_check_and_unscale_``, ``torch._amp_update_scale_``), the grouping
helper they bucket tensors with, the ``GradScaler`` members :class:`DistributedGradScaler`
overrides (and the scale tensor, read without a host sync), the base class of pipeline stages,
FSDP1's hybrid replica group, DTensor's local tensor, the hook tables of ``nn.Module`` (emptied
on a copy made for export), AOTInductor's entry points, the storage of a sparse gradient; and
the one private name each of torchft (the Manager's process group), torchao (the float8
weight wrapper's tensor and precomputed scale) and Accelerate (its mark on a prepared model)
keeps with no public accessor; and the attributes under which torch's module wrappers
(``CheckpointWrapper``, ``torch.compile``'s ``OptimizedModule``, FSDP1, DDP) hold the module they
wrap, whose names show up in every qualified name below them. Private names move between
releases without notice, so they are read here and only here: a rename shows up as one failing
check (:func:`missing_internals`, run by ``tests/test_torch_compat.py`` on the floor, the pinned
and the newest torch of
:data:`distamp.versions.TORCH`) instead of an ``AttributeError`` in the middle of a run.

Each name was checked on every torch release of that window.
"""

from __future__ import annotations

import importlib
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "GRAD_SCALER_MEMBERS",
    "OptState",
    "TorchDispatchMode",
    "amp_unscale_",
    "amp_update_scale_",
    "aoti_compile_and_package",
    "aoti_load_package",
    "clear_module_hooks",
    "accelerate_prepared",
    "dtensor_local",
    "float8_plain_weight",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "fsdp1_replica_group",
    "grad_scaler_scale",
    "group_by_device_and_dtype",
    "in_recomputation",
    "is_state_materialisation",
    "compiled_backward_without_autocast",
    "is_pipeline_stage",
    "wrapped_attribute",
    "mark_optimizer_stepped",
    "takes_step_hooks",
    "checkpoint_recomputation",
    "missing_internals",
    "scaled_mm",
    "set_float8_scale",
    "sparse_values",
    "takes_grad_scale",
    "torchft_manager_group",
]

# The multi-tensor kernels behind torch's GradScaler and clip_grad_norm_ (no public aliases).
foreach_norm = torch._foreach_norm
"""``torch._foreach_norm(tensors, ord, dtype=None)``: one norm per tensor, one launch per group."""
foreach_mul_ = torch._foreach_mul_
"""``torch._foreach_mul_(tensors, scalar_or_tensor)``: in-place multiply of every tensor."""
foreach_copy_ = torch._foreach_copy_
"""``torch._foreach_copy_(dst, src)``: copy every source into its destination in one launch per
group (the 8-bit exchange's packing and unpacking of a bucket's gradients)."""
amp_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
"""``(tensors, found_inf, inv_scale)``: multiply by ``inv_scale`` and set ``found_inf`` to 1
where a value is not finite: torch's ``GradScaler.unscale_`` kernel."""
amp_update_scale_ = torch._amp_update_scale_
"""``(scale, growth_tracker, found_inf, growth, backoff, interval)``: torch's scale update."""
scaled_mm = torch._scaled_mm
"""The float8 GEMM torchao's float8 training calls."""

GRAD_SCALER_MEMBERS: tuple[str, ...] = (
    # methods DistributedGradScaler overrides or calls through super()
    "_lazy_init_scale_growth_tracker",
    "_check_scale_growth_tracker",
    "_unscale_grads_",
    "_check_inf_per_device",
    "_found_inf_per_device",
    # state torch's __init__ assigns and its public methods read
    "_per_optimizer_states",
    "_scale",
    "_growth_tracker",
    "_enabled",
    "_device",
    "_init_scale",
    "_init_growth_tracker",
    "_growth_factor",
    "_backoff_factor",
    "_growth_interval",
)
"""The members of ``torch.amp.GradScaler`` that :class:`DistributedGradScaler` relies on: it
subclasses torch's scaler so that every public method keeps torch's behaviour and signature."""

_OPT_STATES = ("READY", "UNSCALED", "STEPPED")


def group_by_device_and_dtype(
    tensors: list[torch.Tensor],
) -> dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]]:
    """``tensors`` bucketed by (device, dtype), each bucket with the tensors' indices in the
    input: the grouping torch's own foreach-based ``GradScaler`` uses (one C++ pass)."""
    grouped = torch._C._group_tensors_by_device_and_dtype([tensors], True)  # type: ignore[list-item]
    return {key: (lists[0], indices) for key, (lists, indices) in grouped.items()}  # type: ignore[misc]


def in_recomputation() -> bool:
    """Whether a module's forward runs again inside a backward pass: activation checkpointing
    (reentrant, non-reentrant, selective) recomputing it. Monitors then skip their work, so that
    a forward is counted once. torch says so only through the current graph task's id (-1
    outside any backward). Under ``torch.compile`` a recomputation is inside the compiled
    backward graph, where no Python hook runs: the check is never traced."""
    if torch.compiler.is_compiling():
        return False
    return bool(torch._C._current_graph_task_id() != -1)


def compiled_backward_without_autocast() -> AbstractContextManager[Any]:
    """While open, a graph ``torch.compile`` builds traces its backward with autocast off, as
    eager autograd runs it (the training step leaves autocast before ``backward()``). torch's
    default traces the backward under the forward's autocast, so an fp32 island's backward
    matmuls would be cast to the low dtype (pytorch issues 153044, 179804): a promoted layer's
    weight gradient overflows fp16 in the compiled program only. One config of AOTAutograd,
    read when the graph is traced (checked on torch 2.11-2.13)."""
    config = importlib.import_module("torch._functorch.config")
    return config.patch(backward_pass_autocast="off")  # type: ignore[no-any-return]


def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's ``step`` takes ``grad_scale``/``found_inf`` (torch's
    ``fused=True`` optimizers): torch marks them with a private attribute."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def takes_step_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer`` runs step pre-hooks: torch's ``Optimizer.__init__`` makes the
    private hook table, which an optimizer-like wrapper that subclasses ``Optimizer`` without
    calling it (torchft's ``OptimizerWrapper``) lacks (checked on torch 2.11-2.15)."""
    return hasattr(optimizer, "_optimizer_step_pre_hooks")


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell an LR scheduler built over ``optimizer`` that its step ran, when another object
    stepped its parameters in its place (distamp.optim's master-weight optimizer, which shares
    its parameter groups): torch's schedulers patch ``step`` to set this private flag, and warn
    "Detected call of `lr_scheduler.step()` before `optimizer.step()`" without it (checked on
    torch 2.11-2.13)."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def is_state_materialisation(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether an ``optimizer.step`` call about to run is torch's materialisation of a fresh
    optimizer's state for ``torch.distributed.checkpoint`` (``get_state_dict`` and friends
    build the state entries to save or load into by stepping once): no state yet, every
    learning rate set to zero, and the call ``step(closure=None)`` exactly. Such a step moves
    no parameter, so the engine's refusal of steps outside it lets it through (checked on
    torch 2.11-2.13, ``torch.distributed.checkpoint.state_dict._init_optim_state``)."""
    rest = args[1:] if args and args[0] is optimizer else args  # a step hook sees the self
    if rest or kwargs != {"closure": None} or optimizer.state:
        return False
    # A tensor learning rate is torch's own zero on the CPU: no device is read.
    return all(float(group.get("lr", 0.0)) == 0.0 for group in optimizer.param_groups)


def checkpoint_recomputation(frame: Any) -> tuple[Any, str] | None:
    """Where ``torch.utils.checkpoint`` keeps the callable its backward runs again, read from
    one of its own Python frames around the first run of a checkpointed function:
    ``(holder, attribute)``, or ``None`` when ``frame`` is not such a frame.

    Non-reentrant and selective checkpointing: the ``checkpoint`` function's frame holds the
    suspended generator ``gen`` whose ``new_frame`` (a ``_CheckpointFrame``) keeps
    ``recompute_fn`` (torch 2.15: the generator is in ``_checkpoint_impl``, which ``checkpoint``
    calls); reentrant checkpointing: ``CheckpointFunction.forward``'s ``ctx`` keeps
    ``run_function``. Checked on torch 2.11-2.15. Reaching the public ``checkpoint`` frame with
    neither found means a release moved them.

    Raises:
        RuntimeError: ``frame`` is torch's checkpoint but the callable is not where it was (a
            torch release that moved it): the caller then cannot carry anything across.
    """
    code = frame.f_code
    if code.co_filename != _CHECKPOINT_FILE:
        return None
    local = frame.f_locals
    gen = local.get("gen")  # non-reentrant: in `checkpoint` (2.11-2.13), `_checkpoint_impl` (2.15)
    if gen is not None:
        held = getattr(getattr(gen, "gi_frame", None), "f_locals", {}).get("new_frame")
        if held is not None and callable(getattr(held, "recompute_fn", None)):
            return held, "recompute_fn"
    else:
        ctx = local.get("ctx")  # reentrant: CheckpointFunction.forward
        if code.co_name == "forward" and callable(getattr(ctx, "run_function", None)):
            return ctx, "run_function"
        if code.co_name != "checkpoint":
            return None  # a frame of torch's in between: the public entry is further out
    raise RuntimeError(
        f"torch {torch.__version__}: torch.utils.checkpoint no longer keeps the function it "
        "recomputes where torch 2.11-2.15 did"
    )


_CHECKPOINT_FILE = importlib.import_module("torch.utils.checkpoint").__file__


def is_pipeline_stage(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.pipelining`` stage (it holds ``submod``): every
    stage class derives from a private base."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # pragma: no cover - torch builds without pipelining
        return False
    return isinstance(obj, _PipelineStageBase)


def grad_scaler_scale(scaler: Any) -> torch.Tensor | None:
    """A ``torch.amp.GradScaler``'s current scale as its device tensor (``None`` before its
    first ``scale()``), read without a host sync.

    torch offers only ``get_scale()``, which returns a Python float (``.item()``: a wait on the
    device); the tensor itself is the private ``_scale`` (in :data:`GRAD_SCALER_MEMBERS`). Only
    read, never written; any scaler keeping its scale there (torch's ``ShardedGradScaler``) is
    read the same way.
    """
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def fsdp1_replica_group(module: Any) -> Any:
    """The group over which an FSDP1 module with a hybrid strategy replicates its shards
    (``None`` for the other strategies).

    FSDP1 keeps its hybrid strategies and that group in private names (the ZeRO-2 hybrid is
    ``ShardingStrategy._HYBRID_SHARD_ZERO2``, the group ``_inter_node_pg``) with no public
    accessor; the ranks cannot be derived from the world layout, since a user may pass their
    own ``(intra, inter)`` groups.
    """
    from torch.distributed.fsdp import ShardingStrategy

    hybrid = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if getattr(module, "sharding_strategy", None) not in hybrid:
        return None
    return module._inter_node_pg


def torchft_manager_group(manager: Any) -> Any:
    """The process group a torchft ``Manager`` was built with (``pg=``), reconfigured by it for
    every quorum; ``None`` if this torchft keeps it elsewhere.

    torchft 0.2 offers the group's all-reduce (``Manager.allreduce``) but no accessor for the
    group itself, which an exchange of shards (all-to-all, all-gather) needs; it keeps it in
    ``Manager._pg``. Checked on the torchft releases of :data:`distamp.versions.WINDOWS`
    (``tests/test_torchft.py``)."""
    group = getattr(manager, "_pg", None)
    return group if hasattr(group, "alltoall_base") else None


def dtensor_local(weight: Any) -> Any:
    """The local tensor object a DTensor parameter holds (``None`` for a plain tensor).

    ``DTensor.to_local()`` returns a fresh view for a Parameter; code that must change the very
    object FSDP2 all-gathers from (a tensor subclass's attributes) reads the private slot."""
    return getattr(weight, "_local_tensor", None)


def sparse_values(grad: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse COO tensor, coalesced or not.

    The public ``values()`` refuses an uncoalesced tensor, and coalescing a gradient only to
    check and unscale its values would add a sort and a copy; ``_values()`` is the storage
    itself (what torch's own ``GradScaler.unscale_`` reads for sparse gradients)."""
    return grad._values()


def float8_plain_weight(tensor: Any) -> Any:
    """The high-precision tensor inside torchao's ``WeightWithDynamicFloat8CastTensor`` (the
    tensor itself when it is not one): torchao keeps it in ``_tensor``, with no accessor.

    Checked with the torchao releases of :data:`distamp.versions.WINDOWS`
    (``tests/test_fp8_nd.py``)."""
    return getattr(tensor, "_tensor", tensor)


def set_float8_scale(tensor: Any, scale: torch.Tensor) -> None:
    """Set the scale FSDP2's next pre-all-gather cast of torchao's
    ``WeightWithDynamicFloat8CastTensor`` uses (its ``_precomputed_scale``): torchao's own
    ``precompute_float8_dynamic_scale_for_fsdp`` sets it the same way, and has no public
    setter."""
    tensor._precomputed_scale = scale


def accelerate_prepared(model: Any) -> bool:
    """Whether Accelerate's ``prepare`` already wrapped ``model`` (its ``forward`` then runs under
    Accelerate's autocast): Accelerate marks it with ``_is_accelerate_prepared`` and offers no
    public test."""
    return bool(getattr(model, "_is_accelerate_prepared", False))


# The per-module hook tables of ``nn.Module``: torch removes a hook through the handle its
# ``register_*`` call returned, and offers no call that drops them all.
_MODULE_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def clear_module_hooks(module: Any) -> None:
    """Drop every hook registered on ``module`` itself (not its children).

    A copy of a trained model made for export (``copy.deepcopy``) carries the live model's hooks
    (policy regions, the numeric monitor, the non-finite tracer), and they would call back into
    the training run's objects; their handles belong to the original, so only the tables can be
    emptied."""
    for table in _MODULE_HOOK_TABLES:
        hooks = getattr(module, table, None)
        if hooks is not None:
            hooks.clear()


def aoti_compile_and_package(program: Any, package_path: str) -> str:
    """AOTInductor: compile an ``ExportedProgram`` to a shared library packaged as a ``.pt2``
    file. torch documents the entry point under ``torch._inductor`` (no public alias)."""
    inductor = importlib.import_module("torch._inductor")
    return str(inductor.aoti_compile_and_package(program, package_path=package_path))


def aoti_load_package(path: str) -> Any:
    """Load an AOTInductor package (:func:`aoti_compile_and_package`): a callable that takes the
    program's inputs and returns its outputs."""
    return importlib.import_module("torch._inductor").aoti_load_package(path)


# The attribute under which each of torch's module wrappers holds the module it wraps. The
# first three are private to torch (``_CHECKPOINT_WRAPPED_MODULE`` of checkpoint_wrapper,
# ``OptimizedModule.__init__``'s ``self._orig_mod``, ``_common_utils.FSDP_WRAPPED_MODULE``);
# DDP's ``module`` is public. torchft's DDP subclasses torch's and adds no part of its own.
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"
COMPILED_WRAPPED = "_orig_mod"
FSDP1_WRAPPED = "_fsdp_wrapped_module"
WRAPPER_PARTS: frozenset[str] = frozenset({CHECKPOINT_WRAPPED, COMPILED_WRAPPED, FSDP1_WRAPPED})
"""The name parts only torch's wrappers add (no model names its own modules so)."""


def wrapped_attribute(module: Any) -> str | None:
    """The attribute under which ``module``, one of torch's module wrappers, holds the module it
    wraps (``"module"`` for DDP and ``DataParallel``); ``None`` for any other module.

    The wrappers' classes are looked up only where their modules are already imported: a model
    cannot hold a wrapper whose class was never loaded (and importing ``torch._dynamo`` costs
    seconds).
    """
    import sys

    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, (DistributedDataParallel, DataParallel)):
        return "module"
    kinds = (
        ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"),
        ("torch._dynamo.eval_frame", "OptimizedModule"),
        ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"),
    )
    for (where, kind), attribute in zip(
        kinds, (CHECKPOINT_WRAPPED, COMPILED_WRAPPED, FSDP1_WRAPPED), strict=True
    ):
        cls = getattr(sys.modules.get(where), kind, None)
        if cls is not None and isinstance(module, cls):
            return attribute
    return None


def missing_internals() -> list[str]:
    """The internal names above that the running torch lacks (empty: this torch is usable).

    Cheap (no kernels run); ``tests/test_torch_compat.py`` asserts it is empty on each torch of
    the window, and the error of a failing release names what moved.
    """
    missing: list[str] = []
    scaler = GradScaler("cpu")  # enabled: torch assigns its state only then
    missing += [f"torch.amp.GradScaler.{n}" for n in GRAD_SCALER_MEMBERS if not hasattr(scaler, n)]
    missing += [f"OptState.{n}" for n in _OPT_STATES if not hasattr(OptState, n)]
    module = torch.nn.Module()
    missing += [f"torch.nn.Module.{t}" for t in _MODULE_HOOK_TABLES if not hasattr(module, t)]
    inductor = importlib.import_module("torch._inductor")
    if not hasattr(torch, "_foreach_copy_"):
        missing.append("torch._foreach_copy_")
    if not hasattr(torch.Tensor, "_values"):
        missing.append("torch.Tensor._values")
    aoti = ("aoti_compile_and_package", "aoti_load_package")
    missing += [f"torch._inductor.{n}" for n in aoti if not hasattr(inductor, n)]
    if not hasattr(importlib.import_module("torch._functorch.config"), "backward_pass_autocast"):
        missing.append("torch._functorch.config.backward_pass_autocast")
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper
    from torch.distributed.fsdp import _common_utils

    if getattr(checkpoint_wrapper, "_CHECKPOINT_WRAPPED_MODULE", None) != CHECKPOINT_WRAPPED:
        missing.append("checkpoint_wrapper._CHECKPOINT_WRAPPED_MODULE")
    if not hasattr(checkpoint_wrapper, "ActivationWrapper"):
        missing.append("checkpoint_wrapper.ActivationWrapper")
    if getattr(_common_utils, "FSDP_WRAPPED_MODULE", None) != FSDP1_WRAPPED:
        missing.append("torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE")
    compiled = torch.compile(torch.nn.Identity(), backend="eager")
    if getattr(compiled, COMPILED_WRAPPED, None) is None:
        missing.append(f"OptimizedModule.{COMPILED_WRAPPED}")
    if not hasattr(torch._C, "_current_graph_task_id"):
        missing.append("torch._C._current_graph_task_id")
    if not hasattr(torch._C, "_group_tensors_by_device_and_dtype"):
        missing.append("torch._C._group_tensors_by_device_and_dtype")
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase  # noqa: F401
    except ImportError:
        missing.append("torch.distributed.pipelining.stage._PipelineStageBase")
    from torch.distributed.fsdp import ShardingStrategy

    if not hasattr(ShardingStrategy, "_HYBRID_SHARD_ZERO2"):
        missing.append("torch.distributed.fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2")
    return missing
