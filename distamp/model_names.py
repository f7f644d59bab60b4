"""The model's own module names, whatever wraps it.

distamp records module names (adaptive promotions, backward-scale blocks, float8 choices and
fallbacks, telemetry, the run report, overflow attribution, the audit) and matches name patterns
against them (``fp32_modules``, ``fp8_exclude``, ``watch``, ``blocks``). ``named_modules`` of a
wrapped model spells those names with the wrappers' parts in them: torch's ``CheckpointWrapper``
adds ``_checkpoint_wrapped_module.`` under each checkpointed block, ``torch.compile`` adds
``_orig_mod.`` (before every name for a compiled model, under a block compiled on its own),
FSDP1 ``_fsdp_wrapped_module.`` under each unit and DDP (torchft's too: it subclasses torch's)
``module.`` before every name. A name recorded with those parts belongs to one recipe, not to
the model: a run saved without activation checkpointing and resumed with it would find none of
its promoted modules. torch's own ``state_dict`` drops the parts, and so does every name here.

:func:`model_name` is the one normalising function; :func:`named_model_modules` is
``named_modules`` in model names. A wrapper and the module it wraps share a model name, and the
name stands for the module inside (the user's module: the one whose forward carries a
promotion, so that a recomputed forward carries it too).

``module`` is a name a model may give its own submodule; it is dropped only where the module
holding it is DDP (decided by the object, never by the string). The private parts of the other
wrappers are dropped wherever they appear: no model names its modules so.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from distamp.torch_compat import WRAPPER_PARTS, wrapped_attribute

__all__ = ["model_name", "named_model_modules"]


def model_name(name: str, model: nn.Module | None = None) -> str:
    """``name`` (a module's or a parameter's qualified name in ``model``) without the parts
    torch's wrappers add: the model's own name for it, the same under every wrapping.

    Args:
        name: a qualified name as ``named_modules`` or ``named_parameters`` of ``model`` spell
            it, or a model name already (returned as it is).
        model: the module ``name`` is relative to. Needed only to drop DDP's ``module.`` (the
            outermost wrappers of ``model`` are looked at); without it that part stays.
    """
    parts = name.split(".") if name else []
    i, outer = 0, model
    while outer is not None and i < len(parts):  # the outermost wrappers, by their objects
        inner = wrapped_attribute(outer)
        if inner is None or parts[i] != inner:
            break
        outer, i = getattr(outer, inner, None), i + 1
    return ".".join(p for p in parts[i:] if p not in WRAPPER_PARTS)


def named_model_modules(
    model: nn.Module, *, outermost: bool = False
) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` in model names: each name once, in ``named_modules`` order,
    with the innermost module of that name (the wrapped one, whose own forward runs again
    when a checkpoint recomputes it), or with ``outermost`` the outermost (its wrapper, if
    any: hooks at a block's boundary stay outside a checkpointed or compiled region, where a
    graph break inside would leave the block uncompiled). A module reachable under two names
    is yielded once, as ``named_modules`` does."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        key = model_name(name, model)  # pre-order: an inner module comes after its wrapper
        if not (outermost and key in found):
            found[key] = module
    yield from found.items()
