"""Gating an optimizer's step on the agreed on-device flag, without a host sync where it can be.

Fused optimizers take ``grad_scale`` and ``found_inf`` as attributes and skip inside their kernel
(:func:`fused_step`); those still written for torch's older protocol take the scaler itself
(:func:`grad_scaler_step`). Every other optimizer is a Python loop whose ``step()`` cannot be
skipped without reading the flag on the host, so the step is made *undoable* instead
(:func:`masked_step`), or, outside sync-free mode, skipped after one host read of the flag.
:func:`gated_step` picks among these, so that the scaler's state machine only says *when* the
optimizer steps, never *how* each kind of optimizer is gated.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["fused_step", "gated_step", "grad_scaler_step", "masked_step", "takes_grad_scaler"]


def _params_with_grad(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                yield p


def masked_step(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """Run ``optimizer.step`` and undo it on device where ``found_inf`` is set.

    Variant chosen for least memory traffic among the exact ones: snapshot the parameters and the
    optimizer's existing state tensors (one read + one write), step unconditionally, then select
    the snapshot back where ``found_inf`` is set (one more read + write). Non-finite values made
    by a discarded update never survive the select, so params and state are bitwise unchanged on
    a skip. Two cases still sync the host: optimizer state *created* by this step (the first
    step of Adam & co.) must be deleted on a skip, a Python-side effect; and state kept on the CPU
    while the flag is on an accelerator (non-``capturable`` Adam keeps ``step`` there) is restored
    with a device-to-host copy of the flag. Use a fused optimizer for a step with no sync at all.
    """
    params = list(_params_with_grad(optimizer))
    fresh = {id(p) for p in params if not optimizer.state.get(p)}
    skip = found_inf > 0
    tensors: list[torch.Tensor] = [p.data for p in params]
    for p in params:
        if id(p) not in fresh:
            tensors.extend(v for v in optimizer.state[p].values() if isinstance(v, torch.Tensor))
    with torch.no_grad():
        snapshot = [t.clone() for t in tensors]
        retval = optimizer.step(*args, **kwargs)
        skip_on = {skip.device: skip}
        for t, s in zip(tensors, snapshot, strict=True):
            flag = skip_on.setdefault(t.device, skip.to(t.device))
            t.copy_(torch.where(flag, s, t))
    created = [p for p in params if id(p) in fresh and optimizer.state.get(p)]
    # Host sync, only on a step that created optimizer state (normally the first one).
    if created and bool(skip.item()):
        for p in created:
            del optimizer.state[p]
    return retval


def fused_step(
    optimizer: torch.optim.Optimizer,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Step a fused optimizer (torch's ``fused=True``) with ``grad_scale`` and ``found_inf`` set
    as attributes for the call. A ``grad_scale`` the user preset on the optimizer multiplies into
    ours and is removed afterwards, as torch's scaler does. No host sync."""
    preset = getattr(optimizer, "grad_scale", None)
    if preset is not None:
        grad_scale = preset if grad_scale is None else grad_scale * preset
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


def gated_step(
    optimizer: torch.optim.Optimizer,
    found_inf: torch.Tensor,
    *,
    grad_scale: torch.Tensor | None,
    fused: bool,
    sync_free: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Step ``optimizer`` with ``args``/``kwargs`` unless the agreed ``found_inf`` is set.

    Args:
        grad_scale: what a fused optimizer divides its gradients by (ignored otherwise).
        fused: the optimizer takes ``grad_scale``/``found_inf`` (:func:`fused_step`).
        sync_free: a non-fused optimizer steps and is undone on device (:func:`masked_step`);
            otherwise the flag is read on the host and ``optimizer.step`` runs or not.

    Returns:
        What ``optimizer.step`` returns; ``None`` for a step skipped on the host.
    """
    if fused:
        return fused_step(optimizer, grad_scale, found_inf, *args, **kwargs)
    if sync_free:
        return masked_step(optimizer, found_inf, *args, **kwargs)
    # Host sync (one per step): whether optimizer.step runs at all is a Python decision.
    return None if found_inf.item() else optimizer.step(*args, **kwargs)


def takes_grad_scaler(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes torch's deprecated ``grad_scaler`` argument."""
    return "grad_scaler" in inspect.signature(optimizer.step).parameters


def grad_scaler_step(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, *args: Any, **kwargs: Any
) -> Any:
    """Step an optimizer of torch's older protocol: it receives ``scaler`` as ``grad_scaler``
    and asks it for the scale and the flags itself. Warns (``FutureWarning``, at the caller of
    ``scaler.step``) that the protocol is deprecated, as torch does."""
    warnings.warn(
        f"{type(optimizer).__name__}.step takes the deprecated `grad_scaler` argument: "
        "the scaler passes itself, as torch's does for now; optimizers should read the "
        "`grad_scale` and `found_inf` attributes the scaler sets instead.",
        FutureWarning,
        stacklevel=3,
    )
    return optimizer.step(*args, **{**kwargs, "grad_scaler": scaler})
