"""Module name patterns: given as sequences, and each one matching something in the model.

The precision settings name modules with ``fnmatch`` patterns (case-sensitive
``fnmatchcase``, as every matcher in distamp uses): ``AutocastPolicy(fp32_modules=...,
fp8_exclude=...)``, ``AdaptiveRules(watch=...)``, ``BackwardScaleRules(blocks=...)``. Each is
matched against the model's own qualified names (:mod:`distamp.model_names`: the parts
activation checkpointing, ``torch.compile``, FSDP1 and DDP add dropped, so ``"blocks.*.ln"``
matches whatever wraps the model; ``fp32_modules`` also against class names; ``fp8_exclude``
against the Linear layers, the only modules it acts on). A pattern
goes wrong without a word in two ways, both refused here:

- one string where a sequence is expected: ``tuple("lm_head")`` is the patterns ``'l'``,
  ``'m'``, ``'_'``...; refused at construction (:func:`as_patterns`, ``ArgumentTypeError``);
- a pattern that matches nothing in the model (``"lm_haed"``, a module renamed since the
  setting was written): that module stays in low precision, unwatched or unscaled, and the run
  looks healthy. Refused when the setting meets the model (:func:`check_module_patterns`, at
  ``AutocastPolicy.apply``, float8 conversion and the adaptive parts' ``bind``), with a
  ``ValueError`` naming the field, the pattern and the model's closest names.

Only patterns are held to the second rule. Module classes (``fp32_modules``' default, the
normalisation layers) say "every module of this kind, if any": one policy serves models with and
without them, and a misspelt class is a ``NameError`` before it gets here. The defaults of the
other fields are ``None`` or empty, which match nothing by design.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch.distributed as dist
from torch import nn

from distamp.arguments import ArgumentTypeError
from distamp.model_names import named_model_modules

__all__ = [
    "as_patterns",
    "check_matched",
    "check_module_patterns",
    "closest",
    "gather_modules",
    "job_modules",
    "module_specs",
    "unknown_name",
]


def _listed(label: str, value: Any, example: str) -> list[Any]:
    """The items of a sequence argument; a string or a non-iterable refused."""
    if isinstance(value, (str, bytes)):
        chars = ", ".join(repr(c) for c in list(value)[:4])
        raise ArgumentTypeError(
            f"{label}={value!r} is one string where a sequence of name patterns is expected "
            f"(it would be read as the patterns {chars}, ...); pass ({value!r},)"
        )
    try:
        return list(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{label}={value!r} ({type(value).__name__}) is not a sequence of name patterns; "
            f"pass a tuple such as ({example!r},)"
        ) from None


def as_patterns(
    label: str, value: Any, example: str, *, optional: bool, empty: bool
) -> tuple[str, ...] | None:
    """``value`` as a tuple of non-empty pattern strings.

    Args:
        label: the field's name in errors (e.g. ``"AdaptiveRules.watch"``).
        value: any iterable of strings (a list is stored as a tuple: the rules are frozen and
            hashable).
        example: a pattern to suggest in errors.
        optional: ``None`` is accepted (and returned).
        empty: an empty sequence is accepted.

    Raises:
        ArgumentTypeError: a string, a non-iterable, or an item that is not a string.
        ValueError: an empty string (it names the model itself, never a module inside it), or
            an empty sequence where one is needed.
    """
    if value is None and optional:
        return None
    items = _listed(label, value, example)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ArgumentTypeError(
                f"{label}={value!r}: item {i} ({item!r}, {type(item).__name__}) is not a name "
                f"pattern; give strings such as {example!r}"
            )
        if not item:
            raise ValueError(
                f"{label}={value!r}: item {i} is an empty pattern; give module name patterns "
                f"such as {example!r}"
            )
    if not items and not empty:
        either = ", or None" if optional else ""
        raise ValueError(f"{label}={value!r}: give at least one pattern (e.g. {example!r}){either}")
    return tuple(items)


def module_specs(label: str, value: Any) -> tuple[str | type[nn.Module], ...]:
    """``fp32_modules``: module classes and name patterns, as a tuple.

    Raises:
        ArgumentTypeError: one string or one class where a sequence is expected, or an item
            that is neither an ``nn.Module`` subclass nor a non-empty string.
    """
    if isinstance(value, type):
        raise ArgumentTypeError(
            f"{label}={value!r} is one class where a sequence is expected; pass ({value.__name__},)"
        )
    items = _listed(label, value, "lm_head")
    for spec in items:
        if not (
            (isinstance(spec, str) and spec)
            or (isinstance(spec, type) and issubclass(spec, nn.Module))
        ):
            raise ArgumentTypeError(
                f"{label}: {spec!r} is neither an nn.Module subclass nor a name pattern "
                "(e.g. nn.LayerNorm, 'lm_head', 'blocks.*.ln1')"
            )
    return tuple(items)


def closest(name: str, candidates: Iterable[str]) -> str:
    """A phrase naming the ``candidates`` closest to ``name`` (``difflib``), or a few of them
    when none is close."""
    known = list(dict.fromkeys(c for c in candidates if c))
    near = difflib.get_close_matches(name, known, n=3)
    if near:
        return "closest: " + ", ".join(repr(n) for n in near)
    if not known:
        return "there is none"
    shown = ", ".join(repr(n) for n in known[:6])
    return f"none is close; there are {len(known)}: {shown}{', ...' if len(known) > 6 else ''}"


def unknown_name(label: str, name: Any, known: Collection[str], what: str) -> ValueError:
    """The error for a saved name that this model does not have (a checkpoint of another
    model, or of one whose modules were renamed)."""
    hint = closest(name, known) if isinstance(name, str) else f"{what} names are strings"
    return ValueError(f"{label}: {name!r} is not a {what} of this model; {hint}")


def check_matched(
    label: str, patterns: Iterable[str], candidates: Collection[str], what: str
) -> None:
    """Every pattern matches at least one of ``candidates``.

    Raises:
        ValueError: naming ``label``, the first pattern that matches nothing, and the closest
            candidates.
    """
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(c, pattern) for c in candidates):
            hint = closest(pattern, candidates)
            raise ValueError(
                f"{label}: the pattern {pattern!r} matches no {what} ({hint}); patterns are "
                "fnmatch patterns over qualified names, such as 'blocks.*.ln1'"
            )


_Entry = tuple[str, str, bool]  # (qualified name, class name, is a Linear layer)
_JOB: ContextVar[tuple[_Entry, ...] | None] = ContextVar("distamp_job_modules", default=None)


def _entries(model: nn.Module) -> list[_Entry]:
    return [(n, type(m).__name__, isinstance(m, nn.Linear)) for n, m in named_model_modules(model)]


def gather_modules(model: nn.Module) -> tuple[_Entry, ...]:
    """Every rank's module names, classes and Linear layers (``model`` being each rank's part),
    for :func:`job_modules`. Collective when distributed: one gather, at setup."""
    entries: list[Any] = _entries(model)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, entries)
        entries = sorted({tuple(e) for rank in everyone for e in rank})
    return tuple(entries)


@contextmanager
def job_modules(entries: tuple[_Entry, ...] | None) -> Iterator[None]:
    """Within this block, patterns are matched against ``entries`` (:func:`gather_modules`: the
    modules of every rank of the job), not only the model at hand: pipeline stages each hold
    part of the model, and a pattern naming a module on another stage is right, not a typo.
    ``None``: the model at hand, as outside the block."""
    token = _JOB.set(entries)
    try:
        yield
    finally:
        _JOB.reset(token)


def check_module_patterns(
    model: nn.Module,
    *,
    fp32_modules: Iterable[str | type[nn.Module]] = (),
    fp8_exclude: Iterable[str] = (),
    watch: Iterable[str] | None = None,
    blocks: Iterable[str] | None = None,
) -> None:
    """Refuse a pattern of these settings that matches nothing in ``model`` (see the module
    doc for what each field is matched against; inside :func:`job_modules`, in any rank's part
    of the model). Reads names and classes only: no change.

    Raises:
        ValueError: naming the field, the pattern and the model's closest names.
    """
    job = _JOB.get()
    named = list(job) if job is not None else _entries(model)
    names = [n for n, _, _ in named]
    strings = [s for s in fp32_modules if isinstance(s, str)]
    if strings:
        kinds = names + [kind for _, kind, _ in named]
        what = "module of the model (by qualified name or class name)"
        check_matched("AutocastPolicy(fp32_modules=...)", strings, kinds, what)
    linears = [n for n, _, linear in named if linear]
    check_matched("AutocastPolicy(fp8_exclude=...)", fp8_exclude, linears, "Linear layer")
    check_matched("AdaptiveRules(watch=...)", watch or (), names, "module of the model")
    inner = [n for n in names if n]  # a block is never the model itself
    check_matched("BackwardScaleRules(blocks=...)", blocks or (), inner, "module of the model")
