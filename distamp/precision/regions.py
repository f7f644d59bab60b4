"""Where the policy's precision lives: in each module's own forward, wherever that forward runs.

Activation checkpointing runs a module's forward a second time during backward (reentrant,
non-reentrant, selective, ``checkpoint_sequential``), outside every context the training step
opened: torch restores autocast there, nothing else. A precision decision held by a context
around the user's forward (the fp32-op mode) or by a pre/post hook pair would be missing from
the recomputed forward, which then computes in other dtypes: non-reentrant checkpointing refuses
the recomputed tensors ("different metadata"), reentrant checkpointing silently computes other
gradients. So every decision travels with the module, in its class's ``forward``
(:func:`region_of` swaps a module's class for a subclass, as ``fully_shard`` does), that:

- enters the policy's fp32-op mode (:class:`Fp32Ops`) when no call above it has: the user's
  ``policy.autocast()`` context, an enclosing module's forward, or nothing at all when a
  checkpoint recomputes this module alone;
- runs an fp32 module (static, from the policy) with autocast off and its low-precision inputs
  cast to fp32;
- runs a module the adaptive rules promoted with autocast off and every low-precision operand
  cast to fp32 (FSDP2 may hand it parameters already cast to the compute dtype);
- runs a replacement forward (a float8 layer fallen back to bf16) instead of the class's.

A ``with`` block inside one call, never a context opened in a pre-hook and closed in a post-hook:
``torch.compile`` traces it whole, and a flag flipped by a promotion is one guard (one
recompilation per promotion, none per step). The decisions are plain attributes of the module
(:class:`Region`), so every block of a model shares one compiled graph, and
``copy.deepcopy(model)`` gives a copy that decides as the original, on its own weights.
Everything here acts only while autocast is on: the same model still trains in fp32.

This is the one fp32-op mechanism: the policy's fp32 ops, the promotions' upcast and the casts of
an exported program (:mod:`distamp.deploy.casting`) are all :class:`Fp32Ops`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from distamp.precision.casts import to_fp32
from distamp.precision.checkpointed import carry_ops
from distamp.torch_compat import in_recomputation

__all__ = [
    "AUTOCAST_LOW_OPS",
    "Fp32Ops",
    "Region",
    "autocast_on",
    "can_carry_region",
    "has_region",
    "region_of",
    "release_region",
    "strip_regions",
]

# Read once, outside any compiled frame: torch 2.11's dynamo cannot trace the availability check
# (a builtin), and breaks the promoted forward's graph on it.
_AUTOCAST_KINDS = tuple(k for k in ("cpu", "cuda") if torch.amp.is_autocast_available(k))


def autocast_on() -> list[str]:
    """The device types whose autocast is on here (a plain list: no generator to trace)."""
    return [kind for kind in _AUTOCAST_KINDS if torch.is_autocast_enabled(kind)]


def _without_autocast(kinds: list[str], func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` with autocast off on ``kinds`` (plain nested ``with`` blocks,
    no ExitStack: what torch.compile traces whole)."""
    if len(kinds) == 2:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return func(*args, **kwargs)
    with torch.autocast(kinds[0], enabled=False):
        return func(*args, **kwargs)


class Fp32Ops(TorchFunctionMode):
    """Runs ops in fp32: the one mechanism behind fp32 ops, promotions and exported casts.

    A ``TorchFunctionMode`` sees ``torch.X``, ``F.X`` and ``Tensor.X`` calls before autocast's
    dispatch does, which is the only public place to override autocast's per-op choice.

    Args:
        names: the ``__name__`` of the ops it acts on (``"softmax"`` covers ``torch.softmax``,
            ``F.softmax`` and ``Tensor.softmax``); ``None``: every op.
        cast_inputs: cast the low-precision floating arguments of those ops to fp32 (else the
            op only runs with autocast off, in its inputs' dtype).
        always: act whether or not autocast is on, casting only (an exported program has no
            autocast, and computes as under it); otherwise act only while autocast is on,
            turning it off around the op, so that an fp32 run passes through untouched.

        narrow: with ``always``, op names (autocast's matmul family, :data:`AUTOCAST_LOW_OPS`)
            whose floating operands of mixed dtypes are all cast to the narrowest of them, as
            autocast casts them: an fp32 op's output meeting a bf16 weight in a matmul.

    ``depth`` counts how many times the mode is entered right now: a module's forward enters it
    only where nothing above has (:class:`Region`).
    """

    def __init__(
        self,
        names: frozenset[str] | None,
        *,
        cast_inputs: bool = True,
        always: bool = False,
        narrow: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__()
        self.names = names
        self.cast_inputs = cast_inputs
        self.always = always
        self.narrow = narrow
        self.depth = 0

    @override
    def __enter__(self) -> Fp32Ops:
        self.depth += 1
        super().__enter__()
        return self

    @override
    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1
        super().__exit__(*exc)

    @override
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if self.narrow and name in self.narrow:
            return func(*_narrowest(args), **kwargs)
        if self.names is not None and name not in self.names:
            return func(*args, **kwargs)
        if self.always:
            return func(*to_fp32(args), **to_fp32(kwargs))
        kinds = autocast_on()
        if not kinds:
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling() and not in_recomputation():
            # a forward (not a recomputation): a checkpointed function recomputes inside us
            carry_ops(self, _REGION_CODE)
        if self.cast_inputs:
            args, kwargs = to_fp32(args), to_fp32(kwargs)
        return _without_autocast(kinds, func, *args, **kwargs)


AUTOCAST_LOW_OPS = frozenset(
    {
        "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
        "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "scaled_dot_product_attention", "prelu",
    }
)  # fmt: skip
"""The ops autocast runs in the low dtype on CPU and CUDA (matmuls, convolutions, attention)."""


def _narrowest(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with every floating tensor cast to the narrowest floating dtype among them,
    when they differ (what autocast does to a matmul's operands)."""
    dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
    if len(dtypes) < 2:
        return args
    narrow = min(dtypes, key=lambda d: torch.finfo(d).bits)
    return tuple(
        a.to(narrow) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


_UPCAST = Fp32Ops(None, always=True)
"""Inside a promoted module: every op's low-precision floating operands cast to fp32. Casting
the module's inputs is not enough where its parameters arrive in the compute dtype (FSDP2
gathers them so): ``F.linear(fp32, fp16)`` refuses mixed dtypes once autocast is off. The cast
is differentiable, so gradients still reach the parameters."""


class ExactUpcast(Fp32Ops):
    """:data:`_UPCAST` for a promoted module whose weights are 16-bit with an exact master
    (:mod:`distamp.optim`): a parameter operand becomes its fp32 master, differentiably (the
    gradient still reaches the 16-bit parameter), so the island computes from the exact weight
    and not from its rounding; every other low-precision operand is cast to fp32.

    Args:
        exact: a parameter's exact fp32 value, or ``None`` where there is none (the operand is
            then cast like any other); the same answer on every rank.
    """

    def __init__(self, exact: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        super().__init__(None, always=True)
        self.exact = exact

    @override
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return func(*self._fp32(args), **self._fp32(kwargs or {}))

    def _fp32(self, value: Any) -> Any:
        if isinstance(value, nn.Parameter):
            exact = self.exact(value)
            return to_fp32(value) if exact is None else exact
        if isinstance(value, (list, tuple)):
            return type(value)(self._fp32(v) for v in value)
        if isinstance(value, dict):
            return {k: self._fp32(v) for k, v in value.items()}
        return to_fp32(value)


class _ModuleAttribute:
    """A :class:`Region` field read from and written to its module's ``distamp_<name>``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.key = f"distamp_{name}"

    def __get__(self, region: Any, owner: type | None = None) -> Any:
        return getattr(region.module, self.key)

    def __set__(self, region: Any, value: Any) -> None:
        setattr(region.module, self.key, value)


class Region:
    """The precision decisions one module's forward carries, kept as plain attributes of the
    module (``distamp_*``: what ``torch.compile`` guards by value, so that every block of a
    model shares one compiled graph) and read by its class's forward (:func:`region_of` swaps
    the module's class for a subclass whose forward applies them, as ``fully_shard`` does).

    Attributes (on the module):
        distamp_ops: the policy's fp32-op mode, entered when no call above entered it.
        distamp_fp32: a static fp32 module: autocast off inside it.
        distamp_cast_inputs: with ``distamp_fp32``, cast low-precision floating inputs to fp32.
        distamp_promoted: an adaptive promotion: autocast off, every low-precision operand cast
            to fp32.
        distamp_exact: with ``distamp_promoted``, an :class:`ExactUpcast` that hands the
            module its parameters' exact masters (16-bit weights), or ``None``.
        distamp_replacement: a forward run instead of the class's (a float8 layer's bf16
            fallback), or ``None``.
        distamp_previous: an instance ``forward`` the module had (a framework's wrapper),
            called in place of the class's; it comes back when the region goes.
    """

    ops = _ModuleAttribute()
    fp32 = _ModuleAttribute()
    cast_inputs = _ModuleAttribute()
    promoted = _ModuleAttribute()
    exact = _ModuleAttribute()
    replacement = _ModuleAttribute()

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @property
    def idle(self) -> bool:
        """Whether this region decides nothing any more (then it can be taken off)."""
        return self.ops is None and not (self.fp32 or self.promoted) and self.replacement is None


_DEFAULTS: dict[str, Any] = {
    "distamp_ops": None,
    "distamp_fp32": False,
    "distamp_cast_inputs": True,
    "distamp_promoted": False,
    "distamp_exact": None,
    "distamp_replacement": None,
    "distamp_previous": None,
}
_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}  # a module class -> its region class
_BASES: dict[type[nn.Module], type[nn.Module]] = {}  # a region class -> the class it extends


def _region_forward(base: type[nn.Module]) -> Callable[..., Any]:
    """The forward of ``base``'s region class (see the module doc)."""
    inner_forward = base.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        replacement = self.distamp_replacement or self.distamp_previous
        inner = inner_forward if replacement is None else _call_replacement(replacement)
        kinds = autocast_on()
        if not kinds:  # fp32 training, or inside an island: nothing to decide
            return inner(self, *args, **kwargs)
        if self.distamp_promoted:
            args, kwargs = to_fp32(args), to_fp32(kwargs)
            with self.distamp_exact or _UPCAST:
                return _without_autocast(kinds, inner, self, *args, **kwargs)
        if self.distamp_fp32:
            if self.distamp_cast_inputs:
                args, kwargs = to_fp32(args), to_fp32(kwargs)
            return _without_autocast(kinds, inner, self, *args, **kwargs)
        ops = self.distamp_ops
        if ops is None or (ops.depth > 0 and not torch.compiler.is_compiling()):
            return inner(self, *args, **kwargs)
        with ops:
            return inner(self, *args, **kwargs)

    return forward


_REGION_CODE = frozenset({_region_forward(nn.Module).__code__})
"""The code of every region's forward: recomputed, it enters the policy's ops by itself."""


def _call_replacement(replacement: Callable[..., Any]) -> Callable[..., Any]:
    def call(_self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return replacement(*args, **kwargs)

    return call


def _region_class(cls: type[nn.Module]) -> type[nn.Module]:
    made = _CLASSES.get(cls)
    if made is None:
        # Same name and qualified name: patterns that match class names still match, and a
        # pickled model loads as its plain class.
        made = type(cls.__name__, (cls,), {"forward": _region_forward(cls)})
        made.__module__, made.__qualname__ = cls.__module__, cls.__qualname__
        _CLASSES[cls], _BASES[made] = made, cls
    return made


def has_region(module: nn.Module) -> bool:
    """Whether ``module``'s class carries a region (this one's or a wrapper's subclass)."""
    return any(c in _BASES for c in type(module).__mro__)


def can_carry_region(module: nn.Module) -> bool:
    """Whether ``module`` runs its forward through ``nn.Module.__call__``. A wrapper with a
    ``__call__`` of its own (``torch.compile``'s ``OptimizedModule``) never calls its class's
    forward: the module it wraps carries the region instead."""
    return type(module).__call__ is nn.Module.__call__


def region_of(module: nn.Module) -> Region:
    """``module``'s :class:`Region`, its class swapped for the region class on first use (an
    instance ``forward`` it had is kept and called in place of the class's).

    Raises:
        ValueError: ``module`` cannot carry one (:func:`can_carry_region`).
    """
    if not can_carry_region(module):
        raise ValueError(
            f"{type(module).__name__} has a __call__ of its own and never runs its class's "
            "forward: put the precision decision on the module it wraps"
        )
    if not has_region(module):
        previous = module.__dict__.pop("forward", None)
        for name, value in _DEFAULTS.items():
            setattr(module, name, value)
        setattr(module, "distamp_previous", previous)  # noqa: B010
        module.__class__ = _region_class(type(module))
    return Region(module)


def release_region(module: nn.Module) -> None:
    """Take ``module``'s region off once it decides nothing (its class and any instance
    ``forward`` it had come back; a class a wrapper derived from the region class since then
    stays, deciding nothing)."""
    if not has_region(module) or not Region(module).idle:
        return
    base = _BASES.get(type(module))
    if base is not None:
        previous = module.__dict__.get("distamp_previous")
        for name in _DEFAULTS:
            module.__dict__.pop(name, None)
        module.__class__ = base
        if previous is not None:
            setattr(module, "forward", previous)  # noqa: B010 (an instance attribute)


def strip_regions(model: nn.Module) -> None:
    """Every module of ``model`` back to its plain class, decisions dropped (a copy for export:
    its plan says what they were)."""
    for module in model.modules():
        for name in _DEFAULTS:
            module.__dict__.pop(name, None)
        base = _BASES.get(type(module))
        if base is not None:
            module.__class__ = base
