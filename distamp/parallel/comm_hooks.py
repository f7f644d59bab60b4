"""DDP communication hooks that know the gradients they carry are loss-scaled.

torch's hooks treat a bucket as plain numbers, which breaks under fp16 loss scaling:

- ``fp16_compress_hook`` casts *scaled* gradients to fp16: with the default initial scale of
  65536 a gradient of 1.0 is already past fp16's maximum (65504), so compression itself
  overflows, the step is skipped, and the scale backs off for a reason that is not the model's.
- ``powerSGD_hook`` keeps error-feedback residuals and warm-start ``Q`` matrices across steps.
  One non-finite step writes NaN into both, and every later step is non-finite: the loss scale
  collapses (measured: 65536 -> 0.002 in 25 steps) and training never recovers.

The hooks here:

- :func:`fp16_hook`: agree on the bucket's largest magnitude first (one 4-byte
  all-reduce), then compress with the power of two that fits the *sum* into fp16. Powers of two
  scale exactly, so nothing is lost but the fp16 rounding itself; a non-finite bucket passes
  through unchanged, so the scaler still sees the overflow and skips.
- :func:`bf16_hook`: bf16 has fp32's exponent range, so scaled gradients cannot
  overflow; it all-reduces bf16 with a plain ``all_reduce``, which gloo supports. (DDP refuses
  any hook *named* ``bf16_compress_hook`` unless CUDA and NCCL >= 2.10 are present, torch 2.13,
  hence the different name.)
- :func:`powersgd_hook`: torch's PowerSGD, with its state repaired on device before each use:
  after a skipped step the residual is reset and ``Q`` restored to its value before that step,
  and residuals are rescaled when the loss scale changed. The skip flag and the scale are read
  from the scaler as tensors, so no hook call syncs with the host.

Every hook returns the *average* over ranks, as DDP expects.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's annotations
# against the real `dist.GradBucket` / `torch.futures.Future[torch.Tensor]` objects.
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd
from torch.nn.parallel import DistributedDataParallel

__all__ = [
    "COMM_HOOKS",
    "CompressionState",
    "PowerSGDState",
    "bf16_hook",
    "current_loss_scale",
    "fp16_hook",
    "powersgd_hook",
    "register_comm_hook",
]

COMM_HOOKS: tuple[str, ...] = ("fp16", "bf16", "powersgd")

# The fp16 sum is kept at or below 2**15 (fp16's maximum is 65504 < 2**16): a power of two, so the
# compression factor is exact, with a factor-of-two margin for rounding.
_FP16_TARGET_LOG2 = 15.0
# Bounds of the compression factor's exponent: fp32 must hold the factor and its reciprocal.
_LOG2_MIN, _LOG2_MAX = -100.0, 100.0


def current_loss_scale(scaler: Any) -> torch.Tensor | None:
    """The scaler's loss scale as its 0-dim device tensor, without a host sync.

    ``torch.amp.GradScaler`` keeps it in ``_scale`` and offers only ``get_scale()``, which
    syncs; this reads the tensor instead (checked on torch 2.4-2.13). ``None`` when there is no
    scaler, it is disabled (bf16/fp32) or it has not scaled anything yet.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def _last_step_skipped(scaler: Any, device: torch.device) -> torch.Tensor:
    """0-dim bool tensor on ``device``: whether the scaler skipped the previous step."""
    flag = getattr(scaler, "last_step_skipped", None) if scaler is not None else None
    if not isinstance(flag, torch.Tensor):
        return torch.zeros((), dtype=torch.bool, device=device)
    return flag.to(device=device, dtype=torch.bool, non_blocking=True)


class CompressionState:
    """State of the compression hooks: the group to average over.

    Args:
        process_group: the replicas' group; ``None`` is the default group.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group

    @property
    def group(self) -> dist.ProcessGroup:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("comm hook called without an initialized process group")
        return group


def _fp16_factor(amax: torch.Tensor, world: int) -> torch.Tensor:
    """The power of two ``f`` with ``world * amax * f <= 2**15``; 1 when ``amax`` is 0 or not
    finite (non-finite values must reach the scaler unchanged)."""
    safe = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    exponent = torch.floor(_FP16_TARGET_LOG2 - torch.log2(safe * world))
    factor = torch.exp2(exponent.clamp(_LOG2_MIN, _LOG2_MAX))
    return torch.where(safe == amax, factor, torch.ones_like(factor))


def fp16_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in fp16 without ever overflowing on a finite bucket.

    Two collectives: MAX of the bucket's largest magnitude (4 bytes), then SUM of the bucket
    compressed with the factor from :func:`_fp16_factor`. The loss scale can therefore stay as
    high as the backward pass allows instead of backing off for the compression's sake. No host
    sync.
    """
    group = state.group
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    amax = (
        buffer.detach().abs().amax().float().reshape(1)
        if buffer.numel()
        else torch.zeros(1, device=buffer.device)
    )
    agreed = dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group, async_op=True)
    assert agreed is not None

    def compress_and_reduce(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        factor = _fp16_factor(fut.value()[0][0], world)
        compressed = (buffer * factor.to(buffer.dtype)).to(torch.float16)
        work = dist.all_reduce(compressed, group=group, async_op=True)
        assert work is not None
        total = work.get_future().wait()[0]
        buffer.copy_(total.to(buffer.dtype) * (1.0 / (factor * world)).to(buffer.dtype))
        return buffer

    return agreed.get_future().then(compress_and_reduce)


def bf16_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bf16 (half the bytes of fp32), on any backend.

    bf16's exponent range is fp32's, so scaled gradients need no extra factor; division by the
    world size happens before the sum, as in DDP's own averaging. No host sync.
    """
    group = state.group
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    work = dist.all_reduce(compressed, group=group, async_op=True)
    assert work is not None

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


class PowerSGDState:
    """torch's ``PowerSGDState`` plus what it needs to survive loss scaling.

    Args:
        scaler: the loss scaler whose scale and skip decision the hook reads (``None``: no
            rescaling; non-finite state is still repaired).
        process_group: the replicas' group; ``None`` is the default group.
        matrix_approximation_rank, start_powerSGD_iter, min_compression_rate,
        use_error_feedback, warm_start, random_seed: as for torch's ``PowerSGDState``.

    Attributes:
        inner: the wrapped torch state (``inner.iter``, ``inner.error_dict``, ...).
        resets: 0-dim device tensor: bucket repairs done so far (read it when you log).
    """

    def __init__(
        self,
        scaler: Any = None,
        process_group: dist.ProcessGroup | None = None,
        *,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 10,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        random_seed: int = 0,
    ) -> None:
        self.scaler = scaler
        self.inner = _psgd.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            random_seed=random_seed,
        )
        self.random_seed = random_seed
        self._q_before: dict[int, torch.Tensor] = {}
        self._scale_at: dict[int, torch.Tensor] = {}
        self.resets: torch.Tensor | None = None

    def _fresh_q(self, like: torch.Tensor) -> torch.Tensor:
        # Same seed on every rank: Q must be identical across replicas.
        gen = torch.Generator().manual_seed(self.random_seed)
        return torch.randn(like.shape, generator=gen, dtype=like.dtype).to(like.device)

    def repair(self, index: int, device: torch.device) -> None:
        """Make bucket ``index``'s state valid for this step, on device (no host sync).

        - The previous step was skipped (or ``Q`` went non-finite): the residual written during
          it is reset to zero and ``Q`` restored to its value before that step.
        - The loss scale changed since the residual was written: the residual is in the old
          scale's units and is multiplied by ``new / old``.
        """
        inner = self.inner
        skipped = _last_step_skipped(self.scaler, device)
        q = inner.q_memory_dict.get(index) if inner.warm_start else None
        if q is not None:
            skipped = skipped | ~torch.isfinite(q).all()
            before = self._q_before.get(index)
            if before is None or before.shape != q.shape:
                before = self._fresh_q(q)
            q = torch.where(skipped, before, q)
            inner.q_memory_dict[index] = q
            self._q_before[index] = q.clone()
        scale = current_loss_scale(self.scaler)
        err = inner.error_dict.get(index) if inner.use_error_feedback else None
        if err is not None:
            if scale is not None and index in self._scale_at:
                ratio = scale.to(device) / self._scale_at[index].to(device)
                err = err * ratio.to(err.dtype)
            inner.error_dict[index] = torch.where(skipped, torch.zeros_like(err), err)
        if scale is not None:
            self._scale_at[index] = scale.detach().clone()
        if q is not None or err is not None:
            add = skipped.to(torch.int64)
            self.resets = add if self.resets is None else self.resets + add.to(self.resets.device)


def powersgd_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's PowerSGD on ``state.inner``, after :meth:`PowerSGDState.repair`. No host sync
    beyond what torch's hook itself does."""
    state.repair(bucket.index(), bucket.buffer().device)
    return _psgd.powerSGD_hook(state.inner, bucket)


def register_comm_hook(
    model: DistributedDataParallel,
    kind: str,
    *,
    scaler: Any = None,
    process_group: dist.ProcessGroup | None = None,
    **powersgd_options: Any,
) -> CompressionState | PowerSGDState:
    """Register the hook named ``kind`` (``"fp16"``, ``"bf16"`` or ``"powersgd"``) on ``model``.

    Args:
        model: the DDP module; register before its first backward.
        kind: one of :data:`COMM_HOOKS`.
        scaler: the loss scaler (PowerSGD reads its scale and skip flag).
        process_group: the replicas' group; ``None`` is the default group.
        powersgd_options: keyword arguments of :class:`PowerSGDState`.

    Returns:
        The hook's state.

    Raises:
        ValueError: unknown ``kind``, or options given for a hook that takes none.
    """
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"comm_hook={kind!r} needs a DistributedDataParallel module, got "
            f"{type(model).__name__}: comm hooks exist only for strategy='ddp'"
        )
    if kind == "powersgd":
        psgd = PowerSGDState(scaler, process_group, **powersgd_options)
        model.register_comm_hook(psgd, powersgd_hook)
        return psgd
    if kind not in COMM_HOOKS:
        raise ValueError(f"comm_hook={kind!r} is not one of {COMM_HOOKS} (or None)")
    if powersgd_options:
        raise ValueError(f"comm_hook={kind!r} takes no options, got {sorted(powersgd_options)}")
    comp = CompressionState(process_group)
    model.register_comm_hook(comp, fp16_hook if kind == "fp16" else bf16_hook)
    return comp
