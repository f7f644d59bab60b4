"""The op names a policy forces to fp32: each one must name something the policy can act on.

:class:`~distamp.precision.policy.AutocastPolicy` forces its ``fp32_ops`` through a
``TorchFunctionMode``, which compares the ``__name__`` of each call it sees with the names
given. A name that no such call carries (``"softmx"``, ``"F.softmax"``, ``"torch.exp"``) matches
nothing: the op it meant keeps computing in low precision and the run looks healthy. The calls
such a mode sees are exactly the functions torch lets ``__torch_function__`` override
(:func:`torch.overrides.get_overridable_functions`: ``torch``, ``torch.nn.functional``,
``torch.linalg``, ``torch.fft``, ``torch.special`` and the ``Tensor`` methods), so their names
are the ones accepted, checked when the policy is built.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.overrides import get_overridable_functions

from distamp.precision.patterns import as_patterns, closest

__all__ = ["fp32_op_names", "known_op_names"]


@functools.cache
def known_op_names() -> frozenset[str]:
    """The ``__name__`` of every function a ``TorchFunctionMode`` can intercept (built once;
    6 ms on torch 2.13): ``"softmax"`` for ``torch.softmax``, ``F.softmax`` and
    ``Tensor.softmax`` alike, ``"linalg_norm"`` for ``torch.linalg.norm``."""
    return frozenset(
        name
        for functions in get_overridable_functions().values()
        for function in functions
        if isinstance(name := getattr(function, "__name__", None), str)
    )


def fp32_op_names(label: str, value: Any) -> frozenset[str]:
    """``value``, a sequence of op names, as a frozenset; each must be in
    :func:`known_op_names`.

    Raises:
        ArgumentTypeError: one string where a sequence is expected, a non-iterable, or an item
            that is not a string (:func:`~distamp.precision.patterns.as_patterns`).
        ValueError: an empty name, or a name no torch function carries; the message names
            ``label``, the name and the closest valid names.
    """
    names = as_patterns(label, value, "softmax", optional=False, empty=True) or ()
    known = known_op_names()
    for name in names:
        if name not in known:
            # "torch.exp", "F.softmax": the name after the module is the one to suggest.
            plain = sorted(n for n in known if not n.startswith("_"))
            hint = closest(name.rpartition(".")[2], plain)
            raise ValueError(
                f"{label}: {name!r} is not the name of a torch function the policy can run in "
                f"fp32 ({hint}). Give names as torch's functions carry them: 'softmax' for "
                "torch.softmax, F.softmax and Tensor.softmax alike; 'linalg_norm' for "
                "torch.linalg.norm"
            )
    return frozenset(names)
