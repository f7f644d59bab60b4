"""The public unscale entry points and the backend dispatcher ("auto" | "triton" | "torch").

Backends:

- ``"triton"``: :mod:`distamp.kernels.triton`, one read pass over all gradients of a dtype. CUDA
  tensors (or CPU tensors under ``TRITON_INTERPRET=1``). Imported on first use only, so
  ``import distamp`` works without Triton.
- ``"torch"``: :mod:`distamp.kernels.reference`, torch's multi-tensor ops. Runs everywhere.
- ``"auto"`` (default): :func:`auto_backend`'s table; a Triton launch that fails is redone by the
  reference with a one-time warning. An explicitly requested backend that cannot run raises
  instead: a silent fallback would hide a broken install in a benchmark.

The automatic routing on CUDA (:func:`auto_backend`): a call that asks for the sum of squares
(clipping) or for per-gradient flags takes Triton, which delivers them in the same read pass;
a plain unscale or check takes torch's fused ``_amp_foreach_non_finite_check_and_unscale_``
(a check multiplies by exactly 1, as torch's scaler checks for fused optimizers). That op costs
about 50 us of host time for 500 gradients, where a Triton launch costs 0.4 to 0.9 ms (H200,
2026-11-26), and the scaler asks for flags only when sync-free (elsewhere it computes them for a
skipped step only), so a plain step costs what torch's does.

The default comes from :func:`set_default_backend`, else the ``DISTAMP_KERNEL_BACKEND``
environment variable, else ``"auto"``.

The entry point is registered as the custom op ``torch.ops.distamp.unscale_check_sumsq_`` with a
fake implementation, so ``torch.compile`` keeps it as one opaque node instead of tracing the
launcher's Python. Eager calls skip the op dispatcher and call the implementation directly: the
round trip through ``torch.ops`` adds ~80 us per call (torch 2.13, CPU, 10 tensors: 150 vs 72 us).
"""

# No ``from __future__ import annotations`` here: torch.library.custom_op reads the annotations of
# the op's signature at runtime to infer its schema.

import importlib
from collections.abc import Sequence
from types import ModuleType

import torch

from distamp.kernels.reference import unscale_check_sumsq_torch_

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "auto_backend",
    "get_default_backend",
    "set_default_backend",
    "triton_available",
    "unscale_and_check_",
    "unscale_check_sumsq_",
]

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "DISTAMP_KERNEL_BACKEND"
_FLAG_DTYPES = (torch.uint8, torch.float32)
_SUMSQ_DTYPES = (torch.float32, torch.float64)

_default_backend: str | None = None
_triton: ModuleType | None = None
_triton_error: BaseException | None = None


def _check_backend(backend: str, source: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(
            f"{source}={backend!r} is not a kernel backend; expected one of {BACKENDS}"
        )
    return backend


def set_default_backend(backend: str | None) -> None:
    """Set the backend used by calls that pass none; ``None`` returns to the env var / "auto"."""
    global _default_backend
    _default_backend = None if backend is None else _check_backend(backend, "backend")


def get_default_backend() -> str:
    """The backend a call without ``backend=`` uses (reads the environment; writes nothing)."""
    import os

    if _default_backend is not None:
        return _default_backend
    return _check_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def _load_triton() -> ModuleType | None:
    """Import the Triton backend once; ``None`` (error remembered) when Triton is unusable."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        try:
            _triton = importlib.import_module("distamp.kernels.triton")
        except Exception as exc:  # ImportError, or a Triton build that fails on import
            _triton_error = exc
    return _triton


def triton_available() -> bool:
    """Whether the Triton backend imports (it still needs CUDA tensors, or the interpreter)."""
    return _load_triton() is not None


def auto_backend(device: torch.device | str, *, flags: bool, sumsq: bool) -> str:
    """What ``backend="auto"`` runs a call on: ``"triton"`` or ``"torch"`` (module doc).

    Args:
        device: the gradients' device.
        flags: the call asks for per-gradient non-finite flags.
        sumsq: the call asks for the sum of squares.

    Returns:
        ``"triton"`` for CUDA calls that want flags or the sum of squares (provided Triton
        imports and no launch has failed yet; the caller checks), ``"torch"`` otherwise.
    """
    if torch.device(device).type != "cuda":
        return "torch"
    return "triton" if flags or sumsq else "torch"


def _validate(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    per_tensor_flags: torch.Tensor | None,
    sumsq_dtype: torch.dtype,
) -> None:
    for name, t in (("found_inf", found_inf), ("inv_scale", inv_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
            raise TypeError(f"{name} must be a one-element float32 tensor, got {t!r}")
    if inv_scale.device != found_inf.device:
        raise ValueError(
            f"inv_scale is on {inv_scale.device} but found_inf is on {found_inf.device}; "
            "pass both on the gradients' device"
        )
    if per_tensor_flags is not None and (
        per_tensor_flags.dim() != 1
        or per_tensor_flags.numel() != len(grads)
        or per_tensor_flags.dtype not in _FLAG_DTYPES
        or per_tensor_flags.device != found_inf.device
    ):
        raise ValueError(
            f"per_tensor_flags must be a 1-D uint8 or float32 tensor with one entry per gradient "
            f"({len(grads)}) on {found_inf.device}, got shape {tuple(per_tensor_flags.shape)}, "
            f"{per_tensor_flags.dtype} on {per_tensor_flags.device}"
        )
    if sumsq_dtype not in _SUMSQ_DTYPES:
        raise ValueError(f"sumsq_dtype must be torch.float32 or torch.float64, got {sumsq_dtype}")
    # Each gradient's device is checked by the backend, where it already loops over the tensors
    # (the Triton launcher only when it builds a pointer table).


def _run(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    write: bool,
    compute_sumsq: bool,
    per_tensor_flags: torch.Tensor | None,
    sumsq_dtype: torch.dtype,
    backend: str,
    grouped: bool = False,
) -> torch.Tensor | None:
    def triton_(strict: bool) -> torch.Tensor | None:
        mod = _load_triton()
        if mod is None:
            raise ImportError(
                f"backend='triton' was requested but Triton cannot be used ({_triton_error!r}); "
                "install it (pip install -e '.[triton]' from a distamp checkout) or use "
                "backend='torch'"
            ) from _triton_error
        return mod.unscale_check_sumsq_triton_(
            grads,
            found_inf,
            inv_scale,
            write=write,
            compute_sumsq=compute_sumsq,
            per_tensor_flags=per_tensor_flags,
            sumsq_dtype=sumsq_dtype,
            strict=strict,
            grouped=grouped,
        )

    if backend == "triton":
        return triton_(strict=True)
    if backend == "auto" and (
        auto_backend(found_inf.device, flags=per_tensor_flags is not None, sumsq=compute_sumsq)
        == "triton"
    ):
        mod = _load_triton()  # imported once, on the first CUDA call that needs it
        if mod is not None and not mod.auto_failed():
            return triton_(strict=False)
    return unscale_check_sumsq_torch_(
        grads,
        found_inf,
        inv_scale,
        write=write,
        compute_sumsq=compute_sumsq,
        per_tensor_flags=per_tensor_flags,
        sumsq_dtype=sumsq_dtype,
        grouped=grouped,
    )


@torch.library.custom_op(
    "distamp::unscale_check_sumsq_", mutates_args=("grads", "found_inf", "per_tensor_flags")
)
def _unscale_check_sumsq_op(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    write: bool,
    compute_sumsq: bool,
    per_tensor_flags: torch.Tensor | None,
    sumsq_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    out = _run(
        grads, found_inf, inv_scale, write, compute_sumsq, per_tensor_flags, sumsq_dtype, backend
    )
    return found_inf.new_zeros((), dtype=sumsq_dtype) if out is None else out


@_unscale_check_sumsq_op.register_fake
def _(
    grads: list[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    write: bool,
    compute_sumsq: bool,
    per_tensor_flags: torch.Tensor | None,
    sumsq_dtype: torch.dtype,
    backend: str,
) -> torch.Tensor:
    return found_inf.new_empty((), dtype=sumsq_dtype)


def unscale_check_sumsq_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
    compute_sumsq: bool = False,
    per_tensor_flags: torch.Tensor | None = None,
    sumsq_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    grouped: bool = False,
) -> torch.Tensor | None:
    """Check gradients for inf/NaN, optionally unscale them in place and sum their squares.

    One read pass over the gradients with the Triton backend (plus the write when ``write``), so
    unscaling, the overflow check and the gradient norm for clipping cost what one of them costs.
    Never syncs with the host: everything stays on the device.

    Args:
        grads: dense gradients on one device (fp32, fp16, bf16; fp64 and non-dense layouts take the
            torch path). Empty tensors are skipped.
        found_inf: one-element float32 tensor in {0, 1}, raised to 1 in place when any gradient
            holds an inf or NaN; never reset (accumulates over calls, like torch's GradScaler).
        inv_scale: one-element float32 tensor, the reciprocal of the loss scale.
        write: multiply the gradients by ``inv_scale`` in place. ``False`` leaves them untouched
            (a fused optimizer unscales inside its own kernel, or the caller folds ``inv_scale``
            into a clipping coefficient and multiplies once).
        compute_sumsq: also return the sum of squares of the *unscaled* gradients.
        per_tensor_flags: optional 1-D uint8 or float32 tensor, one entry per gradient; entries of
            gradients holding an inf or NaN are raised to 1 (never reset). Costs nothing when not
            requested.
        sumsq_dtype: dtype of the returned sum: float32, or float64 to keep sums beyond fp32's
            range (a gradient norm above ~1.8e19) finite. Partials are combined in fp64 either way.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; ``None`` uses :func:`get_default_backend`.
        grouped: the caller guarantees that every gradient has one floating dtype and lives on
            ``found_inf``'s device, so the torch backend skips its own grouping pass (~0.2 ms
            for 400 tensors on CPU, more than the check itself).

    Returns:
        The 0-dim sum of squares when ``compute_sumsq`` (non-finite when a gradient is), else None.

    Raises:
        TypeError, ValueError: bad arguments (wrong dtype, device mismatch, flag size).
        ImportError: ``backend="triton"`` without a usable Triton.
    """
    grads = list(grads)
    _validate(grads, found_inf, inv_scale, per_tensor_flags, sumsq_dtype)
    resolved = get_default_backend() if backend is None else _check_backend(backend, "backend")
    args = (grads, found_inf, inv_scale, write, compute_sumsq, per_tensor_flags, sumsq_dtype)
    if torch.compiler.is_compiling():
        out = torch.ops.distamp.unscale_check_sumsq_(*args, resolved)
        return out if compute_sumsq else None
    return _run(*args, resolved, grouped)


def unscale_and_check_(
    grads: Sequence[torch.Tensor],
    found_inf: torch.Tensor,
    inv_scale: torch.Tensor,
    *,
    write: bool = True,
) -> None:
    """Multiply ``grads`` by ``inv_scale`` in place and raise ``found_inf`` to 1 on a non-finite.

    A shorthand for :func:`unscale_check_sumsq_` without the sum of squares, on the default
    backend (benchmarks and direct users; the scaler calls :func:`unscale_check_sumsq_`).
    ``write=False`` only checks (one read pass, gradients untouched). No host sync.
    """
    unscale_check_sumsq_(grads, found_inf, inv_scale, write=write)
