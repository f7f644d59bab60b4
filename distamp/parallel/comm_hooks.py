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
- ``"fp8"`` / ``"fp8-ef"``: 8-bit floats with agreed per-chunk scales, fp32 accumulation and
  optional error feedback (:mod:`distamp.parallel.fp8_comm`).
- :func:`fp32_hook`: DDP's own all-reduce (average in fp32), counted: the uncompressed path
  against which the others' bytes are read.

Every hook returns the *average* over ranks, as DDP expects, and every hook but PowerSGD counts
the bytes its rank sends (``state.sent``: payload and scales apart, per step).

**Collective order.** DDP calls a hook once per bucket, in the same bucket order on every rank
(the order can change once, when DDP rebuilds its buckets after the first step, but it changes
the same way everywhere). Every hook here issues *all* of its collectives from that call, in a
fixed sequence; a future's callback only does local work (copy, cast, divide). A collective
issued from a callback would run when the previous collective of its bucket finished, which on
gloo happens on a worker thread at a time that differs between ranks: with two buckets in flight
one rank would pair bucket 1's second collective with another rank's bucket 0, a size mismatch
or a hang. The price on gloo is that a hook waits for its first collective before returning
(NCCL's ``wait`` only orders streams, so GPUs lose no overlap).
"""

# No `from __future__ import annotations`: DDP's register_comm_hook checks the hook's annotations
# against the real `dist.GradBucket` / `torch.futures.Future[torch.Tensor]` objects.
import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as _psgd
from torch.nn.parallel import DistributedDataParallel

from distamp.agreement.scale_reads import current_loss_scale, last_step_skipped
from distamp.model_names import model_name, named_model_modules
from distamp.parallel.fp8_comm import Fp8CommState, Fp8ReduceScatter, GroupState, fp8_hook
from distamp.parallel.fp8_replicas import ReplicaFp8

__all__ = [
    "COMM_HOOKS",
    "CompressionState",
    "PowerSGDState",
    "Fp8CommState",
    "bf16_hook",
    "check_comm_state",
    "comm_state_dict",
    "current_loss_scale",
    "fp8_hook",
    "fp16_hook",
    "fp32_hook",
    "load_comm_state",
    "powersgd_hook",
    "register_comm_hook",
]

COMM_HOOKS: tuple[str, ...] = ("fp32", "fp16", "bf16", "fp8", "fp8-ef", "powersgd")

# The fp16 sum is kept at or below 2**15 (fp16's maximum is 65504 < 2**16): a power of two, so the
# compression factor is exact, with a factor-of-two margin for rounding.
_FP16_TARGET_LOG2 = 15.0
# Bounds of the compression factor's exponent: fp32 must hold the factor and its reciprocal.
# 2**-126 is fp32's smallest normal number: with it any finite fp32 amax fits fp16's range.
_LOG2_MIN, _LOG2_MAX = -126.0, 126.0


class CompressionState(GroupState):
    """State of the compression hooks: the group to average over and the bytes sent.

    Args:
        process_group: the replicas' group; ``None`` is the default group.
    """


def _fp16_factor(amax: torch.Tensor, world: int) -> torch.Tensor:
    """The power of two ``f`` with ``world * amax * f <= 2**15``; 1 when ``amax`` is 0 or not
    finite (non-finite values must reach the scaler unchanged)."""
    safe = torch.where(torch.isfinite(amax) & (amax > 0), amax, torch.ones_like(amax))
    # log2 of the product as a sum: world * amax may be past fp32's range
    exponent = torch.floor(_FP16_TARGET_LOG2 - torch.log2(safe) - math.log2(world))
    factor = torch.exp2(exponent.clamp(_LOG2_MIN, _LOG2_MAX))
    return torch.where(safe == amax, factor, torch.ones_like(factor))


def fp16_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in fp16 without ever overflowing on a finite bucket.

    Two collectives: MAX of the bucket's largest magnitude (4 bytes), then SUM of the bucket
    compressed with the factor from :func:`_fp16_factor`. The loss scale can therefore stay as
    high as the backward pass allows instead of backing off for the compression's sake. No host
    sync on NCCL (the first collective's ``wait`` orders streams); gloo waits for it.
    """
    group = state.group
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    amax = (
        buffer.detach().abs().amax().float().reshape(1)
        if buffer.numel()
        else torch.zeros(1, device=buffer.device)
    )
    state.sent.add("all_reduce", 4, world, scales=True)
    state.sent.add("all_reduce", 2 * buffer.numel(), world)
    state.sent.steps += int(bucket.is_last())
    # Both collectives are issued here, in the hook's own call: DDP calls the hooks in bucket
    # order on every rank, so the collectives' order is that order. (A collective issued from a
    # future's callback runs when that bucket's previous work finishes, which differs between
    # ranks once several buckets are in flight: gloo then pairs one rank's bucket with
    # another's.) On NCCL ``wait()`` only orders the streams; on gloo it blocks the host.
    work = dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group, async_op=True)
    assert work is not None
    work.wait()
    factor = _fp16_factor(amax[0], world)
    compressed = (buffer * factor.to(buffer.dtype)).to(torch.float16)
    summed = dist.all_reduce(compressed, group=group, async_op=True)
    assert summed is not None
    inverse = (1.0 / (factor * world)).to(buffer.dtype)

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0].to(buffer.dtype) * inverse)  # local work only
        return buffer

    return summed.get_future().then(decompress)


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
    state.sent.add("all_reduce", 2 * buffer.numel(), world)
    state.sent.steps += int(bucket.is_last())
    work = dist.all_reduce(compressed, group=group, async_op=True)
    assert work is not None

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def fp32_hook(
    state: CompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP's own averaging all-reduce at the bucket's width, with its bytes counted."""
    group = state.group
    world = dist.get_world_size(group)
    buffer = bucket.buffer().div_(world)
    state.sent.add("all_reduce", buffer.numel() * buffer.element_size(), world)
    state.sent.steps += int(bucket.is_last())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0])


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
        skipped = last_step_skipped(self.scaler, device)
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
    """torch's PowerSGD on ``state.inner``, after :meth:`PowerSGDState.repair`, finished before
    the hook returns.

    torch's hook issues its second and third all-reduce from future callbacks; on gloo those run
    when the previous collective finishes, so with several buckets in flight two ranks could
    issue them in different orders. Waiting here keeps one bucket in flight at a time: the
    order is DDP's bucket order on every rank. (On NCCL the callbacks run at enqueue time and
    ``wait`` only orders the streams.)
    """
    state.repair(bucket.index(), bucket.buffer().device)
    fut = _psgd.powerSGD_hook(state.inner, bucket)
    fut.wait()
    return fut


def register_comm_hook(
    model: torch.nn.Module,
    kind: str,
    *,
    scaler: Any = None,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> CompressionState | PowerSGDState | Fp8CommState:
    """Register the hook named ``kind`` (one of :data:`COMM_HOOKS`) on ``model``.

    Args:
        model: the DDP module, or for ``"fp8"``/``"fp8-ef"`` also an FSDP2 (``fully_shard``)
            model; register before its first backward.
        kind: one of :data:`COMM_HOOKS`.
        scaler: the loss scaler (PowerSGD and fp8's error feedback read its scale and skip
            flag).
        process_group: the replicas' group; ``None`` is the default group.
        options: keyword arguments of :class:`PowerSGDState` (``"powersgd"``) or of
            :class:`~distamp.parallel.fp8_comm.Fp8CommState` (``"fp8"``/``"fp8-ef"``:
            ``format``, ``chunk``).

    Returns:
        The hook's state (``state.sent``: the bytes its rank sends, except for PowerSGD).

    Raises:
        ValueError: unknown ``kind``, or options given for a hook that takes none.
    """
    replicas = getattr(model, "fp8_state", None)  # torchft's DDP built by wrap_replicas
    if isinstance(replicas, ReplicaFp8) and kind in ("fp8", "fp8-ef"):
        replicas.fp8.scaler = scaler  # its hook is in place: error feedback reads the scaler
        return replicas.fp8
    if kind in ("fp8", "fp8-ef") and not isinstance(model, DistributedDataParallel):
        return _register_fsdp2(model, kind, scaler, process_group, options)
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"comm_hook={kind!r} needs a DistributedDataParallel module, got "
            f"{type(model).__name__}: comm hooks exist only for strategy='ddp' (and 'fp8' / "
            "'fp8-ef' for strategy='fsdp2' too)"
        )
    if kind == "powersgd":
        psgd = PowerSGDState(scaler, process_group, **options)
        model.register_comm_hook(psgd, powersgd_hook)
        return psgd
    if kind in ("fp8", "fp8-ef"):
        names = {id(p): model_name(n, model) for n, p in model.named_parameters()}
        ef = kind == "fp8-ef"
        fp8 = Fp8CommState(scaler, process_group, error_feedback=ef, names=names, **options)
        model.register_comm_hook(fp8, fp8_hook)
        return fp8
    if kind not in COMM_HOOKS:
        raise ValueError(f"comm_hook={kind!r} is not one of {COMM_HOOKS} (or None)")
    if options:
        raise ValueError(f"comm_hook={kind!r} takes no options, got {sorted(options)}")
    comp = CompressionState(process_group)
    hooks = {"fp32": fp32_hook, "fp16": fp16_hook, "bf16": bf16_hook}
    model.register_comm_hook(comp, hooks[kind])
    return comp


def _register_fsdp2(
    model: Any, kind: str, scaler: Any, group: Any, options: dict[str, Any]
) -> Fp8CommState:
    """``"fp8"``/``"fp8-ef"`` as every ``fully_shard`` module's gradient reduce-scatter."""
    from torch.distributed.fsdp import FSDPModule

    modules = [(n, m) for n, m in named_model_modules(model) if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(
            f"comm_hook={kind!r} needs a DDP module or an FSDP2 (fully_shard) model, got "
            f"{type(model).__name__}"
        )
    ef = kind == "fp8-ef"
    state = Fp8CommState(scaler, group, error_feedback=ef, **options)
    for name, module in modules:
        comm = Fp8ReduceScatter(state, name or "<root>")  # FSDP2's interface, duck-typed
        module.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
    return state


def comm_state_dict(state: Any) -> dict[str, Any] | None:
    """A hook state's per-rank checkpoint part (the fp8 hook's error-feedback residuals), or
    ``None`` when it keeps nothing across steps worth saving."""
    if isinstance(state, Fp8CommState) and state.error_feedback:
        return {"fp8_comm": state.state_dict()}
    return None


def check_comm_state(state: Any, saved: Any) -> None:
    """Check that :func:`load_comm_state` would accept ``saved`` (``ValueError`` naming the
    entry); changes nothing, so that a rank's bad file refuses the whole load on every rank."""
    if isinstance(state, Fp8CommState) and state.error_feedback and saved is not None:
        if not isinstance(saved, dict) or "fp8_comm" not in saved:
            shown = sorted(map(str, saved)) if isinstance(saved, dict) else repr(saved)[:120]
            raise ValueError(f"rank state: expected an 'fp8_comm' entry, got {shown}")
        state.check_state_dict(saved["fp8_comm"])


def load_comm_state(state: Any, saved: dict[str, Any] | None) -> None:
    """Restore :func:`comm_state_dict`'s output into ``state`` (nothing when either is
    missing: a run that switches the hook on starts with empty residuals)."""
    check_comm_state(state, saved)
    if isinstance(state, Fp8CommState) and state.error_feedback and saved is not None:
        state.load_state_dict(saved["fp8_comm"])
