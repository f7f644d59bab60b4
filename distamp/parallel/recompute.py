"""The large-model memory recipe: activation checkpointing and ``torch.compile`` per block.

Both are applied to the user's model before :meth:`distamp.DistAMP.setup` (or before
``fully_shard`` in a model parallelised by hand), in torchtitan's order: checkpointing first, then
compile, then sharding. Each acts on the model's repeated blocks, the entries of its
``nn.ModuleList`` (the same units FSDP2 shards: :func:`distamp.parallel.fsdp.repeated_blocks`).

- :func:`apply_activation_checkpointing`: ``"full"`` wraps every block in torch's
  ``checkpoint_wrapper`` (non-reentrant: the form torch recommends, which composes with FSDP2 and
  compile); ``"selective"`` checkpoints every block with
  ``create_selective_checkpoint_contexts``, saving the output of every other matmul and
  recomputing the rest (torchtitan's "selective op" mode: about half the recompute of "full" for
  a part of its memory saving).
- :func:`compile_blocks`: ``Module.compile`` on each block, in place (no wrapper module, so FSDP2
  shards the block itself and parameter names stay).

The precision policy needs nothing from either: it lives in each module's own forward
(:mod:`distamp.precision.regions`), so a forward recomputed in backward computes exactly as the
first one, and a compiled block shares one graph with every other block.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["AC_MODES", "ACMode", "apply_activation_checkpointing", "compile_blocks"]

ACMode = Literal["none", "full", "selective"]
AC_MODES: tuple[str, ...] = ("none", "full", "selective")

_MATMULS = frozenset(
    op
    for op in (
        getattr(torch.ops.aten, "mm", None),
        getattr(torch.ops.aten, "addmm", None),
        getattr(torch.ops.aten, "bmm", None),
        getattr(torch.ops.aten, "_scaled_mm", None),
    )
    if op is not None
)


def _every_other_matmul() -> Any:
    """A selective-checkpointing policy function: the outputs of the 1st, 3rd, ... matmul of a
    block are saved, every other op recomputed. One counter per forward and one per recompute,
    so both make the same choices (torch requires it)."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMULS or getattr(op, "overloadpacket", None) in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _block_lists(model: nn.Module, what: str) -> list[nn.ModuleList]:
    """The outermost ``nn.ModuleList`` containers of ``model``: their entries are its blocks
    (as :func:`~distamp.parallel.fsdp.repeated_blocks` finds them)."""
    lists: list[nn.ModuleList] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) not in inside and isinstance(module, nn.ModuleList):
            lists.append(module)
            inside.update(id(m) for m in module.modules())
    if not any(len(blocks) for blocks in lists):
        raise ValueError(
            f"{what}: {type(model).__name__} has no nn.ModuleList of blocks to apply it to; "
            "keep the repeated blocks in one (model.blocks = nn.ModuleList(...)), or wrap your "
            "blocks yourself with torch.utils.checkpoint / Module.compile"
        )
    return lists


def apply_activation_checkpointing(model: nn.Module, mode: ACMode | str = "full") -> nn.Module:
    """Checkpoint every repeated block of ``model`` in place (see the module doc).

    Args:
        model: the model, before :meth:`~distamp.DistAMP.setup` (and before ``fully_shard``).
        mode: ``"none"`` (nothing), ``"full"`` or ``"selective"``.

    Returns:
        ``model`` itself; each block is replaced by torch's ``CheckpointWrapper`` around it
        (its parameters keep their names in ``state_dict``). A block already wrapped is left
        as it is.

    Raises:
        ValueError: an unknown ``mode``, or a model without an ``nn.ModuleList`` of blocks.
    """
    if mode not in AC_MODES:
        raise ValueError(f"mode={mode!r}: activation checkpointing is one of {AC_MODES}")
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        checkpoint_wrapper,
    )

    for blocks in _block_lists(model, f"activation checkpointing {mode!r}"):
        for i, block in enumerate(blocks):
            if isinstance(block, CheckpointWrapper):
                continue
            kwargs: dict[str, Any] = {}
            if mode == "selective":  # a policy function per block: its counters are its own
                policy = _every_other_matmul()
                kwargs["context_fn"] = functools.partial(
                    create_selective_checkpoint_contexts, policy
                )
            blocks[i] = checkpoint_wrapper(block, **kwargs)
    return model


def compile_blocks(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``Module.compile(**compile_kwargs)`` on every repeated block of ``model``, in place (the
    checkpoint wrapper, when there is one, is compiled with its block: compile then traces the
    recomputation into the block's backward graph).

    Returns:
        ``model`` itself.

    Raises:
        ValueError: a model without an ``nn.ModuleList`` of blocks.
    """
    for blocks in _block_lists(model, "compile_blocks"):
        for block in blocks:
            block.compile(**compile_kwargs)
    return model
