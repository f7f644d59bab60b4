"""The policy's fp32 ops in a checkpointed *function*, recomputed as they first ran.

Activation checkpointing runs a checkpointed callable a second time inside the backward.
torch restores autocast around that recomputation (reentrant, non-reentrant and selective
alike), but not a ``TorchFunctionMode``, and the autograd engine runs without the caller's
function modes. A *module*'s forward re-enters the policy's ops by itself
(:mod:`distamp.precision.regions`), so a checkpointed block computes as before. A checkpointed
function (a method other than ``forward``, a closure, a ``functools.partial``, a lambda) that
calls an fp32 op directly, an attention softmax outside any submodule, would be recomputed in
the low dtype: torch's ``CheckpointError`` from inside the backward (non-reentrant), or a
silently different gradient (reentrant).

So the first time the policy's ops act inside a checkpointed function, :func:`carry_ops` finds
torch's checkpoint frame on the Python stack (before any module forward that would re-enter
the ops on its own) and wraps the callable that checkpoint keeps for the recomputation, so that
it runs inside the same ops: the recomputation then computes what the forward computed, bit
for bit. The frames are read through :func:`distamp.torch_compat.checkpoint_recomputation`;
where a torch release moved them, the run is refused before its first backward, naming the
function and the fix, instead of differing silently.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from torch.overrides import TorchFunctionMode

from distamp.torch_compat import checkpoint_recomputation

__all__ = ["carry_ops"]


def carry_ops(mode: TorchFunctionMode, stops: frozenset[CodeType], *, skip: int = 1) -> None:
    """Make the recomputation of the checkpointed function this op runs in (if any) run
    inside ``mode``; nothing when a frame in ``stops`` (a module's forward that enters the
    ops itself) comes first, or when no checkpoint is on the stack.

    Args:
        mode: the policy's fp32-op mode, active now.
        stops: the code of the forwards that enter ``mode`` by themselves when recomputed.
        skip: frames above the caller's to start from (the mode's own).

    Raises:
        RuntimeError: a checkpointed function whose recomputation cannot be carried (a torch
            release that keeps it elsewhere); names the function and the fix.
    """
    frame: FrameType | None = sys._getframe(skip + 1)
    inner: FrameType | None = None  # the frame below: the checkpointed function's own, when found
    while frame is not None:
        if frame.f_code in stops:
            return
        try:
            found = checkpoint_recomputation(frame)
        except RuntimeError as e:
            raise RuntimeError(_refusal(inner, str(e))) from None
        if found is not None:
            holder, name = found
            fn = getattr(holder, name)
            if getattr(fn, "distamp_ops", None) is not mode:
                setattr(holder, name, _inside(fn, mode))
            return
        inner, frame = frame, frame.f_back


def _inside(fn: Callable[..., Any], mode: TorchFunctionMode) -> Callable[..., Any]:
    """``fn`` run inside ``mode``: the backward runs it on an empty function-mode stack."""

    def recompute(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return fn(*args, **kwargs)

    recompute.distamp_ops = mode  # type: ignore[attr-defined]
    return recompute


def _refusal(frame: FrameType | None, why: str) -> str:
    code = None if frame is None else frame.f_code
    qualname = None if code is None else getattr(code, "co_qualname", code.co_name)
    name = "a checkpointed function" if qualname is None else repr(qualname)
    return (
        f"{name} calls the policy's fp32 ops inside activation checkpointing, and its "
        f"recomputation in the backward cannot run them in fp32 ({why}): it would compute "
        "differently from the forward. Checkpoint a module instead (its forward carries the "
        "policy: torch.utils.checkpoint.checkpoint(module, ...) or "
        "distamp's apply_activation_checkpointing), or move the op into a submodule"
    )
